"""Tiny random checkpoints, written once per session, to compare against transformers."""

from __future__ import annotations

from pathlib import Path

import torch

#: the SmolLM2 tokenizer is too big to ship; tests use a byte-level tokenizer built here
VOCAB_SIZE = 320


def build_tokenizer(out_dir: Path):
    """A small byte-level BPE tokenizer (256 byte tokens + a few merges + specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 2,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["The capital of France is Paris. " * 3, "Hello world, hello tokens. ", "héllo wörld ✓ 日本語 🙂 " * 2]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token=None)
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(str(out_dir))
    return fast


def build_checkpoint(kind: str, out_dir: Path, **overrides) -> Path:
    """Write a tiny random `kind` checkpoint (llama, qwen2, qwen3, mistral) into out_dir."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    options = dict(
        vocab_size=VOCAB_SIZE, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0, bos_token_id=None,
        pad_token_id=0,
    )
    if kind == "mistral":
        options["sliding_window"] = None
    options.update(overrides)
    config = config_cls(**options)
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    # Larger weights than the default init make the logits peaked, so greedy argmax is
    # decided by clear margins rather than by float rounding.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.25 if p.dim() > 1 else 0.1)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    build_tokenizer(out_dir)
    return out_dir
