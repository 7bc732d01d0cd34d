"""What leantune refuses about a model before any weight loads, and what it runs on every family.

The refusals: a forward that transforms its logits in a way leantune does not know (the self-check),
an attention implementation the model or the machine cannot run, LoRA targets the model does not
have, checkpointing a model without checkpointable layers. Each is refused with a message naming the
architecture and the fix, and no weight is read (``load_model`` fails the test if called). Then
resume and FSDP2 on families other than Llama.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_distributed import DIST_LOSS_TOL, FAST, step_losses, torchrun
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

import leantune.builders.model as builders_model
import leantune.models.facts as facts_module
from leantune import finetuning
from leantune.flags import parse_run_config
from leantune.config import ConfigError, TrainingConfig
from leantune.planning import plan_command as plan_cli
from leantune.planning.fake_step import trace_step
from leantune.models.facts import run_model_facts
from leantune.models.tiny import FAMILIES

from conftest import TEST_SHAPE

CPU = torch.device("cpu")


class RescaledConfig(LlamaConfig):
    model_type = "leantune_test_rescaled"


class RescaledForCausalLM(LlamaForCausalLM):
    """A Llama whose forward halves its logits: a transform no config field tells leantune about."""

    config_class = RescaledConfig

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        logits = out.logits * 0.5
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


AutoConfig.register(RescaledConfig.model_type, RescaledConfig)
AutoModelForCausalLM.register(RescaledConfig, RescaledForCausalLM)


def _config_of_a_class_whose_forward(logits_of, name: str, **fields):
    """A Llama config whose registered class's forward makes its logits with ``logits_of(model, input_ids)``
    and its loss from them as every transformers class does."""

    class Changed(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = logits_of(self, input_ids)
            loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    class ChangedConfig(LlamaConfig):
        model_type = f"leantune_test_{name}"

    Changed.config_class = ChangedConfig
    Changed.__name__ = Changed.__qualname__ = f"{name.title().replace('_', '')}ForCausalLM"
    AutoConfig.register(ChangedConfig.model_type, ChangedConfig, exist_ok=True)
    AutoModelForCausalLM.register(ChangedConfig, Changed, exist_ok=True)
    return ChangedConfig(**TEST_SHAPE, vocab_size=1000, **fields)


def _hidden(model, input_ids, **to_decoder):
    return model.model(input_ids=input_ids, **to_decoder).last_hidden_state


FORWARDS = {  # name: (how the logits are made, config fields): each differs from leantune's path
    "doubled_gradient": (lambda m, ids: (lambda z: z + (z - z.detach()))(m.lm_head(_hidden(m, ids))), {}),
    "hidden_gradient": (lambda m, ids: m.lm_head((lambda h: h + (h - h.detach()))(_hidden(m, ids))), {}),
    "clamped": (lambda m, ids: m.lm_head(_hidden(m, ids)).clamp(-20, 20), {}),  # bends only logits beyond 20
    "rescaled_slightly": (lambda m, ids: m.lm_head(_hidden(m, ids)) * 1.01, {}),  # near the 1e-4 tolerance
    "dropped": (lambda m, ids: torch.nn.functional.dropout(m.lm_head(_hidden(m, ids)), 0.1, m.training), {}),
    "tied_scaled": (lambda m, ids: m.lm_head(_hidden(m, ids) * (0.5 if m.config.tie_word_embeddings else 1.0)),
                    dict(tie_word_embeddings=True)),
    "shifted_positions": (lambda m, ids: m.lm_head(_hidden(m, ids, position_ids=2 * torch.arange(ids.shape[1])[None])),
                          {}),
    "auxiliary": (lambda m, ids: m.lm_head(_hidden(m, ids)) + (lambda out: 0.0 if out.aux_loss is None else
                                                               out.aux_loss)(m.model(input_ids=ids)), {}),
}


@pytest.mark.parametrize("name", FORWARDS)
def test_the_check_sees_what_a_forward_does_beyond_leantunes_path(name):
    """Only a gradient, only large logits, only in training, only for a tied config, what it hands the decoder,
    what it reads back from it: each is refused."""
    from leantune.builders.own_loss import OwnLossMismatch, check_own_loss
    from leantune.models.facts import ModelFacts

    logits_of, fields = FORWARDS[name]
    config = _config_of_a_class_whose_forward(logits_of, name, **fields)
    with pytest.raises(OwnLossMismatch, match=f"{name.title().replace('_', '')}ForCausalLM: "):
        check_own_loss(TrainingConfig(), ModelFacts(config), sharded=False)


def test_the_check_leaves_the_runs_random_numbers_alone(monkeypatch):
    """Its own generator: the CPU state is as it was, and no GPU seed is set (a CUDA run's dropout keeps --seed)."""
    from leantune.builders.own_loss import check_own_loss
    from leantune.models.facts import ModelFacts

    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: seeded.append(seed))
    torch.manual_seed(1234)
    seeded.clear()
    before = torch.random.get_rng_state()
    check_own_loss(TrainingConfig(), ModelFacts(LlamaConfig(**TEST_SHAPE, vocab_size=1000)), sharded=False)
    assert torch.equal(torch.random.get_rng_state(), before) and seeded == []


REAL_SHAPES = {  # full-size configs (built on the meta device only) of classes a shrunk copy could not build
    "phi3.5-longrope": ("phi3", dict(hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
                                     original_max_position_embeddings=4096, max_position_embeddings=131072,
                                     rope_scaling=dict(type="longrope", short_factor=[1.0] * 48,
                                                       long_factor=[1.0] * 48))),
    "deepseek-v3": ("deepseek_v3", {}), "falcon-h1": ("falcon_h1", dict(lm_head_multiplier=0.5)),
    "gemma3-multimodal": ("gemma3", {}), "gemma3n": ("gemma3n_text", {}), "mixtral": ("mixtral", {}),
    "granite4": ("granitemoehybrid", dict(logits_scaling=4.0)),
    "hyperclovax": ("hyperclovax", dict(logits_scaling=0.25)),
    "gpt2": ("gpt2", {}), "cwm-strict-token-ids": ("cwm", {}),
}


@pytest.mark.parametrize("model_type, fields", REAL_SHAPES.values(), ids=REAL_SHAPES.keys())
def test_real_shaped_configs_are_checked_at_their_own_size(model_type, fields):
    """The check never shrinks the decoder (it stands in for it), so configs whose fields depend on their widths
    pass."""
    from leantune.builders.own_loss import check_own_loss
    from leantune.models.facts import ModelFacts

    check = check_own_loss(TrainingConfig(), ModelFacts(AutoConfig.for_model(model_type, **fields)), sharded=False)
    assert check.loss_difference < 1e-5 and check.gradient_difference < 1e-4
    assert ((model_type in ("falcon_h1", "granitemoehybrid", "hyperclovax", "gemma3n_text"))
            != check.transform.is_identity)


def test_the_run_builds_the_attention_it_resolved_and_the_planner_its_stand_in(monkeypatch, family_dir):
    """flex_attention for a GPU: the loaded model and a --low_cpu_fsdp rank's meta model get flex_attention itself;
    only the planner's and the check's models build varlen in its place (no mask, as flex keeps none)."""
    from leantune.builders.model import build_model
    from leantune.models.facts import meta_model
    from leantune.precision import choose_precision

    cfg = parse_run_config(["--model_name", str(family_dir("llama")), "--attn_implementation", "flex_attention"])
    facts = run_model_facts(cfg.model, "cuda")
    asked = []
    monkeypatch.setattr(builders_model, "load_model",
                        lambda _cfg, _dtype, attention, *_quantized, **_config: asked.append(attention) or 1 / 0)
    monkeypatch.setattr(builders_model, "meta_model", lambda _config, _dtype, cpu_stand_in=True: asked.append(
        cpu_stand_in) or 1 / 0)
    for on_meta in (False, True):
        with pytest.raises(ZeroDivisionError):
            build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lambda _line: None,
                        facts=facts, on_meta=on_meta)
    assert asked == ["flex_attention", False]
    assert meta_model(facts.config, torch.float32).config._attn_implementation == "varlen"


@pytest.mark.parametrize("attention", ["flex_attention", "flash_attention_2"])
def test_a_gpu_plan_with_a_gpu_only_attention_traces_varlen_in_its_place(family_dir, attention, capsys):
    argv = ["--model_name", str(family_dir("llama")), "--device", "cuda", "--use_peft", "--context_length", "64",
            "--batch_size_training", "1", "--attn_implementation", attention, "--json"]
    assert plan_cli.main(argv) == 0, capsys.readouterr().err
    planned = json.loads(capsys.readouterr().out)
    assert plan_cli.main([*argv[:-2], "varlen", "--json"]) == 0
    assert planned == json.loads(capsys.readouterr().out)


@pytest.fixture
def no_weights(monkeypatch):
    """The refusals come before any weight loads."""
    monkeypatch.setattr(builders_model, "load_model", lambda *a, **k: pytest.fail("weights loaded before the refusal"))


def _refused(argv, tmp_path, capsys, code=1) -> str:
    assert finetuning.main([*argv, "--output_dir", str(tmp_path / "out"), "--num_workers_dataloader", "0",
                            "--context_length", "64"]) == code
    err = capsys.readouterr().err
    assert err.startswith("leantune: error: ") and "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def rescaled_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("rescaled")
    tokenizer_files = [f for f in tiny_model_dir.iterdir() if f.name.startswith(("tokenizer", "special"))]
    for file in tokenizer_files:
        shutil.copy(file, path / file.name)
    config = RescaledConfig(**TEST_SHAPE, vocab_size=AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    RescaledForCausalLM(config).save_pretrained(path)
    return path


def test_a_forward_with_an_unknown_logit_transform_is_refused(rescaled_dir, tmp_path, capsys, no_weights):
    err = _refused(["--model_name", str(rescaled_dir), "--use_peft"], tmp_path, capsys)
    assert "RescaledForCausalLM: leantune's loss is not the model's own" in err
    assert "relative difference" in err and "please report the architecture" in err
    assert plan_cli.main(["--model_name", str(rescaled_dir), "--memory_budget_gb", "1"]) == 2
    assert "RescaledForCausalLM: leantune's loss is not the model's own" in capsys.readouterr().err


def test_gemma2_takes_eager_attention_and_refuses_sdpa(family_dir, tmp_path, capsys, no_weights):
    assert run_model_facts(parse_run_config(["--model_name", str(family_dir("gemma2"))]).model).attention == "eager"
    err = _refused(["--model_name", str(family_dir("gemma2")), "--attn_implementation", "sdpa"], tmp_path, capsys, 2)
    assert ("--attn_implementation sdpa: Gemma2ForCausalLM does not support it; it supports eager, flex_attention, "
            "flash_attention_2 (or auto)") in err


def test_the_loaded_model_has_the_attention_asked_for(family_dir, tmp_path):
    lines: list[str] = []
    argv = ["--model_name", str(family_dir("llama")), "--attn_implementation", "eager", "--max_train_step", "1",
            "--num_epochs", "1", "--context_length", "64", "--run_validation", "false", "--save_model", "false",
            "--num_workers_dataloader", "0", "--output_dir", str(tmp_path)]
    finetuning.run(parse_run_config(argv), log=lines.append)
    assert [line for line in lines if line.startswith("model:")][0].endswith("float32 weights, eager attention) on cpu")


def test_flex_attention_needs_a_gpu(family_dir, tmp_path, capsys, no_weights):
    err = _refused(["--model_name", str(family_dir("llama")), "--attn_implementation", "flex_attention"],
                   tmp_path, capsys, 2)
    assert "--attn_implementation flex_attention: needs a CUDA GPU (this run is on cpu" in err


def test_the_plan_shows_what_eager_attention_keeps(family_dir):
    """Eager attention keeps every layer's batch x heads x seq x seq probabilities for backward; SDPA keeps its
    output and log-sum-exp instead (here 14% of the scores' size). Rows packed concatenated: SDPA on its causal
    path, with no mask (packing apart adds one to both)."""
    batch, seq = 2, 64
    peaks = {}
    for attention in ("sdpa", "eager"):
        cfg = parse_run_config(["--model_name", str(family_dir("llama")), "--use_peft", "--batch_size_training",
                                str(batch), "--context_length", str(seq), "--attn_implementation", attention,
                                "--packed_examples", "concatenated"])
        peaks[attention] = trace_step(cfg, run_model_facts(cfg.model).config, CPU, "none").peak_bytes
    scores = TEST_SHAPE["num_hidden_layers"] * batch * TEST_SHAPE["num_attention_heads"] * seq * seq * 4
    assert peaks["eager"] - peaks["sdpa"] >= 0.8 * scores


def test_default_lora_targets_missing_from_phi3_are_refused_with_its_names(family_dir, tmp_path, capsys, no_weights):
    err = _refused(["--model_name", str(family_dir("phi3")), "--use_peft"], tmp_path, capsys)
    assert ("--lora_target_modules: q_proj v_proj not found in Phi3ForCausalLM; its linear layers are down_proj "
            "gate_up_proj o_proj qkv_proj") in err and "--lora_target_modules all-linear" in err


def test_all_linear_adapts_every_linear_layer_but_the_head(family_dir, tmp_path):
    argv = ["--model_name", str(family_dir("phi3")), "--use_peft", "--lora_target_modules", "all-linear",
            "--max_train_step", "1", "--num_epochs", "1", "--context_length", "64", "--run_validation", "false",
            "--num_workers_dataloader", "0", "--output_dir", str(tmp_path)]
    finetuning.run(parse_run_config(argv), log=lambda _line: None)
    adapted = {name.rsplit(".", 1)[-1] for name in json.loads((tmp_path / "adapter_config.json").read_text())[
        "target_modules"]}
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_checkpointing_a_model_without_checkpointable_layers_is_refused(family_dir, tmp_path, capsys, no_weights,
                                                                         monkeypatch):
    monkeypatch.setattr(facts_module, "decoder_layers", lambda model: [])
    err = _refused(["--model_name", str(family_dir("cohere")), "--enable_activation_checkpointing"], tmp_path, capsys)
    assert ("--enable_activation_checkpointing: CohereForCausalLM has no decoder layers leantune can checkpoint"
            in err) and "will not train it without the checkpointing asked for" in err


def _losses(out):
    return [s["loss"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]]


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_reproduces_the_losses_on_every_family(family_dir, family, tmp_path):
    """LoRA on every linear layer, dropout on, selective checkpointing: stopped at step 2 and resumed, steps 3-4
    equal."""
    argv = ["--model_name", str(family_dir(family)), "--use_peft", "--lora_target_modules", "all-linear",
            "--lora_dropout", "0.1", "--enable_activation_checkpointing", "--activation_checkpointing_mode",
            "selective_ops", "--max_train_step", "4", "--num_epochs", "1", "--context_length", "64", "--lr", "3e-3",
            "--batch_size_training", "2", "--run_validation", "false", "--num_workers_dataloader", "0",
            "--save_metrics", "--save_steps", "2", "--output_dir", str(tmp_path / "whole")]
    finetuning.run(parse_run_config(argv), log=lambda _line: None)
    argv[-1] = str(tmp_path / "resumed")
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    finetuning.run(parse_run_config([*argv, "--resume_from_checkpoint", "latest"]), log=lambda _line: None)
    whole, resumed = _losses(tmp_path / "whole"), _losses(tmp_path / "resumed")
    assert len(whole) == 4 and resumed[-2:] == whole[-2:]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_two_ranks_give_the_losses_of_one_process_on_other_families(family_dir, family, tmp_path):
    """Gemma 2 (eager attention, soft-capped logits) and Phi-3 (fused projections) under FSDP2 on two ranks."""
    common = ["--model_name", str(family_dir(family)), *FAST, "--use_peft", "--lora_target_modules", "all-linear",
              "--lora_dropout", "0", "--enable_activation_checkpointing", "--max_train_step", "3"]
    finetuning.run(parse_run_config([*common, "--batch_size_training", "4", "--output_dir", str(tmp_path / "one")]),
                   log=lambda _line: None)
    result = torchrun([*common, "--batch_size_training", "2", "--enable_fsdp", "--output_dir", str(tmp_path / "two")])
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(one) == len(two) == 3
    # these strong heads give losses of 20-30: float32 rounding of the sharded sums is 1e-7 of that
    assert two == pytest.approx(one, rel=1e-6, abs=DIST_LOSS_TOL)


def test_flash_attention_2_is_refused_below_ampere(monkeypatch):
    from leantune.models import attention

    config = AutoConfig.for_model("llama", num_hidden_layers=1, hidden_size=64, num_attention_heads=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    with pytest.raises(ConfigError, match=r"FlashAttention 2 runs on compute capability 8.0 \(Ampere\) or newer, "
                                          r"and this GPU is 7.5; use sdpa"):
        attention.resolve_attention(config, "flash_attention_2", "cuda")
    assert attention.resolve_attention(config, "flash_attention_2", "cuda", installed_here=False) == \
        "flash_attention_2"  # a plan for another machine does not ask this one's GPU
