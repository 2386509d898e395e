"""`inference-node serve`: the node's command line (every flag also an environment variable)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys

from kernels.tuning import DEFAULT_TUNING, Tuning, choice_help, format_choice, parse_choice
from lora_common.envargs import EnvArgumentParser
from lora_common.tls import (TLSConfigError, add_client_flags, add_server_flags, client_tls_from_args,
                               server_tls_from_args)
from .limits import RequestLimits
from .node import NodeSettings, build_node
from .server import NodeServer


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
    serve.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache memory")
    serve.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks (overrides --kv-cache-gb)")
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="running requests per step")
    serve.add_argument("--max-num-batched-tokens", type=int, default=512,
                       help="token budget of one step (chunked prefill)")
    serve.add_argument("--prefill-delay-factor", type=float, default=0.0,
                       help="while requests decode, hold new prompts until the oldest has waited this "
                            "many times the last prefill step, so arrivals share prefill steps (0: admit at once)")
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
    serve.add_argument("--max-graph-batch", type=int, default=64,
                       help="largest decode batch replayed from a graph (larger ones run eagerly)")
    serve.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                       help="turn off the prefix cache (KV reuse of shared prompt prefixes, per adapter)")
    serve.add_argument("--max-loras", type=int, default=8,
                       help="GPU adapter slots: the most distinct adapters in one step (0 disables LoRA)")
    serve.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank served")
    serve.add_argument("--max-cpu-loras", type=int, default=32, help="adapters kept in host memory")
    serve.add_argument("--adapter-store", default=None,
                       help="HOST:PORT of the adapter store (adapters load on demand)")
    serve.add_argument("--adapter-dir", default=None,
                       help="local adapters directory (<dir>/<name>/adapter_config.json ...), "
                            "used when no --adapter-store is given")
    serve.add_argument("--admin-token", default=None, secret=True,
                       help="bearer token that LoadAdapter/UnloadAdapter require (off when unset)")
    serve.add_argument("--generate-token", default=None, secret=True,
                       help="bearer token that Generate requires (off when unset)")
    serve.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics HTTP port (0: off)")
    add_server_flags(serve, "node")
    add_client_flags(serve, "store-tls", "adapter store")
    serve.add_argument("--store-token", default=None, secret=True,
                       help="bearer token sent to an adapter store started with --token")
    serve.add_argument("--max-concurrent-streams", type=int, default=0,
                       help="open Generate streams before RESOURCE_EXHAUSTED (0: only --max-queue bounds them)")
    serve.add_argument("--max-request-mb", type=float, default=16.0,
                       help="largest request message; gRPC refuses larger ones with RESOURCE_EXHAUSTED")
    serve.add_argument("--max-prompt-chars", type=int, default=1 << 20,
                       help="characters of a prompt (or of all its messages) before INVALID_ARGUMENT")
    serve.add_argument("--max-prompt-tokens", type=int, default=0,
                       help="prompt tokens before INVALID_ARGUMENT (0: --max-model-len - 1)")
    serve.add_argument("--max-tokens-limit", type=int, default=0,
                       help="largest max_tokens a request may ask for, else INVALID_ARGUMENT "
                            "(0: what --max-model-len leaves)")
    serve.add_argument("--adapter-fetch-timeout", type=float, default=60.0,
                       help="seconds an adapter load keeps retrying and resuming from the store before "
                            "its waiting requests get UNAVAILABLE")
    serve.add_argument("--max-adapter-mb", type=float, default=1024.0,
                       help="largest adapter fetched from the store or read from --adapter-dir "
                            "(FAILED_PRECONDITION above)")
    serve.add_argument("--drain-seconds", type=float, default=10.0,
                       help="on SIGTERM, time running requests get to finish")
    serve.add_argument("--debug-checks", action="store_true",
                       help="check the engine's invariants after every step (slow)")
    serve.add_argument("--log-level", default="INFO")
    add_tuning_flags(serve)
    return root


def add_tuning_flags(serve: EnvArgumentParser) -> None:
    """One flag per launch choice of the decode step (kernels/tuning.py: Tuning), named after
    it (--gemm-prefetch-k for gemm_prefetch_k), its default the measured best."""
    for f in dataclasses.fields(Tuning):
        def parse(text: str, name: str = f.name):
            try:
                return parse_choice(name, text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        serve.add_argument("--" + f.name.replace("_", "-"), dest="tune_" + f.name,
                           type=parse, metavar=f.name.upper(),
                           default=format_choice(f.name, getattr(DEFAULT_TUNING, f.name)),
                           help="tuning: " + choice_help(f.name))


def tuning_from_args(args: argparse.Namespace) -> Tuning:
    try:
        return Tuning(**{f.name: getattr(args, "tune_" + f.name) for f in dataclasses.fields(Tuning)})
    except ValueError as exc:
        raise SystemExit(f"inference-node serve: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = NodeSettings(
        model=args.model, device=None if args.device == "auto" else args.device, dtype=args.dtype,
        kv_cache_gb=args.kv_cache_gb, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue=args.max_queue, max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens, debug_checks=args.debug_checks,
        prefix_caching=args.prefix_caching, decode_graphs=args.decode_graphs,
        max_graph_batch=args.max_graph_batch, prefill_delay_factor=args.prefill_delay_factor,
        warmup=args.warmup,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        adapter_store=args.adapter_store, adapter_dir=args.adapter_dir,
        admin_token=args.admin_token, generate_token=args.generate_token, metrics_port=args.metrics_port,
        tls=server_tls_from_args(args), store_tls=client_tls_from_args(args, "store-tls"),
        store_token=args.store_token, adapter_fetch_timeout_s=args.adapter_fetch_timeout, max_adapter_bytes=int(args.max_adapter_mb * (1 << 20)),
        tuning=tuning_from_args(args),
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
    node = build_node(settings)
    server = NodeServer(node, args.host, args.port, drain_seconds=args.drain_seconds)
    asyncio.run(server.serve_until_signalled())
    return 0


if __name__ == "__main__":
    sys.exit(main())
