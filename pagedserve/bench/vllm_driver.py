"""Runs one workload on vLLM's CPU engine, inside vLLM's own interpreter.

    PEER_PYTHON -P vllm_driver.py JOB.json RESULT.json

`pagedserve bench offline --vllm-python PEER_PYTHON` writes the job (bench/vllm_peer.py,
`VllmJob`) and reads the result (`VllmResult`). This file imports only vLLM and the
standard library, since it runs in a virtual environment that has vLLM and not pagedserve;
`-P` keeps this folder off `sys.path`, so none of the bench's modules shadows vLLM's imports.

The job's prompts go in as token ids, every request with its own `max_tokens`, so vLLM sees
exactly the input pagedserve sees. A warm-up generate runs first (vLLM compiles its model on
the first start, and sizes its graphs on the first batches); only the second generate is timed.
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, result_path: str) -> int:
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)

    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], seed=job["seed"], **job["engine_options"])

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=job["temperature"], ignore_eos=job["ignore_eos"])

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        """Each request's number of generated tokens, in order."""
        requests = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = llm.generate(requests, [params(n) for n in max_tokens], use_tqdm=False)
        return [len(out.outputs[0].token_ids) for out in outputs]

    warmup = job["warmup"]
    started = time.perf_counter()
    generate(warmup["prompts"], warmup["max_tokens"])
    warmup_seconds = time.perf_counter() - started

    started = time.perf_counter()
    produced = generate(job["prompts"], job["max_tokens"])
    seconds = time.perf_counter() - started

    result = {
        "vllm_version": vllm.__version__,
        "seconds": seconds,
        "warmup_seconds": warmup_seconds,
        "prompt_tokens": sum(len(ids) for ids in job["prompts"]),
        "output_tokens": produced,
    }
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
