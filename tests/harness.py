"""Shared test machinery: in-process nodes, tiny random checkpoints, the HF oracle."""
from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import torch

from family_checkpoints import make_family_adapter as make_peft_adapter  # noqa: F401 (the suite's name)
from inference_node.config import NodeConfig
from inference_node.core.engine_core import EngineCore
from inference_node.frontend.engine_client import EngineClient
from inference_node.llm import LLM
from inference_node.server import NodeServer


class InProcessNode:
    """A real node on a free loopback port, its engine core on one thread and its front end's
    event loop on another: the same ZeroMQ path as the processes of `inference-node serve`,
    with the engine in reach of the test (tests/node/test_node_processes.py runs the real
    processes)."""

    def __init__(self, config: NodeConfig, start_timeout: float | None = None,
                 drain_seconds: float = 2.0, http: bool = False) -> None:
        """http: also serve the OpenAI-compatible HTTP API on a free port (`http_url`).
        start_timeout: None waits 60 s on CPU and 600 s on a GPU, where the core's warm-up
        compiles every kernel variant it may launch (minutes on a machine with no Triton cache)."""
        if start_timeout is None:
            start_timeout = 60.0 if config.model.device == "cpu" else 600.0
        self.llm = LLM(config)
        self.node = self.llm.node
        self.engine = self.node.engine
        self.ipc_dir = tempfile.mkdtemp(prefix="lora-test-node-")
        self.core = EngineCore(self.node, f"ipc://{self.ipc_dir}/core")
        self.core_error: BaseException | None = None

        def run_core() -> None:
            try:
                self.core.run()
            except BaseException as exc:  # the warm-up or a capture failed: start() raises it
                self.core_error = exc

        self.core_thread = threading.Thread(target=run_core, name="engine-core", daemon=True)
        self.core_thread.start()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = EngineClient(self.core.address, f"ipc://{self.ipc_dir}/frontend-0", "frontend-0")
        self.server = NodeServer(config, self.client, "127.0.0.1", 0, drain_seconds=drain_seconds,
                                 http_port=0 if http else None)

        async def start() -> None:
            # As the launcher does with the core's process: a core that dies while it starts
            # fails the start at once, with its error, not after start_timeout.
            connect = asyncio.ensure_future(self.client.connect(start_timeout))
            while not connect.done():
                await asyncio.wait({connect}, timeout=0.25)
                if not connect.done() and not self.core_thread.is_alive():
                    connect.cancel()
                    raise RuntimeError(f"the engine core stopped while starting: "
                                       f"{self.core_error!r}") from self.core_error
            connect.result()
            await self.server.start()

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(start_timeout)
        self.address = self.server.address
        self.http_url = f"{self.server.http.url}/v1" if http else ""  # https:// with the node's TLS

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
        self.core.stop()
        self.core_thread.join(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def check_idle(self) -> dict[str, int]:
        """Asserts that no request, KV block or reference is left; returns the counters."""
        snap = self.engine.call(self.engine.snapshot).result(10)
        self.engine.call(self.engine.check_consistency).result(10)
        assert snap["live_requests"] == 0, snap
        assert snap["kv_blocks_free"] == snap["kv_blocks_total"], snap
        return snap


def wait_for(predicate, timeout: float, what: str) -> None:
    """Polls `predicate` until it is true; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def generate_all(node: "InProcessNode", jobs: Sequence[tuple[str, Sequence[int], int]],
                 timeout: float = 300) -> list[list[int]]:
    """Each (adapter, prompt, max tokens) job's greedy tokens from the node, all in flight at
    once (so steps mix them)."""
    from lora_client.node_client import NodeClient

    def run(job):
        name, prompt, max_new = job
        with NodeClient(node.address) as client:
            return client.generate(client.request(adapter=name, prompt_token_ids=list(prompt),
                                                  max_tokens=max_new, ignore_eos=True),
                                   timeout=timeout).token_ids

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def generate_together(llm: LLM, jobs: Sequence[tuple[str, Sequence[int]]], max_tokens: int) -> list[list[int]]:
    """Each (adapter, prompt) job's greedy tokens from an in-process node, every job submitted
    before the first step (so which rows share a step does not depend on timing), the loop run
    here until all have finished."""
    from inference_node.engine.request import Request, SamplingParams

    llm.prepare()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens: list[list[int]] = [[] for _ in jobs]
    done = [False] * len(jobs)

    def emit(i: int, event) -> None:
        assert event.error is None, event.error
        tokens[i].extend(event.token_ids)
        done[i] = event.finish_reason is not None

    for i, (adapter, prompt) in enumerate(jobs):
        llm.engine.submit(Request(list(prompt), params, lambda event, i=i: emit(i, event), adapter=adapter))
    while not all(done):
        llm.engine.run_once()
    return tokens


def make_tiny_llama(out: Path, tokenizer_from: Path, seed: int = 0, **overrides: object) -> Path:
    """A small random Llama checkpoint (HF format) with a real tokenizer, for parity tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    params = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  initializer_range=0.3, bos_token_id=1, eos_token_id=2)
    params.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**params)).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def hf_greedy(model, prompt_ids: Sequence[int], max_new_tokens: int, eos: bool = True) -> list[int]:
    """Reference greedy continuation with transformers (and PEFT, if model is wrapped)."""
    with torch.no_grad():
        kwargs = {} if eos else {"eos_token_id": None}
        out = model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             pad_token_id=0, **kwargs)
    return out[0][len(prompt_ids):].tolist()


def peft_greedy(base_path: Path, adapter_path: Path | None, prompts: Sequence[Sequence[int]],
                max_new_tokens: int, prepare: Callable[[torch.nn.Module], object] | None = None
                ) -> list[list[int]]:
    """Hugging Face PEFT running one adapter alone (or the base model): the oracle. prepare:
    called on the loaded model (hooks that make it compute as the node is set to)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, adapter_path).eval()
    if prepare is not None:
        prepare(model)
    return [hf_greedy(model, p, max_new_tokens, eos=False) for p in prompts]
