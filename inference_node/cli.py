"""`inference-node serve`: the node's command line, generated from NodeConfig (config.py), every
flag also an environment variable. `--help` lists the operator's flags; `--help-all` adds the
developer options (--tune and the engine's switches for tests and benchmarks). Nothing on
this path imports torch: the engine core process alone loads it."""
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
    return root


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
    args = parser().parse_args(argv)
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
