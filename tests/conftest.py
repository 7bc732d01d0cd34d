"""Shared fixtures: a tiny Llama saved with save_pretrained (no download) and small datasets."""

from __future__ import annotations

import json
import os

import pytest
import torch

# The smallest Llama that still has every part (GQA attention, gated MLP, two layers).
TEST_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)


@pytest.fixture(scope="session", autouse=True)
def _isolated_leantune_home(tmp_path_factory):
    """Tests never touch ~/.cache/leantune."""
    home = tmp_path_factory.mktemp("leantune-home")
    old = os.environ.get("LEANTUNE_HOME")
    os.environ["LEANTUNE_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("LEANTUNE_HOME", None)
    else:
        os.environ["LEANTUNE_HOME"] = old


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from leantune.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0, **TEST_SHAPE)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def load_tiny(tiny_model_dir):
    """A fresh float32 copy of the tiny model each call, in train mode."""
    from transformers import AutoModelForCausalLM

    def load():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
        model.config.use_cache = False
        return model.train()

    return load


@pytest.fixture
def write_jsonl(tmp_path):
    def write(records, name="data.jsonl"):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        return path

    return write
