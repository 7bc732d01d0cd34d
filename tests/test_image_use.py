"""Using an image-and-text run: ``leantune generate --image`` on the run's adapter and on its merge, and ``leantune
merge`` of a vision LoRA run equal to peft's ``merge_and_unload`` (tiny LLaVA trained a few steps on drawn
colours)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from leantune.flags import parse_run_config
from leantune.models.tiny_vision import build_tiny_image_text
from leantune.use import generate, merge


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from leantune.finetuning import run

    work = tmp_path_factory.mktemp("image_lora")
    base = build_tiny_image_text("llava", work / "base")
    out = work / "run"
    run(parse_run_config(["--model_name", str(base), "--dataset", "custom_dataset", "--custom_dataset.file",
                          "examples/image_colors_dataset.py", "--batching_strategy", "padding", "--output_dir",
                          str(out), "--use_peft", "--lora_r", "4", "--lr", "1e-2", "--max_train_step", "3",
                          "--context_length", "64", "--num_workers_dataloader", "0"]), log=lambda line: None)
    Image.new("RGB", (28, 28), "red").save(work / "red.png")
    return base, out, work / "red.png"


def _generate(*flags) -> str:
    printed = io.StringIO()
    generate.run(generate.parser().parse_args([*flags, "--max_new_tokens", "4"]), out=printed)
    return printed.getvalue()


def _logits(model, processor, image) -> torch.Tensor:
    batch = processor(images=[[image]], text=["<image>what color?"], return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits


def test_merge_equals_peft_merge_and_unload_and_generation_reads_the_image(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base, run, image_path = lora_run
    merged_dir = merge.merge_run(run, tmp_path / "merged", log=lambda line: None)
    assert (merged_dir / "processor_config.json").is_file()
    processor, image = AutoProcessor.from_pretrained(merged_dir), Image.open(image_path).convert("RGB")
    merged = AutoModelForImageTextToText.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base_model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32).eval()
    before = _logits(base_model, processor, image)
    peft_merged = PeftModel.from_pretrained(base_model, str(run)).merge_and_unload().eval()
    expected = _logits(peft_merged, processor, image)
    assert (expected - before).abs().max() > 1e-4  # the adapter changed the model
    torch.testing.assert_close(_logits(merged, processor, image), expected, rtol=1e-5, atol=1e-5)
    for model in (str(run), str(merged_dir)):  # the adapter run, and its merge
        answer = _generate("--model_name", model, "--image", str(image_path), "--chat", "--prompt", "What color?")
        assert answer.strip()
    white = Image.new("RGB", (28, 28), "white")
    assert (_logits(merged, processor, white) - _logits(merged, processor, image)).abs().max() > 1e-4  # it sees them


@pytest.mark.parametrize("flags, message", [
    (["--image", "{tmp}/none.png"], "--image {tmp}/none.png: no such file"),
    (["--image", "{tmp}/not.png"], "--image {tmp}/not.png: not an image"),
])
def test_a_missing_or_unreadable_image_is_one_line(lora_run, tmp_path, capsys, flags, message):
    (tmp_path / "not.png").write_text("text")
    _, run, _ = lora_run
    code = generate.main(["--model_name", str(run), "--prompt", "x", *(f.format(tmp=tmp_path) for f in flags)])
    assert code == 2
    assert capsys.readouterr().err.strip() == f"leantune: error: {message.format(tmp=tmp_path)}"


def test_an_image_for_a_language_model_alone_is_refused(tmp_path, capsys):
    from leantune.models.tiny import ensure_default_model

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    code = generate.main(["--model_name", str(ensure_default_model()), "--prompt", "x", "--image",
                          str(tmp_path / "a.png")])
    assert code == 2 and "is a language model alone (LlamaForCausalLM); drop --image" in capsys.readouterr().err
