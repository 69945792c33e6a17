"""`PromptTokenizer`: the gateway's tokenizer and chat template, without torch.

It reads the checkpoint's `tokenizer.json` with the `tokenizers` library and renders the
chat template with jinja2 the way transformers does (sandboxed, trim_blocks, lstrip_blocks,
`raise_exception`, `strftime_now`), so the token ids match `AutoTokenizer` exactly: the
engine tests compare them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from pagedserve.common.errors import InvalidParameterError


def _raise_exception(message: str):
    raise TemplateError(message)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class PromptTokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        template_file = model_dir / "chat_template.jinja"
        if template_file.exists():
            template = template_file.read_text()
        self.special_tokens = {name: _token_text(config.get(name))
                               for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
            self._template = env.from_string(template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt, with the model's special tokens (BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise InvalidParameterError("messages", "this model has no chat template; use /v1/completions")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except TemplateError as exc:
            raise InvalidParameterError("messages", f"the chat template refused them: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation; the template writes the special tokens itself."""
        text = self.render_chat(messages, add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False).ids
