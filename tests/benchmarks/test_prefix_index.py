"""The index lookup benchmark runs, and checks its own answer (the per-worker counts)."""

from benchmark_scripts import load_benchmark

main = load_benchmark("prefix_index").main


def test_prefix_index_benchmark_small(capsys):
    assert main(["--prompt-tokens", "512", "--indexed-blocks", "2000", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "32 blocks" in out and "lookup" in out and "hash the prompt" in out
