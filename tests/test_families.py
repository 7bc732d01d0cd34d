"""Every decoder family trains on exactly its own loss, or is refused before a weight loads.

Each family is built tiny with ``save_pretrained`` (``leantune.models.tiny``), with its head's
transform made strong (Granite's logits_scaling, Cohere's logit_scale, Gemma's soft-cap) and its
head's weights large, so that leaving a transform out would move the loss by far more than rounding
(``test_the_transform_matters_here`` holds that). leantune's loss is compared with the model's own
``forward(labels=...)`` on the same batch, as leantune builds and joins the model for a run.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import STRONG
from helpers import make_batch
from transformers import AutoModelForCausalLM

from leantune import finetuning
from leantune.builders.model import build_model
from leantune.builders.loss_and_optimizer import loss_model_for
from leantune.flags import parse_run_config
from leantune.labels import count_targets
from leantune.loss import IDENTITY
from leantune.models.facts import run_model_facts
from leantune.model_structure import unwrap_model
from leantune.models.tiny import FAMILIES
from leantune.planning.fake_step import trace_step
from leantune.precision import choose_precision

CPU = torch.device("cpu")
ATTENTION = {"gemma2": "eager"}  # what auto takes; varlen elsewhere (no sliding window binds at these positions)
LORA_TARGETS = {"phi3": ["qkv_proj", "o_proj"]}  # Phi-3 fuses q, k and v


def _flags(path, kind: str, *extra: str):
    lora = ["--use_peft", "--lora_dropout", "0", "--lora_target_modules",
            *LORA_TARGETS.get(path.name, ["q_proj", "v_proj"])] if kind == "lora" else []
    return parse_run_config(["--model_name", str(path), *lora, *extra])


def _head_input_and_grads(model, compute):
    """The loss ``compute`` gives, the gradient of the head's input, and every trainable parameter's gradient."""
    captured = []

    def keep(_module, _args, out) -> None:  # returns None: the output is left as it is
        out.last_hidden_state.retain_grad()
        captured.append(out.last_hidden_state)

    hook = unwrap_model(model).get_decoder().register_forward_hook(keep)
    try:
        loss = compute()
        loss.backward()
    finally:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), captured[0].grad.clone(), grads


def _ours_and_own(path, kind, loss, autocast=None):
    cfg = _flags(path, kind, *(["--loss_chunk_size", "0"] if loss == "plain" else ["--loss_chunk_size", "7"]))
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lambda _line: None)
    with torch.no_grad():  # peft starts B at zero, which would make every A gradient zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    loss_model = loss_model_for(model, cfg.training, sharded=False)
    ids, labels = make_batch(unwrap_model(model).config.vocab_size, seq=24)
    context = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        ours = _head_input_and_grads(model, lambda: loss_model(ids, labels) / count_targets(labels))
        own = _head_input_and_grads(model, lambda: model(input_ids=ids, labels=labels).loss)
    return ours, own, loss_model


@pytest.mark.parametrize("loss", ["chunked", "plain"])
@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_loss_and_gradients_are_the_models_own(family_dir, family, kind, loss):
    (our_loss, our_head_grad, our_grads), (own_loss, own_head_grad, own_grads), _ = _ours_and_own(
        family_dir(family), kind, loss)
    assert abs(float(our_loss) - float(own_loss)) <= 1e-5 * abs(float(own_loss))
    assert _relative_difference(our_head_grad, own_head_grad) <= 1e-5
    assert our_grads.keys() == own_grads.keys() and our_grads
    for name in own_grads:
        assert _relative_difference(our_grads[name], own_grads[name]) <= 1e-4, name


def _relative_difference(ours: torch.Tensor, own: torch.Tensor) -> float:
    """The largest difference over the largest value: float32 rounding, not the elementwise noise of tiny entries."""
    scale = float(own.abs().max())
    assert scale > 0, "a gradient that is zero everywhere tests nothing"
    return float((ours - own).abs().max()) / scale


@pytest.mark.parametrize("loss", ["chunked", "plain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_under_bf16_autocast_the_loss_is_the_models_own_within_bf16(family_dir, family, loss):
    (our_loss, our_head_grad, _), (own_loss, own_head_grad, _), _ = _ours_and_own(
        family_dir(family), "full", loss, autocast=torch.bfloat16)
    assert abs(float(our_loss) - float(own_loss)) <= 2e-2 * abs(float(own_loss))
    cosine = torch.nn.functional.cosine_similarity(our_head_grad.float().flatten(), own_head_grad.float().flatten(), 0)
    assert cosine > 0.99


@pytest.mark.parametrize("family", sorted(STRONG))
def test_the_transform_matters_here(family_dir, family):
    """Without the family's transform the loss would be far off: the tests above would catch its absence."""
    (our_loss, _, _), _, loss_model = _ours_and_own(family_dir(family), "full", "chunked")
    assert not loss_model.loss_fn.transform.is_identity
    loss_model.loss_fn.transform = IDENTITY
    ids, labels = make_batch(loss_model.model.config.vocab_size, seq=24)
    with torch.no_grad():
        untransformed = float(loss_model(ids, labels)) / count_targets(labels)
    assert abs(untransformed - float(our_loss)) > 0.05 * float(our_loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_logs_the_check_and_its_first_loss_is_the_models_own(family_dir, family, tmp_path, write_jsonl):
    """The whole run: one repeated text record, so the first batch is known; its step-1 loss is the model's own."""
    path = family_dir(family)
    data = write_jsonl([{"text": "The quick brown fox jumps over the lazy dog. " * 3}] * 8)
    argv = ["--model_name", str(path), "--use_peft", "--lora_target_modules", *LORA_TARGETS.get(family, ["q_proj"]),
            "--dataset", "custom_dataset", "--data_path", str(data), "--context_length", "32",
            "--batch_size_training", "1", "--max_train_step", "1", "--num_epochs", "1", "--run_validation", "false",
            "--num_workers_dataloader", "0", "--save_metrics", "--save_model", "false", "--output_dir",
            str(tmp_path / "out")]
    lines: list[str] = []
    finetuning.run(parse_run_config(argv), log=lines.append)
    assert any(line.startswith(f"loss check: {type(unwrap_model(_loaded(path))).__name__}'s own loss reproduced")
               for line in lines)
    assert any(f"{ATTENTION.get(family, 'varlen')} attention" in line for line in lines if line.startswith("model:"))
    step_1 = json.loads((tmp_path / "out" / "metrics.json").read_text())["train_steps"][0]["loss"]
    assert step_1 == pytest.approx(_own_first_batch_loss(path, parse_run_config(argv)), rel=1e-5)


def _loaded(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _own_first_batch_loss(path, cfg) -> float:
    from leantune.builders.loaders import RunData
    from leantune.models.loading import load_tokenizer

    loader, _ = RunData(cfg.data, cfg.training, load_tokenizer(cfg.model), log=lambda _line: None).loaders(cfg.training)
    batch = next(iter(loader))
    with torch.no_grad():
        return float(_loaded(path)(input_ids=batch["input_ids"], labels=batch["labels"]).loss)


@pytest.mark.parametrize("mode", ["full", "every_n", "selective_ops"])
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_gives_exactly_the_plain_gradients(family_dir, family, mode):
    grads = []
    for flags in ([], ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode]):
        cfg = _flags(family_dir(family), "full", *flags)
        model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lambda _line: None)
        ids, labels = make_batch(model.config.vocab_size, seq=24)
        loss_model_for(model, cfg.training, sharded=False)(ids, labels).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("mode", ["none", "selective_ops"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_equals_the_real_steps_count(family_dir, family, mode):
    cfg = _flags(family_dir(family), "lora", "--batch_size_training", "2", "--context_length", "64")
    config = run_model_facts(cfg.model).config
    predicted, measured = trace_step(cfg, config, CPU, mode), trace_step(cfg, config, CPU, mode, fake=False)
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.breakdown == measured.breakdown
