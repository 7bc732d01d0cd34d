"""Plans of image-and-text runs: each row planned with one image at its processor's default size, the plan equal to
the same step measured on real tensors (tiny Llama 3.2 Vision, LLaVA, Gemma 3, Qwen2-VL), the image said, auto
batch and the frozen 4-bit language model under --freeze_LLM_only, and the published shapes by hub id."""

from __future__ import annotations

import json

import pytest
import torch

from leantune.flags import parse_run_config

CPU = torch.device("cpu")


@pytest.mark.parametrize("family, flags", [("mllama", ["--use_peft"]), ("llava", ["--freeze_LLM_only"]),
                                           ("gemma3", ["--use_peft"]), ("qwen2_vl", [])])
def test_the_plan_equals_the_measured_step_with_its_images(tiny_vision, family, flags):
    from leantune.models.facts import run_model_facts
    from leantune.planning.fake_step import trace_step

    cfg = parse_run_config(["--model_name", str(tiny_vision(family)), "--context_length", "300",
                            "--batch_size_training", "2", "--enable_activation_checkpointing", *flags])
    config = run_model_facts(cfg.model).config
    predicted, measured = trace_step(cfg, config, CPU, "full"), trace_step(cfg, config, CPU, "full", fake=False)
    assert predicted.peak_bytes == measured.peak_bytes and predicted.breakdown == measured.breakdown
    again = trace_step(cfg, config, CPU, "full")
    assert again.peak_bytes == predicted.peak_bytes  # traced once more, the same: nothing random in it


def test_the_planned_batch_holds_the_processors_image_inputs(tiny_vision):
    """The planned Llava row is what its processor makes of one image of the vision tower's size."""
    from transformers import AutoProcessor
    from PIL import Image

    from leantune.data.packing import full_rows_batch
    from leantune.models.facts import run_model_facts
    from leantune.models.image_inputs import planned_image, with_planned_images

    path = tiny_vision("llava")
    config = run_model_facts(parse_run_config(["--model_name", str(path)]).model).config
    image = planned_image(config)
    planned = with_planned_images(full_rows_batch(1, 32, config.text_config.vocab_size, False), config, image)
    made = AutoProcessor.from_pretrained(path)(images=[[Image.new("RGB", (28, 28))]], text=["<image>x"],
                                               return_tensors="pt")
    assert planned["pixel_values"].shape == made["pixel_values"].shape
    assert int((planned["input_ids"] == config.image_token_id).sum()) == int((made["input_ids"] ==
                                                                             config.image_token_id).sum())
    assert image.description == "one 28x28 image a row, 4 image tokens"


def test_auto_batch_size_and_the_plan_line_on_an_image_run(tiny_vision, tmp_path):
    from leantune.finetuning import run

    lines = []
    run(parse_run_config(["--model_name", str(tiny_vision("llava")), "--dataset", "custom_dataset",
                          "--custom_dataset.file", "examples/image_colors_dataset.py", "--batching_strategy", "padding",
                          "--output_dir", str(tmp_path / "out"), "--context_length", "64", "--num_workers_dataloader",
                          "0", "--auto_batch_size", "--memory_budget_gb", "1", "--max_train_step", "1"]),
        log=lines.append)
    assert any(line.startswith("batch size: auto chose ") for line in lines)
    assert any(line.startswith("batch size: confirmed ") and "with one real step" for line in lines)
    assert any(line.startswith("epoch 1 step 1/1") for line in lines)


def test_freeze_llm_only_on_a_4bit_language_model_keeps_the_fusion_layers_whole_and_trains(tiny_vision, tmp_path):
    from leantune.builders.model import build_model
    from leantune.precision import choose_precision

    cfg = parse_run_config(["--model_name", str(tiny_vision("mllama")), "--freeze_LLM_only", "--quantization", "4bit"])
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lambda line: None)
    kinds = {name: type(module).__name__ for name, module in model.named_modules()
             if name.endswith(("q_proj", "gate_proj"))}
    assert {kind for name, kind in kinds.items() if ".language_model.layers.0." in name} == {"Linear4bit"}
    assert {kind for name, kind in kinds.items() if ".language_model.layers.1." in name} == {"Linear"}  # the fusion
    assert {kind for name, kind in kinds.items() if "vision_model" in name} == {"Linear"}
    assert all(p.requires_grad for p in model.model.language_model.layers[1].parameters())


def test_the_offloaded_embedding_leaves_an_image_runs_losses_unchanged(tiny_vision, tmp_path):
    from leantune.finetuning import run

    losses = []
    for extra in ([], ["--offload_embedding"]):
        out = tmp_path / f"out{len(extra)}"
        run(parse_run_config(["--model_name", str(tiny_vision("mllama")), "--dataset", "custom_dataset",
                              "--custom_dataset.file", "examples/image_colors_dataset.py", "--batching_strategy",
                              "padding", "--output_dir", str(out), "--use_peft", "--max_train_step", "2",
                              "--context_length", "64", "--num_workers_dataloader", "0", "--save_metrics", *extra]),
            log=lambda line: None)
        losses.append([step["loss"] for step in json.loads((out / "metrics.json").read_text())["train_steps"]])
    assert losses[0] == losses[1]


@pytest.mark.parametrize("hub_id, billions", [("meta-llama/Llama-3.2-11B-Vision-Instruct", 10.670),
                                              ("meta-llama/Llama-3.2-90B-Vision", 88.593),
                                              ("Qwen/Qwen2.5-VL-7B-Instruct", 8.292),
                                              ("google/gemma-3-12b-it", 12.187)])
def test_the_published_shapes_plan_offline_by_hub_id(hub_id, billions):
    from leantune.models.facts import meta_model
    from leantune.models.image_inputs import planned_image
    from leantune.models.presets import model_config

    config = model_config(hub_id)
    count = sum(p.numel() for p in meta_model(config, torch.bfloat16).parameters())
    assert count / 1e9 == pytest.approx(billions, abs=0.001)
    assert planned_image(config) is not None


def test_a_run_on_text_rows_is_planned_without_an_image(tiny_vision, tmp_path):
    from leantune.builders.loaders import plans_images
    from leantune.models.facts import run_model_facts

    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    text = parse_run_config(["--model_name", str(tiny_vision("gemma3")), "--dataset", "custom_dataset", "--data_path",
                             str(tmp_path / "d.jsonl")])
    bare = parse_run_config(["--model_name", str(tiny_vision("gemma3"))])  # `leantune plan` by name: one image a row
    config = run_model_facts(text.model).config
    assert not plans_images(text.data, config) and plans_images(bare.data, config)


@pytest.mark.parametrize("family, marker", [("mllama", "<|image|>"), ("gemma3", "<start_of_image>")])
def test_the_planned_inputs_match_the_processors(tiny_vision, family, marker):
    from PIL import Image
    from transformers import AutoProcessor

    from leantune.data.packing import full_rows_batch
    from leantune.models.facts import run_model_facts
    from leantune.models.image_inputs import planned_image, with_planned_images

    path = tiny_vision(family)
    config = run_model_facts(parse_run_config(["--model_name", str(path)]).model).config
    planned = with_planned_images(full_rows_batch(1, 32, 64, False), config, planned_image(config))
    made = AutoProcessor.from_pretrained(path)(images=[[Image.new("RGB", (28, 28))]], text=[marker + "x"],
                                               return_tensors="pt")
    for key, value in made.items():
        if key not in ("input_ids", "attention_mask"):
            assert planned[key].shape[0] == value.shape[0] and planned[key].shape[2:] == value.shape[2:], key
    image_id = config.image_token_index
    assert int((planned["input_ids"] == image_id).sum()) == int((made["input_ids"] == image_id).sum())


@pytest.mark.parametrize("family, marker", [("mllama", "<|image|>"), ("gemma3", "<start_of_image>"),
                                            ("llava", "<image>")])
def test_the_planned_batch_holds_what_the_processor_makes_for_one_image(tiny_vision, family, marker):
    """Key for key: the same image inputs, dtypes and shapes (the text's length aside); the row starts with the
    image's tokens as the processor writes them, each token's masks as the processor sets them at the image and
    after it, the labels off the image, and no image token in the rest of the text, whatever ids it held."""
    from PIL import Image
    from transformers import AutoProcessor

    from leantune.data.packing import full_rows_batch
    from leantune.labels import IGNORE_INDEX
    from leantune.models.facts import run_model_facts
    from leantune.models.image_inputs import planned_image, with_planned_images

    path = tiny_vision(family)
    config = run_model_facts(parse_run_config(["--model_name", str(path)]).model).config
    image = planned_image(config)
    vocab = config.get_text_config().vocab_size
    rows, context = 4, -(-vocab // 4)
    batch = full_rows_batch(rows, context, vocab, False)
    batch["input_ids"] = torch.arange(rows * context).reshape(rows, context) % vocab  # every id, the image's too
    planned = with_planned_images(batch, config, image)
    made = AutoProcessor.from_pretrained(path)(images=[[Image.new("RGB", (28, 28))]], text=[marker + "x"],
                                               return_tensors="pt")
    text_keys = {"input_ids", "attention_mask", "labels"}
    assert set(planned) - text_keys == set(made) - text_keys
    specials = set(planned["input_ids"][:, :image.tokens].flatten().tolist())
    at_image = [i for i, token in enumerate(made["input_ids"][0].tolist()) if token in specials]
    assert (made["input_ids"][0, at_image].tolist() == image.first_tokens()
            == planned["input_ids"][0, :image.tokens].tolist())
    for key in set(made) - text_keys:
        ours, theirs = planned[key], made[key]
        assert ours.dtype == theirs.dtype and ours.shape[0] == rows * theirs.shape[0], key
        if key == "pixel_values":
            assert ours.shape[1:] == theirs.shape[1:]
        elif ours.dim() > 1 and ours.shape[1] == context:  # a mask over the text's tokens
            assert ours.shape[2:] == theirs.shape[2:], key
            assert torch.equal(ours[:, :image.tokens], theirs[:, at_image].expand(rows, *theirs[:, at_image].shape[1:]))
            assert (ours[:, image.tokens:] == theirs[0, -1]).all(), key  # the text after the image
        else:
            assert torch.equal(ours, theirs.expand_as(ours)), key
    assert (planned["labels"][:, :image.tokens] == IGNORE_INDEX).all()
    assert not torch.isin(planned["input_ids"][:, image.tokens:], torch.tensor(sorted(specials))).any()
    kept = batch["input_ids"][:, image.tokens:] < min(specials)  # a text id below the image's ids is left as it was
    assert torch.equal(planned["input_ids"][:, image.tokens:][kept], batch["input_ids"][:, image.tokens:][kept])
    assert planned["labels"][:, image.tokens:].equal(planned["input_ids"][:, image.tokens:])


def test_a_context_the_image_fills_is_refused_and_a_text_model_plans_no_image(tiny_vision):
    from leantune.config import ConfigError
    from leantune.data.packing import full_rows_batch
    from leantune.models.facts import run_model_facts
    from leantune.models.image_inputs import planned_image, with_planned_images
    from leantune.models.presets import model_config

    config = run_model_facts(parse_run_config(["--model_name", str(tiny_vision("gemma3"))]).model).config
    image = planned_image(config)
    with pytest.raises(ConfigError, match=f"--context_length {image.tokens}: a plan puts one image in each row"):
        with_planned_images(full_rows_batch(1, image.tokens, 64, False), config, image)
    assert with_planned_images(full_rows_batch(1, image.tokens + 1, 64, False), config, image)["labels"][0, -1] >= 0
    assert planned_image(model_config("tiny")) is None
    config.model_type = "paligemma"  # an image-and-text family whose images are not planned
    with pytest.raises(ConfigError, match="leantune plans the images of mllama, llava, gemma3"):
        planned_image(config)


@pytest.mark.parametrize("family", ["mllama", "llava", "gemma3", "qwen2_vl"])
def test_every_planned_image_is_what_its_class_takes_and_counts_its_own_tokens(tiny_vision, family):
    """Each planned input is an argument of the class's forward, the tokens a plan counts are the ones it writes,
    and none of the family's image ids (Qwen2-VL's video and vision start and end ones too) is left in the text."""
    import inspect

    from transformers import AutoModelForImageTextToText

    from leantune.data.packing import full_rows_batch
    from leantune.models.facts import run_model_facts
    from leantune.models.image_inputs import planned_image, with_planned_images

    config = run_model_facts(parse_run_config(["--model_name", str(tiny_vision(family))]).model).config
    image = planned_image(config)
    assert image.tokens == len(image.first_tokens())
    vocab = config.get_text_config().vocab_size
    batch = full_rows_batch(1, vocab + image.tokens, vocab, False)
    batch["input_ids"] = torch.arange(vocab + image.tokens).reshape(1, -1) % vocab
    planned = with_planned_images(batch, config, image)
    forward = inspect.signature(AutoModelForImageTextToText._model_mapping[type(config)].forward).parameters
    assert set(planned) - {"labels"} <= set(forward)
    names = ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id", "vision_end_token_id",
             "boi_token_index", "eoi_token_index")
    ids = {getattr(config, name) for name in names if isinstance(getattr(config, name, None), int)}
    assert not torch.isin(planned["input_ids"][:, image.tokens:], torch.tensor(sorted(ids))).any()


def test_llava_plans_its_published_image_tokens():
    """llava-1.5's shape: a 336 x 336 image in 14-pixel patches, 576 tokens, one more with the CLS feature kept."""
    from transformers import CLIPVisionConfig, LlavaConfig

    from leantune.models.image_inputs import planned_image

    config = LlavaConfig(vision_config=CLIPVisionConfig(image_size=336, patch_size=14).to_dict())
    assert planned_image(config).tokens == 576
    config.vision_feature_select_strategy = "full"
    assert planned_image(config).tokens == 577


def test_a_qwen2_vl_plan_at_its_published_ids_writes_no_vision_start_in_the_text():
    """Qwen2-VL's image ids sit at the top of its vocabulary, vision start the lowest (151652): every id from it up
    is kept out of the planned text, or a stray vision start would read as an image to its position ids."""
    from transformers import Qwen2VLConfig

    from leantune.data.packing import full_rows_batch
    from leantune.models.image_inputs import planned_image, with_planned_images

    config = Qwen2VLConfig()
    vocab = config.get_text_config().vocab_size
    batch = full_rows_batch(1, vocab, vocab, False)
    batch["input_ids"] = torch.arange(vocab).reshape(1, -1)
    image = planned_image(config)
    text = with_planned_images(batch, config, image)["input_ids"][0, image.tokens:]
    assert int(text.max()) == config.vision_start_token_id - 1
