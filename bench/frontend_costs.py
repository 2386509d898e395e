"""The front end's host cost per streamed token, piece by piece, on this machine's CPU.

    python -m bench.frontend_costs

At high concurrency a front-end process carries tens of thousands of token messages a second
(docs/PERFORMANCE.md: two front ends carried about 49k/s at 256 streams on a 1B model), so
each microsecond of Python per message is capacity. This times, per token of a 128-token
answer, what `frontend.generation` does besides the gRPC write: detokenizing (the node's
incremental decoder against decoding a window of tokens twice per token, the usual Python
method), the per-adapter metrics (series looked up once against `labels()` per message), and
building the protobuf reply; and the core wire's share, a step of --streams requests each
given one token: the core encodes the step's batch for the front end, which decodes it and
feeds the requests' streams (the node's typed Structs, core/protocol.py, against a
MessagePack map per request). Prints one table, µs per token, medians of repeats.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Sequence

TEXT = ("The node streams each answer token by token; accented letters (Ünïcödé, naïve café), "
        "CJK (日本語のテキスト) and emoji (🙂🚀) split across byte-level tokens. ") * 4


def window_decode_stream(decode: Callable[[Sequence[int]], str]) -> Callable[[int], str | None]:
    """The prefix/read-offset method in Python: two decodes of a short window per token."""
    ids: list[int] = []
    offsets = [0, 0]

    def step(token: int) -> str | None:
        ids.append(token)
        prefix = decode(ids[offsets[0]:offsets[1]])
        full = decode(ids[offsets[0]:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            offsets[0], offsets[1] = offsets[1], len(ids)
            return full[len(prefix):]
        return None
    return step


def per_token_us(run: Callable[[], None], tokens: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) / tokens * 1e6)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> list[tuple[str, float, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=64, help="requests given a token in each step (the wire row)")
    args = p.parse_args(argv)

    from lora.v1 import inference_pb2

    from inference_node.frontend.detokenizer import TextStream
    from inference_node.metrics import NodeMetrics
    from inference_node.model.embedded import default_checkpoint
    from inference_node.tokenizer import TextCodec

    codec = TextCodec(default_checkpoint())
    ids = codec.encode(TEXT, add_special_tokens=False)[:args.tokens]
    n = len(ids)

    def detokenize(make_step) -> Callable[[], None]:
        def run() -> None:
            text = TextStream(make_step(), [])
            for token in ids:
                text.push(token)
                text.take(final=False)
        return run

    metrics = NodeMetrics()
    metrics.first_token("adapter-a", 0.01, 1)

    def metrics_cached() -> None:
        for _ in range(n):
            metrics.tokens_streamed("adapter-a", 1, 0.002)

    def metrics_lookup() -> None:
        label = metrics.labels.label
        for _ in range(n):
            name = label("adapter-a")
            metrics.token_latency.labels(name).observe(0.002)
            metrics.generated_tokens.labels(name).inc(1)

    def replies() -> None:
        for token in ids:
            inference_pb2.GenerateResponse(token_ids=[token], text="x")

    import msgspec

    from inference_node.core import protocol as wire
    from inference_node.frontend.engine_client import EngineClient, RequestStream

    client = EngineClient("inproc://bench-core", "inproc://bench-frontend", "bench")
    encode, decode = wire.encoder().encode, wire.frontend_decoder().decode

    def typed_wire() -> None:
        client.streams = {i: RequestStream(i) for i in range(args.streams)}
        for token in ids:
            data = encode(wire.Batch([wire.Output(i, [token]) for i in range(args.streams)], []))
            message = decode(data)
            client.deliver(message.outputs, message.replies)

    def map_wire() -> None:
        streams = {i: RequestStream(i) for i in range(args.streams)}
        for token in ids:
            data = msgspec.msgpack.encode({"kind": "batch", "replies": [], "outputs": [
                {"request_id": i, "token_ids": [token], "finish_reason": None, "error": None,
                 "cached_prompt_tokens": 0, "adapter_version": ""} for i in range(args.streams)]})
            for out in msgspec.msgpack.decode(data)["outputs"]:
                streams[out["request_id"]].feed(out["token_ids"], out["finish_reason"], None,
                                                out["cached_prompt_tokens"], out["adapter_version"])

    rows = [
        ("detokenize", per_token_us(detokenize(lambda: window_decode_stream(codec.decode)), n, args.repeats),
         per_token_us(detokenize(codec.step_decoder), n, args.repeats)),
        ("metrics", per_token_us(metrics_lookup, n, args.repeats), per_token_us(metrics_cached, n, args.repeats)),
        ("protobuf reply", per_token_us(replies, n, args.repeats), float("nan")),
        ("core wire", per_token_us(map_wire, n * args.streams, args.repeats),
         per_token_us(typed_wire, n * args.streams, args.repeats)),
    ]
    client.close()
    print(f"us per token of a {n}-token answer, median of {args.repeats}; the wire: {args.streams} streams a step")
    print("usual method: two decodes a token / labels() a message / a MessagePack map per request; "
          "the node's: incremental decoder / series kept / typed Structs")
    print("| piece | usual method | the node's | ratio |")
    print("| --- | --- | --- | --- |")
    for name, before, after in rows:
        print(f"| {name} | {before:.2f} | {after:.2f} | {before / after:.1f}× |" if after == after
              else f"| {name} | {before:.2f} | | |")
    return rows


if __name__ == "__main__":
    main()
