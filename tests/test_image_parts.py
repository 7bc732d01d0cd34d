"""The parts of an image-and-text model as leantune names them (``models.image_text``): the start-up line's states,
Llama 3.2 Vision's encoder layers made checkpointable once, LoRA kept off the parts not chosen, and the processor a
dataset file is handed (its pad token set; one without a tokenizer refused)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch


def _model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)


def test_the_start_up_line_says_each_part_frozen_trained_or_how_much_trained(tiny_vision):
    from leantune.models.image_text import describe_parts, freeze_language_model, parts

    model = _model(tiny_vision("llava"))
    totals = {role: sum(p.numel() for m in modules for p in {id(p): p for p in m.parameters()}.values())
              for role, modules in parts(model).items()}
    assert describe_parts(model) == "parts: " + ", ".join(f"{role} {n:,} (trained)" for role, n in totals.items())
    freeze_language_model(model)
    line = describe_parts(model)
    assert f"language model {totals['language model']:,} (frozen)" in line
    assert f"vision encoder {totals['vision encoder']:,} (trained)" in line
    next(parts(model)["projector"][0].parameters()).requires_grad_(False)
    projector = parts(model)["projector"][0]
    trained = sum(p.numel() for p in projector.parameters() if p.requires_grad)
    assert 0 < trained < totals["projector"] and f"projector {totals['projector']:,} ({trained:,} trained)" in \
        describe_parts(model)


def test_llama_3_2_visions_encoder_layers_are_made_checkpointable_once_and_keep_their_class(tiny_vision):
    from transformers.modeling_layers import GradientCheckpointingLayer

    from leantune.models.image_text import checkpointable_vision_layers, parts

    model = _model(tiny_vision("mllama"))
    vision = parts(model)["vision encoder"]
    layers = [layer for module in vision for stack in module.modules() if isinstance(stack, torch.nn.ModuleList)
              for layer in stack]
    plain = [layer for layer in layers if not isinstance(layer, GradientCheckpointingLayer)]
    names = [(type(layer).__name__, type(layer).__module__) for layer in plain]
    assert plain and checkpointable_vision_layers(model) == len(plain)
    assert all(isinstance(layer, GradientCheckpointingLayer) for layer in layers)
    assert [(type(layer).__name__, type(layer).__module__) for layer in plain] == names
    assert checkpointable_vision_layers(model) == 0  # applied once: nothing left to make


def test_lora_keeps_off_the_parts_not_chosen_and_nothing_off_a_text_model(tiny_vision):
    from transformers import AutoModelForCausalLM

    from leantune.models.image_text import lora_kept_off, parts
    from leantune.models.presets import model_config

    model = _model(tiny_vision("llava"))
    found = parts(model)
    names = {id(m): n for n, m in model.named_modules()}
    projector, encoder = ([names[id(m)] for m in found[role]] for role in ("projector", "vision encoder"))
    assert projector and encoder
    off, said = lora_kept_off(model, ["vision_encoder"], images=True)
    assert set(projector) <= set(off) and not set(encoder) & set(off)
    assert said.startswith("vision encoder (--lora_parts vision_encoder")
    off, _ = lora_kept_off(model, ["projector"], images=True)
    assert not set(projector) & set(off) and set(encoder) <= set(off)
    with torch.device("meta"):
        text = AutoModelForCausalLM.from_config(model_config("tiny"))
    assert lora_kept_off(text, ["vision_encoder"], images=True) == ([], "")


def test_the_processor_gets_a_pad_token_and_one_without_a_tokenizer_is_refused(tiny_vision, tmp_path, monkeypatch):
    from transformers import AutoProcessor

    from leantune.models.image_text import load_processor
    from leantune.models.loading import ModelLoadError

    source = tiny_vision("llava")
    shutil.copytree(source, tmp_path / "llava")
    processor = AutoProcessor.from_pretrained(source)
    processor.tokenizer.pad_token = None
    processor.save_pretrained(tmp_path / "llava")
    loaded = load_processor(str(tmp_path / "llava"))
    assert loaded.tokenizer.pad_token == loaded.tokenizer.eos_token is not None
    with monkeypatch.context() as patched:  # a checkpoint whose AutoProcessor is its image processor alone
        patched.setattr(AutoProcessor, "from_pretrained", lambda *args, **kwargs: processor.image_processor)
        with pytest.raises(ModelLoadError, match="AutoProcessor gives a .*, not a processor with a tokenizer"):
            load_processor(str(source))
    (tmp_path / "empty").mkdir()
    shutil.copy(source / "config.json", tmp_path / "empty" / "config.json")
    with pytest.raises(ModelLoadError) as err:
        load_processor(str(tmp_path / "empty"))
    assert "cannot load the processor of" in str(err.value) and "processor.save_pretrained" in str(err.value)
    # what the library said, its first line
    assert re.search(r"\((OSError|ValueError|ImportError): [^)\s]", str(err.value))
    assert "\n" not in str(err.value)
