"""Sampling: greedy, seeded determinism, top-k and top-p masks; stop strings in the text."""
from __future__ import annotations

import torch

from inference_node.frontend.detokenizer import TextStream
from inference_node.engine.request import Request, SamplingParams
from inference_node.runner.sampler import filter_logits, sample_on_device


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """The engine's sampling, read back on the host."""
    return sample_on_device(logits, requests).tolist()


def request(**params: object) -> Request:
    return Request([1], SamplingParams(max_tokens=4, **params), emit=lambda e: None)


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sample(logits, [request(), request()]) == [1, 0]


def test_same_seed_same_samples_different_seed_differs() -> None:
    logits = torch.zeros(1, 1000)
    runs = {}
    for seed in (1, 1, 2):
        r = request(temperature=1.0, seed=seed)
        runs.setdefault(seed, []).append([sample(logits, [r])[0] for _ in range(20)])
    assert runs[1][0] == runs[1][1]
    assert runs[1][0] != runs[2][0]


def test_top_k_keeps_only_the_k_largest() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = filter_logits(logits, SamplingParams(max_tokens=1, temperature=1.0, top_k=2))
    assert torch.isfinite(kept).nonzero().flatten().tolist() == [1, 3]


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_logits(probs.log(), SamplingParams(max_tokens=1, temperature=1.0, top_p=0.75))
    assert torch.isfinite(kept).nonzero().flatten().tolist() == [0, 1]


def test_samples_never_leave_the_top_k() -> None:
    logits = torch.randn(1, 50)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    r = request(temperature=2.0, top_k=3, seed=0)
    assert {sample(logits, [r])[0] for _ in range(200)} <= allowed


def fake_step(i):  # token i completes the i-th character of the text below
    return "Hello world. STOP here"[i]


def test_stop_string_truncates_and_is_never_streamed() -> None:
    stream = TextStream(fake_step, ["STOP"])
    shown = ""
    for i in range(len("Hello world. STOP here")):
        stream.push(i)
        shown += stream.take(final=False)
        if stream.stopped:
            break
    shown += stream.take(final=True)
    assert stream.stopped
    assert shown == "Hello world. "
    assert "S" not in shown


def test_text_streams_whole_when_no_stop_matches() -> None:
    stream = TextStream(fake_step, ["XYZ"])
    shown = ""
    for i in range(12):
        stream.push(i)
        shown += stream.take(final=False)
    shown += stream.take(final=True)
    assert shown == "Hello world."


def test_streamed_text_joins_into_the_whole_decode_across_multibyte_characters(tokenizer_dir) -> None:
    """Byte-level tokens split accented letters, CJK and emoji between them: the streamed
    pieces must never show half a character and must join into decode(all tokens)."""
    from inference_node.tokenizer import TextCodec

    codec = TextCodec(tokenizer_dir)
    ids = codec.encode("Ünïcödé → 日本語のテキスト 🙂🚀 naïve café, done.", add_special_tokens=False)
    stream = TextStream(codec.step_decoder(), [])
    pieces = []
    for token in ids:
        stream.push(token)
        pieces.append(stream.take(final=False))
    pieces.append(stream.take(final=True))
    assert "".join(pieces) == codec.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 10  # it streamed, not all at the end


def test_two_pass_argmax_takes_the_first_maximum_like_torch() -> None:
    """Small integer logits tie often: the two-pass argmax must pick torch.argmax's index (the
    first maximum), whichever chunk it falls in, for chunkable and odd vocabularies."""
    from kernels.sampling import first_argmax_ref

    gen = torch.Generator().manual_seed(0)
    for vocab, chunks in ((1024, 64), (96, 8), (97, 8), (49152, 64)):
        logits = torch.randint(0, 4, (33, vocab), generator=gen).to(torch.bfloat16)
        logits[5] = 0
        logits[6, -1] = 9
        got = first_argmax_ref(logits, chunks, two_pass=True)
        assert torch.equal(got, logits.argmax(dim=-1)), vocab
