"""`inference-node serve`: the node's command line, generated from NodeConfig (config.py), every
flag also an environment variable. `--help` lists the operator's flags; `--help-all` adds the
developer options (--tune and the engine's switches for tests and benchmarks). Nothing on
this path imports torch: the engine core process alone loads it.

`inference-node tune`: the kernels' launch choices tuned ahead of time (inference_node/tuner,
imported only when this command runs)."""
from __future__ import annotations

import argparse
import logging
import sys

from kernels.tuning_table import TuningTable, TuningTableError
from lora_common.envargs import EnvArgumentParser
from lora_common.tls import TLSConfigError

from .config import CONFIG_EXIT, ConfigError, NodeConfig, add_flags, from_args, tune_keys
from .launcher import serve

PROG = "inference-node"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in each flag's help; the epilog (--help-all's --tune keys) one key a line."""


class HelpAll(argparse.Action):
    """--help-all: the whole serve command, its developer options too."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        serve_parser(show_hidden=True).print_help()
        parser.exit()


def parser(show_hidden: bool = False) -> EnvArgumentParser:
    root = EnvArgumentParser(prog=PROG, env_prefix="INFERENCE_NODE", description="Multi-LoRA inference node (gRPC).")
    sub = root.add_subparsers(dest="command", required=True, parser_class=EnvArgumentParser)
    serve = sub.add_parser("serve", help="serve the InferenceNode gRPC API", env_prefix="INFERENCE_NODE",
                           description="Serve the InferenceNode gRPC API (and the OpenAI-compatible HTTP API "
                                       "with --http-port). Every flag is also an environment variable: "
                                       "--max-num-seqs is INFERENCE_NODE_MAX_NUM_SEQS; the command line wins.",
                           formatter_class=HelpFormatter, epilog=tune_keys() if show_hidden else None)
    # Not through EnvArgumentParser.add_argument: no environment variable asks for help.
    argparse.ArgumentParser.add_argument(serve, "--help-all", action=HelpAll,
                                         help="show every option, the developer ones too (--tune, the engine's "
                                              "switches for tests and benchmarks), and exit")
    add_flags(serve, show_hidden)
    add_tune_command(sub)
    return root


def add_tune_command(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser(
        "tune", env_prefix="INFERENCE_NODE", formatter_class=HelpFormatter,
        help="tune the kernels' launch choices for a model on this GPU ahead of time",
        description="Tune the decode step's launch choices (the decode GEMM's tilings, plain and with LoRA "
                    "folded in) for a model's shapes on this GPU, as `serve` does at its first start when no "
                    "table matches, and write the tuning table where the node looks for it (or --out). "
                    "Flags shared with serve read the same environment variables.")
    tune.add_argument("--model", default=None,
                      help="HF checkpoint directory (only its config.json is read; default: the embedded model)")
    tune.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                      help="tune one rank's shard of a node split over this many GPUs")
    tune.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                      help="the model's dtype on the node (auto = bfloat16 on cuda, float32 on cpu)")
    tune.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                      help="cpu: a smoke through the PyTorch reference, 3 candidates a case, whose numbers "
                           "mean nothing (tests)")
    tune.add_argument("--batches", default="64,32,16,8,1",
                      help="decode batch buckets, comma-separated, the most used first (above 64 rows cuBLAS "
                           "runs the matmuls: not swept)")
    tune.add_argument("--adapters", default="0,32,16,8,1",
                      help="distinct adapters in a step, comma-separated: 0 the base GEMM, N its LoRA fold "
                           "with N rank-16 adapters")
    tune.add_argument("--budget-s", type=float, default=600.0,
                      help="seconds after which no new candidate starts (the table then holds what was measured)")
    tune.add_argument("--tuning-cache-dir", "--out", dest="out", default=None,
                      help="the table's folder (its file named by device, shape and dtype) or a .json path "
                           "(default: where `serve` looks: its --tuning-cache-dir, else $LORA_SERVING_CACHE/tuning; "
                           "kernels/configs for a seed)")
    tune.add_argument("--groups", default="qkv,o,gate_up,down,experts.gate_up,experts.down,attention",
                      help="fused groups to sweep (a dense model has no experts', a mixture of experts no dense MLP's), "
                           "and attention: decode attention's launch at 8, 64 and 256 rows")
    tune.add_argument("--quantization", choices=("none", "fp8", "fp8-w8a8"), default="none",
                      help="serve's --quantization: FP8 projections' GEMM launches are tuned instead (an FP8 "
                           "checkpoint's are, as weight-only fp8, without it)")
    tune.add_argument("--min-gain", type=float, default=0.02,
                      help="a tiling goes into the table where it is this much faster than the default")


def serve_parser(show_hidden: bool = False) -> argparse.ArgumentParser:
    """The `serve` subcommand's parser."""
    return parser(show_hidden)._subparsers._group_actions[0].choices["serve"]


def checked(config: NodeConfig) -> NodeConfig:
    """Fails now, naming the flag, on settings that can be checked without the model: a
    tuning table given by path is read (its shape is checked against the model's when the
    core loads it), TLS files are read and paired."""
    table = config.kernels.tuning_table
    if table not in ("auto", "off"):
        try:
            TuningTable.read(table)
        except TuningTableError as exc:
            raise ConfigError(f"--tuning-table: {exc}") from None
    config.server.tls.credentials()
    config.sources.store_tls.credentials()
    return config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.command == "tune":
        from .tuner.cli import run

        args.argv = argv[1:]
        return run(args)
    try:
        config = checked(from_args(args))
    except (ConfigError, TLSConfigError) as exc:
        print(f"{PROG} serve: {exc}", file=sys.stderr)
        return CONFIG_EXIT
    logging.basicConfig(level=config.server.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
