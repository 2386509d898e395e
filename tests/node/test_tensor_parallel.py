"""Tensor parallelism on the CPU (gloo): `inference-node serve --tensor-parallel-size 2` gives
the greedy tokens of one rank, for the base model and for a batch mixing adapters of
different ranks and targets (column- and row-parallel projections alike), and keeps every
rank's adapter slot table (adapters and the arena rows each holds) equal to rank 0's through
loads, evictions, unloads and replacements (compared after every step: --debug-checks)."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch

from harness import make_peft_adapter
from inference_node.parallel.shard import COLUMN_PARALLEL, Shard, ShardingError, check_divisible
from inference_node.model.config import ModelConfig
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient
from lora_client.processes import Child, free_port, wait_healthy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Four ranks, and targets that reach only column-parallel (qv2, kgu16), only row-parallel
# (od8) or every projection (all4).
ADAPTERS = {"qv2": (2, ["q_proj", "v_proj"]), "all4": (4, ALL), "od8": (8, ["o_proj", "down_proj"]),
            "kgu16": (16, ["k_proj", "gate_proj", "up_proj"])}
PROMPTS = [[11, 2345, 876, 40], [7, 8, 9, 10, 11, 12], [3000, 12, 4], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
NEW_TOKENS = 8
# Rank rows of adapter memory per module on every rank: all four adapters at once (k, gate and
# up hold 4 + 16), not a fifth on up beside them, so the tests below evict.
ARENA_ROWS = 20


# -- the sharding math, without processes ----------------------------------------------------------
@pytest.mark.parametrize("module", ["q_proj", "gate_proj", "o_proj", "down_proj"])
def test_shards_of_a_projection_and_its_lora_sum_to_the_whole(module):
    """Column-parallel: each rank's output columns, side by side, are the whole output.
    Row-parallel: the ranks' partial outputs, LoRA delta included, sum to the whole."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    w = torch.randn(8, 12, generator=gen, dtype=torch.float64)        # [out, in]
    a = torch.randn(3, 12, generator=gen, dtype=torch.float64)        # [r, in]
    b = torch.randn(8, 3, generator=gen, dtype=torch.float64)         # [out, r]
    whole = x @ w.T + (x @ a.T) @ b.T * 0.5
    parts = []
    for rank in range(2):
        shard = Shard(rank, 2)
        ws = shard.weight(module, w)
        a_s, b_s = shard.lora_pair(module, a, b)
        if module in COLUMN_PARALLEL:
            parts.append(x @ ws.T + (x @ a_s.T) @ b_s.T * 0.5)
        else:
            xs = x[:, shard.block(12)[0]:shard.block(12)[1]]
            parts.append(xs @ ws.T + (xs @ a_s.T) @ b_s.T * 0.5)
    combined = torch.cat(parts, dim=1) if module in COLUMN_PARALLEL else parts[0] + parts[1]
    torch.testing.assert_close(combined, whole)
    assert not torch.allclose(parts[0], parts[1])


def test_vocabulary_blocks_cover_it_once_and_uneven_sizes_are_refused():
    blocks = [Shard(r, 3).vocab_block(10) for r in range(3)]
    assert blocks == [(0, 4, 4), (4, 8, 4), (8, 10, 4)]
    config = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 64,
                                    "intermediate_size": 160, "num_hidden_layers": 1,
                                    "num_attention_heads": 4, "num_key_value_heads": 2})
    check_divisible(config, 2)
    with pytest.raises(ShardingError, match="key/value heads"):
        check_divisible(config, 4)
    with pytest.raises(ShardingError, match="4 attention heads"):
        check_divisible(config, 3)


def test_control_messages_carry_staged_steps_and_adapters_whole():
    """What rank 0 sends its ranks (parallel/wire.py) reads back as it was staged: each kind of
    step with its packed buffers (an eager step without its token ids, which come by broadcast),
    a graph plan, an adapter's tensors bit for bit, and a slot table in the type rank 0 compares."""
    import numpy as np

    from inference_node.adapters.weights import AdapterWeights
    from inference_node.parallel import wire
    from inference_node.runner.batch import HostBatch
    from inference_node.runner.decode_graphs import StagedDecode
    from inference_node.runner.eager import EagerStep
    from inference_node.runner.graph_plan import GraphPlan
    from inference_node.runner.piecewise_graphs import EXPERTS, StagedPieces, StepShape

    def through(frames: list) -> tuple[wire.Control, list[bytes]]:
        return wire.decode_control(bytes(frames[0])), [bytes(f) for f in frames[1:]]

    packed = (np.arange(8, dtype=np.int64), np.arange(6, dtype=np.int32) - 3, np.array([4, 5, 6, 7], np.int32))
    decode = StagedDecode((8, 2, 1), 5, 2, *packed, ((3, 0, 2, 0), (1, 2, 3, -1)))
    pieces = StagedPieces(StepShape(32, 16, EXPERTS, 20, 3, 2, 9, 40), 2, *packed, ((0, 0, 16, 0),))
    host = HostBatch([11, 0], [1], [0], [4, 9], [20, 37], [[1], [2, 3]], [0, 1, 2], [5, 10], [0, 1], 1)
    for step in (decode, pieces):
        message, frames = through(wire.step_frames(step))
        back = wire.staged(message, frames)
        assert type(back) is type(step) and back.width == step.width and back.segments == step.segments
        assert (back.key if step is decode else back.shape) == (step.key if step is decode else step.shape)
        for got, sent in zip((back.int64, back.int32, back.table), packed):
            assert got.dtype == sent.dtype and (got == sent).all()
    back = wire.staged(*through(wire.step_frames(EagerStep(host, [(2, 1), (-1, 1)]))))
    assert isinstance(back, EagerStep) and back.chunk_slots == [(2, 1), (-1, 1)]
    assert back.host.input_ids == back.host.pending_at == back.host.pending_rows == []
    assert (back.host.positions, back.host.block_tables, back.host.max_query_len) == ([4, 9], [[1], [2, 3]], 1)
    plan = GraphPlan(64, 128, 8, 8, 64, 8)
    assert through([wire.encode(wire.Capture(plan))])[0] == wire.Capture(plan)

    gen = torch.Generator().manual_seed(0)
    tensors = {(0, "q_proj"): (torch.randn(4, 64, generator=gen).to(torch.bfloat16),
                               torch.randn(32, 4, generator=gen).to(torch.bfloat16)),
               (1, "down_proj"): (torch.randn(4, 80, generator=gen), torch.randn(64, 4, generator=gen))}
    weights = AdapterWeights("a", "v1", 4, 2.0, ("q_proj", "down_proj"), tensors)
    message, frames = through(wire.write_frames(3, weights, {"q_proj": 8, "down_proj": 0}))
    assert isinstance(message, wire.WriteSlot) and (message.slot, message.firsts) == (3, {"q_proj": 8, "down_proj": 0})
    got = wire.written(message, frames)
    assert (got.name, got.version, got.rank, got.scaling, got.target_modules) == ("a", "v1", 4, 2.0, ("q_proj", "down_proj"))
    for key, (a, b) in tensors.items():
        assert got.tensors[key][0].dtype == a.dtype and torch.equal(got.tensors[key][0], a)
        assert torch.equal(got.tensors[key][1], b)
    table = [None, ("a", "v1", 4, 2.0, ("q_proj",), (("q_proj", 8),))]
    assert wire.decode_reply(wire.encode(wire.SlotTable(1, table))).table == table  # == rank 0's own, as is


def greedy_in_process(model: Path, size: int, load_format: str = "safetensors") -> tuple[dict[int, list[int]], dict]:
    """Three prompts through a node built in this process (rank 0 here, rank 1 spawned)."""
    from inference_node.llm import LLM

    with LLM(checkpoint=str(model), device="cpu", num_kv_blocks=64, cpu_threads=1, tensor_parallel_size=size,
             max_loras=0, debug_checks=True, load_format=load_format) as llm:
        answers = llm.generate(PROMPTS[:3], NEW_TOKENS, ignore_eos=True)
        return {i: a.token_ids for i, a in enumerate(answers)}, llm.engine.snapshot()


def test_a_padded_vocabulary_block_tied_embeddings_and_qkv_bias_split_alike(tmp_path, tokenizer_dir):
    """A vocabulary that 2 does not divide (the last rank's block is padded), an embedding tied
    to the LM head, and q/k/v biases: TP=2 gives TP=1's tokens."""
    from harness import make_tiny_llama

    model = make_tiny_llama(tmp_path / "odd", tokenizer_dir, vocab_size=49153, tie_word_embeddings=True,
                            attention_bias=True)
    one, _ = greedy_in_process(model, 1)
    two, snap = greedy_in_process(model, 2)
    assert one == two and len(one) == 3 and all(len(t) == NEW_TOKENS for t in one.values())
    assert snap["tensor_parallel_size"] == 2 and snap["live_requests"] == 0


def test_dummy_weights_make_one_model_whatever_the_ranks(tiny_llama_path):
    """`--load-format dummy` (the GPU benchmarks' random weights of a checkpoint's shapes)
    makes a model that runs, the same one on every call, and each rank of TP=2 keeps its
    part of it: TP=2 gives TP=1's tokens."""
    one, _ = greedy_in_process(tiny_llama_path, 1, "dummy")
    again, _ = greedy_in_process(tiny_llama_path, 1, "dummy")
    two, _ = greedy_in_process(tiny_llama_path, 2, "dummy")
    real, _ = greedy_in_process(tiny_llama_path, 1)
    assert len(one) == 3 and all(len(t) == NEW_TOKENS for t in one.values())
    assert one == again == two
    assert one != real  # the checkpoint's own weights were not read


def _sleep_forever() -> None:
    import time

    time.sleep(600)


def test_lost_names_a_killed_rank_with_its_exit_and_none_while_all_live() -> None:
    """Workers.lost: None while every rank lives (after waiting), the rank and its exit code
    once one is killed, also when asked the moment its sentinel closes."""
    import multiprocessing
    import os
    import signal
    from types import SimpleNamespace

    from inference_node.parallel.workers import Workers

    proc = multiprocessing.get_context("spawn").Process(target=_sleep_forever, name="tp-rank-1")
    proc.start()
    try:
        ranks = SimpleNamespace(procs=[proc], _reaping=threading.Lock())
        assert Workers.lost(ranks, 0.2) is None
        os.kill(proc.pid, signal.SIGKILL)
        assert Workers.lost(ranks, 10.0) == ("tensor-parallel rank tp-rank-1 (exit -9) died: the node cannot run "
                                             "a step without it")
    finally:
        proc.kill()
        proc.join(5)


def test_a_step_that_fails_beside_a_dead_rank_says_so_in_one_line() -> None:
    """A forward that raises (a collective broken by a dead peer) becomes RankLost naming the
    rank, which the engine logs in one line and its requests get as UNAVAILABLE (the node is
    going down: retry elsewhere); with every rank alive the error is the forward's."""
    from types import SimpleNamespace

    from inference_node.core.engine_core import wire_error
    from inference_node.engine.errors import RankLost
    from inference_node.runner.runner import ModelRunner

    class BrokenWay:
        def run(self, staged):
            raise RuntimeError("Connection closed by peer")

    dead = SimpleNamespace(ranks=SimpleNamespace(lost=lambda wait_s: "tensor-parallel rank tp-rank-1 (exit -9) died"))
    with pytest.raises(RankLost, match=r"^tensor-parallel rank tp-rank-1 \(exit -9\) died") as lost:
        ModelRunner._forward(dead, BrokenWay(), None)
    assert wire_error(lost.value).code == grpc.StatusCode.UNAVAILABLE.name
    for alive in (SimpleNamespace(ranks=SimpleNamespace(lost=lambda wait_s: None)), SimpleNamespace(ranks=None)):
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            ModelRunner._forward(alive, BrokenWay(), None)


def test_a_start_that_fails_after_the_ranks_met_leaves_no_process_group_behind(tiny_llama_path, monkeypatch):
    """Rank 0 fails loading after the group formed: the node stops its ranks and leaves the
    group, so this process can build another node (and its exit does not wait on a group
    whose peers are gone)."""
    from inference_node.config import NodeConfig
    from inference_node.llm import LLM

    def planted(*args, **kwargs):
        raise RuntimeError("planted failure while loading rank 0's shard")

    config = NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=64, tensor_parallel_size=2,
                           cpu_threads=1)
    with monkeypatch.context() as patch:
        patch.setattr("inference_node.node.load_model", planted)  # rank 0's load, in this process
        with pytest.raises(RuntimeError, match="planted failure"):
            LLM(config)
    assert not torch.distributed.is_initialized()
    with LLM(config) as llm:  # the next node forms its own group
        assert llm.node.ranks is not None and llm.node.ranks.size == 2
        ranks = list(llm.node.ranks.procs)
    # Every rank left the group and exited by itself (a rank killed at the stop's timeout: -9).
    assert [p.exitcode for p in ranks] == [0]
    assert not torch.distributed.is_initialized()


# -- the node, as processes ------------------------------------------------------------------------
CPU_FLAGS = ("--device", "cpu", "--num-kv-blocks", "128", "--cpu-threads", "1")


class TPNode:
    def __init__(self, tmp_path: Path, model: Path, adapter_dir: Path, size: int, *flags: str,
                 device_flags: tuple[str, ...] = CPU_FLAGS) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log = tmp_path / f"node-tp{size}-{self.port}.log"
        self.child = Child(f"inference-node-tp{size}", [
            sys.executable, "-m", "inference_node.cli", "serve", "--port", str(self.port), "--model", str(model),
            *device_flags, "--max-loras", "4", "--adapter-dir", str(adapter_dir),
            "--tensor-parallel-size", str(size), *flags], self.log)
        wait_healthy(self.target, 600, self.child)

    def stop(self) -> int:
        return self.child.stop(60)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_llama_path) -> Path:
    root = tmp_path_factory.mktemp("tp-adapters")
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        make_peft_adapter(tiny_llama_path, root / name, rank, 2.0 * rank, targets, seed=seed, scale=3.0)
    return root


def memory_mb(model: Path, tp: int, rows: int) -> str:
    """--lora-memory-mb that gives each rank of a TP=`tp` node `rows` rank rows per module
    (float32 on the CPU; a rank's rows cover its shard's shapes)."""
    from inference_node.adapters.slots import row_nbytes

    config = Shard(0, tp).local_config(ModelConfig.from_checkpoint(model))
    return str((rows + 0.5) * sum(row_nbytes(config, torch.float32).values()) / (1 << 20))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, tiny_llama_path, adapter_dir):
    logs = tmp_path_factory.mktemp("tp-logs")
    one = TPNode(logs, tiny_llama_path, adapter_dir, 1,
                 "--lora-memory-mb", memory_mb(tiny_llama_path, 1, ARENA_ROWS))
    try:
        two = TPNode(logs, tiny_llama_path, adapter_dir, 2, "--debug-checks",
                     "--lora-memory-mb", memory_mb(tiny_llama_path, 2, ARENA_ROWS))
    except BaseException:
        one.stop()
        raise
    yield one, two
    assert two.stop() == 0, two.log.read_text()
    assert one.stop() == 0


def generate_all(target: str, jobs: list[tuple[str, int]]) -> dict[tuple[str, int], list[int]]:
    """Every (adapter, prompt) at once, so the engine batches them together."""
    results: dict[tuple[str, int], list[int]] = {}
    errors: list[BaseException] = []
    channel = grpc.insecure_channel(target)

    def run(adapter: str, i: int) -> None:
        try:
            client = NodeClient(target, channel=channel)
            out = client.generate(client.request(adapter=adapter, prompt_token_ids=PROMPTS[i],
                                                 max_tokens=NEW_TOKENS, ignore_eos=True), timeout=120)
            results[(adapter, i)] = list(out.token_ids)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    channel.close()
    assert not errors, errors
    return results


def stats(target: str) -> pb.GetStatsResponse:
    with NodeClient(target) as client:
        return client.stats(timeout=30)


def test_tp2_gives_tp1_greedy_tokens_for_base_and_mixed_adapters(nodes):
    one, two = nodes
    jobs = [(adapter, i) for adapter in ("", *ADAPTERS) for i in range(len(PROMPTS))]
    expected = generate_all(one.target, jobs)
    got = generate_all(two.target, jobs)
    assert got == expected
    for adapter in ADAPTERS:  # each adapter changes the answer: its shards were applied
        assert any(expected[(adapter, i)] != expected[("", i)] for i in range(len(PROMPTS))), adapter
    s = stats(two.target)
    assert s.tensor_parallel_size == 2 and stats(one.target).tensor_parallel_size == 1
    assert s.steps > 0 and s.slot_table_checks == s.steps
    assert s.running_requests == 0 and s.kv_blocks_free == s.kv_blocks_total


@pytest.fixture(scope="module")
def graph_node(tmp_path_factory, tiny_llama_path, adapter_dir):
    """TP=2 with its decode steps through the decode graphs' static buffers and its steps with
    prompt tokens through the piecewise graphs' (CUDA graphs on a GPU; the same buffers and
    kernels without capture on CPU): rank 0 stages, rank 1 replays.
    No expand on the side stream by default (as in steps of many adapters): o's and down's
    deltas must still reach their all-reduce expanded (parallel.shard.tensor_parallel_tuning)."""
    node = TPNode(tmp_path_factory.mktemp("tp-graph-logs"), tiny_llama_path, adapter_dir, 2, "--debug-checks",
                  "--decode-graphs", "on", "--mixed-graphs", "on", "--tune", "side_expand_segments=0")
    yield node
    assert node.stop() == 0, node.log.read_text()


def test_tp2_graph_steps_give_tp1_greedy_tokens(nodes, graph_node):
    one, _ = nodes
    jobs = [(adapter, i) for adapter in ("", *ADAPTERS) for i in range(len(PROMPTS))]
    expected = generate_all(one.target, jobs)
    assert generate_all(graph_node.target, jobs) == expected
    s = stats(graph_node.target)
    assert s.graph_steps > 0 and s.piecewise_graph_steps > 0 and s.eager_prefill_steps == 0
    assert s.graph_steps + s.piecewise_graph_steps + s.eager_decode_steps == s.steps
    assert s.slot_table_checks == s.steps
    assert s.running_requests == 0 and s.kv_blocks_free == s.kv_blocks_total


def test_loads_unloads_and_replacements_keep_every_rank_slot_table_equal(nodes, adapter_dir, tiny_llama_path):
    """The same adapter operations on both nodes, with answers compared after each: five
    adapters over four places in a step and memory for four (evictions), an unload, and a
    replacement by a new version."""
    one, two = nodes
    swap = adapter_dir / "swap"
    make_peft_adapter(tiny_llama_path, swap, 4, 8.0, ["q_proj", "o_proj", "up_proj"], seed=10, scale=3.0)
    versions = {}
    for node in nodes:
        with NodeClient(node.target) as client:
            client.load_adapter("qv2", timeout=60)  # unloaded below, whichever tests ran before on this node
            versions[node.target] = client.load_adapter("swap", timeout=60).version
    before = generate_all(two.target, [("swap", 0), ("", 0)])
    assert before == generate_all(one.target, [("swap", 0), ("", 0)])
    assert before[("swap", 0)] != before[("", 0)]

    for node in nodes:
        with NodeClient(node.target) as client:
            client.unload_adapter("qv2", timeout=30)
            assert "qv2" not in {a.name for a in client.list_adapters(timeout=30).adapters}
    # Steps while qv2's slot stands empty: every rank's must be empty too.
    assert generate_all(two.target, [("", 1)]) == generate_all(one.target, [("", 1)])
    # Five adapters for four places and memory for four: adapters are drained, evicted and
    # their rows rewritten while others run.
    jobs = [(adapter, i) for adapter in ("swap", *ADAPTERS) for i in range(2)]
    assert generate_all(two.target, jobs) == generate_all(one.target, jobs)
    for node in nodes:  # all4, kgu16 and swap need 24 rows of up: one of them was evicted
        assert f"({ARENA_ROWS} rank rows per module" in node.log.read_text()
        with NodeClient(node.target) as client:
            tiers = {a.name: a.tier for a in client.list_adapters(timeout=30).adapters}
        assert any(tiers.get(name) != pb.ADAPTER_TIER_GPU for name in ("all4", "kgu16", "swap")), tiers

    make_peft_adapter(tiny_llama_path, swap, 8, 16.0, ["v_proj", "down_proj", "gate_proj"], seed=11, scale=3.0)
    for node in nodes:
        with NodeClient(node.target) as client:
            replaced = client.load_adapter("swap", timeout=60).version
            assert replaced != versions[node.target]
    after = generate_all(two.target, [("swap", 0), ("swap", 1)])
    assert after == generate_all(one.target, [("swap", 0), ("swap", 1)])
    assert after[("swap", 0)] != before[("swap", 0)]
    with NodeClient(two.target) as client:
        client.unload_adapter("swap", timeout=30)
    s = stats(two.target)
    assert s.slot_table_checks == s.steps > 0
    assert s.running_requests == 0 and s.kv_blocks_free == s.kv_blocks_total


@pytest.mark.parametrize("all_reduce", ["symm", "fused"])
def test_symmetric_memory_sums_are_refused_on_cpu_at_start(tiny_llama_path, all_reduce):
    proc = subprocess.run([sys.executable, "-m", "inference_node.cli", "serve", "--port", str(free_port()),
                           "--model", str(tiny_llama_path), "--device", "cpu", "--tensor-parallel-size", "2",
                           "--all-reduce", all_reduce], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"--all-reduce {all_reduce} needs CUDA GPUs" in proc.stderr
    assert "Traceback" not in proc.stderr  # a line saying why, not a crash


def test_all_reduce_takes_symmetric_memory_for_messages_it_fits_and_nccl_for_the_rest(monkeypatch):
    from inference_node.parallel.group import TensorParallel

    class Symmetric:  # the kernels' stand-in: a new tensor, as theirs
        def fits(self, x: torch.Tensor) -> bool:
            return x.numel() <= 8

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    nccl = []
    monkeypatch.setattr("torch.distributed.all_reduce", lambda x: nccl.append(x.shape))
    tp = TensorParallel(Shard(0, 2), Symmetric())
    small, large = torch.ones(2, 4), torch.ones(4, 4)
    assert torch.equal(tp.all_reduce(small), small * 2) and nccl == []
    assert tp.all_reduce(large) is large and nccl == [large.shape]


def test_add_norm_after_a_sum_is_the_fused_kernel_for_what_it_fits_and_todays_ops_otherwise(monkeypatch):
    """all_reduce_add_norm: the fused kernel for messages it fits; otherwise the all-reduce,
    the bias after it, then the model's own add + norm with the norm options passed on (the
    ops --all-reduce nccl and symm run, in that order)."""
    from inference_node.parallel.group import TensorParallel
    from kernels.norm.reference import add_rms_norm

    calls = []

    class Fused:  # the kernel's stand-in
        def fits(self, x: torch.Tensor) -> bool:
            return x.shape[0] <= 2

        def __call__(self, x, residual, weight, eps, bias, unit_offset, out_norm):
            calls.append(("fused", x.shape, bias is not None, unit_offset, out_norm is not None))
            return residual + 2 * x, x

    def add_norm(residual, out, weight, eps, delta, *, unit_offset, out_norm):
        calls.append(("add_norm", out.clone(), delta, unit_offset, out_norm))
        return add_rms_norm(residual, out, weight, eps, delta, unit_offset, out_norm)

    monkeypatch.setattr("torch.distributed.all_reduce", lambda x: (calls.append(("nccl", x.shape)), x.mul_(2)))
    gen = torch.Generator().manual_seed(0)
    weight, bias, out_norm = torch.randn(8, generator=gen), torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    tp = TensorParallel(Shard(0, 2), fused=Fused())
    small, residual = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)
    new, _ = tp.all_reduce_add_norm(small, residual, weight, 1e-6, add_norm, bias, unit_offset=True, out_norm=out_norm)
    assert calls == [("fused", small.shape, True, True, True)] and torch.equal(new, residual + 2 * small)

    calls.clear()
    large, residual = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
    summed = large * 2  # what the stand-in all-reduce makes of it
    got = tp.all_reduce_add_norm(large.clone(), residual, weight, 1e-6, add_norm, bias, unit_offset=True,
                                 out_norm=out_norm)
    assert [c[0] for c in calls] == ["nccl", "add_norm"]
    assert torch.equal(calls[1][1], summed + bias) and calls[1][2:4] == (None, True) and calls[1][4] is out_norm
    for a, b in zip(got, add_rms_norm(residual, summed + bias, weight, 1e-6, None, True, out_norm)):
        assert torch.equal(a, b)

    calls.clear()  # no fused kernel (--all-reduce nccl): every size takes the ops, no bias added
    plain = TensorParallel(Shard(0, 2))
    got = plain.all_reduce_add_norm(small.clone(), residual[:2], weight, 1e-6, add_norm)
    assert [c[0] for c in calls] == ["nccl", "add_norm"] and torch.equal(calls[1][1], small * 2)
    assert torch.equal(got[0], residual[:2] + small * 2)


def test_a_size_the_model_cannot_be_split_by_is_refused_at_start(tiny_llama_path, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "inference_node.cli", "serve", "--port", str(free_port()),
                           "--model", str(tiny_llama_path), "--device", "cpu", "--tensor-parallel-size", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--tensor-parallel-size 4 does not divide the model's 2 key/value heads" in proc.stderr


# -- GPU: Llama-3.1-8B's shapes (4 of its 32 layers), float32 -----------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("all_reduce, quantization", [("nccl", "none"), ("symm", "none"), ("fused", "none"),
                                                      ("fused", "fp8")])
def test_gpu_tp2_gives_tp1_greedy_tokens_on_8b_shapes_in_float32(tmp_path, tokenizer_dir, all_reduce,
                                                                 quantization):
    """TP=1 runs eagerly (its graphs and warm-up off); TP=2 replays decode and piecewise
    graphs on both ranks, its sums through NCCL, symmetric memory, or the fused all-reduce +
    add + norm kernel (decode steps; prompt steps' larger sums through NCCL). Float32 sums in
    another order are far from flipping a greedy choice. FP8 projections (quantized at load
    from whole rows) likewise. (W8A8 rounds each rank's part of a row-parallel projection's
    input with its own scale, so TP=2 is not TP=1 there: tests/quant/test_fp8_tensor_parallel.py
    checks it against its own oracle.)"""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from bench.harness import copy_tokenizer, write_random_adapter
    from bench.shapes import LLAMA_3_1_8B

    model = tmp_path / "llama-8b-shapes"
    model.mkdir()
    (model / "config.json").write_text(__import__("json").dumps({**LLAMA_3_1_8B, "num_hidden_layers": 4,
                                                                  "torch_dtype": "float32"}))
    copy_tokenizer(tokenizer_dir, model)
    config = ModelConfig.from_checkpoint(model)
    adapters = tmp_path / "adapters"
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        write_random_adapter(adapters / name, config, rank, targets, seed, torch.device("cpu"),
                             dtype=torch.float32, std=0.05)
    flags = ("--device", "cuda", "--dtype", "float32", "--load-format", "dummy", "--max-model-len", "512",
             "--tune-budget", "0",  # no table for float32 8B shapes: the defaults, not minutes of tuning
             "--quantization", quantization)
    # TP=1 shares GPU 0 with rank 0 of TP=2: a fixed KV cache; TP=2 sizes its own by measuring
    # a forward on both ranks (their collectives must meet) and taking the least.
    one = TPNode(tmp_path, model, adapters, 1, "--num-kv-blocks", "512", "--decode-graphs", "off",
                 "--mixed-graphs", "off", "--warmup", "off", device_flags=flags)
    try:
        two = TPNode(tmp_path, model, adapters, 2, "--debug-checks", "--gpu-memory-utilization", "0.85",
                     "--all-reduce", all_reduce, device_flags=flags)  # the defaults: decode and piecewise graphs on every rank
        try:
            jobs = [(adapter, i) for adapter in ("", *ADAPTERS) for i in range(len(PROMPTS))]
            expected = generate_all(one.target, jobs)
            assert generate_all(two.target, jobs) == expected
            for adapter in ADAPTERS:
                assert any(expected[(adapter, i)] != expected[("", i)] for i in range(len(PROMPTS))), adapter
            s = stats(two.target)
            assert s.tensor_parallel_size == 2 and s.slot_table_checks == s.steps > 0
            assert s.graph_steps > 0 and s.piecewise_graph_steps > 0  # both kinds of graphs, on both ranks
        finally:
            assert two.stop() == 0
    finally:
        one.stop()
