"""bench.frontend_costs runs and compares like with like: both detokenizers give the same text,
and the wire row runs the node's own encode, decode and delivery."""
from __future__ import annotations

from bench import frontend_costs


def test_both_detokenizers_stream_the_same_text_and_the_table_prints(capsys):
    from inference_node.frontend.detokenizer import TextStream
    from inference_node.model.embedded import default_checkpoint
    from inference_node.tokenizer import TextCodec

    codec = TextCodec(default_checkpoint())
    ids = codec.encode(frontend_costs.TEXT, add_special_tokens=False)
    texts = []
    for step in (frontend_costs.window_decode_stream(codec.decode), codec.step_decoder()):
        stream = TextStream(step, [])
        for token in ids:
            stream.push(token)
        texts.append(stream.take(final=True))
    assert texts[0] == texts[1] == codec.decode(ids)
    rows = frontend_costs.main(["--repeats", "2", "--tokens", "32", "--streams", "4"])
    assert [name for name, *_ in rows] == ["detokenize", "metrics", "protobuf reply", "core wire"]
    assert all(before > 0 for _, before, _ in rows) and rows[-1][2] > 0
    out = capsys.readouterr().out
    assert "| detokenize |" in out and "| core wire |" in out
