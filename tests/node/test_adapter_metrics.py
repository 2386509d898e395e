"""Per-adapter Prometheus metrics after a mixed burst, with the label bound: the busiest
adapters keep their own label, the rest fold into "_other", clients' invented names never
take one; adapter tier loads, evictions, load time and numerical faults from the engine's
snapshot."""
from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import InProcessNode, make_peft_adapter
from inference_node.metrics import OTHER, AdapterLabels, NodeMetrics
from inference_node.config import NodeConfig
from lora_client.node_client import NodeClient
from lora_client.processes import free_port


def samples(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def adapters_labelled(found: dict, name: str) -> set[str]:
    return {dict(labels).get("adapter") for n, labels in found if n == name}


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_llama_path):
    root = tmp_path_factory.mktemp("metric-adapters")
    for i, name in enumerate(("busy", "steady", "rare1", "rare2")):
        make_peft_adapter(tiny_llama_path, root / name, 4, 8.0, ["q_proj", "v_proj"], seed=i + 1)
    n = InProcessNode(NodeConfig.of(checkpoint=str(tiny_llama_path), device="cpu", num_kv_blocks=128, max_loras=2,
                                    max_cpu_loras=2, adapter_dir=str(root), metrics_port=free_port(),
                                    metrics_max_adapters=2))
    yield n
    n.stop()


def test_per_adapter_metrics_after_a_mixed_burst(node) -> None:
    plan = ["busy"] * 6 + ["steady"] * 4 + ["rare1", "rare2", ""] + ["ghost"]  # ghost: not in the store
    outcomes: dict[int, str] = {}
    later_tokens: dict[str, int] = {}  # tokens the clients got after each request's first message
    tally = threading.Lock()
    with NodeClient(node.address) as client:
        def run(i: int, name: str) -> None:
            try:
                messages = [m for m in client.stream(client.request(
                    adapter=name, prompt_token_ids=[5 + i, 6, 7], max_tokens=3, ignore_eos=True), 60)]
                with_tokens = [m for m in messages if m.token_ids]
                with tally:
                    later_tokens[name] = later_tokens.get(name, 0) + sum(len(m.token_ids) for m in with_tokens[1:])
                outcomes[i] = messages[-1].finish_reason
            except grpc.RpcError as exc:
                outcomes[i] = exc.code().name.lower()

        # The two busy ones first, so they are the labelled adapters when the rare ones come.
        for name in ("busy", "steady"):
            run(-1, name)
        threads = [threading.Thread(target=run, args=(i, name)) for i, name in enumerate(plan)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert outcomes[len(plan) - 1] == "not_found" and all(outcomes[i] == "length" for i in range(len(plan) - 1))

    found = samples(node.node.config.server.metrics_port)
    req = "lora_node_requests_total"
    assert value(found, req, adapter="busy", status="length") == 7
    assert value(found, req, adapter="steady", status="length") == 5
    assert value(found, req, adapter=OTHER, status="length") == 2          # rare1, rare2
    assert value(found, req, adapter="", status="length") == 1              # the base model
    assert value(found, req, adapter=OTHER, status="not_found") == 1        # ghost never gets a label
    assert adapters_labelled(found, req) == {"busy", "steady", OTHER, ""}
    assert value(found, "lora_node_generated_tokens_total", adapter="busy") == 21
    assert value(found, "lora_node_prompt_tokens_total", adapter="steady") == 15
    assert value(found, "lora_node_time_to_first_token_seconds_count", adapter="busy") == 7
    # One observation per token after a request's first message, however a lagging stream
    # grouped its tokens into messages.
    tpot = "lora_node_time_per_output_token_seconds_count"
    assert value(found, tpot, adapter=OTHER) == later_tokens["rare1"] + later_tokens["rare2"]
    assert value(found, tpot, adapter="busy") == later_tokens["busy"]
    # Every adapter request that bound counted once, by the tier its adapter was in.
    by_tier = {dict(labels)["tier"]: v for (n, labels), v in found.items()
               if n == "lora_node_adapter_requests_by_tier_total"}
    assert set(by_tier) == {"gpu", "host", "disk", "store"} and sum(by_tier.values()) == 7 + 5 + 2
    assert by_tier["gpu"] >= 1
    # Engine side: four adapters through two GPU slots and two host places.
    loads = "lora_node_adapter_tier_loads_total"
    assert value(found, loads, adapter="busy", tier="host") >= 1 and value(found, loads, adapter="busy", tier="gpu") >= 1
    assert value(found, loads, adapter=OTHER, tier="host") >= 2
    evicted = sum(v for (n, labels), v in found.items() if n == "lora_node_adapter_tier_evictions_total")
    assert evicted >= 2
    assert value(found, "lora_node_adapter_load_seconds_count", adapter="busy") >= 1
    assert value(found, "lora_node_adapter_load_seconds_bucket", adapter="busy", le="+Inf") >= 1
    assert value(found, "lora_node_adapter_numerical_faults_total", adapter="busy") == 0
    assert adapters_labelled(found, loads) <= {"busy", "steady", OTHER}


def test_labels_stay_bounded_and_a_new_leader_takes_a_label() -> None:
    removed: list[str] = []
    labels = AdapterLabels(2, on_evict=removed.append)
    for name in ("a", "b"):
        labels.count(name)
        assert labels.label(name, admit=True) == name
    labels.count("b")
    labels.count("c")
    assert labels.label("c", admit=True) == OTHER           # full, and c is no busier
    assert labels.label("never-served") == OTHER            # not admitted without traffic
    for _ in range(5):
        labels.count("c")
    assert labels.label("c", admit=True) == "c" and removed == ["a"]
    assert labels.current() == {"b", "c"}                  # a was the least busy
    for i in range(1000):  # invented names: the traffic table stays bounded too
        labels.count(f"junk{i}")
    assert len(labels.traffic) <= 16


def test_an_evicted_label_loses_its_series() -> None:
    metrics = NodeMetrics(max_adapter_labels=1)
    metrics.first_token("a", 0.1)
    metrics.request_finished("a", "stop", 3, 1)
    for _ in range(3):
        metrics.first_token("b", 0.1)
        metrics.request_finished("b", "stop", 3, 1)
    names = {s.labels.get("adapter") for f in metrics.registry.collect() for s in f.samples if "adapter" in s.labels}
    assert names == {"b", OTHER}


def test_time_per_output_token_counts_tokens_not_messages() -> None:
    metrics = NodeMetrics()
    metrics.first_token("a", 0.5, 2)
    metrics.tokens_streamed("a", 3, 0.06)   # a lagging stream: three tokens in one message
    metrics.tokens_streamed("a", 1, 0.01)
    hist = "lora_node_time_per_output_token_seconds"
    assert metrics.registry.get_sample_value(f"{hist}_count", {"adapter": "a"}) == 4
    assert metrics.registry.get_sample_value(f"{hist}_sum", {"adapter": "a"}) == pytest.approx(0.07)
    assert metrics.registry.get_sample_value("lora_node_generated_tokens_total", {"adapter": "a"}) == 6


def test_streamed_tokens_follow_an_adapter_that_loses_its_label_and_wins_it_back():
    """The streaming series are looked up once per label and kept; a label's eviction must
    drop them, or an adapter labelled again would count into a removed (unexported) series."""
    m = NodeMetrics(max_adapter_labels=1)

    def tokens(adapter: str) -> float:
        return m.registry.get_sample_value("lora_node_generated_tokens_total", {"adapter": adapter}) or 0.0

    m.first_token("a", 0.01, 1)
    m.tokens_streamed("a", 2, 0.01)
    m.request_finished("a", "length", 1, 3)
    for _ in range(3):
        m.request_finished("b", "length", 1, 3)
    m.first_token("b", 0.01, 1)             # 3 finished against a's 1: b takes the one label
    assert m.labels.current() == {"b"} and tokens("a") == 0
    m.tokens_streamed("a", 1, 0.01)         # a request of a still streaming: now under OTHER
    assert tokens(OTHER) == 1
    for _ in range(6):
        m.request_finished("a", "length", 1, 3)
    m.first_token("a", 0.01, 1)             # 7 against 3: a wins it back
    m.tokens_streamed("a", 4, 0.02)
    assert m.labels.current() == {"a"} and tokens("a") == 5
    assert m.registry.get_sample_value("lora_node_time_per_output_token_seconds_count", {"adapter": "a"}) == 4
