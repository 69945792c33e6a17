"""The entry-point loader, and a third-party plugin package installed with pip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.common.errors import PluginError
from pagedserve.plugins import API_VERSION, load_plugin, registry
from pagedserve.plugins.default_sampler import DefaultSampler
from pagedserve.plugins.fcfs_scheduler import FCFSScheduler
from pagedserve.plugins.models.llama import LlamaForCausalLM, Qwen3ForCausalLM

PLUGIN_PKG = Path(__file__).parent.parent / "plugin_pkg"


def test_builtins_register_through_entry_points():
    assert load_plugin("schedulers", "fcfs") is FCFSScheduler
    assert load_plugin("samplers", "default") is DefaultSampler
    assert load_plugin("models", "LlamaForCausalLM") is LlamaForCausalLM
    assert load_plugin("models", "Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(registry.available("models"))


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(PluginError) as info:
        load_plugin("samplers", "nope")
    assert "unknown sampler 'nope'" in info.value.message
    assert "default" in info.value.message
    with pytest.raises(PluginError):
        registry.available("widgets")


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    """pip-install the example package into its own folder (the venv stays untouched)."""
    import shutil

    target = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("src") / "plugin_pkg"
    shutil.copytree(PLUGIN_PKG, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True,
    )
    return target


def run_with_plugin(site: Path, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_third_party_sampler_and_model_generate(installed_plugin, tiny_checkpoint, tmp_path):
    import shutil

    base = tiny_checkpoint("llama-gqa")
    reversed_dir = tmp_path / "reversed"
    shutil.copytree(base, reversed_dir)
    config = json.loads((reversed_dir / "config.json").read_text())
    config["architectures"] = ["ReversedLlamaForCausalLM"]
    (reversed_dir / "config.json").write_text(json.dumps(config))
    code = f"""
import json, logging, torch
from transformers import AutoModelForCausalLM
from pagedserve import LLM, SamplingParams
from pagedserve.plugins import registry
prompt = [5, 6, 7, 8, 9]
params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
# custom sampler: each token is the second best of the model's next-token distribution
llm = LLM({str(base)!r}, sampler="lowest", kv_cache_memory=1 << 22)
tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
hf = AutoModelForCausalLM.from_pretrained({str(base)!r}, dtype=torch.float32).eval()
ids = list(prompt)
expected = []
with torch.inference_mode():
    for _ in range(5):
        t = hf(torch.tensor([ids])).logits[0, -1].topk(2).indices[1].item()
        expected.append(t); ids.append(t)
# custom architecture: greedy picks the least likely token
rev = LLM({str(reversed_dir)!r}, kv_cache_memory=1 << 22).generate([prompt], params)[0].outputs[0].token_ids
ids = list(prompt)
least = []
with torch.inference_mode():
    for _ in range(5):
        t = hf(torch.tensor([ids])).logits[0, -1].argmin().item()
        least.append(t); ids.append(t)
print(json.dumps(dict(tokens=tokens, expected=expected, rev=rev, least=least,
                      samplers=sorted(registry.available("samplers")), broken=sorted(registry.broken("samplers")))))
"""
    result = json.loads(run_with_plugin(installed_plugin, code).strip().splitlines()[-1])
    assert result["tokens"] == result["expected"]
    assert result["rev"] == result["least"]
    assert result["samplers"] == ["default", "lowest"]
    assert result["broken"] == ["broken", "outdated"]


def test_third_party_scheduler_admits_shortest_prompt_first(installed_plugin, tiny_checkpoint):
    code = f"""
import json
from pagedserve import LLM, SamplingParams
prompts = {{"a": list(range(3, 12)), "b": [5, 6, 7], "c": list(range(20, 26))}}
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
result = {{}}
for scheduler in ("fcfs", "shortest"):
    engine = LLM({str(tiny_checkpoint("llama-gqa"))!r}, scheduler=scheduler, max_num_seqs=1,
                 kv_cache_memory=1 << 22).engine
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    order, tokens = [], {{}}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.output is not None:
                order.append(delta.request_id)
                tokens[delta.request_id] = delta.output.outputs[0].token_ids
    result[scheduler] = dict(order=order, tokens=tokens, free=engine.kv_manager.num_free_blocks,
                             blocks=engine.kv_manager.num_blocks)
print(json.dumps(result))
"""
    result = json.loads(run_with_plugin(installed_plugin, code).strip().splitlines()[-1])
    assert result["fcfs"]["order"] == ["a", "b", "c"]  # one at a time, in arrival order
    assert result["shortest"]["order"] == ["b", "c", "a"]  # 3, 6, then 9 prompt tokens
    assert result["shortest"]["tokens"] == result["fcfs"]["tokens"]  # greedy: the order changes nothing else
    assert result["shortest"]["free"] == result["shortest"]["blocks"]  # every block came back


def test_plugins_list_shows_loaded_and_skipped(installed_plugin):
    out = run_with_plugin(installed_plugin, "from pagedserve.entrypoints.cli import main; main(['plugins', 'list'])")
    assert "lowest\tpagedserve_example_plugin.sampler.LowestOfTopTwoSampler" in out
    assert f"outdated\tSKIPPED: API_VERSION {API_VERSION + 100}" in out
    assert "broken\tSKIPPED: ModuleNotFoundError" in out
    assert "fcfs\tpagedserve.plugins.fcfs_scheduler.FCFSScheduler" in out
    assert "shortest\tpagedserve_example_plugin.scheduler.ShortestPromptFirstScheduler" in out


def test_the_routers_register_through_entry_points():
    from pagedserve.plugins.routers import CacheAwareRouter, LeastLoadedRouter

    assert load_plugin("routers", "cache-aware") is CacheAwareRouter
    assert load_plugin("routers", "least-loaded") is LeastLoadedRouter
