"""The node's settings tree (inference_node/config.py) and the command line generated from it:
the operator's --help fits a screen and holds no kernel launch choice, the developer options
are in --help-all, the command line, the environment and Python callers build the same
NodeConfig, and --api-processes auto follows its rule."""
from __future__ import annotations

import dataclasses
import re

import pytest

from inference_node.cli import parser, serve_parser
from inference_node.config import (GB, MB, NodeConfig, RequestLimits, RunnerOptions, from_args, to_flags)
from inference_node.core.protocol import CoreInfo
from inference_node.launcher import frontend_count
from kernels.tuning import Tuning


def options(help_text: str) -> list[str]:
    """The option lines of a help text (what `--help | grep -c -- '^  -'` counts)."""
    return [line for line in help_text.splitlines() if line.startswith("  -")]


def test_serve_help_fits_a_screen_and_holds_no_kernel_launch_choice() -> None:
    shown = options(serve_parser().format_help())
    assert len(shown) <= 60, f"serve --help lists {len(shown)} options"
    flags = {m for line in shown for m in re.findall(r"--[a-z0-9-]+", line.split("  ")[1])}
    for f in dataclasses.fields(Tuning):
        assert "--" + f.name.replace("_", "-") not in flags
    assert "--tune" not in flags and "--decode-graphs" not in flags and "--warmup" not in flags
    assert {"--enforce-eager", "--tuning-table", "--help-all", "--api-processes"} <= flags


def test_help_all_adds_the_developer_options_and_every_tune_key() -> None:
    full = serve_parser(show_hidden=True).format_help()
    for flag in ("--tune", "--decode-graphs", "--mixed-graphs", "--warmup", "--max-graph-batch",
                 "--debug-checks", "--cpu-threads", "--load-format", "--prefill-delay-factor"):
        assert f"  {flag}" in full, flag
    for f in dataclasses.fields(Tuning):
        assert f"\n  {f.name} (default " in full, f.name
    assert len(options(full)) > len(options(serve_parser().format_help()))


def test_help_all_prints_and_exits(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["serve", "--help-all"])
    assert exit_.value.code == 0
    assert "--tune KEY=VALUE" in capsys.readouterr().out


def test_the_command_lines_defaults_are_the_configs() -> None:
    """One tree: a node started with no flags is the one NodeConfig() describes."""
    assert from_args(parser().parse_args(["serve"])) == NodeConfig()


def test_flags_units_and_the_environment_reach_their_groups(monkeypatch) -> None:
    monkeypatch.setenv("INFERENCE_NODE_DECODE_GRAPHS", "on")  # a hidden flag reads its variable too
    monkeypatch.setenv("INFERENCE_NODE_NO_ADAPTER_DISK_TIER", "1")
    config = from_args(parser().parse_args([
        "serve", "--model", "/m", "--lora-memory-mb", "1.5", "--adapter-disk-gb", "2", "--max-request-mb", "1",
        "--max-tokens-limit", "64", "--api-processes", "3", "--no-prefix-caching", "--adapter-fetch-timeout", "5"]))
    assert config.model.checkpoint == "/m" and config.runner.decode_graphs == "on"
    assert config.lora.lora_memory_bytes == int(1.5 * MB) and config.sources.adapter_disk_bytes == 2 * GB
    assert config.limits == RequestLimits(max_request_bytes=MB, max_tokens=64)
    assert config.server.api_processes == 3 and config.cache.prefix_caching is False
    assert config.sources.adapter_disk_tier is False and config.sources.adapter_fetch_timeout_s == 5.0
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--api-processes", "0"])


def test_a_config_built_in_python_is_served_with_the_same_flags() -> None:
    """to_flags: what a benchmark passes to `serve` for the NodeConfig it built in process
    (units, booleans, tuples, hidden options and --tune choices alike)."""
    from kernels.tuning import tuning_from_text

    config = NodeConfig.of(checkpoint="/m", device="cpu", max_loras=0, lora_memory_bytes=123_456_789,
                           lora_modules=("q_proj", "v_proj"), prefix_caching=False, warmup="off",
                           prefill_delay_factor=0.5, api_processes=2, tuning=tuning_from_text({"pdl": "off"}),
                           tuning_fixed=frozenset({"pdl"}), load_format="dummy", kv_cache_gb=1.5,
                           tune_budget=0.0, limits=RequestLimits(max_request_bytes=3 * MB))
    flags = to_flags(config)
    assert "--no-prefix-caching" in flags and "--tune=pdl=off" in flags and "--lora-modules=q_proj,v_proj" in flags
    assert "--tune-budget=0.0" in flags
    assert from_args(parser().parse_args(["serve", *flags])) == config
    assert to_flags(NodeConfig()) == []


def test_the_tune_budget_is_an_operator_flag_and_tune_a_command(monkeypatch) -> None:
    """--tune-budget (the kernels group: seconds a node without a tuning table may tune at
    start, 0 never) is on the operator's --help and reads its variable; `inference-node tune`
    takes the tuner's flags without loading torch here."""
    shown = {m for line in options(serve_parser().format_help()) for m in re.findall(r"--[a-z0-9-]+", line)}
    assert "--tune-budget" in shown
    assert from_args(parser().parse_args(["serve", "--tune-budget", "0"])).kernels.tune_budget == 0.0
    monkeypatch.setenv("INFERENCE_NODE_TUNE_BUDGET", "90")
    assert from_args(parser().parse_args(["serve"])).kernels.tune_budget == 90.0
    args = parser().parse_args(["tune", "--model", "/m", "--tp", "4", "--batches", "64,8", "--adapters", "0,32",
                                "--budget-s", "30", "--out", "/t"])
    assert (args.command, args.model, args.tensor_parallel_size, args.batches, args.adapters, args.budget_s,
            args.out) == ("tune", "/m", 4, "64,8", "0,32", 30.0, "/t")


def test_node_config_of_names_fields_of_any_group_and_refuses_others() -> None:
    config = NodeConfig.of(checkpoint="/m", device="cpu", max_loras=2, debug_checks=True,
                           limits=RequestLimits(max_prompt_chars=10))
    assert (config.model.device, config.lora.max_loras, config.runner.debug_checks) == ("cpu", 2, True)
    assert config.limits.max_prompt_chars == 10
    assert config.replace(max_loras=3).lora.max_loras == 3 and config.lora.max_loras == 2
    with pytest.raises(TypeError, match="no option 'max_lora'"):
        NodeConfig.of(max_lora=2)


def test_enforce_eager_turns_off_graphs_and_the_warm_up() -> None:
    runner = RunnerOptions()
    assert runner.decode_graphs_on("cuda") and runner.mixed_graphs_on("cuda") and runner.warmup_setting() == "auto"
    assert not runner.decode_graphs_on("cpu")
    assert RunnerOptions(decode_graphs="on").decode_graphs_on("cpu")  # the tests' CPU static-buffer path
    eager = RunnerOptions(enforce_eager=True, decode_graphs="on")
    assert not eager.decode_graphs_on("cuda") and not eager.mixed_graphs_on("cuda")
    assert eager.warmup_setting() == "off"


def core(device: str) -> CoreInfo:
    return CoreInfo("m", "/m", 10, 64, 64, 16, True, 2, 4, 1, device)


@pytest.mark.parametrize("device, cores, tp, expected", [
    ("cpu", 64, 1, 1),     # the engine's threads take the cores
    ("cuda", 2, 1, 1),     # the development and CI machines
    ("cuda", 7, 1, 2),     # two or more from 7 cores: the throughput measured with two
    ("cuda", 16, 1, 4),
    ("cuda", 8, 4, 1),     # four ranks' processes take their cores first
    ("cuda", 64, 8, 4),
])
def test_auto_front_ends_follow_the_device_and_the_cores(monkeypatch, device, cores, tp, expected) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    assert frontend_count(NodeConfig.of(tensor_parallel_size=tp), core(device)) == expected
    assert frontend_count(NodeConfig.of(api_processes=3), core(device)) == 3  # a count given is kept


def test_a_store_node_keeps_a_disk_tier_by_default_in_a_slot_of_its_own(tmp_path, monkeypatch) -> None:
    """With a store and no disk settings the tier is on, bounded, under the cache directory in
    a folder of the model's; nodes beside each other get a slot each and a restarted node its
    old one. --no-adapter-disk-tier (or no store) keeps none; a directory given is one node's."""
    from pathlib import Path

    from inference_node.config import ConfigError
    from inference_node.node import open_disk_tier

    monkeypatch.setenv("LORA_SERVING_CACHE", str(tmp_path / "cache"))
    checkpoint, config = Path("/models/tiny-llama"), NodeConfig.of(adapter_store="127.0.0.1:1")
    first, second = open_disk_tier(config, checkpoint), open_disk_tier(config, checkpoint)
    parent = tmp_path / "cache" / "adapter-disk" / "tiny-llama"
    assert (first.root, second.root) == (parent / "0", parent / "1") and first.max_bytes == 20 * GB
    first.close()
    again = open_disk_tier(config, checkpoint)
    assert again.root == parent / "0"
    for tier in (again, second):
        tier.close()
    assert open_disk_tier(config.replace(adapter_disk_tier=False), checkpoint) is None
    assert open_disk_tier(NodeConfig.of(adapter_dir=str(tmp_path)), checkpoint) is None
    given = config.replace(adapter_disk_dir=str(tmp_path / "mine"), adapter_disk_bytes=GB)
    mine = open_disk_tier(given, checkpoint)
    assert mine.root == tmp_path / "mine" and mine.max_bytes == GB
    with pytest.raises(ConfigError, match="--adapter-disk-dir: .* in use by another node"):
        open_disk_tier(given, checkpoint)
    mine.close()
