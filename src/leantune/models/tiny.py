"""A tiny Llama (or another family's tiny model) built locally, so the default run, the tests and the
benchmarks need no network.

The model is randomly initialised from its family's config with a fixed seed and its tokenizer is a
byte-level BPE trained with the ``tokenizers`` library on the bundled instruction data. Both are
written with ``save_pretrained``, so loading goes through the same ``from_pretrained`` path a hub
model uses.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from leantune.formats.alpaca import format_prompt
from leantune.data.synthetic import generate
from leantune.io import leantune_home

TINY_VERSION = "v1"
PAD, BOS, EOS = "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>"

# The default tiny shape: big enough that checkpointing has something to save, small enough that
# a CPU trains it in minutes. Tests pass smaller overrides.
TINY_SHAPE = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
TINY_VOCAB_SIZE = 2048

# The decoder families leantune is tested on (``docs/model_families.md``): --family name -> transformers
# model_type. Each is built at the tiny shape (head_dim = hidden / heads); the families' own fields
# (Gemma's soft-capping, Granite's and Cohere's logit scales, ...) keep their defaults unless overridden.
FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
            "gemma3": "gemma3_text", "phi3": "phi3", "olmo2": "olmo2", "granite": "granite", "cohere": "cohere"}
# The mixture-of-experts families (``docs/model_families.md``), each with its experts' own fields at the tiny
# shape: 4 experts a layer, 2 a token (Llama 4: 1, and a shared expert), experts narrower than the dense MLP.
MOE_FAMILIES = {"qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)),
                "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
                "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2)),
                "llama4": ("llama4_text", dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128))}


# The tiny tokenizer's chat template (--dataset chat_dataset offline): Llama 3's layout with plain-text role
# headers (the tokenizer has no header tokens, and adding some would change the tiny model), EOS ending a turn.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<{{ message['role'] }}>\n{{ message['content'] | trim }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>\n{% endif %}")


def default_model_dir() -> Path:
    return leantune_home() / f"tiny-llama-{TINY_VERSION}"


def _tokenizer_corpus() -> list[str]:
    return [format_prompt(r["instruction"], r["input"]) + r["output"] for r in generate()]


def build_tokenizer(vocab_size: int = TINY_VOCAB_SIZE):
    """Train a byte-level BPE tokenizer on the bundled instructions (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tokenizer_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, seed: int = 0, family: str = "llama", **overrides):
    """A randomly initialised causal LM of ``family`` whose vocabulary matches ``tokenizer``.

    ``overrides``: shape fields (``TINY_SHAPE``'s) or any other field of the family's config; a
    ``vocab_size`` larger than the tokenizer's gives a real model's head (the extra rows are never a label).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in FAMILIES and family not in MOE_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join([*FAMILIES, *MOE_FAMILIES])}")
    model_type, experts = MOE_FAMILIES.get(family, (FAMILIES.get(family), {}))
    fields = {"tie_word_embeddings": False, **TINY_SHAPE, **experts, **overrides}
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    vocab_size = fields.pop("vocab_size", len(tokenizer))
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def make_tiny_model(output_dir: str | os.PathLike, seed: int = 0, family: str = "llama", **overrides) -> Path:
    """Build the tiny model and tokenizer and save them to ``output_dir`` (created atomically).

    The files are written to a temporary sibling first and moved into place in one rename, so a
    crash or a concurrent caller never leaves a half-written model directory behind.
    """
    target = Path(output_dir)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not empty; choose a new directory for the tiny model")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    hf_logging.disable_progress_bar()  # one line says what was saved
    try:
        tokenizer = build_tokenizer()
        build_model(tokenizer, seed=seed, family=family, **overrides).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            target.rmdir()  # empty, checked above
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def ensure_default_model() -> Path:
    """The default tiny model's directory, built on first use."""
    path = default_model_dir()
    if not (path / "config.json").exists():
        print(f"leantune: building the default tiny Llama in {path} (once; no download)")
        try:
            make_tiny_model(path)
        except OSError:
            # A concurrent build that finished first makes our rename fail; theirs is complete.
            if not (path / "config.json").exists():
                raise
    return path
