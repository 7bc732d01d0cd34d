"""Batches of images and text: the loss from the multimodal forward equals each class's own, the self-check runs
with a pixel batch, llama-cookbook's vision dataset files (``get_data_collator(processor)``) train through
``leantune finetune``, ``--freeze_LLM_only`` trains the vision side alone, and what is not built for images yet is
refused by name. Tiny random models of each family (``leantune.models.tiny_vision``), images drawn with PIL."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from PIL import Image, ImageDraw

from leantune.builders.model import loss_function
from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.formats.records import DatasetError
from leantune.labels import count_targets
from leantune.models.loading import ModelLoadError
from leantune.models.tiny_vision import MARKERS, qwen2_vl_image_processor
from leantune.training.step import CausalLMLoss

FAMILIES = ("mllama", "llava", "gemma3", "qwen2_vl")


def _image(color: str, size=(30, 24)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).ellipse([4, 4, 20, 18], fill=color)
    return image


def _batch(family: str, path) -> dict:
    """Two rows of different lengths, one image each, right-padded; labels on the text after the image."""
    texts = ["what color is it? red", "and this one, what color is it? it is blue"]
    images = [_image("red"), _image("blue", (20, 36))]
    if family == "qwen2_vl":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        pixels = qwen2_vl_image_processor()(images=images, return_tensors="pt")
        counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
        rows = ["<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>" + t for n, t in zip(counts, texts)]
        batch = dict(tokenizer(rows, padding=True, return_tensors="pt"), **pixels)
        batch["mm_token_type_ids"] = (batch["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")).int()
    else:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(path)
        processor.tokenizer.padding_side = "right"
        batch = dict(processor(images=[[i] for i in images], text=[MARKERS[family] + t for t in texts],
                               padding=True, return_tensors="pt"))
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    labels[:, :3] = -100
    return {**batch, "labels": labels}


def _model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).train()


def _grads(model) -> dict:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loss_and_every_gradient_equal_the_models_own_with_pixels(tiny_vision, family):
    path = tiny_vision(family)
    model, batch = _model(path), _batch(family, tiny_vision(family))
    torch.manual_seed(0)
    images = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
    own = model(**batch).loss
    own.backward()
    own_grads = _grads(model)
    ours_model = CausalLMLoss(model, loss_function(model, 16, sharded=False))
    ours = ours_model(batch["input_ids"], batch["labels"], images=images) / count_targets(batch["labels"])
    ours.backward()
    our_grads = _grads(model)
    assert ours.item() == pytest.approx(own.item(), rel=1e-5)
    assert own_grads.keys() == our_grads.keys()
    vision = [name for name in own_grads if ".language_model." not in name and "lm_head" not in name]
    patches = [name for name in vision if "patch_embed" in name and name.endswith("weight")]
    assert patches and all(own_grads[name].abs().max() > 0 for name in patches)  # the pixels reached the loss
    for name, grad in own_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item() + 1e-9)
    text_only = CausalLMLoss(model, loss_function(model, 16, sharded=False))(batch["input_ids"], batch["labels"])
    assert abs(text_only.item() / count_targets(batch["labels"]) - own.item()) > 1e-3  # the ids alone differ


@pytest.mark.parametrize("family", FAMILIES)
def test_the_self_check_runs_with_a_pixel_batch(tiny_vision, family):
    from leantune.builders.own_loss import check_own_loss
    from leantune.models.facts import run_model_facts

    cfg = parse_run_config(["--model_name", str(tiny_vision(family))])
    check = check_own_loss(cfg.training, run_model_facts(cfg.model), sharded=False, images=True)
    assert check.loss_difference < 1e-5 and check.gradient_difference < 1e-5


def test_the_self_check_refuses_a_class_that_changes_the_pixels_on_their_way(tiny_vision, monkeypatch):
    from transformers import LlavaForConditionalGeneration

    from leantune.builders.own_loss import OwnLossMismatch, check_own_loss
    from leantune.models.facts import run_model_facts

    forward = LlavaForConditionalGeneration.forward
    monkeypatch.setattr(LlavaForConditionalGeneration, "forward",
                        lambda self, pixel_values=None, **kw: forward(self, pixel_values=pixel_values * 2, **kw))
    cfg = parse_run_config(["--model_name", str(tiny_vision("llava"))])
    with pytest.raises(OwnLossMismatch, match="not pixel_values as given"):
        check_own_loss(cfg.training, run_model_facts(cfg.model), sharded=False, images=True)


def test_a_class_that_embeds_the_images_itself_is_refused_before_loading():
    from transformers import AutoConfig

    from leantune.models.facts import meta_model
    from leantune.models.image_text import check_image_text_class

    config = AutoConfig.for_model("llama4", text_config=dict(hidden_size=64, intermediate_size=64,
                                                             intermediate_size_mlp=128, num_hidden_layers=1,
                                                             num_attention_heads=4, num_key_value_heads=2,
                                                             head_dim=16, num_local_experts=2, vocab_size=128),
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=28, patch_size=14,
                                                     vision_output_dim=64, projector_input_dim=64,
                                                     projector_output_dim=64))
    with pytest.raises(ModelLoadError, match="Llama4ForConditionalGeneration: its forward embeds the images itself"):
        check_image_text_class(meta_model(config, torch.float32))


DATASET = "examples/image_colors_dataset.py"


def _finetune(path, out, *extra, function="get_custom_dataset"):
    from leantune.finetuning import run

    lines = []
    flags = ["--model_name", str(path), "--dataset", "custom_dataset", "--custom_dataset.file",
             f"{DATASET}:{function}", "--batching_strategy", "padding", "--output_dir", str(out),
             "--context_length", "64", "--num_workers_dataloader", "0", *extra]
    summary = run(parse_run_config(flags), log=lines.append)
    return summary, lines


def test_a_cookbook_vision_dataset_file_trains_through_its_collator_and_the_processor_is_saved(tiny_vision, tmp_path):
    summary, lines = _finetune(tiny_vision("mllama"), tmp_path / "out", "--max_train_step", "3",
                               "--batch_size_training", "4", "--custom_dataset.test_split", "test",
                               "--enable_activation_checkpointing", "--save_metrics")
    assert any(line.startswith("data: examples/image_colors_dataset.py:get_custom_dataset: 360 train / 60 "
                               "validation rows, 90 batches of 4 per epoch, each made by the file's "
                               "get_data_collator") for line in lines)
    assert "parts: language model" in next(line for line in lines if line.startswith("parts:"))
    steps = json.loads((tmp_path / "out" / "metrics.json").read_text())["train_steps"]
    assert len(steps) == 3 and all(step["target_tokens"] > 0 and step["loss"] > 0 for step in steps)
    saved = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"processor_config.json", "tokenizer.json", "model.safetensors"} <= saved


def test_freeze_llm_only_trains_the_vision_encoder_and_the_cross_attention_layers_alone(tiny_vision):
    from leantune.builders.model import build_model
    from leantune.precision import choose_precision

    cfg = parse_run_config(["--model_name", str(tiny_vision("mllama")), "--freeze_LLM_only"])
    lines = []
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")),
                           log=lines.append)
    trained = {name.split(".")[1] if name.startswith("model.") else name.split(".")[0]
               for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {"vision_model", "multi_modal_projector", "language_model"}
    language = [name for name, p in model.named_parameters() if name.startswith("model.language_model.")]
    assert all(p.requires_grad == name.startswith("model.language_model.layers.1.")  # its one cross-attention layer
               for name, p in model.named_parameters() if name in language)
    assert not model.lm_head.weight.requires_grad
    line = next(line for line in lines if line.startswith("parts:"))
    assert "vision encoder" in line and "(trained)" in line and "cross-attention" in line


@pytest.mark.parametrize("flags, message", [
    (["--freeze_LLM_only", "--use_peft"], "--freeze_LLM_only: chooses what a full fine-tune trains"),
])
def test_freeze_llm_only_with_lora_is_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(flags)


def test_freeze_llm_only_on_a_text_model_is_refused(tmp_path):
    from leantune.preflight import preflight

    cfg = parse_run_config(["--freeze_LLM_only", "--output_dir", str(tmp_path / "o")])
    with pytest.raises(ConfigError, match="--freeze_LLM_only: LlamaForCausalLM is a language model alone"):
        preflight(cfg, log=lambda line: None)


@pytest.mark.parametrize("extra, message", [
    (["--batching_strategy", "packing"], "--batching_strategy packing: examples/image_colors_dataset.py"),
    (["--tiled_mlp", "16"], "--tiled_mlp: not for image-and-text runs yet"),
    (["--offload_experts", "1", "--use_peft", "--quantization", "4bit"],
     "--offload_experts: not for image-and-text runs yet"),
])
def test_what_is_not_built_for_images_yet_is_refused_by_name(tiny_vision, tmp_path, extra, message):
    with pytest.raises((ConfigError, DatasetError), match=message):
        _finetune(tiny_vision("llava"), tmp_path / "out", *extra)


@pytest.mark.parametrize("body, message", [
    ("return lambda rows: {'input_ids': [[1, 2]]}", "the collator returned \\['input_ids'\\]; it must return a mapping "
                                                     "with input_ids and labels"),
    ("def fail(rows):\n        raise FileNotFoundError('no such image: a.png')\n    return fail",
     "colors.py train row 0: the dataset file's collator failed: FileNotFoundError: no such image: a.png"),
    ("import torch\n    return lambda rows: {'input_ids': torch.ones(1, 99, dtype=torch.long), 'labels': "
     "torch.ones(1, 99, dtype=torch.long)}", "the collator made rows of 99 tokens, over --context_length 64"),
    ("import torch\n    return lambda rows: {'input_ids': torch.ones(1, 9, dtype=torch.long), 'labels': "
     "torch.full((1, 9), -100)}", "every label is -100, so the batch has nothing to learn"),
])
def test_a_broken_collator_is_said_naming_the_rows_before_any_weight_loads(tiny_vision, tmp_path, body, message):
    file = tmp_path / "colors.py"
    file.write_text(f"from image_colors import rows\n\ndef get_custom_dataset(c, processor, split):\n"
                    f"    return [{{'text': 'x'}}] * 4\n\ndef get_data_collator(processor):\n    {body}\n")
    (tmp_path / "image_colors.py").write_text("rows = None\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        from leantune.finetuning import run

        flags = ["--model_name", str(tiny_vision("llava")), "--dataset", "custom_dataset", "--custom_dataset.file",
                 str(file), "--batching_strategy", "padding", "--output_dir", str(tmp_path / "out"),
                 "--context_length", "64"]
        with pytest.raises(DatasetError, match=message):
            run(parse_run_config(flags), log=lambda line: None)
    finally:
        sys.path.remove(str(tmp_path))
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_it_learns_from_the_images_and_not_from_blank_ones(tmp_path):
    """The learning benchmark's two runs: held-out accuracy at least 0.5 with the images, at most 0.2 blank."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("image_learning", "benchmarks/image_learning.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.learn("llava", epochs=8, work=tmp_path)
    assert result["runs"]["images"]["accuracy"] >= 0.5, json.dumps(result)
    assert result["runs"]["blank"]["accuracy"] <= 0.2, json.dumps(result)


def test_checkpointing_reaches_llama_vision_encoder_layers_and_leaves_the_gradients_exactly_equal(tiny_vision):
    from leantune.builders.model import prepare_model
    from leantune.precision import choose_precision

    path = tiny_vision("mllama")
    batch = _batch("mllama", path)
    images = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
    results = []
    for flags in ([], ["--enable_activation_checkpointing"]):
        cfg = parse_run_config(["--model_name", str(path), *flags])
        model, report = prepare_model(_model(path), cfg,
                                      choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")))
        loss_model = CausalLMLoss(model, loss_function(model, 16, sharded=False))
        loss_model(batch["input_ids"], batch["labels"], images=images).backward()
        results.append((report, _grads(model)))
    (plain, plain_grads), (checkpointed, grads) = results
    # 2 local and 1 global vision encoder layers (plain modules in transformers), 2 decoder layers
    assert plain.total_layers == checkpointed.checkpointed_layers == 5
    assert plain_grads.keys() == grads.keys()
    assert all(torch.equal(plain_grads[name], grads[name]) for name in grads)


def _lora_places(path, *flags, images=True) -> tuple[list[str], str]:
    from leantune.builders.model import build_model
    from leantune.precision import choose_precision

    data = ["--dataset", "custom_dataset", "--custom_dataset.file", DATASET] if images else []
    cfg = parse_run_config(["--model_name", str(path), "--use_peft", *data, *flags])
    lines = []
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")),
                           log=lines.append)
    places = [name.removeprefix("base_model.model.").removesuffix(".lora_A") for name, _ in model.named_modules()
              if name.endswith(".lora_A")]
    return places, next(line for line in lines if line.startswith("lora:"))


@pytest.mark.parametrize("flags, images, where, said", [
    ([], True, {"model.vision_model.transformer.layers.0", "model.vision_model.transformer.layers.1",
                "model.vision_model.global_transformer.layers.0", "model.language_model.layers.0",
                "model.language_model.layers.1"},
     "on the language model, vision encoder, projector, cross-attention (--lora_parts auto: the batches hold "
     "images)"),
    ([], False, {"model.language_model.layers.0", "model.language_model.layers.1"},
     "on the language model, cross-attention (--lora_parts auto: text rows never run the vision side)"),
    (["--lora_parts", "cross_attention,vision_encoder"], True,
     {"model.vision_model.transformer.layers.0", "model.vision_model.transformer.layers.1",
      "model.vision_model.global_transformer.layers.0", "model.language_model.layers.1"},
     "on the vision encoder, cross-attention (--lora_parts cross_attention vision_encoder)"),
    (["--lora_parts", "projector", "--lora_target_modules", "all-linear"], True, {"model.multi_modal_projector"},
     "on the projector (--lora_parts projector)"),
])
def test_lora_goes_on_the_parts_asked_for_and_the_log_names_them(tiny_vision, flags, images, where, said):
    places, line = _lora_places(tiny_vision("mllama"), *flags, images=images)
    assert {place.rsplit(".", 2)[0] if "layers" in place else place for place in places} == where
    assert line.endswith(said)


@pytest.mark.parametrize("flags, message", [
    (["--use_peft", "--lora_parts", "vision"], "--lora_parts: vision is not a part; choose from auto, all"),
    (["--lora_parts", "projector"], "--lora_parts: chooses where LoRA goes: needs --use_peft"),
    (["--use_peft", "--lora_parts", "all", "projector"], "--lora_parts: auto and all stand alone"),
])
def test_a_bad_lora_parts_value_is_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(flags)


def test_qlora_quantizes_the_language_model_and_keeps_the_vision_side_in_16_bits(tiny_vision, tmp_path):
    summary, lines = _finetune(tiny_vision("llava"), tmp_path / "out", "--use_peft", "--quantization", "4bit",
                               "--max_train_step", "2", "--batch_size_training", "2")
    line = next(line for line in lines if line.startswith("quantization:"))
    assert line.startswith("quantization: 14 Linear layers in 4bit") and line.endswith(
        "the LM head, model.vision_tower, model.multi_modal_projector and embeddings unquantized")
    assert summary["epochs"][0]["steps"] == 2


def test_gemma3s_base_is_handed_the_labels_as_its_class_hands_them(tiny_vision, monkeypatch):
    from transformers.models.gemma3 import modeling_gemma3

    seen = []
    forward = modeling_gemma3.Gemma3Model.forward

    @functools.wraps(forward)  # its signature kept: leantune reads it
    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("labels"))
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(modeling_gemma3.Gemma3Model, "forward", spy)
    path = tiny_vision("gemma3")
    model, batch = _model(path), _batch("gemma3", path)
    images = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
    model(**batch)
    CausalLMLoss(model, loss_function(model, 16, sharded=False))(batch["input_ids"], batch["labels"], images=images)
    assert len(seen) == 2 and seen[0] is batch["labels"] and seen[1] is batch["labels"]


@pytest.mark.slow
def test_two_ranks_give_the_losses_of_one_process_on_an_image_run(tiny_vision, tmp_path):
    """FSDP2 over two gloo ranks, tiny Llama 3.2 Vision with LoRA on every part, its images batched by the
    cookbook-contract file: each rank takes its half of every batch."""
    from test_distributed import step_losses, torchrun

    from leantune.finetuning import run

    common = ["--model_name", str(tiny_vision("mllama")), "--dataset", "custom_dataset", "--custom_dataset.file",
              DATASET, "--batching_strategy", "padding", "--context_length", "64", "--num_workers_dataloader", "0",
              "--use_peft", "--lora_dropout", "0", "--enable_activation_checkpointing", "--max_train_step", "3",
              "--save_metrics", "--run_validation", "false"]
    run(parse_run_config([*common, "--batch_size_training", "4", "--output_dir", str(tmp_path / "one")]),
        log=lambda line: None)
    result = torchrun([*common, "--batch_size_training", "2", "--enable_fsdp", "--output_dir", str(tmp_path / "two")])
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(one) == len(two) == 3 and two == pytest.approx(one, rel=1e-4)


def test_freeze_layers_freezes_the_first_decoder_layers_as_llama_cookbook_does(tiny_vision, tmp_path):
    from leantune.builders.model import build_model
    from leantune.precision import choose_precision
    from leantune.preflight import preflight

    cfg = parse_run_config(["--model_name", str(tiny_vision("llava")), "--freeze_layers", "--num_freeze_layers", "1"])
    lines = []
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")),
                           log=lines.append)
    layers = model.model.language_model.layers
    assert not any(p.requires_grad for p in layers[0].parameters())
    assert all(p.requires_grad for p in layers[1].parameters()) and model.lm_head.weight.requires_grad
    assert ("frozen: the first 1 of 2 decoder layers (--freeze_layers --num_freeze_layers 1); the rest of the model "
            "trains") in lines
    too_many = parse_run_config(["--model_name", str(tiny_vision("llava")), "--freeze_layers", "--num_freeze_layers",
                                 "3", "--output_dir", str(tmp_path / "o"), "--context_length", "64"])
    with pytest.raises(ConfigError, match="--num_freeze_layers 3: LlavaForConditionalGeneration has 2 decoder layers"):
        preflight(too_many, log=lambda line: None)


def test_training_the_vision_side_alone_on_text_rows_is_refused(tiny_vision, tmp_path):
    from leantune.preflight import preflight

    for flags, said in ((["--freeze_LLM_only"], "--freeze_LLM_only"),
                        (["--use_peft", "--lora_parts", "vision_encoder"], "--lora_parts vision_encoder")):
        cfg = parse_run_config(["--model_name", str(tiny_vision("llava")), "--output_dir", str(tmp_path / "o"),
                                "--context_length", "64", *flags])
        with pytest.raises(ConfigError, match=f"{said}: only the vision side trains, and the run's rows hold no image"):
            preflight(cfg, log=lambda line: None)


def _collator_file(tmp_path, body: str):
    file = tmp_path / "colors.py"
    file.write_text("import sys\nsys.path.insert(0, 'examples')\nimport torch\n"
                    "from image_colors_dataset import rows, ColorsCollator\n\n"
                    "def get_custom_dataset(c, processor, split):\n    return rows(split)[:8]\n\n"
                    f"def get_data_collator(processor):\n{body}\n")
    return file


def test_image_inputs_that_are_not_tensors_are_refused(tiny_vision, tmp_path):
    from leantune.finetuning import run

    file = _collator_file(tmp_path, "    made = ColorsCollator(processor)\n"
                                    "    def listed(rows):\n        batch = made(rows)\n"
                                    "        batch['pixel_values'] = batch['pixel_values'].tolist()\n"
                                    "        return batch\n    return listed")
    flags = ["--model_name", str(tiny_vision("llava")), "--dataset", "custom_dataset", "--custom_dataset.file",
             str(file), "--batching_strategy", "padding", "--output_dir", str(tmp_path / "out"), "--context_length",
             "64"]
    with pytest.raises(DatasetError, match="the collator returned pixel_values as list, not a tensor"):
        run(parse_run_config(flags), log=lambda line: None)


def test_a_collators_labels_on_image_tokens_are_masked(tiny_vision, tmp_path):
    from transformers import AutoProcessor

    from leantune.builders.loaders import _image_token_ids
    from leantune.data.collated import CollatedBatches

    processor = AutoProcessor.from_pretrained(tiny_vision("llava"))
    sys_path = __import__("sys").path
    sys_path.insert(0, "examples")
    try:
        from image_colors_dataset import ColorsCollator, rows
    finally:
        sys_path.remove("examples")
    made = ColorsCollator(processor)

    def everything(batch_rows):  # labels on every token, image placeholders included
        batch = made(batch_rows)
        batch["labels"] = batch["input_ids"].clone()
        return batch
    batch = CollatedBatches(everything, 64, "", _image_token_ids(processor))([("r0", rows("train")[0])])
    image = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert (batch["input_ids"] == image).sum() == 4
    assert ((batch["labels"] == -100) == (batch["input_ids"] == image)).all()


def test_an_error_in_a_dataloader_worker_is_said_in_one_line(tiny_vision, tmp_path, capsys):
    from leantune.finetuning import main

    file = _collator_file(tmp_path, "    made = ColorsCollator(processor)\n    seen = []\n"
                                    "    def failing(rows):\n        seen.append(1)\n"
                                    "        if len(seen) > 2:\n            raise ValueError('cannot read the image')\n"
                                    "        return made(rows)\n    return failing")
    code = main(["--model_name", str(tiny_vision("llava")), "--dataset", "custom_dataset", "--custom_dataset.file",
                 str(file), "--batching_strategy", "padding", "--output_dir", str(tmp_path / "out"),
                 "--context_length", "64", "--num_workers_dataloader", "1", "--batch_size_training", "2",
                 "--run_validation", "false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert "the dataset file's collator failed: ValueError: cannot read the image" in err[0]
    assert err[0].startswith("leantune: error: colors.py train row ")


def test_freeze_llm_only_keeps_the_frozen_base_in_bfloat16_and_trains_in_float32(tiny_vision):
    from leantune.builders.model import prepare_model
    from leantune.precision import choose_precision

    cfg = parse_run_config(["--model_name", str(tiny_vision("mllama")), "--freeze_LLM_only"])
    on_gpu = choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cuda"), bf16_supported=True)
    assert on_gpu.weight_dtype is torch.bfloat16 and on_gpu.note.endswith("(the trained parts in float32)")
    model = _model(tiny_vision("mllama")).to(torch.bfloat16)
    model, _ = prepare_model(model, cfg, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")))
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_varlen_attention_is_refused_for_an_image_and_text_model(tiny_vision):
    from leantune.models.facts import run_model_facts

    cfg = parse_run_config(["--model_name", str(tiny_vision("llava")), "--attn_implementation", "varlen"])
    with pytest.raises(ConfigError, match="--attn_implementation varlen: LlavaForConditionalGeneration is an "
                                          "image-and-text model"):
        run_model_facts(cfg.model)
