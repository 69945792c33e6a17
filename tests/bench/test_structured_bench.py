"""`bench offline --workload structured` (bench/structured.py) on a tiny random checkpoint:
the shape of its result, not its figures."""

from __future__ import annotations

from pagedserve import LLM
from pagedserve.bench.structured import extraction_prompt, run_structured
from pagedserve.bench.structured_schemas import SCHEMAS

from tiny_models import build_checkpoint


def test_structured_workload_reports_every_figure(tmp_path):
    model = build_checkpoint("llama", tmp_path / "long", max_position_embeddings=2048)  # the prompts are long
    llm = LLM(str(model), attention_backend="torch", kv_cache_memory=1 << 22, max_num_seqs=4)
    schemas = SCHEMAS[:2]
    prompts = [llm.apply_chat_template([{"role": "user", "content": extraction_prompt(s)}]) for s in schemas]
    result = run_structured(llm, prompts, schemas, batch_sizes=(1,), rounds=1, max_tokens=16)
    assert set(result) == {"batches", "rounds", "mask_fill_per_row", "grammar_ready", "forced"}
    row = result["batches"][1]
    assert set(row) == {"structured_tok_s", "unstructured_tok_s", "ratio", "structured_rounds",
                        "unstructured_rounds", "output_tokens"}
    assert row["structured_tok_s"] > 0 and row["unstructured_tok_s"] > 0 and row["ratio"] > 0
    assert len(row["structured_rounds"]) == len(row["unstructured_rounds"]) == 1
    assert 2 <= row["output_tokens"] <= 2 * 16
    for key in ("mask_fill_per_row", "grammar_ready"):
        assert set(result[key]) == {"p50_ms", "p99_ms", "n"} and result[key]["n"] > 0
        assert 0 < result[key]["p50_ms"] <= result[key]["p99_ms"]
    assert result["grammar_ready"]["n"] == len(schemas)
    forced = result["forced"]
    assert set(forced) == {"steps_saved", "forced_tokens", "output_tokens", "share", "cut_at_max_tokens"}
    assert forced["steps_saved"] >= 0 and forced["forced_tokens"] >= forced["steps_saved"]
    # the random model's answers may be cut at max_tokens, after forced tokens the engine counted
    assert forced["output_tokens"] == row["output_tokens"] and forced["share"] >= 0
