"""The node's settings: one tree of frozen groups, and `inference-node serve`'s flags generated
from it (every flag also an INFERENCE_NODE_* environment variable).

A field's metadata carries its flag: help text, choices, the unit the flag counts in, and
whether it is a developer option (`hidden`: left out of `--help`, listed by `--help-all`).
The command line, the environment and Python callers (tests, benchmarks: `NodeConfig.of`)
thus build the same object, which the engine core is built from and the front ends read.
Nothing here imports torch: the launcher and the front ends import this module.
"""
from __future__ import annotations

import argparse
import dataclasses
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

from kernels.tuning import DEFAULT_TUNING, GROUPS, Tuning, choice_help, format_choice, parse_choice
from lora_common.tls import (ClientTLS, ServerTLS, add_client_flags, add_server_flags, client_tls_from_args,
                             server_tls_from_args)
from lora_common.validation import DEFAULT_MAX_WEIGHT_ABS, EDGE_MODULES, LORA_MODULES

MB, GB = 1 << 20, 1 << 30
CONFIG_EXIT = 2  # the exit status of a node (or its engine core) refusing a setting it cannot run with


class ConfigError(ValueError):
    """A setting the node cannot run with; the message names the flag."""


def option(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None,
           choices: tuple[str, ...] | None = None, hidden: bool = False, secret: bool = False,
           unit: int = 1, parse: Callable[[str], Any] | None = None, shown: str | None = None,
           default_factory: Any = dataclasses.MISSING, add: Callable[..., None] | None = None,
           read: Callable[[argparse.Namespace], Any] | None = None) -> Any:
    """A config field and its flag. flag: its name when not the field's (a True bool's is
    --no-<field>); unit: the field holds the flag's value times this (MB, GB); parse: the
    flag's text to a value; shown: the default as the flag writes it; add/read: a field that
    has flags of its own (TLS) adds them to a parser and reads them back; secret: never in a
    repr or in --help's defaults."""
    meta = {"help": help, "flag": flag, "choices": choices, "hidden": hidden, "secret": secret,
            "unit": unit, "parse": parse, "shown": shown, "add": add, "read": read}
    return field(default=default, default_factory=default_factory, repr=not secret, metadata=meta)


# Every module adapter memory can hold: the decoder layers' projections, the embedding's and
# the LM head's (a Phi-3 adapter's fused qkv_proj and gate_up_proj count as their modules).
ADAPTER_MODULES = LORA_MODULES + EDGE_MODULES


def lora_modules(text: str) -> tuple[str, ...]:
    """--lora-modules: names of LoRA target modules, comma-separated."""
    names = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in names if m not in ADAPTER_MODULES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown LoRA modules {unknown or text!r}; choose from "
                                         f"{', '.join(ADAPTER_MODULES)}")
    return names


def count_or_auto(text: str) -> int:
    """--api-processes: a count, or auto (0)."""
    if text.strip().lower() == "auto":
        return 0
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto or a count of at least 1")
    return value


@dataclass(frozen=True)
class ModelOptions:
    """model: the checkpoint and how it is placed."""

    checkpoint: str | None = option(None, flag="--model",
                                    help="HF safetensors checkpoint directory of a served family: Llama, "
                                         "Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2, Gemma 3 (default: the "
                                         "embedded SmolLM2-135M-Instruct)")
    device: str = option("auto", choices=("auto", "cpu", "cuda"), help="auto = cuda when available")
    dtype: str = option("auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto = bfloat16 on cuda, float32 on cpu")
    quantization: str = option("none", choices=("none", "fp8", "fp8-w8a8"),
                               help="fp8: the decoder's projections (q, k, v, o, gate, up, down) held as FP8 "
                                    "(e4m3, one scale per output channel) made at load from a 16/32-bit "
                                    "checkpoint and widened to --dtype to multiply (exact); fp8-w8a8: the "
                                    "same, each matmul's input quantized to e4m3 per token (dynamic scales) "
                                    "on the fp8 tensor cores: faster on Hopper, activations rounded to 3 "
                                    "mantissa bits. Embeddings, norms and the LM head stay in --dtype. An FP8 "
                                    "checkpoint (config.json quantization_config: fine-grained fp8, "
                                    "compressed-tensors FP8) is served with its own scales either way")
    max_model_len: int = option(4096, help="prompt + output tokens")
    tensor_parallel_size: int = option(1, help="split the model over this many GPUs of the host (one process "
                                               "each; gloo on CPU)")
    all_reduce: str = option("nccl", choices=("nccl", "symm", "fused"),
                             help="with --tensor-parallel-size > 1 on GPUs: sum decode-sized messages (up to "
                                  "4 MB) through PyTorch's symmetric-memory one-shot/two-shot kernels instead "
                                  "of NCCL (symm), or those up to 1 MB after o and down in one kernel with the "
                                  "residual add and norm that follow them (fused)")
    load_format: str = option("safetensors", choices=("safetensors", "dummy"), hidden=True,
                              help="dummy: random weights of the shapes in the checkpoint's config.json, made "
                                   "on the device (benchmarks of models whose weights are not at hand)")

    @property
    def quantize_fp8(self) -> bool:
        """Whether plain projections are quantized to FP8 at load (--quantization fp8*)."""
        return self.quantization != "none"

    @property
    def fp8_w8a8(self) -> bool:
        """Whether FP8 projections take their input quantized per token (--quantization fp8-w8a8)."""
        return self.quantization == "fp8-w8a8"


@dataclass(frozen=True)
class CacheOptions:
    """KV cache."""

    kv_cache_gb: float = option(0.0, help="KV cache memory (0: on CUDA what --gpu-memory-utilization leaves, "
                                          "on CPU 0.5)")
    gpu_memory_utilization: float = option(
        0.9, help="CUDA: the share of the device's memory the node may take; the KV cache gets what the "
                  "weights, adapter slots and the largest step's activations leave")
    num_kv_blocks: int = option(0, help="KV blocks (overrides --kv-cache-gb)")
    block_size: int = option(16, help="tokens per KV block")
    prefix_caching: bool = option(True, help="turn off the prefix cache (KV reuse of shared prompt prefixes, "
                                             "per adapter)")


@dataclass(frozen=True)
class SchedulerOptions:
    """scheduler."""

    max_num_seqs: int = option(0, help="running requests per step (0: 256 on CUDA, 64 on CPU)")
    max_num_batched_tokens: int = option(512, help="token budget of one step (chunked prefill)")
    max_queue: int = option(1024, help="waiting requests before RESOURCE_EXHAUSTED")
    prefill_delay_factor: float = option(
        0.0, hidden=True, help="while requests decode, hold new prompts until the oldest has waited this many "
                               "times the last prefill step, so arrivals share prefill steps (0: admit at once)")
    refill_wait_factor: float = option(
        1.0, hidden=True, help="after a step in which a burst of requests finished, new prompts wait until as "
                               "many have arrived, at most this many times the last prefill step, so a "
                               "closed-loop client's resubmissions share one prefill step (0: off)")


@dataclass(frozen=True)
class LoraOptions:
    """LoRA."""

    max_loras: int = option(8, help="the most distinct adapters in one step (0 disables LoRA)")
    max_lora_rank: int = option(16, help="largest adapter rank served")
    lora_memory_bytes: int = option(
        0, flag="--lora-memory-mb", unit=MB,
        help="GPU memory for adapters (on each GPU of a tensor-parallel node), shared by rank: an adapter "
             "holds its own rank's rows on each module it targets, a mixture-of-experts model's experts "
             "included (0: --max-loras adapters of --max-lora-rank)")
    lora_modules: tuple[str, ...] = option(
        ADAPTER_MODULES, parse=lora_modules, shown=",".join(ADAPTER_MODULES),
        help="comma-separated modules adapters may target (default: all: the seven projections, embed_tokens "
             "and lm_head; a Phi-3 adapter's qkv_proj and gate_up_proj count as q,k,v and gate,up); the "
             "adapter memory keeps rank rows only for their fused groups (q,k,v / o / gate,up / down), the "
             "edge modules named and a mixture-of-experts model's experts of the MLP modules named")
    adapter_eviction: str = option("lru", choices=("lru", "gdsf"),
                                   help="which idle adapters leave the GPU first when memory is wanted: least "
                                        "recently used, or GreedyDual-Size-Frequency (requests per byte, aged)")
    max_cpu_loras: int = option(32, help="adapters kept in host memory (also how deep waiting requests' "
                                         "adapters are fetched ahead)")
    max_adapter_bytes: int = option(GB, flag="--max-adapter-mb", unit=MB,
                                    help="largest adapter fetched from the store or read from --adapter-dir "
                                         "(FAILED_PRECONDITION above)")
    max_weight_abs: float = option(DEFAULT_MAX_WEIGHT_ABS,
                                   help="largest |value| of a LoRA weight; adapters with larger ones are refused "
                                        "as numerically unsafe, FAILED_PRECONDITION (0: no bound)")


def _add_store_tls(parser: argparse._ActionsContainer, show_hidden: bool) -> None:
    add_client_flags(parser, "store-tls", "adapter store")


def _add_server_tls(parser: argparse._ActionsContainer, show_hidden: bool) -> None:
    add_server_flags(parser, "node")


@dataclass(frozen=True)
class SourceOptions:
    """adapter sources: the store (with the node's disk tier in front) or a local directory."""

    adapter_store: str | None = option(None, help="HOST:PORT of the adapter store (adapters load on demand)")
    adapter_dir: str | None = option(None, help="local adapters directory (<dir>/<name>/adapter_config.json "
                                                "...), used when no --adapter-store is given")
    adapter_disk_tier: bool = option(True, help="keep no disk tier: every adapter not in memory is fetched "
                                                "from the store again, also after a restart")
    adapter_disk_dir: str | None = option(
        None, help="directory of the node's disk tier, where adapters fetched from the store are kept "
                   "(verified on every read) across restarts; one node at a time (default: a directory of "
                   "its own under the cache directory, $LORA_SERVING_CACHE or ~/.cache/lora-serving)")
    adapter_disk_bytes: int = option(20 * GB, flag="--adapter-disk-gb", unit=GB,
                                     help="bound of the disk tier; least recently used adapters are evicted "
                                          "first")
    adapter_direct_reads: bool = option(
        False, help="read adapters straight from the object store by the read plans of a store started with "
                    "--direct-reads (verified against its BLAKE3; streamed from the store when it offers none "
                    "or a read fails)")
    adapter_fetch_timeout_s: float = option(
        60.0, flag="--adapter-fetch-timeout",
        help="seconds an adapter load keeps retrying and resuming from the store before its waiting requests "
             "get UNAVAILABLE")
    store_tls: ClientTLS = option(default_factory=lambda: ClientTLS(flag="--store-tls"), help="",
                                  add=_add_store_tls, read=lambda args: client_tls_from_args(args, "store-tls"))
    store_token: str | None = option(None, secret=True, help="bearer token sent to an adapter store started "
                                                             "with --token")


@dataclass(frozen=True)
class ServerOptions:
    """server: the gRPC port, the HTTP API, metrics, security and shutdown."""

    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(50051, help="gRPC port (0 picks a free one)")
    http_port: int = option(0, help="OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, "
                                    "/v1/models), served by every front-end process beside gRPC (0: off)")
    api_processes: int = option(
        0, parse=count_or_auto, shown="auto",
        help="front-end processes serving the ports (tokenising, detokenising, streaming); auto: one on a "
             "CPU engine (its threads take the other cores), else one per three cores the engine's "
             "processes leave, from 1 to 4")
    admin_token: str | None = option(None, secret=True, help="bearer token that LoadAdapter/UnloadAdapter "
                                                             "require (off when unset)")
    generate_token: str | None = option(None, secret=True, help="bearer token that Generate and the HTTP API "
                                                                "require (off when unset)")
    tls: ServerTLS = option(default_factory=ServerTLS, help="", add=_add_server_tls, read=server_tls_from_args)
    metrics_port: int = option(0, help="Prometheus metrics HTTP port (0: off)")
    metrics_max_adapters: int = option(
        32, help="adapters with their own `adapter` label in the metrics, the busiest by requests; the others "
                 "share adapter=\"_other\" (bounds the series count)")
    drain_seconds: float = option(10.0, help="on SIGTERM, time running requests get to finish")
    drain_min_seconds: float = option(
        1.5, hidden=True, help="on SIGTERM, the least time the node answers NOT_SERVING (refusing new requests with "
                  "UNAVAILABLE) before it closes its port, so a proxy's health checks see it first")
    log_level: str = option("INFO", help="DEBUG, INFO, WARNING or ERROR")


@dataclass(frozen=True)
class RequestLimits:
    """request limits: checked by the front ends before work reaches the engine (limits.py)."""

    max_concurrent_streams: int = option(
        0, help="open Generate streams and HTTP completions of a front end before RESOURCE_EXHAUSTED (HTTP "
                "429; 0: only --max-queue bounds them)")
    max_request_bytes: int = option(16 * MB, flag="--max-request-mb", unit=MB,
                                    help="largest request message; gRPC refuses larger ones with "
                                         "RESOURCE_EXHAUSTED")
    max_prompt_chars: int = option(1 << 20, help="characters of a prompt (or of all its messages) before "
                                                 "INVALID_ARGUMENT")
    max_prompt_tokens: int = option(0, help="prompt tokens before INVALID_ARGUMENT (0: --max-model-len - 1)")
    max_tokens: int = option(0, flag="--max-tokens-limit",
                             help="largest max_tokens a request may ask for, else INVALID_ARGUMENT (0: what "
                                  "--max-model-len leaves)")
    default_max_tokens: int = option(256, help="when max_tokens is 0")

    def max_tokens_default(self) -> int:
        """What a request asking for max_tokens 0 gets."""
        return min(self.default_max_tokens, self.max_tokens) if self.max_tokens else self.default_max_tokens


def _auto_on_off(setting: str, device_type: str) -> bool:
    return setting == "on" or (setting == "auto" and device_type == "cuda")


@dataclass(frozen=True)
class RunnerOptions:
    """engine: how steps run (the hidden switches are for tests and benchmarks)."""

    enforce_eager: bool = option(False, help="run every step eagerly: no CUDA graphs and no start-up warm-up "
                                             "(a faster start; slower steps, whose kernels compile under the "
                                             "first requests)")
    cpu_threads: int = option(0, hidden=True, help="torch threads of an engine on the CPU (0: the cores less "
                                                   "one, left to the front end)")
    decode_graphs: str = option("auto", choices=("auto", "on", "off"), hidden=True,
                                help="replay decode steps from CUDA graphs (auto: on CUDA; on: also on CPU, "
                                     "eagerly through the same static buffers, for tests)")
    mixed_graphs: str = option("auto", choices=("auto", "on", "off"), hidden=True,
                               help="replay prefill and mixed steps from CUDA graphs piece by piece, attention "
                                    "run between (auto: on CUDA; on: also on CPU, through the same static "
                                    "buffers, for tests)")
    max_graph_batch: int = option(0, hidden=True, help="largest decode batch replayed from a graph, larger ones "
                                                       "run eagerly (0: --max-num-seqs)")
    warmup: str = option("auto", choices=("auto", "on", "off"), hidden=True,
                         help="before serving, run synthetic eager steps so their Triton kernels compile now "
                              "rather than under the first requests (auto: on CUDA)")
    debug_checks: bool = option(False, hidden=True, help="check the engine's invariants after every step (slow)")

    def decode_graphs_on(self, device_type: str) -> bool:
        return not self.enforce_eager and _auto_on_off(self.decode_graphs, device_type)

    def mixed_graphs_on(self, device_type: str) -> bool:
        return not self.enforce_eager and _auto_on_off(self.mixed_graphs, device_type)

    def warmup_setting(self) -> str:
        """The engine's warm-up setting (auto, on, off: runner/warmup.py)."""
        return "off" if self.enforce_eager else self.warmup


def tune_item(text: str) -> tuple[str, Any]:
    """--tune KEY=VALUE: one launch choice of kernels/tuning.py's Tuning, parsed."""
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    names = [f.name for f in dataclasses.fields(Tuning)]
    if not sep or key not in names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE with KEY one of {', '.join(names)}")
    try:
        return key, parse_choice(key, value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tune_keys() -> str:
    """--tune's keys, one a line with its form and default (--help-all's epilog)."""
    lines = [f"--tune keys (groups are {', '.join(GROUPS)}):"]
    for f in dataclasses.fields(Tuning):
        default = format_choice(f.name, getattr(DEFAULT_TUNING, f.name))
        lines.append(textwrap.fill(f"{f.name} (default {default}): {choice_help(f.name)}", width=100,
                                   initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines)


def _add_tune(parser: argparse._ActionsContainer, show_hidden: bool) -> None:
    parser.add_argument("--tune", action="append", type=tune_item, default=[], metavar="KEY=VALUE",
                        help="one launch choice of the decode step (keys: below), repeatable (the "
                             "variable: space-separated); it wins over the tuning table for every step"
                        if show_hidden else argparse.SUPPRESS)


def _read_tuning(args: argparse.Namespace) -> Tuning:
    try:
        return Tuning(**dict(args.tune))
    except ValueError as exc:  # choices that cannot go together (Tuning checks them)
        raise ConfigError(f"--tune: {exc}") from None


@dataclass(frozen=True)
class KernelOptions:
    """kernels: the decode step's launch choices (kernels/tuning.py)."""

    tuning_table: str = option(
        "auto", help="launch choices per decode batch and adapter-count bucket from a table kept as data "
                     "(kernels/configs/README.md): auto = the repository's table for this GPU, model (shard) "
                     "shape and dtype, else the one this host tuned before (in the cache directory), else one "
                     "tuned now within --tune-budget; off; or a table file's path")
    tune_budget: float = option(
        240.0, help="seconds a node that finds no tuning table for its GPU, shape and dtype may spend tuning "
                    "its kernels at start (CUDA; the table is stored in the cache directory and used from then "
                    "on; `inference-node tune` does it ahead of time); 0 = never tune, run the defaults")
    tuning_cache_dir: str | None = option(
        None, hidden=True, help="writable folder of the tuning tables this host tunes (default: "
                                "$LORA_SERVING_CACHE/tuning, beside the embedded model)")
    tuning: Tuning = option(default_factory=Tuning, help="", add=_add_tune, read=_read_tuning)
    # The choices given (--tune): they keep `tuning`'s values whatever the table says.
    tuning_fixed: frozenset[str] = option(frozenset(), help="", add=lambda parser, show_hidden: None,
                                          read=lambda args: frozenset(name for name, _ in args.tune))


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node is built from, by group."""

    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    sources: SourceOptions = field(default_factory=SourceOptions)
    server: ServerOptions = field(default_factory=ServerOptions)
    limits: RequestLimits = field(default_factory=RequestLimits)
    runner: RunnerOptions = field(default_factory=RunnerOptions)
    kernels: KernelOptions = field(default_factory=KernelOptions)

    @classmethod
    def of(cls, **options: Any) -> "NodeConfig":
        """The defaults with the named fields set, each named as in its group (the names are
        unique across groups), or whole groups: NodeConfig.of(checkpoint=path, device="cpu",
        max_loras=2, limits=RequestLimits(max_prompt_chars=2000))."""
        return cls().replace(**options)

    def replace(self, **options: Any) -> "NodeConfig":
        """This config with the named fields (of any group), or whole groups, changed."""
        groups = {name: options.pop(name) for name in list(options) if name in _GROUPS}
        changes: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            if name not in _GROUP_OF:
                raise TypeError(f"NodeConfig has no option {name!r}")
            changes.setdefault(_GROUP_OF[name], {})[name] = value
        config = dataclasses.replace(self, **groups)
        return dataclasses.replace(config, **{group: dataclasses.replace(getattr(config, group), **values)
                                              for group, values in changes.items()})


def _groups() -> list[tuple[str, type]]:
    return [(f.name, f.default_factory) for f in dataclasses.fields(NodeConfig)]


_GROUPS = {f.name for f in dataclasses.fields(NodeConfig)}
_GROUP_OF: dict[str, str] = {}
for _group, _cls in _groups():
    for _f in dataclasses.fields(_cls):
        assert _f.name not in _GROUP_OF and _f.name not in _GROUPS, f"option {_f.name} is not unique"
        _GROUP_OF[_f.name] = _group


# -- the command line ------------------------------------------------------------------------------
def _flag(f: dataclasses.Field) -> str:
    if f.metadata["flag"]:
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def add_flags(parser: argparse.ArgumentParser, show_hidden: bool = False) -> None:
    """One flag per field of NodeConfig's groups, in a section per group; the hidden ones
    parse too but are listed only with show_hidden."""
    for _, cls in _groups():
        section = parser.add_argument_group(cls.__doc__.split(":")[0].rstrip("."))
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if meta["add"] is not None:
                meta["add"](section, show_hidden)
                continue
            help_text = meta["help"] if show_hidden or not meta["hidden"] else argparse.SUPPRESS
            default = _default(f)
            if isinstance(default, bool):
                section.add_argument(_flag(f), dest=f.name, help=help_text,
                                     action="store_false" if default else "store_true")
                continue
            parse = meta["parse"] or (float if meta["unit"] != 1 else (str if default is None else type(default)))
            shown = meta["shown"] if meta["shown"] is not None else (
                default / meta["unit"] if meta["unit"] != 1 else default)
            flag = _flag(f)
            section.add_argument(flag, dest=f.name, type=parse, default=shown, choices=meta["choices"],
                                 metavar=None if meta["choices"] else flag[2:].upper().replace("-", "_"),
                                 help=help_text, secret=meta["secret"])


def to_flags(config: NodeConfig) -> list[str]:
    """The flags that give `config` back through from_args: each field that differs from its
    default (a benchmark serves as a subprocess the node it builds in process)."""
    flags: list[str] = []
    for name, cls in _groups():
        group, defaults = getattr(config, name), cls()
        for f in dataclasses.fields(cls):
            value, default = getattr(group, f.name), getattr(defaults, f.name)
            if f.name == "tuning":
                changed = {t.name for t in dataclasses.fields(Tuning) if getattr(value, t.name) != getattr(default, t.name)}
                flags += [f"--tune={key}={format_choice(key, getattr(value, key))}"
                          for key in sorted(changed | config.kernels.tuning_fixed)]
                continue
            if value == default or f.name == "tuning_fixed":
                continue
            if f.metadata["add"] is not None:
                raise ConfigError(f"{f.name} has no flag of its own to write")
            unit = f.metadata["unit"]
            if isinstance(default, bool):
                flags.append(_flag(f))
            else:
                text = ",".join(value) if isinstance(value, tuple) else repr(value / unit) if unit != 1 else str(value)
                flags.append(f"{_flag(f)}={text}")
    return flags


def from_args(args: argparse.Namespace) -> NodeConfig:
    """The NodeConfig of parsed flags (ConfigError for choices that cannot go together)."""
    groups = {}
    for name, cls in _groups():
        values = {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if meta["read"] is not None:
                values[f.name] = meta["read"](args)
                continue
            value = getattr(args, f.name)
            if meta["unit"] != 1:
                value = int(value * meta["unit"])
            values[f.name] = value
        groups[name] = cls(**values)
    return NodeConfig(**groups)

