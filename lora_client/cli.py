"""`lora-client`: talk to a node or a fleet's proxy (generate, load, unload, ls, stats), see
which node of a fleet holds which adapter (fleet), or talk to a store (store-ls, push).

Global options (--node, --timeout, --token, --tls-*) go before or after the command. Expected
failures (an unreachable node, a refused request, missing S3 credentials) print one line
naming the program, the command and the fix, never a traceback.
"""
from __future__ import annotations

import os

# gRPC's C core logs some connection failures (a TLS handshake that fails...) to stderr in its
# own format; this CLI says what failed in one line instead. A GRPC_VERBOSITY the user set
# (debug) still wins. It takes effect only if set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from typing import Callable  # noqa: E402

import grpc  # noqa: E402

from lora_common.envargs import EnvArgumentParser  # noqa: E402
from lora_common.tls import TLSConfigError, add_client_flags, client_tls_from_args  # noqa: E402

from .fleet import TIER_GPU, TIER_HOST, TIER_NAMES, fleet_view, format_fleet, nodes_from_proxy  # noqa: E402
from .node_client import NodeClient, RetryPolicy  # noqa: E402

INT32_MAX = (1 << 31) - 1   # max_tokens and top_k are int32 in a GenerateRequest
UINT64_MAX = (1 << 64) - 1  # seed
SIGPIPE_EXIT = 141          # what a program killed by SIGPIPE exits with (128 + 13), as `yes | head` does


def bounded(kind: type, low: int | float, high: int | float, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a `kind` (int or float) in [low, high] (above=True: low excluded), so a
    value the node could not take is refused here, naming the range, never as a traceback."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value) or value < low or value > high or (above and value == low):
            where = f"above {low} and at most {high}" if above else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a value {where}")
        return value
    return parse


def _http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL")
    return text


def _client(args: argparse.Namespace, target: str | None = None) -> NodeClient:
    retry = RetryPolicy(attempts=args.retries + 1) if args.retries > 0 else None
    return NodeClient(target or args.node, token=args.token, tls=client_tls_from_args(args, "tls"), retry=retry)


DEFAULT_MAX_TOKENS = 128  # an interactive answer: a few paragraphs, not a wait for 256 tokens on a CPU


def cmd_generate(args: argparse.Namespace) -> int:
    with _client(args) as client:
        request = client.request(args.prompt, adapter=args.adapter, chat=not args.raw,
                                 max_tokens=args.max_tokens, temperature=args.temperature,
                                 top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                                 system=args.system)
        last = None
        answer = client.answer(request, timeout=args.timeout)
        for msg in answer:
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            last = msg
        sys.stdout.write("\n")
        if last is not None and args.verbose:
            node = f", node {answer.node}" if answer.node else ""  # through a fleet's proxy
            print(f"[{last.finish_reason}: {last.prompt_tokens} prompt + {last.completion_tokens} "
                  f"completion tokens, adapter version {last.adapter_version[:12] or '-'}{node}]", file=sys.stderr)
        elif last is not None and last.finish_reason == "length":
            print(f"[cut at {last.completion_tokens} tokens: --max-tokens N for a longer answer]", file=sys.stderr)
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    with _client(args) as client:
        reply = client.load_adapter(args.name, args.version, args.pin, timeout=args.timeout)
    print(f"{reply.name} {reply.version[:12]} {TIER_NAMES.get(reply.tier, '?')}")
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    with _client(args) as client:
        reply = client.unload_adapter(args.name, timeout=args.timeout)
    print(f"{args.name}: {'unload deferred until running requests end' if reply.deferred else 'unloaded'}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        reply = client.list_adapters(timeout=args.timeout)
    print(f"{'NAME':24} {'VERSION':12} {'TIER':8} {'SLOT':>4} {'RANK':>4} {'REFS':>4} PINNED PENDING")
    for a in reply.adapters:
        print(f"{a.name:24} {a.version[:12]:12} {TIER_NAMES.get(a.tier, '?'):8} {a.slot:>4} {a.rank:>4} "
              f"{a.ref_count:>4} {'yes' if a.pinned else 'no':6} {'yes' if a.pending_eviction else 'no'}")
    print(f"({ls_footer(reply)})")
    return 0


def ls_footer(reply) -> str:
    """What the node holds against its limits. GPU memory (--lora-memory-mb) may hold more
    adapters than --max-loras, which bounds the distinct adapters one step serves."""
    on_gpu = sum(1 for a in reply.adapters if a.tier == TIER_GPU)
    in_host = sum(1 for a in reply.adapters if a.tier == TIER_HOST)
    return (f"{on_gpu} on the GPU, of which at most {reply.max_loras} serve in one step (--max-loras); "
            f"{in_host} only in host memory, which keeps up to {reply.max_cpu_loras}")


def cmd_fleet(args: argparse.Namespace) -> int:
    if args.nodes:
        nodes = [(f"n{i + 1}", address, "") for i, address in enumerate(a for a in args.nodes.split(",") if a)]
    else:
        try:
            nodes = nodes_from_proxy(args.proxy_stats)
        except (OSError, ValueError) as exc:
            print(f"lora-client fleet: cannot read the proxy's stats page at {args.proxy_stats} ({exc}); "
                  "point --proxy-stats at it, or list the nodes with --nodes HOST:PORT,...", file=sys.stderr)
            return 1
    views = fleet_view(nodes, lambda address: _client(args, address), timeout=min(args.timeout, 10.0))
    print(format_fleet(views))
    return 1 if any(v.error for v in views) else 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(client.stats())
    return 0


STORE_COMMANDS = {"push": "push", "store-ls": "ls"}


def parser() -> argparse.ArgumentParser:
    ap = EnvArgumentParser(prog="lora-client", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter, env_prefix="LORA_CLIENT")
    ap.add_argument("--node", default="127.0.0.1:50051", help="inference node HOST:PORT (default 127.0.0.1:50051)")
    ap.add_argument("--timeout", type=bounded(float, 0, 10**6, above=True), default=300,
                    help="seconds per call (default 300)")
    ap.add_argument("--token", default=None, secret=True, help="bearer token for nodes that require one")
    ap.add_argument("--retries", type=bounded(int, 0, 100), default=2,
                    help="times an answer refused with UNAVAILABLE before its first token is asked again "
                         "(a draining node, a fleet node going away; not a node that says retrying will not "
                         "help, such as one whose adapter store is down); never after a token (default 2)")
    add_client_flags(ap, "tls", "node")
    # Subcommand flags are per call: no environment variables for them.
    sub = ap.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser,
                            metavar="COMMAND")
    gen = sub.add_parser("generate", help="stream a completion to the terminal",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompt", help="the user message (or, with --raw, the whole prompt)")
    gen.add_argument("--adapter", default="", help="adapter name (empty: the base model)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--system", default=None, help="system message (chat)")
    gen.add_argument("--max-tokens", type=bounded(int, 0, INT32_MAX), default=DEFAULT_MAX_TOKENS,
                     help="most tokens to generate (0: the node's --default-max-tokens)")
    gen.add_argument("--temperature", type=bounded(float, 0, 2), default=0.0,
                     help="sampling temperature, 0 to 2; 0 is greedy")
    gen.add_argument("--top-p", type=bounded(float, 0, 1), default=0.0,
                     help="nucleus sampling: keep the most likely tokens up to this probability mass (0 or 1: off)")
    gen.add_argument("--top-k", type=bounded(int, 0, INT32_MAX), default=0,
                     help="sample among the k most likely tokens (0: off)")
    gen.add_argument("--seed", type=bounded(int, 0, UINT64_MAX), default=None,
                     help="seed of a sampled answer, for a reproducible one (0 to 2**64 - 1)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="end the answer before this text (repeat for several)")
    gen.add_argument("-v", "--verbose", action="store_true",
                     help="print the finish reason, token counts and adapter version to stderr")
    gen.set_defaults(func=cmd_generate)
    load = sub.add_parser("load", help="make an adapter resident on the node")
    load.add_argument("name", help="adapter name")
    load.add_argument("--version", default="", help="a version the store holds (default: its current one)")
    load.add_argument("--pin", action="store_true", help="never evict it from its GPU slot")
    load.set_defaults(func=cmd_load)
    unload = sub.add_parser("unload", help="unload an adapter (deferred while in use)")
    unload.add_argument("name", help="adapter name")
    unload.set_defaults(func=cmd_unload)
    sub.add_parser("ls", help="adapters on the node").set_defaults(func=cmd_ls)
    sub.add_parser("stats", help="engine counters").set_defaults(func=cmd_stats)
    fleet = sub.add_parser("fleet", help="which node of a fleet holds which adapter, in which tier")
    where = fleet.add_mutually_exclusive_group()
    where.add_argument("--proxy-stats", type=_http_url, default="http://127.0.0.1:8404/stats",
                       help="the proxy's stats page, where the nodes' addresses are read (default %(default)s)")
    where.add_argument("--nodes", default="", metavar="HOST:PORT,...", help="the nodes, instead of the proxy's list")
    fleet.set_defaults(func=cmd_fleet)
    # The store's commands, forwarded to `adapter-store` (one implementation).
    sub.add_parser("push", help="upload an adapter folder to the bucket (= adapter-store push ...)")
    sub.add_parser("store-ls", help="list the store's catalog (= adapter-store ls ...)")
    return ap


def globals_first(argv: list[str], ap: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """The global options (with their values), and the rest of argv: moved before the
    command, they may be written anywhere (`lora-client ls --node H:P` = `lora-client --node
    H:P ls`). Everything after `--` stays in the rest."""
    takes_value = {flag: action.nargs != 0 for action in ap._actions for flag in action.option_strings
                   if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))}
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        name = arg.split("=", 1)[0]
        if name in takes_value:
            front.append(arg)
            if takes_value[name] and "=" not in arg and i + 1 < len(argv):
                front.append(argv[i + 1])
                i += 1
        else:
            rest.append(arg)
        i += 1
    return front, rest


# How gRPC's client reports a node it could not reach (no status came from any node).
_UNREACHABLE = ("failed to connect to all addresses", "DNS resolution failed", "Name resolution failure",
                "errors resolving", "empty address list", "Connection refused",
                "connections to all backends failing", "Failed to create channel")
_TLS_FAILED = ("Tls handshake failed", "SSL_ERROR", "Handshake failed")


def failure(args: argparse.Namespace, exc: grpc.RpcError) -> str:
    """One line: what failed, and what to do about it. A status the node answered with is the
    node's own message (e.g. naming an adapter store it cannot reach); only a call that
    reached no node says the node could not be reached."""
    code, details = exc.code(), exc.details() or ""
    prog = f"lora-client {args.command}"
    first = details.splitlines()[0] if details else ""
    if code == grpc.StatusCode.UNAVAILABLE and any(t in details for t in _TLS_FAILED):
        hint = ("is it serving TLS? drop --tls for a plaintext node, or check --tls-ca" if args.tls or args.tls_ca
                else "it may serve TLS: add --tls (and --tls-ca)")
        return f"{prog}: the TLS handshake with the node at {args.node} failed; {hint}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN) and details.startswith(_UNREACHABLE):
        return (f"{prog}: cannot reach the node at {args.node} ({first}); is it running? "
                "point --node HOST:PORT (or LORA_CLIENT_NODE) at it")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{prog}: no answer from {args.node} within {args.timeout:g}s (--timeout)"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{prog}: {details} (pass --token or set LORA_CLIENT_TOKEN)"
    return f"{prog}: {code.name}: {details}"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except BrokenPipeError:
        # The reader of stdout went away (`lora-client ls | head -1`): what it read was what it
        # wanted. stdout now points nowhere, so the interpreter's last flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_EXIT


def _main(argv: list[str]) -> int:
    ap = parser()
    front, rest = globals_first(argv, ap)
    if rest and rest[0] in STORE_COMMANDS:  # the store's own CLI; node options do not apply to it
        from adapter_store.cli import main as store_main
        return store_main([STORE_COMMANDS[rest[0]], *rest[1:]], prog="lora-client",
                          command_names={v: k for k, v in STORE_COMMANDS.items()})
    args = ap.parse_args(front + rest)
    try:
        return args.func(args)
    except TLSConfigError as exc:
        print(f"lora-client {args.command}: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(failure(args, exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
