"""The demo: a burst of concurrent prompts to a node, each answer printed with its timing.

`python -m lora_client.demo --target HOST:PORT` talks to a running node; without
--target it starts a node on the embedded model first (and stops it afterwards).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .node_client import NodeClient
from .processes import Child, console_script, free_port, wait_healthy

DEFAULT_PROMPTS = [
    ("", "What is the capital of France?"),
    ("", "Give me three tips for staying focused while studying."),
    ("", "Write a two-line poem about autumn."),
    ("", "What is 12 times 7?"),
]


@dataclass
class Answer:
    adapter: str
    prompt: str
    text: str
    ttft: float
    total: float
    tokens: int
    finish_reason: str


def ask(client: NodeClient, adapter: str, prompt: str, max_tokens: int) -> Answer:
    start = time.monotonic()
    first = None
    text, tokens, reason = "", 0, ""
    for msg in client.stream(client.request(prompt, adapter=adapter, max_tokens=max_tokens), timeout=300):
        if first is None and msg.token_ids:
            first = time.monotonic() - start
        text += msg.text
        tokens += len(msg.token_ids)
        reason = msg.finish_reason or reason
    return Answer(adapter, prompt, text.strip(), first or 0.0, time.monotonic() - start, tokens, reason)


def run_burst(target: str, prompts: list[tuple[str, str]], max_tokens: int) -> list[Answer]:
    with NodeClient(target) as client, ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(ask, client, adapter, prompt, max_tokens) for adapter, prompt in prompts]
        return [f.result() for f in futures]


def print_answers(answers: list[Answer], wall: float) -> None:
    for a in answers:
        print(f"\n[{a.adapter or 'base model'}] {a.prompt}")
        print(f"  -> {a.text}")
        print(f"     ({a.tokens} tokens, first token {a.ttft * 1000:.0f} ms, total {a.total:.2f} s, "
              f"{a.finish_reason})")
    total_tokens = sum(a.tokens for a in answers)
    print(f"\n{len(answers)} concurrent requests, {total_tokens} tokens in {wall:.2f} s "
          f"({total_tokens / wall:.1f} tokens/s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", help="a running node (HOST:PORT); default: start one")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--startup-timeout", type=float, default=600)
    args = ap.parse_args(argv)
    node = None
    target = args.target
    if target is None:
        port = free_port()
        log = Path(tempfile.gettempdir()) / f"inference-node-{port}.log"
        print(f"starting an inference node on 127.0.0.1:{port} (log: {log}) ...", flush=True)
        node = Child("inference-node", console_script("inference-node") +
                     ["serve", "--host", "127.0.0.1", "--port", str(port)], log)
        target = f"127.0.0.1:{port}"
    try:
        if node is not None:
            wait_healthy(target, args.startup_timeout, node)
        started = time.monotonic()
        answers = run_burst(target, DEFAULT_PROMPTS, args.max_tokens)
        print_answers(answers, time.monotonic() - started)
    finally:
        if node is not None:
            node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
