"""The prefix cache through gRPC, against Hugging Face PEFT: the same prompt prefix under the
base model, adapter A, adapter B and A re-uploaded with new weights gives each its own
reference's tokens while hits happen only within a namespace; a 512-token shared prefix is
not prefilled twice; and a KV cache too small for everyone preempts without changing outputs."""
from __future__ import annotations

import random
import shutil
import threading
from pathlib import Path

import pytest

from harness import InProcessNode, make_peft_adapter, peft_greedy
from inference_node.config import NodeConfig
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient

MAX_NEW = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix-adapters")
    made = {
        "alpha": make_peft_adapter(tiny_llama_path, root / "store" / "alpha", 8, 16.0,
                                   ["q_proj", "v_proj", "down_proj"], seed=1, scale=3.0),
        "beta": make_peft_adapter(tiny_llama_path, root / "store" / "beta", 8, 16.0,
                                  ["k_proj", "o_proj", "gate_proj", "up_proj"], seed=2, scale=3.0),
        "alpha-v2": make_peft_adapter(tiny_llama_path, root / "alpha-v2", 8, 16.0,
                                      ["q_proj", "v_proj", "down_proj"], seed=3, scale=3.0),
    }
    shutil.copytree(made["alpha"], root / "alpha-v1")
    made["alpha-v1"] = root / "alpha-v1"
    made["root"] = root / "store"
    return made


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def reupload(adapters: dict[str, Path], version: str) -> None:
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(adapters[version] / f, adapters["root"] / "alpha" / f)


def test_namespaces_isolate_and_hits_stay_within_them(adapters, tiny_llama_path) -> None:
    reupload(adapters, "alpha-v1")
    rng = random.Random(5)
    prefix = tokens(rng, 64)  # four full blocks of 16
    prompts = [prefix + tokens(rng, 8), prefix + tokens(rng, 8)]
    folders = {"": None, "alpha": adapters["alpha-v1"], "beta": adapters["beta"], "alpha-v2": adapters["alpha-v2"]}
    expected = {k: peft_greedy(tiny_llama_path, v, prompts, MAX_NEW) for k, v in folders.items()}
    assert len({tuple(e[0]) for e in expected.values()}) == 4, "the adapters must change the output"

    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=256,
                                       max_loras=4, max_lora_rank=16, adapter_dir=str(adapters["root"]),
                                       debug_checks=True))
    try:
        with NodeClient(node.address) as client:
            def run(adapter: str, prompt: list[int]):
                return client.generate(client.request(adapter=adapter, prompt_token_ids=prompt,
                                                      max_tokens=MAX_NEW, ignore_eos=True), 120)

            v1 = ""
            for key in ("", "alpha", "beta", "alpha-v2"):
                if key == "alpha-v2":
                    reupload(adapters, "alpha-v2")
                    loaded = client.stub.LoadAdapter(pb.LoadAdapterRequest(name="alpha"), timeout=60)
                    assert loaded.version != v1
                adapter = "alpha" if key.startswith("alpha") else key
                first, second = run(adapter, prompts[0]), run(adapter, prompts[1])
                # the same 64 tokens are cached under every earlier namespace, but not this one
                assert first.cached_prompt_tokens == 0, key
                assert second.cached_prompt_tokens == 64, key
                assert [first.token_ids, second.token_ids] == expected[key], key
                if key == "alpha":
                    v1 = first.adapter_version
                if key == "alpha-v2":
                    assert first.adapter_version == second.adapter_version != v1

            stats = client.stats()
            rows = {(r.adapter, r.version): r for r in stats.prefix_cache}
            assert sorted(a for a, _ in rows) == ["", "alpha", "beta"]  # alpha's v1 namespace is gone
            assert ("alpha", v1) not in rows
            for row in rows.values():
                assert (row.lookups, row.hits, row.hit_tokens) == (2, 1, 64)
                assert row.blocks > 0
            assert stats.kv_blocks_cached == sum(r.blocks for r in rows.values())
            assert stats.cached_prompt_tokens == 4 * 64
            listed = {a.name: a for a in client.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters}
            assert listed["alpha"].cache_hit_tokens == 64 and listed["alpha"].cache_blocks > 0

            # Unloading drops the namespace: the next load is a new namespace, nothing reused.
            client.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="beta"), timeout=10)
            assert "beta" not in {r.adapter for r in client.stats().prefix_cache}
            again = run("beta", prompts[1])
            assert again.cached_prompt_tokens == 0 and again.token_ids == expected["beta"][1]
        node.check_idle()
    finally:
        node.stop()
        reupload(adapters, "alpha-v1")


def test_a_512_token_shared_prefix_is_prefilled_once(adapters, tiny_llama_path) -> None:
    reupload(adapters, "alpha-v1")
    rng = random.Random(9)
    prefix = tokens(rng, 512)
    prompts = [prefix + tokens(rng, 11), prefix + tokens(rng, 7)]
    expected = peft_greedy(tiny_llama_path, adapters["alpha-v1"], prompts, MAX_NEW)
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=256,
                                       max_loras=2, max_lora_rank=16, adapter_dir=str(adapters["root"]),
                                       debug_checks=True))
    try:
        with NodeClient(node.address) as client:
            first = client.generate(client.request(adapter="alpha", prompt_token_ids=prompts[0],
                                                   max_tokens=MAX_NEW, ignore_eos=True), 120)
            computed_before = client.stats().prompt_tokens
            second = client.generate(client.request(adapter="alpha", prompt_token_ids=prompts[1],
                                                    max_tokens=MAX_NEW, ignore_eos=True), 120)
            computed = client.stats().prompt_tokens - computed_before
        assert [first.token_ids, second.token_ids] == expected
        assert first.cached_prompt_tokens == 0 and second.cached_prompt_tokens == 512
        assert computed == 7, "only the new suffix is prefilled"
        node.check_idle()
    finally:
        node.stop()


def test_preemption_with_shared_prefixes_keeps_every_output(adapters, tiny_llama_path) -> None:
    reupload(adapters, "alpha-v1")
    rng = random.Random(13)
    prefix = tokens(rng, 32)
    jobs = [(adapter, prefix + tokens(rng, 6 + i)) for i, adapter in
            enumerate(["", "alpha", "beta", "alpha", "", "beta", "alpha", ""])]
    folders = {"": None, "alpha": adapters["alpha-v1"], "beta": adapters["beta"]}
    expected = {i: peft_greedy(tiny_llama_path, folders[a], [p], 24)[0] for i, (a, p) in enumerate(jobs)}
    # 12 blocks of 16 tokens cannot hold 8 requests of ~40 + 24 tokens at once
    node = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=12,
                                       block_size=16, max_num_seqs=8, max_loras=2, max_lora_rank=16,
                                       adapter_dir=str(adapters["root"]), debug_checks=True))
    try:
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            adapter, prompt = jobs[i]
            with NodeClient(node.address) as c:
                results[i] = c.generate(c.request(adapter=adapter, prompt_token_ids=prompt, max_tokens=24,
                                                  ignore_eos=True), timeout=180).token_ids
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == expected
        with NodeClient(node.address) as c:
            assert c.stats().preemptions > 0
        node.check_idle()
    finally:
        node.stop()
