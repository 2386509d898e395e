"""The HTTP API of the real `inference-node serve` with two front-end processes sharing the
HTTP port (SO_REUSEPORT), as they share the gRPC port: both serve it, answers equal gRPC's,
and a drain answers new HTTP requests 503 while it finishes the running stream. The engine's
death ends a running event stream with an error event (and no [DONE]).
"""
from __future__ import annotations

import json
import os
import signal
import threading

import httpx

from harness import wait_for
from lora.v1 import inference_pb2 as pb
from lora_client.node_client import NodeClient
from lora_client.processes import free_port
from test_node_processes import ADAPTERS, NEW_TOKENS, PROMPTS, Node, _core_pid, adapter_dir  # noqa: F401 (fixture)


def _completion(url: str, body: dict) -> httpx.Response:
    with httpx.Client(timeout=60) as client:  # a connection of its own: the kernel picks the front end
        return client.post(f"{url}/completions", json=body)


def _tail(node: Node, lines: int = 60) -> str:
    return "\n".join(node.log_text().splitlines()[-lines:])


def test_two_front_ends_share_the_http_port_and_drain_it(tmp_path, tiny_llama_path, adapter_dir) -> None:
    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}/v1"
    node = Node(tmp_path, tiny_llama_path, "--adapter-dir", str(adapter_dir), "--max-loras", "2",
                "--max-lora-rank", "8", "--api-processes", "2", "--http-port", str(http_port),
                "--max-model-len", "1024", "--drain-seconds", "60")
    try:
        base = tiny_llama_path.name
        with NodeClient(node.target) as client:
            expected = {(a, i): client.generate(pb.GenerateRequest(adapter=a, prompt_token_ids=p, max_tokens=NEW_TOKENS,
                                                                   ignore_eos=True), timeout=60).text
                        for a in ("", *ADAPTERS) for i, p in enumerate(PROMPTS)}
        got: dict[tuple[str, int, int], str] = {}

        def run(adapter: str, i: int, k: int) -> None:
            reply = _completion(url, {"model": adapter or base, "prompt": PROMPTS[i], "max_tokens": NEW_TOKENS,
                                      "temperature": 0, "ignore_eos": True})
            got[(adapter, i, k)] = reply.json()["choices"][0]["text"] if reply.status_code == 200 else reply.text

        jobs = [(a, i, k) for k in range(2) for (a, i) in expected]
        threads = [threading.Thread(target=run, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == {(a, i, k): expected[(a, i)] for (a, i, k) in jobs}, _tail(node)
        http_lines = [line for line in node.log_text().splitlines() if "api=http" in line]
        assert len(http_lines) == len(jobs)
        served_by_second = sum("frontend-1" in line for line in http_lines)
        assert 0 < served_by_second < len(jobs), (f"{served_by_second} of {len(jobs)} connections went to the "
                                                  f"second front end; the node's log:\n{_tail(node)}")
        listed = {m["id"] for m in httpx.get(f"{url}/models", timeout=30).json()["data"]}
        assert listed == {base, *ADAPTERS}

        # A drain: the running stream finishes, a new request is refused with 503 and a retry hint.
        body = {"model": "qv8", "prompt": PROMPTS[0], "max_tokens": 600, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as running:
            events = running.iter_lines()
            assert next(e for e in events if e).startswith("data: ")
            node.child.proc.send_signal(signal.SIGTERM)
            refusals: list[httpx.Response] = []

            def refused() -> bool:
                reply = _completion(url, {"model": base, "prompt": PROMPTS[1], "max_tokens": 4})
                if reply.status_code == 503:
                    refusals.append(reply)
                return bool(refusals)

            wait_for(refused, 20, "a 503 from the draining node")
            assert refusals[0].headers["retry-after"] == "1"
            assert "draining" in refusals[0].json()["error"]["message"]
            rest = [e for e in events if e]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        assert node.child.proc.wait(60) == 0
        node.assert_no_children()
    finally:
        node.stop()


def test_the_engines_death_ends_an_event_stream_with_an_error_event(tmp_path, tiny_llama_path) -> None:
    http_port = free_port()
    node = Node(tmp_path, tiny_llama_path, "--http-port", str(http_port), "--max-model-len", "1024")
    try:
        body = {"model": tiny_llama_path.name, "prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60) as running:
            events = running.iter_lines()
            assert next(e for e in events if e).startswith("data: ")
            os.kill(_core_pid(node), signal.SIGKILL)
            rest = [e for e in events if e]
        assert "data: [DONE]" not in rest
        error = json.loads(rest[-1][len("data: "):])["error"]
        assert error["code"] == "unavailable" and "engine process" in error["message"], error
        assert node.child.proc.wait(30) != 0
        node.assert_no_children()
    finally:
        node.stop()
