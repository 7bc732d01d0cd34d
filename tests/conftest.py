"""Shared fixtures: a tiny Llama saved with save_pretrained (no download) and small datasets."""

from __future__ import annotations

import json
import os

# No test downloads anything: this also stops bitsandbytes' import from fetching a CPU kernel from the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The smallest Llama that still has every part (GQA attention, gated MLP, two layers).
TEST_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)


@pytest.fixture(scope="module", autouse=True)
def _dynamo_forgotten_after_each_module():
    """What dynamo keeps of a module's compiled code (torchao's compiled optimizer updates, compiled layers: caches,
    recompile guards) is dropped after it, so the next module's compiled code starts as in a fresh process."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session", autouse=True)
def _isolated_leantune_home(tmp_path_factory):
    """Tests never touch ~/.cache/leantune (and transformers draws no progress bars into captured output)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
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
def block_aligned_model_dir(tmp_path_factory):
    """The tiny model with rows of 256 elements: every FSDP2 shard of a weight is whole blocks of bitsandbytes'
    8-bit moments (``leantune.optimizers.bitsandbytes_sharded``)."""
    from leantune.models.tiny import make_tiny_model

    shape = dict(TEST_SHAPE, hidden_size=256, intermediate_size=512)
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-256", seed=0, **shape)


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


# The decoder families' tiny models (``tests/test_families.py``): each family's head transform made strong
# enough to matter (their defaults are 30 and 0.0625, or none), and the head's weights large.
FAMILY_SHAPE = dict(TEST_SHAPE, max_position_embeddings=512)
STRONG = {"granite": dict(logits_scaling=0.25), "cohere": dict(logit_scale=4.0),
          "gemma2": dict(final_logit_softcapping=5.0), "gemma3": dict(final_logit_softcapping=5.0)}
HEAD_STD = 1.0  # with hidden 64, logits of about 8 either way of zero


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """``moe_dir(family)``: the mixture-of-experts family's tiny model (``MOE_FAMILIES``), built once per session.

    Its routers start random (some families' start at zero, which would send every token to the same experts)."""
    root, built = tmp_path_factory.mktemp("moe"), {}

    from transformers import AutoModelForCausalLM

    from leantune.models.tiny import make_tiny_model

    def build(family: str):
        if family not in built:
            path = make_tiny_model(root / family, seed=0, family=family, **FAMILY_SHAPE)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if ".gate.weight" in name or ".router." in name:
                        param.normal_(0.0, 0.5)
            model.save_pretrained(path)
            built[family] = path
        return built[family]

    return build


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """``family_dir(family)``: the family's tiny model, built once per session."""
    root, built = tmp_path_factory.mktemp("families"), {}

    from transformers import AutoModelForCausalLM

    from leantune.models.tiny import make_tiny_model

    def build(family: str):
        if family not in built:
            path = make_tiny_model(root / family, seed=0, family=family, **FAMILY_SHAPE, **STRONG.get(family, {}))
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            with torch.no_grad():
                model.get_output_embeddings().weight.normal_(0.0, HEAD_STD)
            model.save_pretrained(path)
            built[family] = path
        return built[family]

    return build


@pytest.fixture(scope="session")
def tiny_vision(tmp_path_factory):
    """``tiny_vision(family)``: leantune's tiny image-and-text model of ``family`` (``models.tiny_vision``), built
    once a session on first use."""
    from leantune.models.tiny_vision import build_tiny_image_text

    built = {}

    def make(family: str):
        if family not in built:
            built[family] = build_tiny_image_text(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return built[family]
    return make
