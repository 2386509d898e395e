"""Three real nodes behind a real HAProxy (the Debian package `haproxy`), on the CPU.

- Adapter affinity: 300 requests over 12 adapters load each adapter on at most 2 nodes,
  against every node loading most adapters under round-robin (printed side by side:
  adapter loads per node, prefix-cache hit tokens).
- Base-model requests (no header, or an empty one) reach every node.
- The OpenAI HTTP entry routes each adapter to the node gRPC routes it to, by the JSON body's
  model (or the header), and spreads the base model.
- A draining node leaves the proxy's pool while it still runs, and its running answer ends;
  only its adapters move to other nodes, and they come back when it rejoins.
- Under continuous load, a rolling restart of all 3 nodes fails no request (refusals are
  retried, only before a first token) and every answer equals a single-node run's.
- A node killed with SIGKILL fails only the answers it was streaming, with UNAVAILABLE; its
  adapters' next requests are served by other nodes.
"""
from __future__ import annotations

import json
import random
import signal
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import make_peft_adapter, wait_for
from lora.v1 import inference_pb2 as pb
from lora.v1 import inference_pb2_grpc as pb_grpc
from lora_client import cli
from lora_client.fleet import NodeFleet
from lora_client.haproxy import ADAPTER_HEADER, MISSING, haproxy_binary
from lora_client.node_client import NodeClient, NodeLost, RetryPolicy

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason=MISSING)

ADAPTERS = [f"tenant-{i:02d}" for i in range(12)]
BLOCK = 16
RETRY = RetryPolicy(attempts=12, first_backoff_s=0.05, max_backoff_s=1.0)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_llama_path) -> Path:
    root = tmp_path_factory.mktemp("fleet-adapters")
    for seed, name in enumerate(ADAPTERS, start=1):
        make_peft_adapter(tiny_llama_path, root / name, 4, 8.0, ["q_proj", "v_proj"], seed=seed, scale=3.0)
    return root


def node_flags(model: Path, adapters: Path) -> list[str]:
    """Small enough that three nodes share two cores: one torch thread, a small KV cache,
    4 adapters in slots and 4 in host memory (12 adapters do not fit one node)."""
    return ["--model", str(model), "--device", "cpu", "--cpu-threads", "1", "--num-kv-blocks", "192",
            "--max-num-seqs", "16", "--warmup", "off", "--adapter-dir", str(adapters), "--max-loras", "4",
            "--max-cpu-loras", "4", "--max-lora-rank", "8", "--drain-seconds", "60", "--log-level", "INFO"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_llama_path, adapter_dir):
    with NodeFleet(tmp_path_factory.mktemp("fleet"), 3, node_flags(tiny_llama_path, adapter_dir),
                   start_timeout=180) as f:
        f.start()
        yield f


def shared_prefix(adapter: str) -> list[int]:
    """Three KV blocks every request of this adapter starts with (a system prompt)."""
    rng = random.Random(adapter)
    return [rng.randrange(100, 40000) for _ in range(3 * BLOCK)]


def request(adapter: str, i: int, max_tokens: int = 4) -> pb.GenerateRequest:
    return NodeClient.request(adapter=adapter, prompt_token_ids=shared_prefix(adapter) + [500 + i, 7, 8 + i % 5],
                              max_tokens=max_tokens, ignore_eos=True)


def run_concurrently(target: str, requests: list[pb.GenerateRequest], workers: int,
                     timeout: float = 120) -> list:
    """Each request once, `workers` at a time, through one channel; results in order."""
    results: list = [None] * len(requests)
    cursor = iter(range(len(requests)))
    lock = threading.Lock()
    with NodeClient(target, retry=RETRY) as client:
        def work() -> None:
            while True:
                with lock:
                    i = next(cursor, None)
                if i is None:
                    return
                try:
                    results[i] = client.generate(requests[i], timeout=timeout)
                except grpc.RpcError as exc:
                    results[i] = exc

        threads = [threading.Thread(target=work) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    return results


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def node_report(fleet: NodeFleet) -> dict[str, dict]:
    """Per node: the adapters it loaded into host memory (fetches), slot loads, prefix-cache hit tokens."""
    report = {}
    for node in fleet.nodes:
        samples = scrape(node.metrics_url)
        loads = {dict(labels)["adapter"]: value for (name, labels), value in samples.items()
                 if name == "lora_node_adapter_tier_loads_total" and dict(labels)["tier"] == "host" and value}
        slot_loads = sum(value for (name, labels), value in samples.items()
                         if name == "lora_node_adapter_tier_loads_total" and dict(labels)["tier"] == "gpu")
        with NodeClient(node.target) as client:
            stats = client.stats(timeout=10)
        report[node.name] = {"loaded": loads, "host_loads": sum(loads.values()), "slot_loads": slot_loads,
                             "hit_tokens": stats.cached_prompt_tokens, "requests": 0}
    return report


def traffic() -> list[pb.GenerateRequest]:
    """300 requests over 12 adapters (25 each, shuffled), 10 prompts per adapter behind its prefix."""
    order = [(adapter, i % 10) for adapter in ADAPTERS for i in range(25)]
    random.Random(7).shuffle(order)
    return [request(adapter, i) for adapter, i in order]


def test_adapter_affinity_against_round_robin(fleet, tmp_path, tiny_llama_path, adapter_dir, capsys) -> None:
    requests = traffic()
    results = {"adapter": run_concurrently(fleet.target, requests, workers=12)}
    outcomes = {"adapter": node_report(fleet)}
    with NodeFleet(tmp_path / "rr", 3, node_flags(tiny_llama_path, adapter_dir), routing="roundrobin",
                   start_timeout=180) as rr:
        rr.start()
        results["roundrobin"] = run_concurrently(rr.target, requests, workers=12)
        outcomes["roundrobin"] = node_report(rr)
    answers = {}
    for routing, done in results.items():
        failures = [r for r in done if isinstance(r, grpc.RpcError)]
        assert not failures, (routing, failures[:3])
        answers[routing] = [r.token_ids for r in done]
        served = defaultdict(set)
        for req, r in zip(requests, done):
            served[req.adapter].add(r.node)
            outcomes[routing][r.node]["requests"] += 1
        outcomes[routing]["served"] = served

    assert answers["adapter"] == answers["roundrobin"]  # the routing changes where, never what
    table = side_by_side(outcomes)
    with capsys.disabled():
        print("\n" + table)

    affinity, rr = outcomes["adapter"], outcomes["roundrobin"]
    nodes = [n.name for n in fleet.nodes]
    for adapter in ADAPTERS:
        holders = [n for n in nodes if affinity[n]["loaded"].get(adapter)]
        assert 1 <= len(holders) <= 2, (adapter, holders, table)
        assert affinity["served"][adapter] <= set(holders)
    assert all(len(rr["served"][a]) == 3 for a in ADAPTERS)  # round-robin: every node serves every adapter
    total = {name: sum(o[n]["host_loads"] for n in nodes) for name, o in (("adapter", affinity), ("rr", rr))}
    assert total["adapter"] < total["rr"], table
    hits = {name: sum(o[n]["hit_tokens"] for n in nodes) for name, o in (("adapter", affinity), ("rr", rr))}
    assert hits["adapter"] > hits["rr"], table

    # The fleet view reads the nodes from the proxy and lists where each adapter is.
    assert cli.main(["fleet", "--proxy-stats", fleet.stats_url]) == 0
    view = capsys.readouterr().out
    with capsys.disabled():
        print(view)
    listed = {}
    for node in fleet.nodes:
        with NodeClient(node.target) as client:
            listed[node.name] = {a.name: a.tier for a in client.list_adapters(timeout=10).adapters}
    for line in view.splitlines():
        cells = line.split()
        if cells and cells[0] in ADAPTERS:
            for name, cell in zip(nodes, cells[1:]):
                assert (cell != "-") == (cells[0] in listed[name]), (line, listed)
    assert all(f"{n.name} " in view and n.target in view for n in fleet.nodes)


def side_by_side(outcomes: dict[str, dict]) -> str:
    nodes = [n for n in outcomes["adapter"] if n != "served"]
    lines = ["300 requests (12 at a time) over 12 adapters, 3 nodes with 4 adapter slots and 4 adapters in host "
             "memory each; 48-token prefix per adapter",
             f"{'':30}{'adapter affinity':>22}{'round-robin':>22}"]

    def row(label: str, key) -> None:
        cells = [key(outcomes[r]) for r in ("adapter", "roundrobin")]
        lines.append(f"{label:30}{cells[0]:>22}{cells[1]:>22}")

    for n in nodes:
        row(f"{n}: requests served", lambda o, n=n: str(o[n]["requests"]))
        row(f"{n}: adapters loaded", lambda o, n=n: str(len(o[n]["loaded"])))
        row(f"{n}: adapter loads (host)", lambda o, n=n: str(int(o[n]["host_loads"])))
        row(f"{n}: adapter loads (slot)", lambda o, n=n: str(int(o[n]["slot_loads"])))
        row(f"{n}: prefix-cache hit tokens", lambda o, n=n: str(o[n]["hit_tokens"]))
    row("total adapter loads (host)", lambda o: str(int(sum(o[n]["host_loads"] for n in nodes))))
    row("total prefix-cache hit tokens", lambda o: str(sum(o[n]["hit_tokens"] for n in nodes)))
    row("nodes per adapter (max)", lambda o: str(max(sum(1 for n in nodes if o[n]["loaded"].get(a))
                                                     for a in ADAPTERS)))
    return "\n".join(lines)


def alive(fleet: NodeFleet, name: str) -> bool:
    return fleet.node(name).child.alive()


def where(client: NodeClient) -> dict[str, str]:
    """The node each adapter's request goes to now, one request at a time (no load to bound)."""
    return {adapter: client.generate(request(adapter, 9), timeout=60).node for adapter in ADAPTERS}


def test_base_model_requests_spread_over_every_node(fleet) -> None:
    with NodeClient(fleet.target) as plain, NodeClient(fleet.target, metadata=[(ADAPTER_HEADER, "")]) as empty:
        requests = [NodeClient.request(prompt_token_ids=[11, 2345, 876, 40 + i], max_tokens=4, ignore_eos=True)
                    for i in range(6)]
        served = Counter()
        for client in (plain, empty):  # no header, and an empty one
            for req in requests:
                served[client.generate(req, timeout=60).node] += 1
    assert set(served) == {n.name for n in fleet.nodes}, served


def test_the_openai_http_entry_routes_as_grpc_does(fleet) -> None:
    """The openai client against the proxy's HTTP port: each adapter's requests land on one
    node, the node its gRPC requests go to (the same hash of the same name, read from the JSON
    body's model, or from the x-lora-adapter header when set); base-model requests spread."""
    with NodeClient(fleet.target) as client:
        by_grpc = where(client)
    with openai.OpenAI(base_url=fleet.http_url, api_key="-", max_retries=0, timeout=60) as api:
        for adapter in ADAPTERS:
            nodes = set()
            for i in range(3):
                raw = api.completions.with_raw_response.create(
                    model=adapter, prompt=shared_prefix(adapter) + [500 + i], max_tokens=2, temperature=0)
                assert raw.parse().usage.completion_tokens == 2
                nodes.add(raw.headers["x-lora-node"])
            assert nodes == {by_grpc[adapter]}, (adapter, nodes, by_grpc[adapter])
        header = api.chat.completions.with_raw_response.create(  # the header names the adapter first
            model=ADAPTERS[0], messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_headers={ADAPTER_HEADER: ADAPTERS[1]})
        assert header.headers["x-lora-node"] == by_grpc[ADAPTERS[1]] and header.parse().choices
        base = api.models.list().data[0].id
        assert {m.id for m in api.models.list().data} >= {base, *ADAPTERS}
        served = Counter(api.completions.with_raw_response.create(
            model=base, prompt=[11, 2345, 876, 40 + i], max_tokens=2).headers["x-lora-node"] for i in range(6))
    assert set(served) == {n.name for n in fleet.nodes}, served


def test_a_draining_node_leaves_the_pool_before_it_stops(fleet) -> None:
    """SIGTERM: the proxy marks the node DOWN while its process still runs its answer; the
    answer ends whole; only that node's adapters move (consistent hashing); the node exits 0,
    rejoins once started again, and gets its adapters back."""
    with NodeClient(fleet.target, retry=RETRY) as client:
        before = where(client)
        victim = before[ADAPTERS[0]]
        long = client.answer(request(ADAPTERS[0], 1, max_tokens=400), timeout=120)
        stream = iter(long)
        first = next(stream)
        assert long.node == victim and first.token_ids
        fleet.node(victim).child.proc.send_signal(signal.SIGTERM)
        fleet.proxy.wait(lambda servers: not servers[victim].up, 10, f"{victim} out of the pool")
        assert alive(fleet, victim), "the node stopped before the proxy took it out of the pool"
        during = where(client)
        for adapter in ADAPTERS:
            if before[adapter] == victim:
                assert during[adapter] != victim, adapter
            else:
                assert during[adapter] == before[adapter], (adapter, before[adapter], during[adapter])
        tokens = len(first.token_ids) + sum(len(m.token_ids) for m in stream)
        assert tokens == 400 and long.attempts == 1
        assert fleet.node(victim).child.proc.wait(60) == 0
        fleet.node(victim).child.stop()
        fleet.start_node(victim)
        assert fleet.proxy.servers()[victim].status == "UP"
        assert where(client) == before


class Load:
    """Clients sending requests through the proxy until stopped: typed clients with a retry
    policy, and one plain gRPC channel with the retry policy of gRPC's service config
    (docs/FLEET.md), as other clients would."""

    SERVICE_CONFIG = json.dumps({"methodConfig": [{
        "name": [{"service": "lora.v1.InferenceNode", "method": "Generate"}],
        "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"]}}]})

    def __init__(self, target: str, requests: list[pb.GenerateRequest], typed_workers: int = 5) -> None:
        self.target, self.requests = target, requests
        self.results: list[tuple[int, object, float]] = []  # (request index, Completion or error, when)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.typed, args=(w,)) for w in range(typed_workers)]
        self.threads.append(threading.Thread(target=self.plain))

    def record(self, i: int, outcome: object) -> None:
        with self.lock:
            self.results.append((i, outcome, time.monotonic()))

    def typed(self, worker: int) -> None:
        with NodeClient(self.target, retry=RETRY) as client:
            i = worker
            while not self.stopping.is_set():
                try:
                    self.record(i, client.generate(self.requests[i], timeout=120))
                except grpc.RpcError as exc:
                    self.record(i, exc)
                i = (i + 7) % len(self.requests)

    def plain(self) -> None:
        channel = grpc.insecure_channel(self.target, options=[("grpc.service_config", self.SERVICE_CONFIG)])
        stub = pb_grpc.InferenceNodeStub(channel)
        i = 3
        while not self.stopping.is_set():
            req = self.requests[i]
            try:
                call = stub.Generate(req, timeout=120, metadata=[(ADAPTER_HEADER, req.adapter)] if req.adapter else [])
                tokens = [t for msg in call for t in msg.token_ids]
                self.record(i, ("plain", tokens, dict(call.initial_metadata()).get("x-lora-node", "")))
            except grpc.RpcError as exc:
                self.record(i, exc)
            i = (i + 5) % len(self.requests)
        channel.close()

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(180)


def load_requests() -> list[pb.GenerateRequest]:
    """Every adapter and the base model, answers long enough to be running at each SIGTERM."""
    out = [request(adapter, i, max_tokens=24) for adapter in ADAPTERS for i in range(2)]
    out += [NodeClient.request(prompt_token_ids=[11, 2345, 876, 40 + i], max_tokens=24, ignore_eos=True)
            for i in range(4)]
    return out


def test_rolling_restart_under_load_loses_nothing(fleet, capsys) -> None:
    requests = load_requests()
    # The single-node run: every request straight to one node, no proxy.
    expected = [r.token_ids for r in run_concurrently(fleet.nodes[0].target, requests, workers=4)]
    assert all(len(t) == 24 for t in expected)

    log_sizes = {n.name: fleet.log_path(n).stat().st_size for n in fleet.nodes}
    with Load(fleet.target, requests) as load:
        time.sleep(2.0)
        codes = fleet.rolling_restart(report=lambda line: None)
        all_back = time.monotonic()
        time.sleep(3.0)
    assert codes == [0, 0, 0]

    failures = [(requests[i].adapter, outcome) for i, outcome, _ in load.results if isinstance(outcome, grpc.RpcError)]
    assert not failures, failures[:5]
    retried = 0
    served_after = Counter()
    for i, outcome, when in load.results:
        if isinstance(outcome, tuple):
            _, tokens, node = outcome
        else:
            tokens, node = outcome.token_ids, outcome.node
            retried += outcome.attempts > 1
        assert tokens == expected[i], (requests[i].adapter, tokens, expected[i])
        if when > all_back:
            served_after[node] += 1
    plain = sum(1 for _, o, _ in load.results if isinstance(o, tuple))
    with capsys.disabled():
        print(f"\nrolling restart: {len(load.results)} answers ({plain} by a plain gRPC client with a "
              f"retry policy), 0 failed, {retried} typed-client answers retried before their first token; "
              f"after the restart: {dict(served_after)}")
    assert plain > 0 and len(load.results) > 60
    for node in fleet.nodes:
        text = fleet.log_path(node).read_text(errors="replace")[log_sizes[node.name]:]
        assert "cut short" not in text  # every answer running at the SIGTERM ended whole
        assert "draining" in text
    assert set(served_after) == {n.name for n in fleet.nodes}, served_after  # every node rejoined


LONG = 800


def test_sigkill_fails_only_the_answers_that_node_was_streaming(fleet, capsys) -> None:
    long_requests = [request(adapter, 3, max_tokens=LONG) for adapter in ADAPTERS]
    long_requests += [NodeClient.request(prompt_token_ids=[11, 2345, 876, 90 + i], max_tokens=LONG, ignore_eos=True)
                      for i in range(3)]
    answers = [None] * len(long_requests)
    outcomes: list = [None] * len(long_requests)

    def run(i: int) -> None:
        with NodeClient(fleet.target, retry=RETRY) as client:
            answer = client.answer(long_requests[i], timeout=180)
            answers[i] = answer
            tokens = []
            try:
                for msg in answer:
                    tokens += msg.token_ids
                outcomes[i] = tokens
            except grpc.RpcError as exc:
                outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(long_requests))]
    for t in threads:
        t.start()
    wait_for(lambda: all(a is not None and a.tokens for a in answers), 120, "every answer's first tokens")
    by_node = Counter(a.node for a in answers)
    victim = by_node.most_common(1)[0][0]
    at_kill = [a.tokens for a in answers]  # what each client had when the node died
    assert fleet.kill(victim) == -9
    for t in threads:
        t.join(300)

    victims_adapters, failed = set(), 0
    for req, answer, outcome, seen in zip(long_requests, answers, outcomes, at_kill):
        if answer.node == victim:
            if req.adapter:
                victims_adapters.add(req.adapter)
            if isinstance(outcome, list):  # it ended at the node before the kill, only its reading lagged
                assert len(outcome) == LONG and seen > LONG - 200, (req.adapter, seen)
                continue
            failed += 1
            assert outcome.code() == grpc.StatusCode.UNAVAILABLE, outcome
            assert isinstance(outcome, NodeLost) and outcome.tokens >= seen and outcome.node == victim
            assert answer.attempts == 1  # tokens were streamed: never asked again
        else:
            assert isinstance(outcome, list) and len(outcome) == LONG, (req.adapter, answer.node, outcome)
    assert failed > 0 and victims_adapters, by_node
    with NodeClient(fleet.target, retry=RETRY) as client:
        for adapter in sorted(victims_adapters):
            after = client.generate(request(adapter, 4), timeout=60)
            assert after.node and after.node != victim and len(after.token_ids) == 4
    with capsys.disabled():
        print(f"\nSIGKILL of {victim}: of {len(long_requests)} answers, {by_node[victim]} were on it: {failed} still "
              f"streaming failed with UNAVAILABLE, {by_node[victim] - failed} it had already finished ended whole; "
              f"every answer on the other nodes ended whole; its adapters {sorted(victims_adapters)} are now "
              "served by other nodes")
    fleet.start_node(victim)
