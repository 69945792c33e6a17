"""`pagedserve bench offline` end to end on a tiny model, peers included."""

from __future__ import annotations

import json

from pagedserve.entrypoints.cli import main

from tiny_models import build_checkpoint


def test_bench_offline_runs_pagedserve_and_both_peers(tiny_checkpoint, capsys):
    model = str(tiny_checkpoint("llama-gqa"))
    assert main(["bench", "offline", "--model", model, "--workload", "fixed", "--compare", "transformers", "--json",
                 "--kv-cache-memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])
    assert [r["system"] for r in rows] == ["pagedserve", "generate", "generate_batch"]
    for r in rows:  # each system produced exactly 64 x 64 tokens (asserted inside) in r["seconds"]
        assert abs(r["output_tok_s"] * r["seconds"] - 64 * 64) < 1e-6
        assert abs(r["total_tok_s"] * r["seconds"] - 64 * (128 + 64)) < 1e-6
    assert "pagedserve x" in out


def test_bench_offline_shared_prefix_reports_cache_on_and_off(tmp_path, capsys):
    model = str(build_checkpoint("llama", tmp_path / "long", max_position_embeddings=1024))
    assert main(["bench", "offline", "--model", model, "--workload", "shared-prefix", "--json", "--kv-cache-memory", "64MiB"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    on, off = rows
    assert off["system"] == "pagedserve (no prefix cache)"
    # with the cache on, 63 requests take the 32 blocks of the 512-token prefix from it
    assert on["cached_prompt_tokens"] == 63 * 512 and off["cached_prompt_tokens"] == 0


def test_concurrency_sweep_with_plot(tiny_checkpoint, tmp_path, capsys):
    model = str(tiny_checkpoint("llama-gqa"))
    plot = tmp_path / "offline.png"
    assert main(["bench", "offline", "--model", model, "--workload", "fixed", "--max-num-seqs", "8,64",
                 "--kv-cache-memory", "64MiB", "--json", "--plot", str(plot)]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["system"] for r in rows] == ["pagedserve max_num_seqs=8", "pagedserve max_num_seqs=64"]
    # at most 8 sequences a step: 64 requests × 64 output tokens take at least 64·64 / 8 = 512
    # steps; all 64 at once take fewer (their prompts in a few steps, then 63 decodes)
    assert rows[0]["model_steps"] >= 512 > rows[1]["model_steps"] >= 64
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
