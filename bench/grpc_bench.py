"""The path users take: `inference-node serve` started as a subprocess and driven by several
gRPC client processes, then by as many HTTP client processes through its OpenAI-compatible
API (/v1/completions streamed as server-sent events), beside the same engine driven
in-process, on the same requests and checkpoint, in one table.

    python -m bench.grpc_bench                          # CUDA: Llama-3.2-1B shapes; CPU: the embedded model
    python -m bench.grpc_bench --shape 8b               # Llama-3.1-8B shapes
    python -m bench.grpc_bench --concurrency 64,256 --rows base,c32 --api-processes 2
    python -m bench.grpc_bench --poisson 200 --zipf-alpha 1.0   # open loop, Zipf adapter popularity

Rows, each at every concurrency: `base` (no adapter; LoRA on, unused) and `cN` (N distinct
rank-16 adapters on all seven projections, request i on adapter i mod N, all pinned before
timing). Both paths run the node's own settings (`LLM` in-process, the same flags
for the subprocess), so the ratio is what the serving path costs: gRPC, tokenising,
detokenising, IPC, the front-end processes. The `http` rows send the same token-id prompts
with the `ignore_eos` extension and count tokens from the last chunk's `usage`; their
time to first token and per token are those of the first and last chunk carrying text.

Columns: output tok/s (output tokens over the time from the first request to the last
finish), TTFT and TPOT (the time between a request's first and last token over its tokens
after the first) p50 and p99, and the engine's steps by kind: decode steps replayed from a
decode graph, other steps (prompt chunks, maybe beside decodes) replayed piece by piece from
the piecewise graphs, decode steps run eagerly, and steps with prompt tokens run eagerly.

On CUDA the model has random bf16 weights of the named shapes, made on the device (the
node's `--load-format dummy`), and the embedded SmolLM2's tokenizer (so vocab 49,152): a
checkpoint of config.json and tokenizer files only. Adapters are random PEFT folders.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from bench.shapes import LLAMA_3_1_70B, LLAMA_3_1_8B, LLAMA_3_2_1B

log = logging.getLogger("grpc_bench")

# The named models' layer shapes (bench.common); the checkpoint around them has SmolLM2's
# vocabulary, so the requests' token ids are text the front end can detokenize.
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_theta")
SHAPES = {name: {k: config[k] for k in SHAPE_KEYS}
          for name, config in (("1b", LLAMA_3_2_1B), ("8b", LLAMA_3_1_8B), ("70b", LLAMA_3_1_70B))}
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    adapter: str
    arrival: float  # seconds after the start (Poisson); 0 in closed loop


@dataclass
class Record:
    submit: float
    first: float | None
    last: float | None
    done: float
    tokens: int
    error: str | None


@dataclass
class Result:
    row: str
    path: str
    concurrency: int
    records: list[Record]
    steps: dict[str, int]


# -- the model and adapters ------------------------------------------------------------------------------
def prepare_checkpoint(work: Path, shape: str | None, tokenizer: Path | None) -> Path:
    """config.json of the named shape beside the embedded model's tokenizer (dummy weights),
    or the embedded model itself (shape None: its real weights, for CPU runs)."""
    from inference_node.model.embedded import default_checkpoint

    embedded = tokenizer or default_checkpoint()
    if shape is None:
        return embedded
    out = work / f"llama-{shape}-dummy"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (embedded / name).exists():
            shutil.copy(embedded / name, out / name)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "bos_token_id": 1,
              "eos_token_id": 2, "torch_dtype": "bfloat16", **SHAPES[shape]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def prepare_adapters(work: Path, checkpoint: Path, count: int, cuda: bool) -> Path:
    import torch

    from inference_node.model.config import ModelConfig
    from bench.common import write_random_adapter

    root = work / "adapters"
    cfg = ModelConfig.from_checkpoint(checkpoint)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    for k in range(count):
        folder = root / f"r16-{k:03d}"
        if not (folder / "adapter_model.safetensors").exists():
            write_random_adapter(folder, cfg, 16, ALL_MODULES, seed=1000 + k, device=device, dtype=dtype)
    return root


def make_requests(n: int, prompt_len: tuple[int, int], output: int, vocab: int, adapters: list[str],
                  poisson: float | None, alpha: float, seed: int) -> list[Request]:
    from bench.engine_driver import make_specs, zipf_index

    specs = make_specs(n, prompt_len, (output, output), vocab, poisson, seed)
    out = []
    for s in specs:
        adapter = ""
        if adapters:
            adapter = adapters[zipf_index(s.pick, len(adapters), alpha) if poisson else s.index % len(adapters)]
        out.append(Request(list(s.prompt), s.max_tokens, adapter, s.arrival))
    return out


# -- clients (processes of their own): gRPC, and the OpenAI-compatible HTTP API --------------------------
@dataclass(frozen=True)
class Endpoint:
    api: str                    # "grpc" or "http"
    target: str                 # HOST:PORT (gRPC) or the HTTP API's base URL
    model: str = ""             # HTTP: the base model's name (`model` of requests without an adapter)


def client_process(endpoint: Endpoint, requests: list[Request], concurrency: int, poisson: bool, ready, start,
                   results) -> None:
    """Sends its requests: closed loop at `concurrency`, or at their arrival times; puts its
    records on `results`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    client = _grpc_client if endpoint.api == "grpc" else _http_client
    results.put(asyncio.run(client(endpoint, requests, concurrency, poisson, ready, start)))


async def _drive(requests: list[Request], concurrency: int, poisson: bool, start, one) -> list[Record]:
    await asyncio.get_running_loop().run_in_executor(None, start.wait)
    t0 = time.monotonic()
    gate = asyncio.Semaphore(concurrency if not poisson else len(requests) or 1)

    async def timed(req: Request) -> Record:
        if poisson:
            await asyncio.sleep(max(0.0, t0 + req.arrival - time.monotonic()))
        async with gate:
            return await one(req)

    return await asyncio.gather(*(timed(r) for r in requests))


async def _grpc_client(endpoint: Endpoint, requests: list[Request], concurrency: int, poisson: bool, ready,
                       start) -> list[Record]:
    """One connection, a stream per request."""
    import grpc

    from lora.v1 import inference_pb2 as pb
    from lora.v1 import inference_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(endpoint.target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = pb_grpc.InferenceNodeStub(channel)
        async for _ in stub.Generate(pb.GenerateRequest(prompt_token_ids=[1000, 1001], max_tokens=1)):
            pass
        ready.set()

        async def one(req: Request) -> Record:
            submit = time.monotonic()
            first = last = None
            tokens, error = 0, None
            try:
                async for msg in stub.Generate(pb.GenerateRequest(
                        prompt_token_ids=req.prompt, max_tokens=req.max_tokens, adapter=req.adapter,
                        ignore_eos=True), timeout=600):
                    if msg.token_ids:
                        now = time.monotonic()
                        first = first or now
                        last = now
                        tokens += len(msg.token_ids)
            except grpc.aio.AioRpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            return Record(submit, first, last, time.monotonic(), tokens, error)

        return await _drive(requests, concurrency, poisson, start, one)


async def _http_client(endpoint: Endpoint, requests: list[Request], concurrency: int, poisson: bool, ready,
                       start) -> list[Record]:
    """POST /v1/completions with stream: true, a connection per request in flight (HTTP/1.1);
    the same token-id prompts with `ignore_eos`, tokens counted from the last chunk's usage."""
    import httpx

    url = f"{endpoint.target}/completions"
    limits = httpx.Limits(max_connections=max(concurrency, 1), max_keepalive_connections=max(concurrency, 1))
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        (await http.post(url, json={"model": endpoint.model, "prompt": [1000, 1001], "max_tokens": 1})).raise_for_status()
        ready.set()

        async def one(req: Request) -> Record:
            body = {"model": req.adapter or endpoint.model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            submit = time.monotonic()
            first = last = None
            tokens, error = 0, None
            try:
                async with http.stream("POST", url, json=body) as reply:
                    if reply.status_code != 200:
                        error = f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:200]}"
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = event["error"]["message"]
                        elif event["choices"] and event["choices"][0]["text"]:
                            now = time.monotonic()
                            first = first or now
                            last = now
                        elif event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            return Record(submit, first, last, time.monotonic(), tokens, error)

        return await _drive(requests, concurrency, poisson, start, one)


def run_client_row(endpoint: Endpoint, requests: list[Request], concurrency: int, clients: int,
                   poisson: bool) -> list[Record]:
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    shares = [requests[i::clients] for i in range(clients)]
    procs, readies = [], []
    for i, share in enumerate(shares):
        ready = ctx.Event()
        per = concurrency // clients + (1 if i < concurrency % clients else 0)
        p = ctx.Process(target=client_process, args=(endpoint, share, max(per, 1), poisson, ready, start, results))
        p.start()
        procs.append(p)
        readies.append(ready)
    for ready in readies:
        if not ready.wait(120):
            raise RuntimeError("a client process did not connect")
    start.set()
    records: list[Record] = []
    for _ in procs:
        records += results.get(timeout=3600)
    for p in procs:
        p.join(30)
    return records


# -- the node as a subprocess --------------------------------------------------------------------------
class NodeProcess:
    def __init__(self, flags: list[str], log_path: Path) -> None:
        from lora_client.processes import free_port, wait_healthy

        self.port = free_port()
        self.http_port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}/v1"
        self.log_file = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "inference_node.cli", "serve", "--port", str(self.port),
                                      "--http-port", str(self.http_port), *flags],
                                     stdout=self.log_file, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.target, 1800)
        except Exception:
            self.stop()
            raise RuntimeError(f"the node did not start; its log: {log_path}") from None

    def processes(self) -> dict[str, int]:
        """The launcher (front end 0) and its children (engine core, other front ends) by pid."""
        children = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return {"launcher": self.proc.pid, **{f"child-{pid}": int(pid) for pid in children}}

    def stats(self) -> dict[str, int]:
        from lora_client.node_client import NodeClient

        with NodeClient(self.target) as client:
            s = client.stats()
        return {"graph": s.graph_steps, "piecewise": s.piecewise_graph_steps,
                "eager_decode": s.eager_decode_steps, "mixed": s.eager_prefill_steps}

    def pin(self, names: list[str]) -> None:
        from lora.v1 import inference_pb2 as pb
        from lora_client.node_client import NodeClient

        with NodeClient(self.target) as client:
            for name in names:
                client.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, pin=True), timeout=600)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log_file.close()


def node_flags(args, checkpoint: Path, adapters: Path, dummy: bool) -> list[str]:
    flags = ["--model", str(checkpoint), "--adapter-dir", str(adapters), "--max-loras", str(max(args.adapters, 1)),
             "--max-lora-rank", "16", "--max-cpu-loras", str(max(args.adapters, 1)),
             "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_batched_tokens),
             "--api-processes", str(args.api_processes), "--max-model-len", "1024", "--log-level", "WARNING"]
    if dummy:
        flags += ["--load-format", "dummy"]
    if args.device != "auto":
        flags += ["--device", args.device]
    if args.num_kv_blocks:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.prefill_delay_factor:
        flags += ["--prefill-delay-factor", str(args.prefill_delay_factor)]
    if args.refill_wait_factor is not None:
        flags += ["--refill-wait-factor", str(args.refill_wait_factor)]
    if args.tensor_parallel_size > 1:
        flags += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    return flags + ["--mixed-graphs", args.mixed_graphs]


# -- the engine in-process -------------------------------------------------------------------------------
def run_engine_rows(args, checkpoint: Path, adapters: Path, dummy: bool, plan) -> list[Result]:
    import torch

    from bench.engine_driver import Driver, Spec, preload_adapters
    from inference_node.config import NodeConfig
    from inference_node.llm import LLM

    llm = LLM(NodeConfig.of(
        checkpoint=str(checkpoint), device=args.device,
        load_format="dummy" if dummy else "safetensors", adapter_dir=str(adapters),
        max_loras=max(args.adapters, 1), max_lora_rank=16, max_cpu_loras=max(args.adapters, 1),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens, max_model_len=1024,
        num_kv_blocks=args.num_kv_blocks, prefill_delay_factor=args.prefill_delay_factor,
        **({} if args.refill_wait_factor is None else {"refill_wait_factor": args.refill_wait_factor}),
        mixed_graphs=args.mixed_graphs, tensor_parallel_size=args.tensor_parallel_size))
    node, engine = llm.node, llm.engine
    llm.prepare()
    names = sorted({r.adapter for _, _, reqs in plan for r in reqs if r.adapter})
    if names:
        preload_adapters(engine, node.adapters, names)
    out = []
    for row, conc, reqs in plan:
        specs = [Spec(i, r.prompt, r.max_tokens, r.arrival, 0.0) for i, r in enumerate(reqs)]
        adapter_of = {id(s): r.adapter for s, r in zip(specs, reqs)}
        driver = Driver(engine, node.model.device, conc, poisson=bool(args.poisson))
        driver.run(specs[:conc], lambda s: adapter_of[id(s)], lambda s: 4)  # warm: this row's shapes
        before = dict(engine.stats.__dict__)
        records, _ = driver.run(specs, lambda s: adapter_of[id(s)])
        steps = {"graph": engine.stats.graph_steps - before["graph_steps"],
                 "piecewise": engine.stats.piecewise_graph_steps - before["piecewise_graph_steps"],
                 "eager_decode": engine.stats.eager_decode_steps - before["eager_decode_steps"],
                 "mixed": engine.stats.eager_prefill_steps - before["eager_prefill_steps"]}
        out.append(Result(row, "engine", conc, [Record(r.submit, r.first, r.last, r.done or r.submit, r.tokens,
                                                       r.error) for r in records], steps))
        print(f"# {format_row(summarize(out[-1]))}", file=sys.stderr, flush=True)
    llm.close()  # and a tensor-parallel node's other ranks
    del llm, node, engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


# -- the table ---------------------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float:
    from bench.engine_driver import pct as _pct
    return _pct(values, q)


def summarize(res: Result) -> dict:
    ok = [r for r in res.records if r.error is None and r.first is not None]
    start = min((r.submit for r in res.records), default=0.0)
    end = max((r.done for r in res.records), default=0.0)
    tokens = sum(r.tokens for r in ok)
    ttft = [(r.first - r.submit) * 1e3 for r in ok]
    tpot = [(r.last - r.first) / (r.tokens - 1) * 1e3 for r in ok if r.tokens > 1]
    return {"row": res.row, "path": res.path, "conc": res.concurrency, "requests": len(res.records),
            "errors": len(res.records) - len(ok), "tok_s": tokens / (end - start) if end > start else 0.0,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50),
            "tpot_p99": pct(tpot, 99), **res.steps}


def format_row(s: dict) -> str:
    return (f"{s['row']:<6} {s['conc']:>5} {s['path']:<7} {s['tok_s']:>10.0f} {s['ttft_p50']:>9.1f} "
            f"{s['ttft_p99']:>9.1f} {s['tpot_p50']:>9.2f} {s['tpot_p99']:>9.2f}   "
            f"{s['graph']:>6}/{s['piecewise']}/{s['eager_decode']}/{s['mixed']:<6} {s['errors']:>4}")


HEADER = (f"{'row':<6} {'conc':>5} {'path':<7} {'out tok/s':>10} {'TTFT p50':>9} {'p99 ms':>9} "
          f"{'TPOT p50':>9} {'p99 ms':>9}   steps graph/piecewise/eager decode/eager mixed  errors")


def comparisons(rows: list[dict]) -> list[str]:
    lines = []
    by = {(s["row"], s["conc"], s["path"]): s for s in rows}
    for (row, conc, path), g in sorted(by.items()):
        e = by.get((row, conc, "engine"))
        if path != "grpc" or e is None:
            continue
        lines.append(f"{row} @ {conc}: gRPC/engine tok/s {g['tok_s'] / e['tok_s']:.3f} (target >= 0.9), "
                     f"TTFT p50 +{g['ttft_p50'] - e['ttft_p50']:.1f} ms (target <= +15), "
                     f"TPOT p50 x{g['tpot_p50'] / e['tpot_p50']:.3f} (target <= 1.1)")
    for (row, conc, path), h in sorted(by.items()):
        g = by.get((row, conc, "grpc"))
        if path != "http" or g is None or not g["tok_s"]:
            continue
        tpot = f", TPOT p50 x{h['tpot_p50'] / g['tpot_p50']:.3f}" if g["tpot_p50"] else ""
        lines.append(f"{row} @ {conc}: HTTP/gRPC tok/s {h['tok_s'] / g['tok_s']:.3f} ({h['tok_s']:.0f} vs "
                     f"{g['tok_s']:.0f}), TTFT p50 {h['ttft_p50'] - g['ttft_p50']:+.1f} ms{tpot}")
    for row in sorted({s["row"] for s in rows}):
        grpc_by_conc = sorted((s["conc"], s["tok_s"]) for s in rows if s["row"] == row and s["path"] == "grpc")
        if len(grpc_by_conc) > 1:
            lines.append(f"{row}: gRPC tok/s by concurrency " + ", ".join(f"{c}: {t:.0f}" for c, t in grpc_by_conc))
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--shape", choices=[*SHAPES, "embedded"], default=None,
                   help="model shapes (CUDA default 1b; CPU default: the embedded model's real weights)")
    p.add_argument("--rows", default="base,c32", help="base and/or cN (N distinct adapters)")
    p.add_argument("--concurrency", default=None, help="comma-separated (CUDA 64,256; CPU 8)")
    p.add_argument("--requests-per-stream", type=int, default=4, help="requests per row = this x concurrency")
    p.add_argument("--prompt-len", default=None, help="LO:HI tokens (CUDA 32:256, CPU 8:32)")
    p.add_argument("--output-len", type=int, default=None, help="tokens per request (CUDA 128, CPU 16)")
    p.add_argument("--poisson", type=float, default=None, metavar="RATE", help="open loop at RATE requests/s")
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--clients", type=int, default=4, help="client processes (of each API)")
    p.add_argument("--api-processes", default="auto", help="the node's front-end processes (auto: the node's "
                                                           "choice by its device and cores)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the node's (CUDA 256, CPU 16)")
    p.add_argument("--max-batched-tokens", type=int, default=None, help="the node's (CUDA 2048, CPU 256)")
    p.add_argument("--num-kv-blocks", type=int, default=0, help="0: the node's default sizing")
    p.add_argument("--prefill-delay-factor", type=float, default=0.0, help="the node's")
    p.add_argument("--refill-wait-factor", type=float, default=None, help="the node's (default: the node's default)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="the node's (one GPU per rank)")
    p.add_argument("--mixed-graphs", choices=["auto", "on", "off"], default="auto",
                   help="the node's: prompt and mixed steps replayed from piecewise CUDA graphs")
    p.add_argument("--paths", default="grpc,http,engine",
                   help="which paths to run: grpc, http (the OpenAI-compatible API, /v1/completions streamed), "
                        "engine (in-process)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="folder of SmolLM2's tokenizer files (default: the converted embedded model)")
    p.add_argument("--profile", type=int, default=0, metavar="SECONDS",
                   help="py-spy the node's processes this long during the first gRPC row (raw stacks to --profile-out)")
    p.add_argument("--profile-out", type=Path, default=Path("."))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    shape = args.shape or ("1b" if cuda else "embedded")
    concurrencies = [int(c) for c in (args.concurrency or ("64,256" if cuda else "8")).split(",")]
    lo, _, hi = (args.prompt_len or ("32:256" if cuda else "8:32")).partition(":")
    prompt_len = (int(lo), int(hi or lo))
    output = args.output_len or (128 if cuda else 16)
    args.max_num_seqs = args.max_num_seqs or (256 if cuda else 16)
    args.max_batched_tokens = args.max_batched_tokens or (2048 if cuda else 256)
    rows = args.rows.split(",")
    args.adapters = max([int(r[1:]) for r in rows if r.startswith("c")] or [0])
    with tempfile.TemporaryDirectory(prefix="grpc-bench-") as tmp:
        work = args.workdir or Path(tmp)
        dummy = shape != "embedded"
        checkpoint = prepare_checkpoint(work, shape if dummy else None, args.tokenizer)
        adapter_root = prepare_adapters(work, checkpoint, args.adapters, cuda)
        names = [f"r16-{k:03d}" for k in range(args.adapters)]
        from inference_node.model.config import ModelConfig

        vocab = ModelConfig.from_checkpoint(checkpoint).vocab_size
        plan = []
        for conc in concurrencies:
            for row in rows:
                pool = names[:int(row[1:])] if row.startswith("c") else []
                reqs = make_requests(conc * args.requests_per_stream, prompt_len, output, vocab, pool, args.poisson,
                                     args.zipf_alpha, args.seed + conc)
                plan.append((row, conc, reqs))
        device_name = torch.cuda.get_device_name() if cuda else "CPU"
        print(f"device: {device_name}; model: {shape} shapes ({checkpoint.name}), "
              f"{'random bf16 weights' if dummy else 'real weights'}, vocab {vocab}; node: max_num_seqs "
              f"{args.max_num_seqs}, {args.max_batched_tokens} tokens a step, prefill delay factor "
              f"{args.prefill_delay_factor:g}, refill wait factor "
              f"{'default' if args.refill_wait_factor is None else format(args.refill_wait_factor, 'g')}, mixed graphs {args.mixed_graphs}, tensor parallel "
              f"{args.tensor_parallel_size}, {args.api_processes} front-end "
              f"process(es); {args.clients} client processes per API; "
              + (f"Poisson {args.poisson} req/s, Zipf({args.zipf_alpha})" if args.poisson else "closed loop")
              + f"; prompts {prompt_len[0]}-{prompt_len[1]}, {output} new tokens (ignore EOS)", flush=True)
        results: list[Result] = []
        apis = [api for api in ("grpc", "http") if api in args.paths]
        if apis:
            node = NodeProcess(node_flags(args, checkpoint, adapter_root, dummy), work / "node.log")
            endpoints = {"grpc": Endpoint("grpc", node.target), "http": Endpoint("http", node.http_url, checkpoint.name)}
            try:
                if names:
                    node.pin(names)
                for k, (row, conc, reqs) in enumerate(plan):
                    for api in apis:  # the same requests through each API, one after the other
                        run_client_row(endpoints[api], reqs[:conc], conc, args.clients, False)  # warm
                        before = node.stats()
                        profiler = None
                        if args.profile and k == 0 and api == apis[0]:  # the node's processes, by py-spy
                            profiler = [subprocess.Popen(["py-spy", "record", "--pid", str(pid), "-d",
                                                          str(args.profile), "-r", "250", "-f", "raw", "--nonblocking",
                                                          "-o", str(args.profile_out / f"pyspy-{name}.txt")],
                                                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                                        for name, pid in node.processes().items()]
                        records = run_client_row(endpoints[api], reqs, conc, args.clients, bool(args.poisson))
                        for proc in profiler or []:
                            proc.wait(60)
                        after = node.stats()
                        results.append(Result(row, api, conc, records, {k: after[k] - before[k] for k in after}))
                        print(f"# {format_row(summarize(results[-1]))}", file=sys.stderr, flush=True)
            finally:
                node.stop()
        if "engine" in args.paths:
            results += run_engine_rows(args, checkpoint, adapter_root, dummy, plan)
    summaries = [summarize(r) for r in results]
    summaries.sort(key=lambda s: (s["row"], s["conc"], s["path"]))
    print(HEADER)
    for s in summaries:
        print(format_row(s))
    for line in comparisons(summaries):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"rows": summaries, "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=2))
    return summaries


if __name__ == "__main__":
    main()
