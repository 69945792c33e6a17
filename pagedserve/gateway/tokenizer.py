"""`PromptTokenizer`: the gateway's tokenizer and chat template, without torch.

It reads the checkpoint's `tokenizer.json` with the `tokenizers` library and renders the
chat template with jinja2 the way transformers does (sandboxed, trim_blocks, lstrip_blocks,
`raise_exception`, `strftime_now`), so the token ids match `AutoTokenizer` exactly: the
engine tests compare them.

In a chat, what the caller wrote (a message's content or name) is text, never a control
token: a user who writes `<|im_start|>system` gets those characters, not the model's turn
marker. Only the template writes control tokens.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from pagedserve.common.errors import InvalidParameterError

#: The fields of a template message that the caller wrote (the role is one of a fixed few).
CALLER_TEXT_FIELDS = ("content", "name")


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
        self.model_dir = model_dir
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        added = self.tokenizer.get_added_tokens_decoder()  # id → AddedToken: the specials and any added ones
        self._added_ids = frozenset(added)
        self._added_texts = tuple({token.content for token in added.values() if token.content})
        # Added tokens matched after normalization: looked for in the normalized text too.
        self._normalized_added_texts = tuple({token.content for token in added.values()
                                              if token.content and token.normalized})
        self._text_tokenizer = _text_only(self.tokenizer)
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
        self.template_source: str = template or ""
        # does the template render `tools` itself, and does it know a `tool` role?
        self.template_uses_tools = bool(re.search(r"\btools\b", self.template_source))
        self.template_knows_tool_role = bool(re.search(r"[\'\"]tool[\'\"]", self.template_source))
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
        """Token ids of a completion prompt, with the model's special tokens (BOS).

        A raw prompt is the caller's own template: special-token text in it (`<|im_start|>`)
        becomes the special token, as with transformers' `encode`. Only chat content is kept
        as text (`encode_chat`)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if self._template is None:
            raise InvalidParameterError("messages", "this model has no chat template; use /v1/completions")
        extra = {"tools": tools} if tools else {}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except TemplateError as exc:
            raise InvalidParameterError("messages", f"the chat template refused them: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation; the template writes the special tokens itself.

        When no caller text holds the text of a special or added token, the rendered
        conversation is tokenized whole, exactly as transformers' `apply_chat_template`
        does. Otherwise the caller's text is tokenized apart, as plain text
        (`_encode_keeping_caller_text`).
        """
        # what the template renders of tools and earlier calls is the caller's too: refused
        # whole when it spells a special token (only content and names are split out below)
        structured = [tools or [], [m.get("tool_calls") for m in messages]]
        if self._holds_added_token(json.dumps(structured, ensure_ascii=False)):
            raise InvalidParameterError("tools" if tools and self._holds_added_token(json.dumps(tools, ensure_ascii=False))
                                        else "messages", "holds special-token text; remove it")
        text = self.render_chat(messages, add_generation_prompt, tools)
        if not any(self._holds_added_token(value) for value in _caller_texts(messages)):
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return self._encode_keeping_caller_text(messages, add_generation_prompt, text, tools)

    def _holds_added_token(self, text: str) -> bool:
        """Would tokenizing `text` with special tokens parsed give a special or added token?"""
        if any(token in text for token in self._added_texts):
            return True
        normalizer = self.tokenizer.normalizer
        if self._normalized_added_texts and normalizer is not None:
            normalized = normalizer.normalize_str(text)
            return any(token in normalized for token in self._normalized_added_texts)
        return False

    def _encode_keeping_caller_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                                    rendered: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render the template with a placeholder for each caller text, check that putting the
        texts back gives exactly `rendered`, then tokenize the template's pieces with special
        tokens parsed and the caller's texts as plain text. A template that changes the
        caller's text (trims it, say) fails the check: refused rather than tokenized unsafely."""
        marker = uuid.uuid4().hex
        texts: list[str] = []

        def placeholder(value: str) -> str:
            texts.append(value)
            return f"\x00{marker}:{len(texts) - 1}\x00"

        marked = [{key: placeholder(value) if key in CALLER_TEXT_FIELDS and isinstance(value, str) else value
                   for key, value in message.items()} for message in messages]
        # the pieces alternate: the template's text, the index of a caller's text, the template's text, ...
        pieces = re.split(f"\x00{marker}:(\\d+)\x00", self.render_chat(marked, add_generation_prompt, tools))
        segments = [(piece, False) if i % 2 == 0 else (texts[int(piece)], True) for i, piece in enumerate(pieces)]
        if "".join(text for text, _ in segments) != rendered:
            raise InvalidParameterError("messages", "a message holds special-token text that this model's chat template "
                                                    "would not keep as plain text; remove it")
        ids: list[int] = []
        for text, is_callers in segments:
            if not is_callers:
                ids += self.tokenizer.encode(text, add_special_tokens=False).ids
                continue
            text_ids = self._text_tokenizer.encode(text, add_special_tokens=False).ids
            if self._added_ids.intersection(text_ids):  # the vocabulary spells one out: never let it through
                raise InvalidParameterError("messages", "a message holds special-token text that cannot be kept as plain text")
            ids += text_ids
        return ids


def _caller_texts(messages: list[dict[str, Any]]):
    for message in messages:
        for key in CALLER_TEXT_FIELDS:
            value = message.get(key)
            if isinstance(value, str):
                yield value


def _text_only(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that reads every special or added token's text as plain text.

    `encode_special_tokens` splits only the tokens marked special; the copy marks them all.
    A copy, not the flag toggled on the shared tokenizer, since tokenization runs in threads.
    """
    spec = json.loads(tokenizer.to_str())
    for token in spec.get("added_tokens", []):
        token["special"] = True
    text_only = Tokenizer.from_str(json.dumps(spec))
    text_only.encode_special_tokens = True
    return text_only
