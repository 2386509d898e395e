"""A small typed client of the InferenceNode gRPC API, for services and scripts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc

from lora_common.auth import bearer_metadata
from lora_common.tls import ClientTLS, open_channel
from lora.v1 import inference_pb2, inference_pb2_grpc


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    adapter_version: str = ""


class NodeClient:
    def __init__(self, target: str, channel: grpc.Channel | None = None,
                 metadata: Sequence[tuple[str, str]] = (), token: str | None = None,
                 tls: ClientTLS | None = None) -> None:
        """token: sent as `authorization: Bearer <token>` (nodes started with a token need it);
        tls: for nodes serving TLS (a CA to trust, and a client certificate for mutual TLS)."""
        self.channel = channel or open_channel(target, tls)
        self.stub = inference_pb2_grpc.InferenceNodeStub(self.channel)
        self.metadata = list(metadata) + bearer_metadata(token)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def request(prompt: str = "", *, adapter: str = "", chat: bool = True, max_tokens: int = 0,
                temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0,
                seed: int | None = None, stop: Sequence[str] = (),
                prompt_token_ids: Sequence[int] = (), system: str | None = None,
                ignore_eos: bool = False) -> inference_pb2.GenerateRequest:
        """Builds a GenerateRequest; with chat=True the prompt is one user message."""
        req = inference_pb2.GenerateRequest(
            adapter=adapter, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, stop=list(stop), prompt_token_ids=list(prompt_token_ids),
            ignore_eos=ignore_eos)
        if seed is not None:
            req.seed = seed
        if not prompt_token_ids:
            if chat:
                if system is not None:
                    req.messages.add(role="system", content=system)
                req.messages.add(role="user", content=prompt)
            else:
                req.prompt = prompt
        return req

    def stream(self, request: inference_pb2.GenerateRequest,
               timeout: float | None = None) -> Iterator[inference_pb2.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def generate(self, request: inference_pb2.GenerateRequest, timeout: float | None = None) -> Completion:
        result = Completion()
        for msg in self.stream(request, timeout):
            result.text += msg.text
            result.token_ids += msg.token_ids
            if msg.finish_reason:
                result.finish_reason = msg.finish_reason
                result.prompt_tokens = msg.prompt_tokens
                result.completion_tokens = msg.completion_tokens
                result.cached_prompt_tokens = msg.cached_prompt_tokens
                result.adapter_version = msg.adapter_version
        return result

    def stats(self) -> inference_pb2.GetStatsResponse:
        return self.stub.GetStats(inference_pb2.GetStatsRequest(), metadata=self.metadata)
