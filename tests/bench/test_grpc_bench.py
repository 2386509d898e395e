"""bench.grpc_bench on CPU: the real `inference-node serve` as a subprocess driven by a gRPC
client process, then the same requests through the engine in-process, rows side by side
(the numbers are meaningless on CPU; the path is the GPU benchmark's)."""
from __future__ import annotations

from bench import grpc_bench


def test_grpc_bench_drives_the_served_node_and_the_engine_on_the_same_requests(tmp_path, capsys):
    rows = grpc_bench.main(["--device", "cpu", "--paths", "grpc,engine", "--rows", "base,c2", "--concurrency", "2",
                            "--requests-per-stream", "1", "--clients", "1", "--output-len", "6",
                            "--workdir", str(tmp_path)])
    assert sorted((r["row"], r["path"]) for r in rows) == [("base", "engine"), ("base", "grpc"),
                                                           ("c2", "engine"), ("c2", "grpc")]
    for r in rows:
        assert r["requests"] == 2 and r["errors"] == 0 and r["tok_s"] > 0
    out = capsys.readouterr().out
    assert "gRPC/engine tok/s" in out
