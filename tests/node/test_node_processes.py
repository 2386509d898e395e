"""The real `inference-node serve`: an engine core process and front-end processes.

Everything a client sees must work across the process boundary: outputs equal to PEFT,
adapter RPCs, stats and metrics summed over front ends, cancellation freeing the engine's
state (and leaving a request-log line), a drain that refuses what has not started and
finishes what runs (what its deadline cuts says the count of tokens the client got), the engine's
death answered with UNAVAILABLE and a non-zero exit, and no process left behind.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness import make_peft_adapter, peft_greedy, wait_for
from lora.v1 import inference_pb2 as pb
from lora.v1 import inference_pb2_grpc as pb_grpc
from lora_client.node_client import NodeClient
from lora_client.processes import Child, free_port, wait_healthy

PROMPTS = [[11, 2345, 876, 40], [7, 8, 9, 10, 11, 12], [3000, 12, 4]]
ADAPTERS = {"qv8": (8, ["q_proj", "v_proj"]), "all4": (4, ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])}
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_llama_path) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        make_peft_adapter(tiny_llama_path, root / name, rank, 2.0 * rank, targets, seed=seed, scale=3.0)
    return root


@pytest.fixture(scope="module")
def expected(tiny_llama_path, adapter_dir) -> dict[str, list[list[int]]]:
    out = {"": peft_greedy(tiny_llama_path, None, PROMPTS, NEW_TOKENS)}
    for name in ADAPTERS:
        out[name] = peft_greedy(tiny_llama_path, adapter_dir / name, PROMPTS, NEW_TOKENS)
    return out


class Node:
    def __init__(self, tmp_path: Path, model: Path, *flags: str) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log = tmp_path / f"node-{self.port}.log"
        self.child = Child("inference-node", [
            sys.executable, "-m", "inference_node.cli", "serve", "--port", str(self.port), "--model", str(model),
            "--device", "cpu", "--num-kv-blocks", "128", "--cpu-threads", "1", *flags], self.log)
        wait_healthy(self.target, 120, self.child)
        self.pids = descendants(self.child.proc.pid)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def terminate(self) -> int:
        """SIGTERM to the launcher alone (as an orchestrator sends it); every child must go too."""
        self.child.proc.send_signal(signal.SIGTERM)
        code = self.child.proc.wait(90)
        self.assert_no_children()
        return code

    def assert_no_children(self) -> None:
        wait_for(lambda: not [p for p in self.pids if alive(p)], 10, f"the children {self.pids} to exit")

    def stop(self) -> int:
        return self.child.stop(60)


def descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc: each process's parent)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_two_front_ends_serve_outputs_rpcs_stats_and_summed_metrics(tmp_path, tiny_llama_path, adapter_dir,
                                                                     expected) -> None:
    metrics_port = free_port()
    node = Node(tmp_path, tiny_llama_path, "--adapter-dir", str(adapter_dir), "--max-loras", "2",
                "--max-lora-rank", "8", "--api-processes", "2", "--metrics-port", str(metrics_port))
    try:
        assert _core_pid(node) in node.pids
        results: dict[tuple[str, int], list[int]] = {}

        def run(adapter: str, i: int) -> None:
            # A connection each (gRPC shares one per target in a process unless told not to):
            # the kernel spreads connections over the front ends.
            channel = grpc.insecure_channel(node.target, options=[("grpc.use_local_subchannel_pool", 1)])
            with NodeClient(node.target, channel=channel) as client:
                out = client.generate(client.request(adapter=adapter, prompt_token_ids=PROMPTS[i],
                                                     max_tokens=NEW_TOKENS, ignore_eos=True), timeout=60)
                results[(adapter, i)] = list(out.token_ids)

        jobs = [(a, i) for _ in range(4) for a in ("", *ADAPTERS) for i in range(len(PROMPTS))]
        threads = [threading.Thread(target=run, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for (adapter, i), tokens in results.items():
            assert tokens == expected[adapter][i], (adapter, i)
        assert len(results) == len(set(jobs))
        text = node.log_text()
        assert "frontend-1" in text and text.count("finished=length") == len(jobs)
        assert any("frontend-1" in line and "finished=length" in line for line in text.splitlines()), \
            "the second front end served none of the connections"

        with NodeClient(node.target) as client:
            stub = client.stub
            listed = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
            assert set(listed) == set(ADAPTERS) and listed["qv8"].rank == 8 and listed["all4"].rank == 4
            assert stub.UnloadAdapter(pb.UnloadAdapterRequest(name="qv8")).deferred is False
            assert "qv8" not in {a.name for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
            loaded = stub.LoadAdapter(pb.LoadAdapterRequest(name="qv8", pin=True))
            assert loaded.tier == pb.ADAPTER_TIER_GPU
            stats = client.stats()
            assert stats.running_requests == 0 and stats.waiting_requests == 0
            assert stats.kv_blocks_free == stats.kv_blocks_total == 128
            assert stats.generated_tokens >= len(jobs) * NEW_TOKENS
            with pytest.raises(grpc.RpcError) as err:
                stub.LoadAdapter(pb.LoadAdapterRequest(name="no-such-adapter"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        streamed = sum(float(line.split()[-1]) for line in body.splitlines()
                       if line.startswith("lora_node_generated_tokens_total"))
        assert streamed == len(jobs) * NEW_TOKENS  # both front ends' counters, summed
        assert "lora_node_kv_blocks_total 128.0" in body  # the engine's gauges, through the core
    finally:
        code = node.terminate()
        node.stop()
    assert code == 0


def test_cancel_and_deadline_free_the_engine(tmp_path, tiny_llama_path) -> None:
    node = Node(tmp_path, tiny_llama_path, "--max-model-len", "1024")
    try:
        with NodeClient(node.target) as client:
            stream = client.stream(client.request(prompt_token_ids=PROMPTS[0], max_tokens=900, ignore_eos=True),
                                   timeout=60)
            assert next(stream).token_ids
            stream.cancel()
            with pytest.raises(grpc.RpcError) as err:
                client.generate(client.request(prompt_token_ids=PROMPTS[1], max_tokens=900, ignore_eos=True),
                                timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

            def idle() -> bool:
                s = client.stats()
                return s.running_requests == 0 and s.waiting_requests == 0 and s.kv_blocks_free == 128

            wait_for(idle, 10, "the engine to free the cancelled requests")
            assert client.stats().generated_tokens < 1500  # they stopped, not ran to the end
    finally:
        code = node.terminate()
        node.stop()
    assert code == 0
    ended = re.findall(r"request \d+ api=grpc adapter=- finished=(\w+) prompt=(\d+)", node.log_text())
    assert ended == [("cancelled", str(len(PROMPTS[0]))), ("cancelled", str(len(PROMPTS[1])))]  # in the request log too


def test_answers_cut_at_the_drain_deadline_say_what_the_client_got(tmp_path, tiny_llama_path) -> None:
    """The count in the error, the log's and the client's are the same number."""
    node = Node(tmp_path, tiny_llama_path, "--max-model-len", "1024", "--drain-seconds", "1")
    got: dict[int, tuple[grpc.StatusCode, str, int]] = {}
    streaming = threading.Semaphore(0)

    def run(i: int) -> None:
        tokens = 0
        with NodeClient(node.target) as client:
            try:
                for msg in client.stream(client.request(prompt_token_ids=PROMPTS[i], max_tokens=1000,
                                                        ignore_eos=True), timeout=120):
                    if msg.token_ids and not tokens:
                        streaming.release()
                    tokens += len(msg.token_ids)
            except grpc.RpcError as exc:
                got[i] = (exc.code(), exc.details(), tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for _ in threads:
        assert streaming.acquire(timeout=60)
    node.child.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert node.child.proc.wait(60) == 0
    node.stop()
    log = node.log_text()
    for code, details, tokens in got.values():
        assert code == grpc.StatusCode.UNAVAILABLE and 0 < tokens < 1000
        assert details == f"the node shut down after {tokens} tokens of this answer", (details, tokens)
        assert f"cut short at shutdown after {tokens} tokens" in log
        assert re.search(rf"finished=unavailable prompt=\d+ completion={tokens} ", log), log[-2000:]
    assert len(got) == 3


def test_engine_death_answers_unavailable_and_the_node_exits_non_zero(tmp_path, tiny_llama_path) -> None:
    node = Node(tmp_path, tiny_llama_path, "--api-processes", "2", "--max-model-len", "1024")
    core = _core_pid(node)
    codes: list[grpc.StatusCode] = []
    got_tokens = threading.Barrier(3)

    threads = [threading.Thread(target=_long_stream, args=(node.target, codes, lambda: got_tokens.wait(30)))
               for _ in range(2)]
    for t in threads:
        t.start()
    got_tokens.wait(30)
    killed_at = time.monotonic()
    os.kill(core, signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 2
    assert node.child.proc.wait(30) != 0
    assert time.monotonic() - killed_at < 20
    assert "engine process" in node.log_text() and "exited" in node.log_text()
    node.assert_no_children()
    node.stop()


def test_a_front_end_death_drains_the_node_and_exits_non_zero(tmp_path, tiny_llama_path) -> None:
    node = Node(tmp_path, tiny_llama_path, "--api-processes", "2", "--drain-seconds", "30")
    try:
        core = _core_pid(node)
        spawned = [p for p in node.pids if p != core and "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(spawned) == 1, (spawned, node.pids)
        killed_at = time.monotonic()
        os.kill(spawned[0], signal.SIGKILL)
        assert node.child.proc.wait(30) == 1
        assert time.monotonic() - killed_at < 20
        assert "frontend-1 exited with code -9 while serving" in node.log_text(), node.log_text()
        node.assert_no_children()
    finally:
        node.stop()


def test_a_tensor_parallel_rank_that_dies_ends_the_node_with_exit_1_and_leaves_no_rank(tmp_path,
                                                                                      tiny_llama_path) -> None:
    """TP 2 over gloo: SIGKILL to rank 1 while a stream runs. Rank 0 cannot run a step without
    it, so the node ends: the stream gets UNAVAILABLE, the log names the dead rank in a line
    (no traceback), the launcher exits 1, and no process of the node is left behind."""
    node = Node(tmp_path, tiny_llama_path, "--tensor-parallel-size", "2", "--max-model-len", "1024")
    try:
        core = _core_pid(node)
        ranks = [p for p in descendants(core) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(ranks) == 1, (ranks, node.pids)
        codes: list[grpc.StatusCode] = []
        streaming = threading.Event()

        thread = threading.Thread(target=_long_stream, args=(node.target, codes, streaming.set))
        thread.start()
        assert streaming.wait(60)
        os.kill(ranks[0], signal.SIGKILL)
        thread.join(30)
        assert codes == [grpc.StatusCode.UNAVAILABLE]
        assert node.child.proc.wait(30) == 1
        # The rank watcher's line, and the engine's where a step's collective broke first: each
        # names the rank and its exit, without a traceback.
        died = [line for line in node.log_text().splitlines() if "tensor-parallel rank tp-rank-1" in line]
        assert died and all("(exit -9) died" in line for line in died), node.log_text()[-3000:]
        assert "Traceback" not in node.log_text(), node.log_text()[-3000:]
        node.assert_no_children()
    finally:
        node.stop()


def _long_stream(target: str, codes: list[grpc.StatusCode], first_token: Callable[[], object]) -> None:
    """A stream of 1000 tokens: calls first_token() once the first arrives, then reads to its
    end and appends how it ended (OK, or the gRPC code it failed with)."""
    with NodeClient(target) as client:
        stream = client.stream(client.request(prompt_token_ids=PROMPTS[0], max_tokens=1000, ignore_eos=True),
                               timeout=60)
        next(stream)
        first_token()
        try:
            for _ in stream:
                pass
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())


def _core_pid(node: Node) -> int:
    """The engine core logs its pid when it starts."""
    match = re.search(r"engine core started \(pid (\d+)\)", node.log_text())
    assert match, node.log_text()
    assert int(match.group(1)) in node.pids
    return int(match.group(1))


def test_drain_refuses_what_has_not_started_and_finishes_what_runs(tmp_path, tiny_llama_path) -> None:
    max_tokens = 300
    node = Node(tmp_path, tiny_llama_path, "--max-num-seqs", "2", "--drain-seconds", "60",
                "--max-model-len", "1024")
    outcomes: dict[int, tuple[str, int]] = {}
    first_tokens = threading.Semaphore(0)

    def run(i: int) -> None:
        tokens = 0
        with NodeClient(node.target) as client:
            try:
                for msg in client.stream(client.request(prompt_token_ids=PROMPTS[i % 3], max_tokens=max_tokens,
                                                        ignore_eos=True), timeout=120):
                    if msg.token_ids and not tokens:
                        first_tokens.release()
                    tokens += len(msg.token_ids)
                    if msg.finish_reason:
                        outcomes[i] = (msg.finish_reason, tokens)
            except grpc.RpcError as exc:
                outcomes[i] = (exc.code().name, tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert first_tokens.acquire(timeout=60) and first_tokens.acquire(timeout=60)  # two are running
    node.child.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: health(node.target) == health_pb2.HealthCheckResponse.NOT_SERVING, 5,
             "health to say NOT_SERVING")
    for t in threads:
        t.join(120)
    assert node.child.proc.wait(60) == 0
    node.assert_no_children()
    node.stop()
    finished = [o for o in outcomes.values() if o == ("length", max_tokens)]
    refused = [o for o in outcomes.values() if o == ("UNAVAILABLE", 0)]
    assert len(finished) + len(refused) == 8, outcomes  # nothing cut part-way
    assert len(finished) >= 2 and refused, outcomes
    assert "cut short" not in node.log_text()


def test_ctrl_c_stops_every_process(tmp_path, tiny_llama_path) -> None:
    node = Node(tmp_path, tiny_llama_path, "--api-processes", "2")
    os.killpg(node.child.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert node.child.proc.wait(60) == 0
    node.assert_no_children()
    node.stop()


def test_a_thousand_open_streams_complete_and_memory_returns(tmp_path, tiny_llama_path) -> None:
    node = Node(tmp_path, tiny_llama_path, "--max-num-seqs", "64", "--num-kv-blocks", "256")
    pids = [node.child.proc.pid, *node.pids]
    try:
        def rss_mb() -> float:
            total = 0
            for pid in pids:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            return total / 1024

        async def burst() -> list[str]:
            async with grpc.aio.insecure_channel(node.target) as channel:
                stub = pb_grpc.InferenceNodeStub(channel)

                async def one(i: int) -> str:
                    request = pb.GenerateRequest(prompt_token_ids=PROMPTS[i % 3] + [i % 500 + 1], max_tokens=8,
                                                 ignore_eos=True)
                    tokens = 0
                    try:
                        async for msg in stub.Generate(request, timeout=300):
                            tokens += len(msg.token_ids)
                            if msg.finish_reason:
                                return "ok" if tokens == 8 else f"short {tokens}"
                    except grpc.aio.AioRpcError as exc:
                        return exc.code().name
                    return "no finish"

                return await asyncio.gather(*(one(i) for i in range(1000)))

        asyncio.run(burst())  # warm: allocator pools, protobuf classes, the tokenizer
        before = rss_mb()
        outcomes = asyncio.run(burst())
        assert outcomes.count("ok") == 1000, {o: outcomes.count(o) for o in set(outcomes)}
        assert health(node.target) == health_pb2.HealthCheckResponse.SERVING
        with NodeClient(node.target) as client:
            stats = client.stats()
            assert stats.running_requests == 0 and stats.kv_blocks_free == stats.kv_blocks_total
        after = rss_mb()
        assert after < before * 1.10 + 20, (before, after)
    finally:
        code = node.terminate()
        node.stop()
    assert code == 0


def test_an_idle_node_answers_not_serving_for_the_drain_minimum_before_it_closes(tmp_path, tiny_llama_path) -> None:
    """Nothing runs, so the drain itself is instant; the port stays open, saying NOT_SERVING
    and refusing new requests with a retryable UNAVAILABLE, until --drain-min-seconds have
    passed, so a proxy's health checks take the node out of the pool before its connections
    close."""
    node = Node(tmp_path, tiny_llama_path, "--drain-min-seconds", "3")
    sent = time.monotonic()
    node.child.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: health(node.target) == health_pb2.HealthCheckResponse.NOT_SERVING, 5,
             "health to say NOT_SERVING")
    with NodeClient(node.target) as client, pytest.raises(grpc.RpcError) as refused:
        client.generate(client.request(prompt_token_ids=[5, 6, 7], max_tokens=2), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - sent < 3.0  # all of that inside the window
    assert node.child.proc.wait(60) == 0
    assert time.monotonic() - sent >= 3.0
    node.assert_no_children()
    node.stop()
