"""Decode steps through the graph path's static buffers (padded batch sizes, scratch KV
block, LoRA segments sized for the worst case) give the same tokens as PEFT, mixed with
eager prefill steps and with batches too large for a graph. On CPU the path runs eagerly;
on CUDA (marked gpu) the same test replays captured CUDA graphs."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import InProcessNode, generate_all, make_peft_adapter, peft_greedy
from inference_node.config import NodeConfig
from inference_node.runner.decode_graphs import graph_batch_sizes
from lora_client.node_client import NodeClient

ADAPTERS = {
    "qv-r4": (4, 8.0, ["q_proj", "v_proj"], False),
    "all-r8": (8, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp-r16": (16, 16.0, ["gate_proj", "up_proj", "down_proj"], False),
}


def small_graph_node(model: Path, adapters: Path, device: str) -> InProcessNode:
    """A node of 8 sequences and 2 adapter slots whose decode steps replay graphs of up to 8
    rows, with its debug checks on."""
    return InProcessNode(NodeConfig.of(checkpoint=str(model), device=device, dtype="float32",
                                       num_kv_blocks=64, max_num_seqs=8, max_loras=2, max_lora_rank=16,
                                       adapter_dir=str(adapters), decode_graphs="on", max_graph_batch=8,
                                       debug_checks=True))


def test_graph_batch_sizes_cover_every_batch() -> None:
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(1) == [1]


@pytest.mark.parametrize("device,norm_split,side_down,fold,sfold", [
    ("cpu", 0, False, None, None), ("cpu", 16, False, (), None), ("cpu", 0, True, (), None),
    ("cpu", 0, False, "all", "none"), ("cpu", 16, False, (), "all"), ("cpu", 16, True, (), None),
    pytest.param("cuda", 0, False, None, None, marks=pytest.mark.gpu),
    pytest.param("cuda", 16, False, (), None, marks=pytest.mark.gpu),
    pytest.param("cuda", 0, True, (), None, marks=pytest.mark.gpu),
    pytest.param("cuda", 0, False, "all", "none", marks=pytest.mark.gpu),
    pytest.param("cuda", 16, False, (), "all", marks=pytest.mark.gpu),
    pytest.param("cuda", 16, True, (), None, marks=pytest.mark.gpu)],
    ids=["cpu", "cpu-split", "cpu-down", "cpu-fold", "cpu-sfold", "cpu-split-down", "cuda",
         "cuda-split", "cuda-down", "cuda-fold", "cuda-sfold", "cuda-split-down"])
def test_graph_decode_matches_peft_for_mixed_adapters(device, norm_split, side_down, fold, sfold,
                                                      tiny_llama_path, tmp_path, monkeypatch) -> None:
    """The node's tuning (kernels/tuning.py) picks how graph steps run LoRA. norm_split: the
    LoRA add + norm after o spreads each row over programs of that many columns
    (norm_split_columns), with the expands left to it (no side-stream expand), as in steps of
    many adapters. side_down: only down's expand runs on the side stream and the other groups'
    are left to the ops after them, as in steps of 9 to 32 adapters
    (side_expand_group_segments). fold: the groups whose matmul adds their LoRA in the same
    launch (kernels/gemm/fold.py; None: the default fold_groups; "all": every group); the
    others of the shrink-fold groups (sfold: None for the default shrink_fold_groups, "none",
    "all" for every group, o and down then expanded by the split add + norm, gate/up's and
    down's shrink spread over their tile programs: fold_shrink_spread) shrink in their
    matmul. With norm_split the add + norms after o and down split their rows, except where
    the side stream expanded the delta (side_down): those take one program a row. They run in Triton (natively, or interpreted by test_triton_interpreter.py); the
    CPU reference ignores the split."""
    from inference_node.runner.lora import overlap
    from inference_node.model.llama import FUSED_MODULES
    from kernels.tuning import DEFAULT_TUNING

    tuning = DEFAULT_TUNING
    fold_groups = set(tuning.fold_groups if fold is None else FUSED_MODULES if fold == "all" else fold)
    sfold_groups = set(FUSED_MODULES if sfold == "all" else () if sfold == "none"
                       else tuning.shrink_fold_groups)
    if norm_split or side_down or fold is not None:
        tuning = tuning.replace(
            side_expand_segments=0, norm_split_columns=norm_split,
            side_expand_group_segments={"down": 64} if side_down else {},
            norm_split_groups=frozenset({"o", "down"}),
            fold_groups=frozenset(fold_groups), shrink_fold_groups=frozenset(sfold_groups),
            fold_shrink_spread=frozenset({"gate_up", "down"} if sfold == "all" else ()))
        expands = []
        real_expand = overlap.lora_expand
        monkeypatch.setattr(overlap, "lora_expand",
                            lambda *a, **k: expands.append(a[1]) or real_expand(*a, **k))
    folded, shrink_folded, spread = set(), set(), set()
    real_fold = overlap.OverlappedLoraApplier.fold

    def spy_fold(self, layer, group):
        lora = real_fold(self, layer, group)
        if lora is not None:
            (folded if lora.expand else shrink_folded).add(group)
            if lora.shrink_splits:
                spread.add(group)
        return lora

    monkeypatch.setattr(overlap.OverlappedLoraApplier, "fold", spy_fold)
    split_deltas = []  # (group, expanded on the side stream, split over column programs)
    real_end = overlap.OverlappedLoraApplier.end

    def spy_end(self, layer, group, x, y):
        delta = real_end(self, layer, group, x, y)
        if delta is not None and group in ("o", "down"):
            split_deltas.append((group, delta.expanded is not None, delta.column_split is not None))
        return delta

    monkeypatch.setattr(overlap.OverlappedLoraApplier, "end", spy_end)
    root = tmp_path / "adapters"
    for seed, (name, (rank, alpha, targets, rs)) in enumerate(ADAPTERS.items()):
        make_peft_adapter(tiny_llama_path, root / name, rank, alpha, targets, rs, seed=seed, scale=3.0)
    rng = random.Random(3)
    # 16 requests (more than the largest graph) that end at different times
    jobs = [(name, [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))], rng.randrange(2, 20))
            for name in ["", *ADAPTERS] for _ in range(4)]
    rng.shuffle(jobs)
    folders = {"": None, **{n: root / n for n in ADAPTERS}}
    expected = [peft_greedy(tiny_llama_path, folders[name], [prompt], max_new)[0]
                for name, prompt, max_new in jobs]
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device=device, dtype="float32",
                                       num_kv_blocks=128, max_num_seqs=16, max_loras=4, max_lora_rank=16,
                                       adapter_dir=str(root), decode_graphs="on", max_graph_batch=12,
                                       debug_checks=True, tuning=tuning))
    try:
        got = generate_all(node, jobs)
        assert got == expected
        snap = node.check_idle()
        assert snap["graph_steps"] > 0 and snap["steps"] > snap["graph_steps"]
        # Every group the test's adapters target is in a step. A group in both fold sets
        # folds whole only in steps of few adapters (none here when patched: no side-stream
        # expands), else only its shrink.
        whole = fold_groups - sfold_groups if fold is not None else fold_groups
        assert folded == whole
        # The shrink folded into the matmuls of sfold's groups, the op after each expanding
        # (RoPE, SiLU, the add + norm), in steps whose expands are not on the side stream
        # (here: every step but the default's, whose few adapters expand there).
        shrink = sfold_groups - whole if fold is not None else set()
        if side_down:
            shrink -= {"down"}
        assert shrink_folded == shrink
        assert spread == ({"gate_up", "down"} if sfold == "all" else set())
        if norm_split or side_down:  # the side stream expanded down's deltas, or none
            buffers = node.engine.runner.decode_graphs.lora.applier.__self__.buffers
            downs = {id(layer["down"].b) for layer in buffers.layers}
            assert {id(b) in downs for b in expands} == ({True} if side_down else set())
        if norm_split:
            # Down's side-stream shrink leaves an unexpanded delta, which splits; expanded
            # there too (side_down), it does not. (o, and down with sfold, shrink in their
            # matmul: not seen here.)
            assert set(split_deltas) == ({("down", side_down, not side_down)}
                                         if "down" not in shrink_folded else set())
            from kernels.dispatch import use_triton

            split = node.engine.runner.decode_graphs.lora.applier.__self__.beside.column_split
            assert split is not None and split.block == norm_split
            assert int(split.arrivals.count_nonzero()) == 0  # every row's count reset
            if use_triton(split.sums):  # the split kernel ran (the reference ignores it)
                assert int(split.sums.count_nonzero()) > 0
    finally:
        node.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_steps_replay_the_smallest_group_variant_that_covers_their_adapters(device, tiny_llama_path,
                                                                            tmp_path) -> None:
    """q/v adapters replay graphs without o or MLP launches; a step that also holds an MLP
    adapter replays the all-groups graph. Outputs match PEFT either way."""
    root = tmp_path / "adapters"
    chosen = {"qv-r4": ADAPTERS["qv-r4"], "mlp-r16": ADAPTERS["mlp-r16"]}
    for seed, (name, (rank, alpha, targets, rs)) in enumerate(chosen.items()):
        make_peft_adapter(tiny_llama_path, root / name, rank, alpha, targets, rs, seed=seed, scale=3.0)
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device=device, dtype="float32",
                                       num_kv_blocks=64, max_num_seqs=4, max_loras=2, max_lora_rank=16,
                                       adapter_dir=str(root), decode_graphs="on", max_graph_batch=4,
                                       debug_checks=True))
    try:
        graphs = node.engine.runner.decode_graphs
        qkv_only = graphs.group_variants.index(frozenset({"qkv"}))
        everything = len(graphs.group_variants) - 1

        def run(name: str, prompt: list[int]) -> list[int]:
            with NodeClient(node.address) as client:
                return client.generate(client.request(adapter=name, prompt_token_ids=prompt, max_tokens=6,
                                                      ignore_eos=True), timeout=300).token_ids

        # Phase 1: q/v adapter and base requests only.
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(run, ["qv-r4", "", "qv-r4", ""], prompts))
        lora_keys = {k for k in graphs.replays if k[1] > 0}
        assert lora_keys and {k[2] for k in lora_keys} == {qkv_only}
        # Phase 2: the q/v adapter next to the MLP adapter in the same steps.
        graphs.replays.clear()
        with ThreadPoolExecutor(4) as pool:
            got += list(pool.map(run, ["qv-r4", "mlp-r16", "qv-r4", "mlp-r16"], prompts))
        assert everything in {k[2] for k in graphs.replays if k[1] > 0}
        folders = {"": None, **{n: root / n for n in chosen}}
        names = ["qv-r4", "", "qv-r4", "", "qv-r4", "mlp-r16", "qv-r4", "mlp-r16"]
        expected = [peft_greedy(tiny_llama_path, folders[n], [p], 6)[0] for n, p in zip(names, prompts * 2)]
        assert got == expected
        node.check_idle()
    finally:
        node.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_single_adapter_steps_expand_beside_the_matmul_and_match_peft(device, tiny_llama_path,
                                                                       tmp_path, monkeypatch) -> None:
    """Steps whose rows share one adapter (some rows on the base model) run each LoRA expand
    on the side stream into a delta buffer that the next op adds (runner/lora/overlap.py,
    Tuning.side_expand_segments). Same tokens as PEFT; on CPU the expand calls are seen."""
    from inference_node.runner.lora import overlap
    from kernels.tuning import DEFAULT_TUNING

    expands = []
    real_expand = overlap.lora_expand
    monkeypatch.setattr(overlap, "lora_expand", lambda *a, **k: expands.append(1) or real_expand(*a, **k))
    root = tmp_path / "adapters"
    rank, alpha, targets, rs = ADAPTERS["all-r8"]
    make_peft_adapter(tiny_llama_path, root / "all-r8", rank, alpha, targets, rs, seed=4, scale=3.0)
    rng = random.Random(7)
    jobs = [(name, [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 20))], rng.randrange(3, 12))
            for name in ["all-r8", "all-r8", "", "all-r8", "", "all-r8"]]
    folders = {"": None, "all-r8": root / "all-r8"}
    expected = [peft_greedy(tiny_llama_path, folders[name], [prompt], max_new)[0]
                for name, prompt, max_new in jobs]
    node = small_graph_node(tiny_llama_path, root, device)
    try:
        got = generate_all(node, jobs)
        assert got == expected
        graphs = node.engine.runner.decode_graphs
        assert {k[1] for k in graphs.replays if k[1] > 0} == {1} and DEFAULT_TUNING.side_expand_segments >= 1
        if device == "cpu":  # eager: every LoRA decode step called the expand itself
            assert expands
        node.check_idle()
    finally:
        node.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_graphs_larger_than_the_decode_gemm_add_lora_after_the_matmuls(device, tiny_llama_path, tmp_path,
                                                                      monkeypatch) -> None:
    """Decode graphs of more rows than the decode GEMM takes (kernels.gemm
    MAX_ROWS, 64: on CPU lowered to 8 so the test stays small) run cuBLAS matmuls with the
    LoRA deltas added after them, and still match PEFT."""
    from inference_node.runner.lora import eager as plain
    from inference_node.runner.lora import overlap, plan

    rows = 96 if device == "cuda" else 16
    if device == "cpu":
        monkeypatch.setattr(plan, "MAX_ROWS", 8)
    sizes_after: set[int] = set()
    real_init = plain.StepLoraApplier.__init__

    def spy(self, buffers, meta, groups=None, **edge):
        sizes_after.add(meta.num_active_tokens)
        real_init(self, buffers, meta, groups, **edge)

    monkeypatch.setattr(plain.StepLoraApplier, "__init__", spy)
    sizes_beside: set[int] = set()
    real_applier = overlap.LoraOverlap.applier
    monkeypatch.setattr(overlap.LoraOverlap, "applier",
                        lambda self, meta, groups=None: sizes_beside.add(meta.num_active_tokens)
                        or real_applier(self, meta, groups))
    root = tmp_path / "adapters"
    names = list(ADAPTERS)[:2]
    for seed, name in enumerate(names):
        rank, alpha, targets, rs = ADAPTERS[name]
        make_peft_adapter(tiny_llama_path, root / name, rank, alpha, targets, rs, seed=seed, scale=3.0)
    rng = random.Random(5)
    # Lengths that end at different times: the batch shrinks below the limit as they finish.
    jobs = [(["", *names][i % 3], [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 12))],
             rng.randrange(2, 16)) for i in range(rows)]
    folders = {"": None, **{n: root / n for n in names}}
    expected = {}
    for name in folders:
        mine = [(i, job) for i, job in enumerate(jobs) if job[0] == name]
        for i, job in mine:
            expected[i] = peft_greedy(tiny_llama_path, folders[name], [job[1]], job[2])[0]
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device=device, dtype="float32",
                                       num_kv_blocks=256, max_num_seqs=rows, max_loras=2, max_lora_rank=16,
                                       adapter_dir=str(root), decode_graphs="on", debug_checks=True))
    try:
        got = generate_all(node, jobs)
        assert got == [expected[i] for i in range(rows)]
        node.check_idle()
        limit = 8 if device == "cpu" else 64
        assert any(size > limit for size in sizes_after), (sizes_after, sizes_beside)
        assert sizes_beside and all(size <= limit for size in sizes_beside)
    finally:
        node.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rope_in_the_qkv_gemm_matches_peft(device, tokenizer_dir, tmp_path, monkeypatch) -> None:
    """Steps without LoRA on q/k/v rotate queries and keys and write the KV cache in q/k/v's
    decode GEMM (Tuning.qkv_rope); q/v adapters' steps keep the RoPE kernel. A model with
    32-wide heads (16 columns of each half a program). Same tokens as PEFT, in graph and
    eager steps. On a CPU the decode GEMM serves q/k/v only where Triton's interpreter runs
    (test_triton_interpreter.py runs this so): there the test makes it serve, and the RoPE
    launch must run; in plain CPU runs the references run."""
    from kernels.gemm import dispatch as gemm_dispatch
    from kernels.gemm.shapes import tiling
    from kernels.host import interpreting

    from harness import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", tokenizer_dir, hidden_size=128,
                            num_attention_heads=4, num_key_value_heads=2)
    launches = []
    real = gemm_dispatch.DecodeGemm.qkv_rope

    def spy(self, x, w, rope):
        q = real(self, x, w, rope)
        if q is not None:
            launches.append(x.shape[0])
        return q

    monkeypatch.setattr(gemm_dispatch.DecodeGemm, "qkv_rope", spy)
    fuse = device == "cuda" or interpreting()
    if device == "cpu" and fuse:  # the decode GEMM serves q/k/v in the interpreter
        monkeypatch.setattr(gemm_dispatch.DecodeGemm, "serves", lambda self, group: group == "qkv")
        monkeypatch.setattr(gemm_dispatch.DecodeGemm, "applies", lambda self, x, w, group=None: (
            0 < x.shape[0] <= 64 and tiling(w, group, self.tuning.gemm_tilings) is not None))
    root = tmp_path / "adapters"
    for seed, name in enumerate(["qv-r4", "mlp-r16"]):
        rank, alpha, targets, rs = ADAPTERS[name]
        make_peft_adapter(model, root / name, rank, alpha, targets, rs, seed=seed, scale=3.0)
    rng = random.Random(11)
    # Phase 1 has no q/k/v adapter: every step takes the RoPE launch. Phase 2 mixes the q/v
    # adapter in: its steps run the RoPE kernel (which steps hold it depends on timing).
    phases = [[(name, [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 20))], rng.randrange(3, 10))
               for name in names] for names in (["", "mlp-r16", "", "mlp-r16"], ["qv-r4", "", "mlp-r16", "qv-r4"])]
    folders = {"": None, **{n: root / n for n in ("qv-r4", "mlp-r16")}}
    expected = [[peft_greedy(model, folders[name], [prompt], max_new)[0] for name, prompt, max_new in jobs]
                for jobs in phases]
    node = small_graph_node(model, root, device)
    try:
        assert generate_all(node, phases[0]) == expected[0]
        assert bool(launches) == fuse
        assert generate_all(node, phases[1]) == expected[1]
        node.check_idle()
    finally:
        node.stop()
