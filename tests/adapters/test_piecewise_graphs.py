"""Prefill and mixed steps through the piecewise graphs' static buffers (token buckets, padded
sampled rows, LoRA segments of a bucket's fixed size, attention run between the pieces) give
the same tokens as PEFT: prompt chunks beside decodes, several adapters of different ranks and
targets, prompts chunked across steps, prefix-cache hits and preemption. On CPU the pieces run
eagerly; on CUDA (marked gpu) the same tests replay captured CUDA graphs."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import InProcessNode, make_peft_adapter, peft_greedy
from inference_node.engine.kv_cache import KVCache
from inference_node.runner.piecewise_graphs import (PiecewiseGraphs, PiecewiseLora, lora_rows, lora_segments, rows_buckets,
                                                token_buckets)
from inference_node.model.loader import load_model
from inference_node.config import NodeConfig
from inference_node.runner.launches import StepLaunches
from lora_client.node_client import NodeClient

ADAPTERS = {
    "qv-r4": (4, 8.0, ["q_proj", "v_proj"], False),
    "all-r8": (8, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp-r16": (16, 16.0, ["gate_proj", "up_proj", "down_proj"], False),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_buckets_cover_every_step_size() -> None:
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert token_buckets(8) == [8]
    assert rows_buckets(512, 256) == [16, 64, 256]
    assert rows_buckets(16, 256) == [16]
    assert rows_buckets(128, 8) == [8]
    assert [lora_rows(b) for b in (16, 512, 1024, 2048)] == [16, 16, 32, 64]
    assert lora_segments(16, 32) == 16 and lora_segments(2048, 32) == 32 + 32


def test_lora_segments_cover_each_adapter_token_once(tiny_llama_path) -> None:
    """Random steps (sequences of random lengths on random slots, some on the base model): the
    metadata the kernels read puts every adapter token in exactly one segment of its own slot,
    segments no longer than the bucket's rows and no more than the bucket's count; the empty
    segments past them have length 0."""
    model = load_model(tiny_llama_path, torch.device("cpu"), torch.float32)
    kv = KVCache(model.config, 9, 16, torch.float32, torch.device("cpu"))
    max_loras, max_tokens = 5, 600
    graphs = PiecewiseGraphs(model, StepLaunches.fixed(model.device), kv, scratch_block=8, max_model_len=128,
                             max_tokens=max_tokens, max_seqs=64, lora=PiecewiseLora(lambda meta: None, max_loras))
    h32, o32 = graphs._host.next().np32, graphs._o32
    rng = random.Random(0)
    for _ in range(300):
        slots: list[int] = []
        while True:
            length = rng.choice([1, 1, 1, rng.randrange(2, 40), rng.randrange(40, 300)])
            if len(slots) + length > max_tokens:
                break
            slots += [rng.randrange(-1, max_loras)] * length
            if rng.random() < 0.15:
                break
        if not slots:
            continue
        tokens = np.asarray(slots, dtype=np.int32)
        bucket = next(b for b in graphs.buckets if b >= len(slots))
        graphs._fill_lora(h32, tokens, bucket)
        count = lora_segments(bucket, max_loras)
        sorted_ids = h32[o32[3]:o32[3] + bucket]
        seg_slots, starts, lens = (h32[o32[i]:o32[i] + count] for i in (4, 5, 6))
        real = int(np.count_nonzero(lens))
        assert (lens[:real] > 0).all() and (lens[real:] == 0).all()
        assert lens.max() <= lora_rows(bucket)
        seen = []
        for slot, start, n in zip(seg_slots[:real], starts[:real], lens[:real]):
            rows = sorted_ids[start:start + n]
            assert (tokens[rows] == slot).all()
            seen += rows.tolist()
        assert sorted(seen) == [i for i, s in enumerate(slots) if s >= 0]
        assert (h32[o32[2]:o32[2] + len(slots)] == tokens).all() and (h32[o32[2] + len(slots):o32[2] + bucket] == -1).all()
        assert len(graphs._host_segments) == real


def make_adapters(tiny_llama_path: Path, root: Path, names) -> dict[str, Path | None]:
    for seed, name in enumerate(names):
        rank, alpha, targets, rs = ADAPTERS[name]
        make_peft_adapter(tiny_llama_path, root / name, rank, alpha, targets, rs, seed=seed, scale=3.0)
    return {"": None, **{n: root / n for n in names}}


def start_node(tiny_llama_path: Path, root: Path, device: str, **settings) -> InProcessNode:
    base = dict(checkpoint=str(tiny_llama_path), device=device, dtype="float32", num_kv_blocks=160, max_num_seqs=8,
                max_num_batched_tokens=64, max_loras=3, max_lora_rank=16, adapter_dir=str(root),
                decode_graphs="on", mixed_graphs="on", debug_checks=True)
    return InProcessNode(NodeConfig.of(**{**base, **settings}))


def generate(node: InProcessNode, job, delay: float = 0.0) -> list[int]:
    name, prompt, max_new = job
    time.sleep(delay)
    with NodeClient(node.address) as client:
        return client.generate(client.request(adapter=name, prompt_token_ids=prompt, max_tokens=max_new,
                                              ignore_eos=True), timeout=300).token_ids


def spy_steps(monkeypatch) -> list[tuple[int, list[int]]]:
    """Each piecewise step's decode rows and the requests whose prompt chunks it carries."""
    seen: list[tuple[int, list[int]]] = []
    real_stage = PiecewiseGraphs.stage
    lock = threading.Lock()

    def stage(self, chunks):
        with lock:
            seen.append((sum(not c.request.in_prefill for c in chunks),
                         [c.request.id for c in chunks if c.request.in_prefill]))
        return real_stage(self, chunks)

    monkeypatch.setattr(PiecewiseGraphs, "stage", stage)
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_chunks_beside_decodes_match_peft(device, tiny_llama_path, tmp_path, monkeypatch) -> None:
    """A base-model prompt alone and a short one, then prompts of 3-150 tokens (up to three 64-token chunks)
    on three adapters of different ranks and targets and the base model arriving while others
    decode; a second wave repeats some of them with longer answers (prefix-cache hits). Every step with prompt
    tokens replays the pieces (none runs eagerly), in several token buckets, with and without
    LoRA, and the tokens equal PEFT's."""
    folders = make_adapters(tiny_llama_path, tmp_path / "adapters", list(ADAPTERS))
    seen = spy_steps(monkeypatch)
    rng = random.Random(11)
    first = [(name, [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 150))], rng.randrange(2, 14))
             for name in ["", *ADAPTERS] for _ in range(3)]
    rng.shuffle(first)
    second = [(name, prompt, max_new + 3) for name, prompt, max_new in first[:6]]
    # Alone, one after the other: steps without LoRA (buckets 64 and 32), then a short one (16).
    solos = [("", [rng.randrange(100, 40000) for _ in range(90)], 5),
             ("qv-r4", [rng.randrange(100, 40000) for _ in range(6)], 5)]
    expected = {}
    for name, prompt, max_new in solos + first + second:
        expected[(name, tuple(prompt), max_new)] = peft_greedy(tiny_llama_path, folders[name], [prompt], max_new)[0]
    node = start_node(tiny_llama_path, tmp_path / "adapters", device)
    try:
        for name, prompt, max_new in solos:
            assert generate(node, (name, prompt, max_new)) == expected[(name, tuple(prompt), max_new)]
        with ThreadPoolExecutor(len(first)) as pool:  # staggered: new prompts land beside decodes
            got = list(pool.map(lambda ij: generate(node, ij[1], 0.02 * ij[0]), enumerate(first)))
        with ThreadPoolExecutor(len(second)) as pool:
            got += list(pool.map(lambda job: generate(node, job), second))
        assert got == [expected[(n, tuple(p), m)] for n, p, m in first + second]
        snap = node.check_idle()
        assert snap["piecewise_graph_steps"] > 0 and snap["eager_prefill_steps"] == 0 and snap["eager_decode_steps"] == 0
        assert snap["graph_steps"] > 0 and snap["cached_prompt_tokens"] > 0
        graphs = node.engine.runner.piecewise_graphs
        assert {k[1] for k in graphs.replays} == {False, True}  # base-only steps and LoRA steps
        assert len({k[0] for k in graphs.replays}) >= 3       # several token buckets
        assert any(decodes and prompts for decodes, prompts in seen)  # prompt chunks beside decodes
        chunked = [r for _, prompts in seen for r in prompts]
        assert len(set(chunked)) < len(chunked)  # a prompt chunked across steps
        if device == "cuda":
            assert len(graphs._graphs) == len(graphs.keys())
    finally:
        node.stop()


@pytest.mark.parametrize("device", DEVICES)
def test_preempted_requests_recompute_through_the_pieces(device, tiny_llama_path, tmp_path) -> None:
    """A KV cache too small for every request at once: the latest are preempted and recomputed
    from their prompt and streamed tokens in piecewise steps; the tokens still equal PEFT's
    and every block and adapter reference is back at the end."""
    names = ["qv-r4", "all-r8"]
    folders = make_adapters(tiny_llama_path, tmp_path / "adapters", names)
    rng = random.Random(5)
    jobs = [(["", *names][i % 3], [rng.randrange(100, 40000) for _ in range(rng.randrange(20, 40))], 40)
            for i in range(6)]
    expected = [peft_greedy(tiny_llama_path, folders[n], [p], m)[0] for n, p, m in jobs]
    node = start_node(tiny_llama_path, tmp_path / "adapters", device, num_kv_blocks=14, max_num_seqs=6,
                      max_loras=2)
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job: generate(node, job), jobs))
        assert got == expected
        snap = node.check_idle()
        assert snap["preemptions"] > 0 and snap["piecewise_graph_steps"] > 0 and snap["eager_prefill_steps"] == 0
    finally:
        node.stop()


def test_with_the_pieces_off_prompt_steps_run_eagerly(tiny_llama_path, tmp_path) -> None:
    """--mixed-graphs off: no piecewise graphs; steps with prompt tokens count as eager."""
    folders = make_adapters(tiny_llama_path, tmp_path / "adapters", ["qv-r4"])
    job = ("qv-r4", [5, 900, 31, 4000, 77], 4)
    node = start_node(tiny_llama_path, tmp_path / "adapters", "cpu", mixed_graphs="off")
    try:
        assert node.engine.runner.piecewise_graphs is None
        assert generate(node, job) == peft_greedy(tiny_llama_path, folders["qv-r4"], [job[1]], 4)[0]
        snap = node.check_idle()
        assert snap["eager_prefill_steps"] > 0 and snap["piecewise_graph_steps"] == 0
    finally:
        node.stop()


@pytest.mark.gpu
def test_piecewise_steps_compile_nothing_while_serving(tiny_llama_path, tmp_path) -> None:
    """After start (warm-up and capture), a workload of prompt chunks beside decodes with and
    without LoRA launches no Triton kernel or torch.compile graph that compiles: the pieces
    replay what the capture compiled, and the attention between them takes the variants the
    warm-up compiled (its static buffers keep the alignment Triton specialises on)."""
    from bench.harness import CompileWatch

    make_adapters(tiny_llama_path, tmp_path / "adapters", list(ADAPTERS))
    watch = CompileWatch().install()
    node = start_node(tiny_llama_path, tmp_path / "adapters", "cuda", dtype="bfloat16", max_num_batched_tokens=256,
                      max_num_seqs=16, warmup="on")
    try:
        mark = watch.mark()
        rng = random.Random(2)
        jobs = [(name, [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 400))], rng.randrange(2, 20))
                for name in ["", *ADAPTERS] for _ in range(6)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda ij: generate(node, ij[1], 0.01 * ij[0]), enumerate(jobs)))
        snap = node.check_idle()
        assert snap["piecewise_graph_steps"] > 0 and snap["eager_prefill_steps"] == 0
        assert len({k[0] for k in node.engine.runner.piecewise_graphs.replays}) >= 3
        assert watch.since(mark) == []
    finally:
        node.stop()


def test_the_segment_bound_holds_for_the_worst_step() -> None:
    """lora_segments bounds the segments of any step: the worst puts one token more than the
    rows of a segment on every adapter but one, and the rest of the bucket on that one."""
    for bucket in (16, 64, 300, 512, 1024, 2048):
        rows = lora_rows(bucket)
        for loras in (1, 4, 32):
            counts = [min(rows + 1, bucket // loras)] * (loras - 1)
            counts.append(bucket - sum(counts))
            segments = sum(-(-c // rows) for c in counts if c > 0)
            assert segments <= lora_segments(bucket, loras), (bucket, loras, segments)
