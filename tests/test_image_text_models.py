"""An image-and-text checkpoint trained on text rows (Gemma 3's conditional-generation class, built tiny): its
language model's attention settings are read from its text config, the planner reads its layers there too, and LoRA
stays off the vision tower and projector, which text rows never run (said in the run's log)."""

from __future__ import annotations

import pytest
import torch

from leantune.builders.model import build_model
from leantune.flags import parse_run_config
from leantune.models.facts import run_model_facts
from leantune.precision import choose_precision

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gemma3_image_text(tmp_path_factory):
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    from leantune.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    config = AutoConfig.for_model(
        "gemma3", tie_word_embeddings=False, mm_tokens_per_image=4, image_token_index=vocab + 1,
        boi_token_index=vocab + 2, eoi_token_index=vocab + 3,
        text_config=dict(vocab_size=vocab + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                         max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=28, patch_size=14))
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gemma3_image_text")
    Gemma3ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_its_sliding_window_is_read_from_the_text_config_and_it_plans_as_it_runs(gemma3_image_text):
    from leantune.planning.fake_step import trace_step

    cfg = parse_run_config(["--model_name", str(gemma3_image_text), "--use_peft", "--context_length", "32",
                            "--batch_size_training", "2"])
    facts = run_model_facts(cfg.model)
    assert facts.attention == "sdpa"  # its layers slide over 8 tokens: not varlen, whose spans ignore the window
    predicted = trace_step(cfg, facts.config, CPU, "full")
    measured = trace_step(cfg, facts.config, CPU, "full", fake=False)
    assert predicted.peak_bytes == measured.peak_bytes and predicted.breakdown == measured.breakdown


@pytest.mark.parametrize("targets", [[], ["--lora_target_modules", "all-linear"]])
def test_lora_stays_off_the_vision_tower_and_the_log_says_so(gemma3_image_text, targets):
    cfg = parse_run_config(["--model_name", str(gemma3_image_text), "--use_peft", *targets])
    lines = []
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lines.append)
    wrapped = [name for name, _ in model.named_modules() if name.endswith(".lora_A")]
    assert wrapped and all(".language_model." in name for name in wrapped)
    line = next(line for line in lines if line.startswith("lora:"))
    assert line.endswith("; on the language model (--lora_parts auto: text rows never run the vision side)")
