"""One node serves 1,000 adapters of mixed ranks (8, 16, 32, 64) from its adapter folder with
adapter memory for a few of them: every adapter answers, a sample of them batched together
matches PEFT token for token, and the adapter memory in use always equals the sum of the
resident adapters' own sizes (rank x (in + out) x layers x bytes of each module they target,
computed here from their configs, not from the node's bookkeeping): no padding to rank 64.
Every slot always holds exactly the adapter the manager says, at that adapter's own rank on
the modules its config targets, at the rows the arenas gave it."""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from bench.harness import ALL_MODULES, QV, write_random_adapter
from harness import InProcessNode, peft_greedy
from inference_node.adapters.slots import row_nbytes
from inference_node.model.config import ModelConfig
from inference_node.model.llama import LORA_MODULES
from inference_node.config import NodeConfig
from lora_client.node_client import NodeClient

RANKS = (8, 16, 32, 64)
TARGETS = (QV, ALL_MODULES, ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"))
COUNT = 1000
ROWS = 256  # rank rows per module: two adapters of each rank at most
MAX_LORAS = 8


def own_nbytes(config: ModelConfig, rank: int, targets: tuple[str, ...]) -> int:
    shapes = config.module_shapes()
    return sum(rank * config.num_layers * (shapes[m][0] + shapes[m][1]) * 4 for m in targets)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_thousand_mixed_rank_adapters_match_peft_and_hold_their_own_size(tiny_llama_path: Path,
                                                                         tmp_path: Path, device: str) -> None:
    config = ModelConfig.from_checkpoint(tiny_llama_path)
    root = tmp_path / "adapters"
    spec = {}
    for k in range(COUNT):  # ranks and target sets vary independently (4 x 4 combinations)
        name = f"a{k:04d}"
        spec[name] = (RANKS[k % 4], TARGETS[(k // 4) % 4])
        write_random_adapter(root / name, config, spec[name][0], spec[name][1], seed=k,
                             device=torch.device("cpu"), dtype=torch.float32, std=0.1)
    row = sum(row_nbytes(config, torch.float32).values())
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device=device, dtype="float32",
                                       num_kv_blocks=256, max_loras=MAX_LORAS, max_lora_rank=64, max_cpu_loras=16,
                                       lora_memory_bytes=ROWS * row, adapter_dir=str(root),
                                       max_num_batched_tokens=256, debug_checks=True))
    engine, manager = node.engine, node.node.adapters
    checked = {"times": 0, "resident_max": 0, "adapters_in_a_step": 0}

    def check_memory() -> None:  # on the engine thread, between steps
        resident = [e for e in manager.slots if e is not None]
        own = sum(own_nbytes(config, *spec[e.name]) for e in resident)
        assert manager.buffers.used_nbytes() == own, (manager.buffers.used_nbytes(), own)
        assert own <= manager.buffers.nbytes()
        for slot, entry in enumerate(manager.slots):
            record = manager.buffers.table[slot]
            pairs = manager.buffers.module_rows[slot].reshape(-1, 2)  # (rank, first row) per module
            if entry is None:
                assert record is None and not pairs.any(), slot
                continue
            rank, targets = spec[entry.name]
            assert record[:3] == (entry.name, entry.version, rank), (slot, record, entry.name)
            assert pairs[:, 0].tolist() == [rank if m in targets else 0 for m in LORA_MODULES], (slot, entry.name)
            runs = {m: manager.buffers.arenas[m].run_of(slot) for m in targets}
            assert dict(record[5]) == {m: first for m, (first, _) in runs.items()}, (slot, record, runs)
            assert all(length == rank for _, length in runs.values()), (slot, runs)
            assert [int(pairs[LORA_MODULES.index(m), 1]) for m in targets] == [runs[m][0] for m in targets]
        checked["times"] += 1
        checked["resident_max"] = max(checked["resident_max"], len(resident))

    original = engine.scheduler.schedule

    def schedule():  # how many distinct adapters each step batches
        chunks = original()
        adapters = {c.request.adapter for c in chunks if c.request.adapter}
        assert len(adapters) <= MAX_LORAS
        checked["adapters_in_a_step"] = max(checked["adapters_in_a_step"], len(adapters))
        return chunks

    engine.scheduler.schedule = schedule
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            engine.call(check_memory).result(30)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        # Every adapter, one short request each, 32 at a time: loads, evictions, reloads.
        def one(name: str) -> list[int]:
            with NodeClient(node.address) as client:
                return client.generate(client.request(adapter=name, prompt_token_ids=[5, 6, 7],
                                                      max_tokens=1, ignore_eos=True), timeout=600).token_ids

        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(one, spec))
        assert all(len(a) == 1 for a in answers)
        resident = engine.call(lambda: sum(e is not None for e in manager.slots)).result(30)
        assert resident <= ROWS // min(RANKS)  # every adapter loaded once; all but these evicted
        assert manager.stats["evictions"] >= COUNT - resident, manager.stats
        assert checked["times"] > 0 and checked["resident_max"] >= 4

        # A sample, two adapters of each rank, all requests at once: batched together.
        rng = random.Random(0)
        sample = [n for r in RANKS for n in rng.sample([n for n in spec if spec[n][0] == r], 2)]
        prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 24))] for _ in range(2)]
        max_new = 8
        expected = {n: peft_greedy(tiny_llama_path, root / n, prompts, max_new) for n in sample}
        base = peft_greedy(tiny_llama_path, None, prompts, max_new)
        assert sum(expected[n] != base for n in sample) >= len(sample) - 1, "adapters too weak for the test"
        checked["adapters_in_a_step"] = 0

        def run(job: tuple[str, int]) -> list[int]:
            name, i = job
            with NodeClient(node.address) as client:
                return client.generate(client.request(adapter=name, prompt_token_ids=prompts[i],
                                                      max_tokens=max_new, ignore_eos=True), timeout=300).token_ids

        jobs = [(n, i) for n in sample for i in range(len(prompts))]
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(run, jobs))
        for (name, i), tokens in zip(jobs, got):
            assert tokens == expected[name][i], f"adapter {name} (rank {spec[name][0]}) prompt {i} diverged"
        assert checked["adapters_in_a_step"] >= 4, checked  # several ranks in one step
        stop.set()
        watcher.join(10)
        engine.call(check_memory).result(30)
        node.check_idle()
    finally:
        stop.set()
        node.stop()
