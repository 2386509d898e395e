"""`inference-node serve`: the node's command line (every flag also an environment variable)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from kernels.tuning import DEFAULT_TUNING, Tuning, choice_help, format_choice, parse_choice
from kernels.tuning_table import TuningTable, TuningTableError
from lora_common.envargs import EnvArgumentParser
from lora_common.validation import DEFAULT_MAX_WEIGHT_ABS
from lora_common.tls import (TLSConfigError, add_client_flags, add_server_flags, client_tls_from_args,
                               server_tls_from_args)
from .launcher import ServeOptions, serve as serve_node
from .limits import RequestLimits
from .model.llama import LORA_MODULES
from .node import NodeSettings


def lora_modules(text: str) -> tuple[str, ...]:
    """--lora-modules: names of LoRA target modules, comma-separated."""
    names = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in names if m not in LORA_MODULES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown LoRA modules {unknown or text!r}; choose from "
                                         f"{', '.join(LORA_MODULES)}")
    return names


def parser() -> EnvArgumentParser:
    root = EnvArgumentParser(prog="inference-node", env_prefix="INFERENCE_NODE",
                             description="Multi-LoRA inference node (gRPC).")
    sub = root.add_subparsers(dest="command", required=True, parser_class=EnvArgumentParser)
    serve = sub.add_parser("serve", help="serve the InferenceNode gRPC API", env_prefix="INFERENCE_NODE")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    serve.add_argument("--model", default=None,
                       help="HF safetensors checkpoint directory of the Llama family "
                            "(default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="auto = cuda when available")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                       help="auto = bfloat16 on cuda, float32 on cpu")
    serve.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors",
                       help="dummy: random weights of the shapes in the checkpoint's config.json, made on "
                            "the device (benchmarks of models whose weights are not at hand)")
    serve.add_argument("--kv-cache-gb", type=float, default=0.0,
                       help="KV cache memory (0: on CUDA what --gpu-memory-utilization leaves, on CPU 0.5)")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="CUDA: the share of the device's memory the node may take; the KV cache gets "
                            "what the weights, adapter slots and the largest step's activations leave")
    serve.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks (overrides --kv-cache-gb)")
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    serve.add_argument("--max-num-seqs", type=int, default=0,
                       help="running requests per step (0: 256 on CUDA, 64 on CPU)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=512,
                       help="token budget of one step (chunked prefill)")
    serve.add_argument("--prefill-delay-factor", type=float, default=0.0,
                       help="while requests decode, hold new prompts until the oldest has waited this "
                            "many times the last prefill step, so arrivals share prefill steps (0: admit at once)")
    serve.add_argument("--refill-wait-factor", type=float, default=1.0,
                       help="after a step in which a burst of requests finished, new prompts wait until as many "
                            "have arrived, at most this many times the last prefill step, so a closed-loop client's "
                            "resubmissions share one prefill step (0: off)")
    serve.add_argument("--warmup", choices=["auto", "on", "off"], default="auto",
                       help="before serving, run synthetic eager steps so their Triton kernels compile "
                            "now rather than under the first requests (auto: on CUDA)")
    serve.add_argument("--max-queue", type=int, default=1024,
                       help="waiting requests before RESOURCE_EXHAUSTED")
    serve.add_argument("--max-model-len", type=int, default=4096, help="prompt + output tokens")
    serve.add_argument("--default-max-tokens", type=int, default=256, help="when max_tokens is 0")
    serve.add_argument("--decode-graphs", choices=["auto", "on", "off"], default="auto",
                       help="replay decode steps from CUDA graphs (auto: on CUDA; on: also on CPU, "
                            "eagerly through the same static buffers, for tests)")
    serve.add_argument("--mixed-graphs", choices=["auto", "on", "off"], default="auto",
                       help="replay prefill and mixed steps from CUDA graphs piece by piece, attention "
                            "run between (auto: on CUDA; on: also on CPU, eagerly through the same "
                            "static buffers, for tests)")
    serve.add_argument("--max-graph-batch", type=int, default=0,
                       help="largest decode batch replayed from a graph, larger ones run eagerly "
                            "(0: --max-num-seqs)")
    serve.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                       help="turn off the prefix cache (KV reuse of shared prompt prefixes, per adapter)")
    serve.add_argument("--max-loras", type=int, default=8,
                       help="the most distinct adapters in one step (0 disables LoRA)")
    serve.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank served")
    serve.add_argument("--lora-memory-mb", type=float, default=0,
                       help="GPU memory for adapters (on each GPU of a tensor-parallel node), shared by "
                            "rank: an adapter holds its own rank's rows on each module it targets "
                            "(0: --max-loras adapters of --max-lora-rank)")
    serve.add_argument("--lora-modules", type=lora_modules, default=",".join(LORA_MODULES),
                       help="comma-separated modules adapters may target (default: all seven); the "
                            "adapter memory keeps rank rows only for their fused groups (q,k,v / o / "
                            "gate,up / down), so a fleet of q,v adapters spends none on o or the MLP")
    serve.add_argument("--adapter-eviction", choices=["lru", "gdsf"], default="lru",
                       help="which idle adapters leave the GPU first when memory is wanted: least "
                            "recently used, or GreedyDual-Size-Frequency (requests per byte, aged)")
    serve.add_argument("--max-cpu-loras", type=int, default=32,
                       help="adapters kept in host memory (also how deep waiting requests' adapters are "
                            "fetched ahead)")
    serve.add_argument("--adapter-store", default=None,
                       help="HOST:PORT of the adapter store (adapters load on demand)")
    serve.add_argument("--adapter-dir", default=None,
                       help="local adapters directory (<dir>/<name>/adapter_config.json ...), "
                            "used when no --adapter-store is given")
    serve.add_argument("--admin-token", default=None, secret=True,
                       help="bearer token that LoadAdapter/UnloadAdapter require (off when unset)")
    serve.add_argument("--generate-token", default=None, secret=True,
                       help="bearer token that Generate requires (off when unset)")
    serve.add_argument("--http-port", type=int, default=0,
                       help="OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, "
                            "/v1/models), served by every front-end process beside gRPC (0: off)")
    serve.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics HTTP port (0: off)")
    serve.add_argument("--metrics-max-adapters", type=int, default=32,
                       help="adapters with their own `adapter` label in the metrics, the busiest by "
                            "requests; the others share adapter=\"_other\" (bounds the series count)")
    add_server_flags(serve, "node")
    add_client_flags(serve, "store-tls", "adapter store")
    serve.add_argument("--store-token", default=None, secret=True,
                       help="bearer token sent to an adapter store started with --token")
    serve.add_argument("--max-concurrent-streams", type=int, default=0,
                       help="open Generate streams and HTTP completions of a front end before RESOURCE_EXHAUSTED "
                            "(HTTP 429; 0: only --max-queue bounds them)")
    serve.add_argument("--max-request-mb", type=float, default=16.0,
                       help="largest request message; gRPC refuses larger ones with RESOURCE_EXHAUSTED")
    serve.add_argument("--max-prompt-chars", type=int, default=1 << 20,
                       help="characters of a prompt (or of all its messages) before INVALID_ARGUMENT")
    serve.add_argument("--max-prompt-tokens", type=int, default=0,
                       help="prompt tokens before INVALID_ARGUMENT (0: --max-model-len - 1)")
    serve.add_argument("--max-tokens-limit", type=int, default=0,
                       help="largest max_tokens a request may ask for, else INVALID_ARGUMENT "
                            "(0: what --max-model-len leaves)")
    serve.add_argument("--adapter-disk-dir", default=None,
                       help="directory of the node's disk tier: adapters fetched from the store are kept "
                            "there (verified on every read) and survive restarts (off when unset)")
    serve.add_argument("--adapter-disk-gb", type=float, default=20.0,
                       help="bound of --adapter-disk-dir; least recently used adapters are evicted first")
    serve.add_argument("--adapter-direct-reads", action="store_true",
                       help="read adapters straight from the object store by the read plans of a store "
                            "started with --direct-reads (verified against its BLAKE3; streamed from the "
                            "store when it offers none or a read fails)")
    serve.add_argument("--adapter-fetch-timeout", type=float, default=60.0,
                       help="seconds an adapter load keeps retrying and resuming from the store before "
                            "its waiting requests get UNAVAILABLE")
    serve.add_argument("--max-adapter-mb", type=float, default=1024.0,
                       help="largest adapter fetched from the store or read from --adapter-dir "
                            "(FAILED_PRECONDITION above)")
    serve.add_argument("--max-weight-abs", type=float, default=DEFAULT_MAX_WEIGHT_ABS,
                       help="largest |value| of a LoRA weight; adapters with larger ones are refused as "
                            "numerically unsafe, FAILED_PRECONDITION (0: no bound; the overflow probe still runs)")
    serve.add_argument("--drain-seconds", type=float, default=10.0,
                       help="on SIGTERM, time running requests get to finish")
    serve.add_argument("--drain-min-seconds", type=float, default=1.5,
                       help="on SIGTERM, the least time the node answers NOT_SERVING (refusing new requests with "
                            "UNAVAILABLE) before it closes its port, so a proxy's health checks see it first")
    serve.add_argument("--cpu-threads", type=int, default=0,
                       help="torch threads of an engine on the CPU (0: the cores less one, left to the front end)")
    serve.add_argument("--api-processes", type=int, default=1,
                       help="front-end processes serving gRPC on the port (tokenising, detokenising, "
                            "streaming); the engine always runs in a process of its own")
    serve.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="split the model over this many GPUs of the host (one process each; gloo on CPU)")
    serve.add_argument("--all-reduce", choices=["nccl", "symm"], default="nccl",
                       help="with --tensor-parallel-size > 1 on GPUs: sum decode-sized messages (up to 4 MB) "
                            "through PyTorch's symmetric-memory one-shot/two-shot kernels instead of NCCL")
    serve.add_argument("--debug-checks", action="store_true",
                       help="check the engine's invariants after every step (slow)")
    serve.add_argument("--log-level", default="INFO")
    add_tuning_flags(serve)
    return root


def add_tuning_flags(serve: EnvArgumentParser) -> None:
    """--tuning-table, and one flag per launch choice of the decode step (kernels/tuning.py:
    Tuning), named after it (--gemm-prefetch-k for gemm_prefetch_k). A choice flag left unset
    takes the tuning table's value for the step's bucket, else the default (the measured
    best); one given (or set in its environment variable) wins over the table."""
    serve.add_argument("--tuning-table", default="auto",
                       help="launch choices per decode batch and adapter-count bucket from a table "
                            "kept as data (kernels/configs/README.md): auto = the one filed for this "
                            "GPU and model shape if any, off, or a table file's path; the choice "
                            "flags below override it")
    for f in dataclasses.fields(Tuning):
        def parse(text: str, name: str = f.name):
            try:
                return parse_choice(name, text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        # No parser default: an unset flag (None) leaves the choice to the table.
        default = format_choice(f.name, getattr(DEFAULT_TUNING, f.name))
        serve.add_argument("--" + f.name.replace("_", "-"), dest="tune_" + f.name,
                           type=parse, metavar=f.name.upper(), default=None,
                           help=f"tuning: {choice_help(f.name)} (default: {default}, or the "
                                f"tuning table's)%(default).0s")


def given_tuning_flags(args: argparse.Namespace) -> frozenset[str]:
    """The launch choices whose flag was given (or set in its environment variable)."""
    return frozenset(f.name for f in dataclasses.fields(Tuning)
                     if getattr(args, "tune_" + f.name) is not None)


def tuning_from_args(args: argparse.Namespace) -> Tuning:
    """The defaults with the choice flags given applied."""
    try:
        return Tuning(**{name: getattr(args, "tune_" + name) for name in given_tuning_flags(args)})
    except ValueError as exc:
        raise SystemExit(f"inference-node serve: {exc}") from None


def check_tuning_table(setting: str) -> None:
    """A table given by path is read now, so a bad file fails before the model loads (its
    shape is checked against the model's when it loads)."""
    if setting not in ("auto", "off"):
        try:
            TuningTable.read(setting)
        except TuningTableError as exc:
            raise SystemExit(f"inference-node serve: --tuning-table: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    check_tuning_table(args.tuning_table)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = NodeSettings(
        model=args.model, device=None if args.device == "auto" else args.device, dtype=args.dtype,
        load_format=args.load_format, kv_cache_gb=args.kv_cache_gb,
        gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue=args.max_queue, max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens, debug_checks=args.debug_checks,
        prefix_caching=args.prefix_caching, decode_graphs=args.decode_graphs, mixed_graphs=args.mixed_graphs,
        max_graph_batch=args.max_graph_batch, prefill_delay_factor=args.prefill_delay_factor,
        refill_wait_factor=args.refill_wait_factor,
        warmup=args.warmup,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        lora_memory_bytes=int(args.lora_memory_mb * (1 << 20)), adapter_eviction=args.adapter_eviction,
        lora_modules=args.lora_modules,
        adapter_store=args.adapter_store, adapter_dir=args.adapter_dir,
        adapter_disk_dir=args.adapter_disk_dir, adapter_disk_bytes=int(args.adapter_disk_gb * (1 << 30)),
        adapter_direct_reads=args.adapter_direct_reads,
        admin_token=args.admin_token, generate_token=args.generate_token, metrics_port=args.metrics_port,
        metrics_max_adapters=args.metrics_max_adapters,
        tls=server_tls_from_args(args), store_tls=client_tls_from_args(args, "store-tls"),
        store_token=args.store_token, cpu_threads=args.cpu_threads, adapter_fetch_timeout_s=args.adapter_fetch_timeout,
        max_adapter_bytes=int(args.max_adapter_mb * (1 << 20)), max_weight_abs=args.max_weight_abs,
        tuning=tuning_from_args(args), tuning_table=args.tuning_table,
        tuning_fixed=given_tuning_flags(args), tensor_parallel_size=args.tensor_parallel_size,
        all_reduce=args.all_reduce,
        limits=RequestLimits(max_concurrent_streams=args.max_concurrent_streams,
                             max_request_bytes=int(args.max_request_mb * (1 << 20)),
                             max_prompt_chars=args.max_prompt_chars, max_prompt_tokens=args.max_prompt_tokens,
                             max_tokens=args.max_tokens_limit))
    try:  # a bad TLS setting fails now, with its flag named, not after the model has loaded
        settings.tls.credentials()
        settings.store_tls.credentials()
    except TLSConfigError as exc:
        print(f"inference-node serve: {exc}", file=sys.stderr)
        return 2
    if args.api_processes < 1:
        print("inference-node serve: --api-processes must be at least 1", file=sys.stderr)
        return 2
    return serve_node(settings, ServeOptions(host=args.host, port=args.port, drain_seconds=args.drain_seconds,
                                        drain_min_seconds=args.drain_min_seconds,
                                        api_processes=args.api_processes, log_level=args.log_level,
                                        http_port=args.http_port))


if __name__ == "__main__":
    sys.exit(main())
