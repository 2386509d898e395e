"""Bad input through gRPC while a healthy mixed workload runs: malformed requests,
out-of-range parameters, an oversized prompt, unknown and invalid adapters (NaN weights,
pickle-only weights, a rank over the node's limit, shapes of another model, an unsafe name),
and unauthenticated or wrongly authenticated admin calls. Each gets its status and a message
a person can act on; the workload's requests all keep matching PEFT; the node ends idle."""
from __future__ import annotations

import random
import shutil
import threading
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import InProcessNode, make_peft_adapter, peft_greedy
from inference_node.config import NodeConfig
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient

ADMIN = "admin-secret-token"
MAX_NEW = 6
WEIGHTS = "adapter_model.safetensors"
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(100, 40000) for _ in range(_rng.randrange(4, 20))] for _ in range(3)]


def rewrite(folder: Path, change) -> None:
    tensors = load_file(folder / WEIGHTS)
    change(tensors)
    save_file(tensors, folder / WEIGHTS)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_path) -> Path:
    root = tmp_path_factory.mktemp("bad-adapters")
    targets = ["q_proj", "v_proj"]
    make_peft_adapter(tiny_llama_path, root / "good", 4, 8.0, targets, seed=1, scale=3.0)
    make_peft_adapter(tiny_llama_path, root / "too-wide", 16, 16.0, targets, seed=2)
    for name in ("nan", "pickle-only", "other-model"):
        shutil.copytree(root / "good", root / name)

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        key = next(k for k in tensors if "lora_A" in k)
        tensors[key][0, 0] = float("nan")

    def reshape(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if "lora_A" in k]:
            tensors[key] = torch.zeros(tensors[key].shape[0], 96)  # in-features of another model
    rewrite(root / "nan", poison)
    rewrite(root / "other-model", reshape)
    (root / "pickle-only" / WEIGHTS).unlink()
    (root / "pickle-only" / "adapter_model.bin").write_bytes(b"\x80\x04not-really-a-pickle")
    return root


@pytest.fixture(scope="module")
def node(tiny_llama_path, adapters):
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=256, max_loras=2,
                                    max_lora_rank=8, adapter_dir=str(adapters), max_model_len=512,
                                    admin_token=ADMIN, debug_checks=True))
    yield n
    n.stop()


BAD_GENERATE = [
    (dict(prompt="hi", max_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt="hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt="hi", top_p=2.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt="hi", top_k=-2), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    (dict(prompt_token_ids=[1, 10 ** 9]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
    (dict(prompt_token_ids=[7] * 600), grpc.StatusCode.INVALID_ARGUMENT, "limit"),
    (dict(prompt="hi", adapter="../../etc/passwd"), grpc.StatusCode.INVALID_ARGUMENT, "adapter name"),
    (dict(prompt="hi", adapter="nobody"), grpc.StatusCode.NOT_FOUND, "nobody"),
    (dict(prompt="hi", adapter="nan"), grpc.StatusCode.FAILED_PRECONDITION, "NaN"),
    (dict(prompt="hi", adapter="pickle-only"), grpc.StatusCode.FAILED_PRECONDITION, "pickle"),
    (dict(prompt="hi", adapter="too-wide"), grpc.StatusCode.FAILED_PRECONDITION, "--max-lora-rank"),
    (dict(prompt="hi", adapter="other-model"), grpc.StatusCode.FAILED_PRECONDITION, "other-model"),
]


def test_bad_input_is_refused_clearly_while_the_workload_stays_correct(node, adapters, tiny_llama_path) -> None:
    expected = {"": peft_greedy(tiny_llama_path, None, PROMPTS, MAX_NEW),
                "good": peft_greedy(tiny_llama_path, adapters / "good", PROMPTS, MAX_NEW)}
    stop = threading.Event()
    outcomes: list[str] = []

    def workload(seed: int) -> None:
        rng = random.Random(seed)
        with NodeClient(node.address) as client:
            while not stop.is_set():
                adapter, i = rng.choice(["", "good"]), rng.randrange(len(PROMPTS))
                try:
                    got = client.generate(client.request(adapter=adapter, prompt_token_ids=PROMPTS[i],
                                                         max_tokens=MAX_NEW, ignore_eos=True), timeout=60)
                    outcomes.append("ok" if got.token_ids == expected[adapter][i] else f"wrong {adapter} {i}")
                except grpc.RpcError as exc:
                    outcomes.append(f"{exc.code().name}: {exc.details()}")

    threads = [threading.Thread(target=workload, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        with NodeClient(node.address) as client:
            for fields, code, needle in BAD_GENERATE:
                with pytest.raises(grpc.RpcError) as err:
                    client.generate(pb.GenerateRequest(**fields), timeout=60)
                assert err.value.code() == code, (fields, err.value.details())
                assert needle in err.value.details(), (fields, err.value.details())

            load = client.stub.LoadAdapter
            for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                                   ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED)):
                with pytest.raises(grpc.RpcError) as err:
                    load(pb.LoadAdapterRequest(name="good", pin=True), timeout=10, metadata=metadata)
                assert err.value.code() == code
                assert ADMIN not in err.value.details() and "wrong" not in err.value.details()
                with pytest.raises(grpc.RpcError) as err:
                    client.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="good"), timeout=10, metadata=metadata)
                assert err.value.code() == code
            admin = (("authorization", f"Bearer {ADMIN}"),)
            with pytest.raises(grpc.RpcError) as err:
                load(pb.LoadAdapterRequest(name="nan"), timeout=30, metadata=admin)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.RpcError) as err:
                client.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="never-loaded"), timeout=10, metadata=admin)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:5]
    listed = {a.name for a in NodeClient(node.address).stub.ListAdapters(pb.ListAdaptersRequest(),
                                                                          timeout=10).adapters}
    assert listed <= {"good"}, "an invalid adapter was kept"
    node.check_idle()
