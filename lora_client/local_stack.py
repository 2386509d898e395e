"""The whole system on this machine, on loopback: SeaweedFS (S3), the adapter store, one
inference node on the embedded model; pushes the sample adapters; then a demo burst that
mixes every sample adapter and the base model in one batch.

    python -m lora_client.local_stack              # demo, then stop everything
    python -m lora_client.local_stack --serve      # demo, then keep serving until Ctrl-C
    python -m lora_client.local_stack --fleet 3    # 3 nodes behind HAProxy (make fleet), serving

With --fleet N, N nodes (one torch thread each) serve behind HAProxy, which routes each
adapter's requests to one node, gRPC and the OpenAI HTTP API alike (docs/FLEET.md); the demo
goes through the proxy, and SIGHUP to this launcher restarts the nodes one at a time under
whatever load is running.

Ctrl-C (or the end of the demo) stops every process it started. Once up it prints where
everything is: the node (gRPC and its OpenAI-compatible HTTP API), the store, their
Prometheus metrics, the S3 endpoint, bucket and credentials, and a push command that works as
pasted. The demo ends with one answer fetched with curl over the HTTP API. If a process dies it names it, with
its exit code and the last lines of its log, stops the rest and exits with status 1.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from .demo import Answer, print_answers, run_burst
from .fleet import NodeFleet
from .processes import Child, ChildDied, console_script, free_port, wait_healthy

REPO = Path(__file__).resolve().parents[1]


def sample_behaviours():
    """The sample adapters' checkers (samples/behaviours.py, next to this package)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from samples import behaviours
    return behaviours


class LocalStack:
    def __init__(self, work_dir: Path, node_port: int, store_port: int, max_loras: int,
                 node_args: list[str], node_metrics_port: int = 0, store_metrics_port: int = 0,
                 node_http_port: int = 0, fleet_size: int = 0, stats_port: int = 0) -> None:
        """fleet_size > 0: that many nodes behind HAProxy, which listens on node_port (gRPC)
        and node_http_port (the OpenAI HTTP API)."""
        self.work_dir = work_dir
        self.fleet_size = fleet_size
        self.stats_port = stats_port
        self.fleet: NodeFleet | None = None
        self.node_port = node_port or free_port()
        self.node_http_port = node_http_port or free_port()
        self.store_port = store_port or free_port()
        self.node_metrics_port = node_metrics_port or free_port()
        self.store_metrics_port = store_metrics_port or free_port()
        self.max_loras = max_loras
        self.node_args = node_args
        self.seaweed = None
        self.children: list[Child] = []
        self.bucket = f"lora-adapters-{uuid.uuid4().hex[:6]}"

    @property
    def node_target(self) -> str:
        """Where requests go: the node, or the fleet's proxy."""
        return self.fleet.target if self.fleet is not None else f"127.0.0.1:{self.node_port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API, the node's or the fleet's proxy's (the openai client's base_url)."""
        return self.fleet.http_url if self.fleet is not None else f"http://127.0.0.1:{self.node_http_port}/v1"

    @property
    def store_target(self) -> str:
        return f"127.0.0.1:{self.store_port}"

    def start(self, samples: Path) -> list[str]:
        from adapter_store.push import push_adapter
        from adapter_store.s3 import S3Store
        from adapter_store.seaweedfs import SeaweedFS

        logs = self.work_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        print(f"[stack] SeaweedFS (S3) in {self.work_dir / 'seaweedfs'} ...", flush=True)
        self.seaweed = SeaweedFS(self.work_dir / "seaweedfs").start()
        self.seaweed.create_bucket(self.bucket)
        env = self.seaweed.env()
        print(f"[stack] S3 at {self.seaweed.endpoint_url}, bucket {self.bucket}", flush=True)

        s3 = S3Store(self.bucket, self.seaweed.boto3_client())
        names = sorted(p.name for p in samples.iterdir() if (p / "adapter_config.json").exists())
        for name in names:
            push_adapter(samples / name, name, s3, "adapters/", progress=False)
        print(f"[stack] pushed sample adapters: {', '.join(names)}", flush=True)

        store = Child("adapter-store", console_script("adapter-store") + [
            "serve", "--host", "127.0.0.1", "--port", str(self.store_port),
            "--metrics-port", str(self.store_metrics_port),
            "--s3-endpoint", self.seaweed.endpoint_url, "--bucket", self.bucket,
            "--cache-dir", str(self.work_dir / "store-cache")], logs / "adapter-store.log", env)
        self.children.append(store)
        wait_healthy(self.store_target, 60, store)
        print(f"[stack] adapter store on {self.store_target} (log: {logs / 'adapter-store.log'})", flush=True)

        if self.fleet_size:
            self._start_fleet(env)
        else:
            node = Child("inference-node", console_script("inference-node") + [
                "serve", "--host", "127.0.0.1", "--port", str(self.node_port), "--http-port", str(self.node_http_port),
                "--metrics-port", str(self.node_metrics_port), "--adapter-store", self.store_target,
                "--max-loras", str(self.max_loras), *self.node_args], logs / "inference-node.log", env)
            self.children.append(node)
            wait_healthy(self.node_target, 600, node)
            print(f"[stack] inference node on {self.node_target} (log: {logs / 'inference-node.log'})", flush=True)
        print(self.summary(samples / names[0] if names else samples), flush=True)
        return names

    def _start_fleet(self, env: dict[str, str]) -> None:
        # Several nodes share this machine's cores: one torch thread each unless told otherwise.
        threads = [] if "--cpu-threads" in self.node_args else ["--cpu-threads", "1"]
        print(f"[stack] {self.fleet_size} inference nodes and HAProxy ...", flush=True)
        self.fleet = NodeFleet(self.work_dir, self.fleet_size, [
            "--adapter-store", self.store_target, "--max-loras", str(self.max_loras), *threads, *self.node_args],
            env=env, proxy_port=self.node_port, stats_port=self.stats_port, http_port=self.node_http_port)
        self.fleet.start()
        for node in self.fleet.nodes:
            print(f"[stack] inference node {node.name} on {node.target} (log: {self.fleet.log_path(node)})", flush=True)
        print(f"[stack] HAProxy on {self.fleet.target}, OpenAI API {self.fleet.http_url}, stats "
              f"{self.fleet.stats_url} (log: {self.fleet.proxy.child.log_path})", flush=True)

    def summary(self, example: Path) -> str:
        """Where everything is, once up, with a push command that works as pasted."""
        env = self.seaweed.env()
        credentials = " ".join(f"{k}={shlex.quote(env[k])}" for k in
                               ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"))
        push = " ".join(shlex.quote(a) for a in console_script("adapter-store") + [
            "push", str(example.resolve()), "--name", "my-adapter",
            "--s3-endpoint", self.seaweed.endpoint_url, "--bucket", self.bucket])
        client = " ".join(shlex.quote(a) for a in console_script("lora-client"))
        if self.fleet is not None:
            nodes = [f"  HAProxy         {self.fleet.target}   stats {self.fleet.stats_url}"]
            nodes += [f"  inference node  {n.target}   {n.name}, metrics {n.metrics_url}" for n in self.fleet.nodes]
        else:
            nodes = [f"  inference node  {self.node_target}   metrics http://127.0.0.1:{self.node_metrics_port}/metrics"]
        nodes.append(f"  OpenAI API      {self.http_url}   (curl, or the openai client with this base_url)")
        fleet_view = (["  which node holds which adapter:", f"    {client} fleet --proxy-stats {self.fleet.stats_url}"]
                      if self.fleet is not None else [])
        return "\n".join([
            "[stack] up:",
            *nodes,
            f"  adapter store   {self.store_target}   metrics http://127.0.0.1:{self.store_metrics_port}/metrics",
            f"  S3              {self.seaweed.endpoint_url}   bucket {self.bucket}   prefix adapters/",
            f"  credentials     {credentials}",
            "  push an adapter (then it is served by name within a few seconds):",
            f"    {credentials} {push}",
            f"    {client} --node {self.node_target} generate --adapter my-adapter \"Hello!\"",
            f"    {shlex.join(curl_command(self.http_url, 'my-adapter', 'Hello!', 64))}",
            *fleet_view,
        ])

    def check_alive(self) -> None:
        """Raises ChildDied for the first process of the stack that is no longer running."""
        if self.seaweed is not None and not self.seaweed.running:
            process = self.seaweed.process
            raise ChildDied("seaweedfs (S3)", process.returncode if process else None, self.seaweed.log_path)
        if self.fleet is not None:
            self.fleet.check_alive()
        for child in self.children:
            if not child.alive():
                raise child.died()

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        if self.seaweed is not None:
            self.seaweed.close()
            self.seaweed = None
        print("[stack] stopped", flush=True)


def demo(target: str, names: list[str], max_tokens: int) -> list[tuple[str, Answer, bool]]:
    """One concurrent burst: each sample adapter's demo prompt, served by the adapter and by
    the base model. Returns (behaviour, answer, shown) for each request."""
    behaviours = sample_behaviours()
    burst: list[tuple[str, str]] = []
    behaviour_of: list[str] = []
    for name in names:
        prompt = behaviours.DEMO_PROMPTS.get(name, ["Hello!"])[0]
        burst += [(name, prompt), ("", prompt)]
        behaviour_of += [name, name]
    started = time.monotonic()
    answers = run_burst(target, burst, max_tokens)
    print_answers(answers, time.monotonic() - started)
    print("\nbehaviour checks (each adapter should show its behaviour, the base model should not):")
    results = []
    for behaviour, answer in zip(behaviour_of, answers):
        shown = behaviour in behaviours.ADAPTER_NAMES and behaviours.shows_behaviour(behaviour, answer.prompt, answer.text)
        results.append((behaviour, answer, shown))
        print(f"  {answer.adapter or 'base model':14} {'shows' if shown else 'does not show'} the {behaviour} behaviour")
    return results


def curl_command(http_url: str, model: str, prompt: str, max_tokens: int) -> list[str]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    return ["curl", "-sS", f"{http_url}/chat/completions", "-H", "Content-Type: application/json",
            "-d", json.dumps(body)]


def curl_adapter(names: list[str]) -> str:
    """The adapter the curl demo asks: the first whose demo prompt reads well in a shell line."""
    prompts = sample_behaviours().DEMO_PROMPTS
    return next((n for n in names if "'" not in prompts.get(n, ["Hello!"])[0]), names[0])


def curl_answer(http_url: str, name: str, max_tokens: int) -> Answer | None:
    """One chat answer of adapter `name` over the OpenAI-compatible API, fetched with curl
    (greedy, so it equals the burst's gRPC answer to the same prompt)."""
    prompt = sample_behaviours().DEMO_PROMPTS.get(name, ["Hello!"])[0]
    command = curl_command(http_url, name, prompt, max_tokens)
    print(f"\n[stack] one answer over the OpenAI-compatible HTTP API, fetched with curl:\n  $ {shlex.join(command)}",
          flush=True)
    if shutil.which("curl") is None:
        print("  (curl is not installed here: nothing fetched)", flush=True)
        return None
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - started
    try:
        reply = json.loads(done.stdout)
        text = reply["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError):
        raise RuntimeError(f"curl exited with {done.returncode}: {done.stdout or done.stderr}") from None
    print(f"  [{name}] {prompt}\n  -> {text.strip()}\n     ({reply['usage']['completion_tokens']} tokens, "
          f"{seconds:.2f} s, {reply['choices'][0]['finish_reason']})", flush=True)
    return Answer(name, prompt, text.strip(), 0.0, seconds, reply["usage"]["completion_tokens"],
                  reply["choices"][0]["finish_reason"])


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM both stop the stack, even when started from a shell or service that
    set SIGINT to be ignored (background jobs, nohup): Python then installs no handler itself."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


class RestartRequest:
    """SIGHUP: a rolling restart of the fleet, run by the serving loop."""

    def __init__(self) -> None:
        self.pending = False
        signal.signal(signal.SIGHUP, self._set)

    def _set(self, signum: int, frame: object) -> None:
        self.pending = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help="keep the stack running after the demo")
    ap.add_argument("--work-dir", default=None, help="data and logs (default: a temporary directory)")
    ap.add_argument("--node-port", type=int, default=int(os.environ.get("STACK_NODE_PORT", 0)),
                    help="inference node gRPC port (0: a free one)")
    ap.add_argument("--store-port", type=int, default=int(os.environ.get("STACK_STORE_PORT", 0)),
                    help="adapter store gRPC port (0: a free one)")
    ap.add_argument("--node-metrics-port", type=int, default=int(os.environ.get("STACK_NODE_METRICS_PORT", 0)),
                    help="the node's Prometheus metrics port (0: a free one; printed once up)")
    ap.add_argument("--node-http-port", type=int, default=int(os.environ.get("STACK_NODE_HTTP_PORT", 0)),
                    help="the node's OpenAI-compatible HTTP API port, with --fleet the proxy's (0: a free one; "
                         "printed once up)")
    ap.add_argument("--store-metrics-port", type=int, default=int(os.environ.get("STACK_STORE_METRICS_PORT", 0)),
                    help="the store's Prometheus metrics port (0: a free one; printed once up)")
    ap.add_argument("--samples", default=str(REPO / "samples" / "adapters"), help="adapters pushed at start")
    ap.add_argument("--max-loras", type=int, default=4, help="the node's GPU adapter slots")
    ap.add_argument("--fleet", type=int, default=0, metavar="N",
                    help="N nodes behind HAProxy (the `haproxy` package), routed by adapter; implies --serve, "
                         "and --node-port is the proxy's")
    ap.add_argument("--stats-port", type=int, default=int(os.environ.get("STACK_STATS_PORT", 0)),
                    help="with --fleet: HAProxy's stats page port (0: a free one; printed once up)")
    ap.add_argument("--max-tokens", type=int, default=40, help="tokens per answer of the demo burst")
    ap.add_argument("--report", default=None, help="write the demo's answers and checks as JSON here")
    ap.add_argument("--no-demo", dest="demo", action="store_false", help="skip the demo burst")
    ap.add_argument("node_args", nargs="*", help="extra inference-node flags (after --)")
    args = ap.parse_args(argv)
    _stop_on_signals()
    # Every process this stack starts inherits this marker, so leftovers can be found.
    os.environ.setdefault("LORA_STACK_ID", uuid.uuid4().hex)
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="lora-stack-"))
    if args.fleet:
        from .haproxy import MISSING, haproxy_binary
        if haproxy_binary() is None:
            print(f"[stack] --fleet needs HAProxy. {MISSING}", file=sys.stderr)
            return 1
        args.serve = True
    stack = LocalStack(work_dir, args.node_port, args.store_port, args.max_loras, args.node_args,
                       args.node_metrics_port, args.store_metrics_port, args.node_http_port, args.fleet,
                       args.stats_port)
    restart = RestartRequest() if args.fleet else None
    status = 0
    try:
        names = stack.start(Path(args.samples))
        try:
            results = demo(stack.node_target, names, args.max_tokens) if args.demo else []
            over_http = (curl_answer(stack.http_url, curl_adapter(names), args.max_tokens)
                         if args.demo and names else None)
        except Exception:
            stack.check_alive()  # a dead process explains a failed demo better than its symptom
            raise
        if args.report:
            rows = [{"behaviour": b, "adapter": a.adapter, "prompt": a.prompt, "text": a.text, "shown": shown,
                     "tokens": a.tokens, "seconds": round(a.total, 3), "api": "grpc"} for b, a, shown in results]
            if over_http is not None:
                name = over_http.adapter
                rows.append({"behaviour": name, "adapter": name, "prompt": over_http.prompt,
                             "text": over_http.text, "tokens": over_http.tokens, "seconds": round(over_http.total, 3),
                             "api": "http", "shown": sample_behaviours().shows_behaviour(
                                 name, over_http.prompt, over_http.text)})
            Path(args.report).write_text(json.dumps(rows, indent=2))
        if args.serve:
            client = " ".join(shlex.quote(a) for a in console_script("lora-client"))
            listing = (f"fleet --proxy-stats {stack.fleet.stats_url}" if stack.fleet is not None
                       else f"--node {stack.node_target} ls")
            print(f"\n[stack] serving; try:\n  {client} --node {stack.node_target} generate "
                  f"--adapter {names[0]} \"Tell me about the sea.\"\n  {client} {listing}", flush=True)
            print(f"  curl -sS {stack.http_url}/models", flush=True)
            if restart is not None:
                print(f"[stack] kill -HUP {os.getpid()} restarts the nodes one at a time.", flush=True)
            print("[stack] Ctrl-C stops everything.", flush=True)
            while True:
                if restart is not None and restart.pending:
                    restart.pending = False
                    stack.fleet.rolling_restart(report=lambda line: print(line, flush=True))
                    print("[stack] rolling restart done", flush=True)
                stack.check_alive()
                time.sleep(0.5)
    except KeyboardInterrupt:
        print("\n[stack] interrupted", flush=True)
    except ChildDied as exc:
        print(f"\n[stack] {exc}\n[stack] stopping the rest", flush=True)
        status = 1
    finally:
        stack.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
