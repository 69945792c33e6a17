"""The gateway's torch-free tokenizer gives exactly the ids transformers gives."""

from __future__ import annotations

import sys

import pytest

from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.model_store import resolve_model
from pagedserve.gateway.tokenizer import PromptTokenizer

from tiny_models import build_tokenizer

TEXTS = ["The capital of France is", "héllo wörld ✓ 日本語 🙂", "  leading spaces\n\nand lines", "<|im_start|>x<|im_end|>", ""]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
]


def _compare(model_dir) -> None:
    from transformers import AutoTokenizer

    ours, theirs = PromptTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=True), text
    for messages in CHATS:
        for gen in (True, False):
            ids = theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert ours.encode_chat(messages, gen) == list(ids)


def test_tiny_tokenizer_matches_transformers(tmp_path):
    build_tokenizer(tmp_path)
    _compare(tmp_path)


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers():
    _compare(resolve_model("smollm2-135m-instruct"))


def test_gateway_tokenizer_needs_no_torch(tmp_path):
    import subprocess

    build_tokenizer(tmp_path)
    code = ("import sys; from pagedserve.gateway.tokenizer import PromptTokenizer; "
            f"PromptTokenizer({str(tmp_path)!r}).encode_chat([{{'role': 'user', 'content': 'hi'}}]); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_no_chat_template_is_a_typed_error(tmp_path):
    build_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = (tmp_path / "tokenizer_config.json")
    import json

    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    with pytest.raises(InvalidParameterError, match="no chat template"):
        PromptTokenizer(tmp_path).encode_chat([{"role": "user", "content": "hi"}])
