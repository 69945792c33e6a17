"""`pagedserve bench latency` against a fake `llama-bench` (llama.cpp is not installed here): the
command lines it runs, `--depth` on both sides, and the table it prints."""

from __future__ import annotations

import stat

from pagedserve.bench.latency import llama_bench_commands
from pagedserve.entrypoints.cli import main


def test_llama_bench_commands_decode_at_a_depth_only_when_asked():
    plain = llama_bench_commands("/l/llama-bench", "m.gguf", 2, 128, 64, 3)
    assert plain["tg"] == ["/l/llama-bench", "-m", "m.gguf", "-p", "0", "-n", "64", "-t", "2", "-r", "3", "-o", "json"]
    assert plain["pp"] == ["/l/llama-bench", "-m", "m.gguf", "-p", "128", "-n", "0", "-t", "2", "-r", "3", "-o", "json"]
    deep = llama_bench_commands("/l/llama-bench", "m.gguf", 2, 128, 64, 3, depth=2048)
    assert deep["tg"] == ["/l/llama-bench", "-m", "m.gguf", "-p", "0", "-n", "64", "-d", "2048", "-t", "2", "-r", "3",
                          "-o", "json"]
    assert deep["pp"] == plain["pp"]  # the prompt's time is the same question at any depth


def test_bench_latency_decodes_after_a_prompt_of_the_depth(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "llama"
    folder.mkdir()
    calls = tmp_path / "calls.txt"
    binary = folder / "llama-bench"
    # decode (-n 8) at 50 tok/s, prompt processing (-n 0) at 400 tok/s
    binary.write_text(f'#!/bin/sh\necho "$@" >> {calls}\ncase " $* " in *" -n 0 "*) ts=400 ;; *) ts=50 ;; esac\n'
                      'echo "[{\\"avg_ts\\": $ts}]"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    model = str(tiny_checkpoint("llama-gqa"))
    assert main(["bench", "latency", "--model", model, "--threads", "1", "--tokens", "8", "--prompt", "16",
                 "--depth", "40", "--repeat", "1", "--llama-cpp", str(folder), "--gguf", "smollm2-Q4_K_M.gguf"]) == 0
    lines = calls.read_text().splitlines()
    assert lines == ["-m smollm2-Q4_K_M.gguf -p 0 -n 8 -d 40 -t 1 -r 1 -o json",
                     "-m smollm2-Q4_K_M.gguf -p 16 -n 0 -t 1 -r 1 -o json"]
    out = capsys.readouterr().out.splitlines()
    assert "decode: 8 tokens after a 40-token prompt; TTFT: 16-token prompt" in out[0]
    rows = {line[:36].strip(): line[36:].split() for line in out[2:-1]}
    assert list(rows) == ["llama.cpp smollm2-Q4_K_M", "pagedserve", "pagedserve --enforce-eager"]
    # llama.cpp's row: 50 tok/s (20 ms a token), itself 1.00x; TTFT 16 tokens at 400 tok/s = 40 ms
    assert rows["llama.cpp smollm2-Q4_K_M"][:3] == ["50.0", "20.0", "1.00"] and rows["llama.cpp smollm2-Q4_K_M"][4] == "40.0"
