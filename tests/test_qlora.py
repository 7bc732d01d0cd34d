"""QLoRA (--quantization 4bit|8bit): the base quantized as a run loads it, planned as it is held, trained,
checkpointed, resumed and saved as an adapter that loads on the unquantized base."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from leantune import finetuning
from leantune.builders.model import build_model
from leantune.checkpointing import FullCheckpointing, apply_activation_checkpointing
from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.memory import custom_ops
from leantune.planning.oom_advice import memory_fixes
from leantune.memory.tracker import carried_tensors
from leantune.models import quantized
from leantune.models.presets import model_config
from leantune.planning.fake_step import prepare_step, trace_step
from leantune.planning.flops import count_token_flops
from leantune.precision import choose_precision

from helpers import assert_same_gradients, gradients, make_batch, with_lora

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the measuring tools
from measure_peak import profiled_peak_bytes  # noqa: E402
from test_checkpointing_modes import POLICIES

bnb = pytest.importorskip("bitsandbytes")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
QLORA = ("--use_peft", "--quantization", "4bit")


def flags(*argv) -> object:
    return parse_run_config(["--context_length", "128", "--batch_size_training", "2", "--loss_chunk_size", "64",
                             *argv])


def _loaded(tiny_model_dir, *argv):
    """The model a run trains: loaded through from_pretrained with the run's BitsAndBytesConfig, LoRA attached."""
    cfg = parse_run_config(["--model_name", str(tiny_model_dir), *QLORA, *argv])
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lambda _line: None)
    return model


def _held(model) -> list:
    """(name, shape, dtype) of every parameter and of the quantization state it carries, in order; then each
    module's class (peft wraps a bitsandbytes layer in its own LoRA class) and a 4-bit layer's compute dtype."""
    held = []
    for name, param in model.named_parameters():
        state = getattr(param, "quant_state", None)
        held.append((name, tuple(state.shape) if state is not None else tuple(param.shape), param.dtype,
                     sorted((tuple(t.shape), t.dtype) for t in carried_tensors(param))))
    for name, module in model.named_modules():
        held.append((name, type(module).__module__, type(module).__name__, getattr(module, "compute_dtype", None)))
    return held


@pytest.mark.parametrize("precision, kind, nested", [([], "nf4", True), (["--model_dtype", "bfloat16"], "nf4", True),
                                                    (["--quant_type", "fp4"], "fp4", True),
                                                    (["--no_use_double_quant"], "nf4", False)],
                         ids=["float32", "bf16", "fp4", "single-quantization"])
def test_the_planner_traces_the_storages_a_run_loads(tiny_model_dir, precision, kind, nested):
    """transformers' loading and the planner's fake quantization give the same layers, LoRA classes,
    compute dtypes and tensors, with the 4-bit type and double quantization asked for."""
    loaded = _loaded(tiny_model_dir, *precision)
    cfg = parse_run_config(["--model_name", str(tiny_model_dir), *QLORA, *precision])
    planned = prepare_step(cfg, loaded.config, CPU, None).model
    assert _held(planned) == _held(loaded)
    q_proj = loaded.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__module__ == "peft.tuners.lora.bnb"
    bf16 = "bfloat16" in precision
    assert q_proj.base_layer.compute_dtype is (torch.bfloat16 if bf16 else torch.float32)
    four_bit = [name for name, module in loaded.named_modules() if isinstance(module, bnb.nn.Linear4bit)]
    assert len(four_bit) == 7 * loaded.config.num_hidden_layers  # every projection, nothing else
    assert type(loaded.get_output_embeddings()) is torch.nn.Linear  # the LM head stays unquantized
    state = loaded.base_model.model.model.layers[0].mlp.up_proj.weight.quant_state
    dtype = torch.bfloat16 if bf16 else torch.float32  # the weights' dtype, which dequantizing gives back
    assert (state.quant_type, state.blocksize, state.nested, state.dtype) == (kind, 64, nested, dtype)
    assert (state.dtype, state.absmax.dtype) == next(
        (s.dtype, s.absmax.dtype) for s in (getattr(p, "quant_state", None) for p in planned.parameters()) if s)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_quantized_layers_hold_at_most_0_3_of_their_bf16_bytes(preset):
    """Half a byte a weight, plus an 8-bit scale per 64 and, per layer, the double quantization's 1 KiB code
    book (which is why the test model's 64-wide layers, not measured here, take 0.36)."""
    planned = prepare_step(parse_run_config(list(QLORA)), model_config(preset), CPU, None).model
    held = quantized.base_weight_bytes(planned)
    assert 0.25 < held["quantized_bytes"] / held["bf16_bytes"] <= 0.27


@pytest.mark.parametrize("target", [CPU, CUDA], ids=["cpu", "gpu"])
@pytest.mark.parametrize("mode", ["none", "full", "selective_ops"])
def test_the_plan_equals_the_real_step(mode, target):
    """Fake and real quantization trace the same bytes; PyTorch's profiler, which sees inside bitsandbytes'
    kernels (the dequantized weight), counts the same step within checkpointing's RNG states."""
    cfg, config = flags(*QLORA, "--enable_activation_checkpointing"), model_config("tiny")
    predicted = trace_step(cfg, config, target, mode)
    assert predicted.peak_bytes == trace_step(cfg, config, target, mode, fake=True).peak_bytes
    assert predicted.peak_bytes == trace_step(cfg, config, target, mode, fake=False).peak_bytes
    if mode != "none":  # without checkpointing the bf16 CPU kernels allocate 400 KiB out of sight, quantized or not
        measured = profiled_peak_bytes(cfg, config, target, mode)
        # checkpointing's RNG states; with the GPU's bf16 on CPU stand-ins, also what the CPU's bf16 kernels
        # allocate for themselves, which depends on the processor (75 KiB for full on an AMD EPYC with
        # avx512_bf16, none on the Intel machine this test was first written on) and which no GPU allocates
        scratch = 96 * 1024 if target == CUDA else 0
        assert measured["missed_bytes"] == 0
        assert 0 <= measured["bytes"] - predicted.peak_bytes <= 4 * 5120 + 16 * 512 + scratch


def test_the_plan_counts_the_dequantized_weight_and_the_flops_of_its_matmul(monkeypatch):
    """bitsandbytes' 4-bit matmul dequantizes the weight inside one operator; the tracker replays it as its
    steps, so that weight is counted while it lives and the matmul's FLOPs are those of the base's."""
    config = model_config("tiny")
    plain, four_bit = (trace_step(flags("--use_peft", *extra), config, CPU, "none")
                       for extra in ((), ("--quantization", "4bit")))
    assert four_bit.flops == plain.flops
    assert 0 < four_bit.breakdown["parameter"] < 0.5 * plain.breakdown["parameter"]
    monkeypatch.setattr(custom_ops, "REPLAYED", {})
    unreplayed = trace_step(flags(*QLORA), config, CPU, "none")
    # without the replay the forward's peak misses a dequantized 704 x 256 float32 weight, and every base matmul
    assert four_bit.stage_peaks["forward"] - unreplayed.stage_peaks["forward"] >= 704 * 256 * 4
    assert unreplayed.flops < 0.7 * four_bit.flops


def test_the_1b_qlora_plan_fits_in_2_gib():
    cfg = parse_run_config([*QLORA, "--context_length", "2048", "--batch_size_training", "1",
                            "--enable_activation_checkpointing"])
    trace = trace_step(cfg, model_config("Llama-3.2-1B"), CUDA, "full")
    assert trace.peak_bytes < 1.5 * 2**30  # the table's 1.96 GiB adds the CUDA context and fragmentation
    assert trace.breakdown["parameter"] < 1.0 * 2**30  # bf16 it is 2.3 GiB


@pytest.mark.parametrize("mode", sorted(POLICIES))
def test_every_checkpointing_mode_gives_the_gradients_of_none(tiny_model_dir, mode):
    """float32 compute: exactly equal, as without quantization."""
    plain, checkpointed = (with_lora(_loaded_base(tiny_model_dir)) for _ in range(2))
    apply_activation_checkpointing(checkpointed, POLICIES[mode]())
    assert_same_gradients(plain, checkpointed)


@pytest.mark.parametrize("mode", ["full", "selective_ops", "every_n"])
def test_bf16_compute_gives_the_losses_of_none_in_every_mode(tiny_model_dir, tmp_path, mode):
    runs = {}
    for name, extra in (("none", []), (mode, ["--enable_activation_checkpointing",
                                              "--activation_checkpointing_mode", mode])):
        runs[name] = _run(tiny_model_dir, tmp_path / name, "--model_dtype", "bfloat16", *extra, steps=4)
    assert runs[mode] == pytest.approx(runs["none"], rel=1e-2)


def _loaded_base(tiny_model_dir, compute=torch.float32):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=compute)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=config, device_map="cpu",
                                                 dtype=torch.float32)
    quantized.prepare_quantized_for_training(model)
    return model.train()


class _CountQuantizedMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.name() == "bitsandbytes::gemm_4bit"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, recomputed", [("full", True), ("selective_ops", False)])
def test_selective_ops_saves_the_quantized_projections(tiny_model_dir, mode, recomputed):
    """Its rule saves a projection's output, also when it is bitsandbytes' matmul: no dequantize-and-multiply
    is run again in backward (full checkpointing reruns them all)."""
    model = with_lora(_loaded_base(tiny_model_dir))
    apply_activation_checkpointing(model, POLICIES[mode]())
    ids, labels = make_batch(model.config.vocab_size)
    from leantune.loss import causal_lm_loss_sum
    from leantune.training.step import forward_hidden

    loss = causal_lm_loss_sum(forward_hidden(model, ids), model.get_output_embeddings(), labels)
    with _CountQuantizedMatmuls() as counted:
        loss.backward()
    assert (counted.calls > 0) == recomputed


def test_validation_does_not_switch_the_base_to_an_inference_kernel(tiny_model_dir):
    """bitsandbytes repacks a 4-bit weight for a CPU inference kernel on an eval forward without gradients
    (on a CPU with AVX512-BF16), and that kernel has no backward: the layers below would get no gradient.
    The run's model (its builder) must train after validation as before it."""
    model = _loaded(tiny_model_dir)
    ids, labels = make_batch(model.config.vocab_size)
    before = gradients(model, ids, labels)
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    after = gradients(model, ids, labels)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert not any(layer.support_avx512bf16_for_cpu for layer in quantized.quantized_layers(model))


def _run(tiny_model_dir, out, *extra, steps=8, save_steps=0, resume=False, quant=QLORA):
    argv = ["--model_name", str(tiny_model_dir), *quant, *extra, "--max_train_step", str(steps), "--num_epochs", "1",
            "--context_length", "64", "--lr", "3e-3", "--batch_size_training", "2", "--run_validation", "false",
            "--num_workers_dataloader", "0", "--save_metrics", "--save_steps", str(save_steps),
            "--output_dir", str(out)]
    if resume:
        argv += ["--resume_from_checkpoint", "latest"]
    finetuning.run(parse_run_config(argv), log=lambda _line: None)
    return [s["loss"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]]


SWITCHES = {"no quantization": (("--use_peft",), "--quantization '4bit' -> None"),
            "fp4": ((*QLORA, "--quant_type", "fp4"), "--quant_type 'nf4' -> 'fp4'"),
            "single quantization": ((*QLORA, "--no_use_double_quant"), "--use_double_quant True -> False"),
            "bf16 compute": ((*QLORA, "--compute_dtype", "bfloat16"), "--compute_dtype 'auto' -> 'bfloat16'")}


def test_a_resumed_qlora_run_gives_the_losses_of_one_never_stopped(tiny_model_dir, tmp_path):
    whole = _run(tiny_model_dir, tmp_path / "whole", steps=6, save_steps=2)
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _run(tiny_model_dir, tmp_path / "resumed", steps=6, save_steps=2, resume=True)
    assert len(whole) == 6 and resumed[-4:] == whole[-4:]
    for name, (quant, message) in SWITCHES.items():  # another quantization would not continue the same run
        shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / name / "checkpoint-2")
        with pytest.raises(ConfigError, match=message):
            _run(tiny_model_dir, tmp_path / name, steps=6, resume=True, quant=quant)


def test_the_seed_command_with_4bit_trains_and_its_adapter_loads_on_the_unquantized_base(tiny_model_dir, tmp_path,
                                                                                         capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    code = finetuning.main(["--model_name", str(tiny_model_dir), "--enable_activation_checkpointing",
                            "--enable_memory_monitoring", "--use_peft", "--peft_method", "lora",
                            "--batch_size_training", "4", "--dataset", "alpaca_dataset", "--output_dir", str(out),
                            "--quantization", "4bit", "--context_length", "128", "--max_train_step", "30",
                            "--num_epochs", "1", "--lr", "3e-3", "--save_metrics", "--num_workers_dataloader", "0"])
    printed = capsys.readouterr().out
    assert code == 0 and "quantization: 14 Linear layers in 4bit (nf4 blocks of 64, double quantization" in printed
    losses = [s["loss"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1  # it learns (LoRA on q, v of a random 2-layer model)
    assert (out / "memory.jsonl").is_file() and (out / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out))
    lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # the trained adapter, not a fresh one
    generated = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 7)
    merged = model.merge_and_unload()
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_an_8bit_base_trains_but_is_not_planned(tiny_model_dir, tmp_path):
    losses = _run(tiny_model_dir, tmp_path / "int8", steps=4, quant=("--use_peft", "--quantization", "8bit"))
    assert len(losses) == 4 and all(loss == loss for loss in losses)
    cfg = flags("--use_peft", "--quantization", "8bit")
    held = quantized.base_weight_bytes(_loaded(tiny_model_dir, "--quantization", "8bit"))
    assert 0.5 <= held["quantized_bytes"] / held["bf16_bytes"] < 0.55  # int8 codes once, and a scale per row
    with pytest.raises(ConfigError, match="--quantization 8bit: the planner cannot trace LLM.int8"):
        trace_step(cfg, model_config("tiny"), CPU, "none")
    plain = count_token_flops(flags("--use_peft"), model_config("tiny"), CPU)
    assert count_token_flops(cfg, model_config("tiny"), CPU) == plain  # the same matmuls, counted unquantized


def test_auto_mode_and_batch_plan_a_quantized_base(tiny_model_dir, tmp_path):
    """What auto decides with a 4-bit base: a mode and the largest batch whose plan fits 0.012 GiB, traced on the
    quantized layers (the batch one larger does not fit). A small budget keeps the batches searched small (11 to 19
    rows a mode) and the test short."""
    budget = 0.012
    losses = _run(tiny_model_dir, tmp_path / "auto", "--enable_activation_checkpointing",
                  "--activation_checkpointing_mode", "auto", "--auto_batch_size", "--memory_budget_gb", str(budget),
                  steps=2)
    metrics = json.loads((tmp_path / "auto" / "metrics.json").read_text())
    config = metrics["config"]
    mode = config["activation_checkpointing_mode"] if config["enable_activation_checkpointing"] else "none"
    batch = config["batch_size_training"]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    assert mode in ("none", "full", "every_n", "selective_ops") and batch > 2  # grown from 2
    assert _fits(tiny_model_dir, mode, batch, budget) and not _fits(tiny_model_dir, mode, batch + 1, budget)


def _fits(tiny_model_dir, mode: str, batch: int, budget_gb: float) -> bool:
    """Whether the plan of the 4-bit run at ``batch`` with ``mode`` fits ``budget_gb``."""
    from transformers import AutoConfig

    from leantune.planning.plan import plan_modes

    cfg = parse_run_config(["--model_name", str(tiny_model_dir), *QLORA, "--context_length", "64",
                            "--batch_size_training", str(batch)])
    config = AutoConfig.from_pretrained(tiny_model_dir)
    return plan_modes(cfg, config, CPU, [mode], int(budget_gb * 2**30))[0].fits


def test_compute_dtype_refuses_a_dtype_the_rest_of_the_step_does_not_compute_in():
    cfg = parse_run_config([*QLORA, "--compute_dtype", "float32"])
    on_gpu = choose_precision(cfg.model, cfg.training, cfg.peft, CUDA, bf16_supported=True)
    with pytest.raises(ConfigError, match="--compute_dtype float32: this run computes in bfloat16 .autocast., and "
                       "bitsandbytes' matmul would run apart from it in float32; use --compute_dtype auto or bfloat16"):
        quantized.compute_dtype(cfg.quant, on_gpu)
    assert quantized.compute_dtype(parse_run_config(list(QLORA)).quant, on_gpu) is torch.bfloat16
    fp16 = parse_run_config([*QLORA, "--use_fp16", "--compute_dtype", "bfloat16"])
    with pytest.raises(ConfigError,
                       match="this run computes in float16 .autocast.*use --compute_dtype auto or float16"):
        quantized.compute_dtype(fp16.quant,
                                choose_precision(fp16.model, fp16.training, fp16.peft, CUDA, bf16_supported=False))
    for half in ("bfloat16", "float16"):  # a float32 GPU run: no bf16 on the GPU, or mixed precision off
        no_bf16 = parse_run_config([*QLORA, "--compute_dtype", half])
        with pytest.raises(ConfigError, match=f"--compute_dtype {half}: this GPU run computes in float32"):
            quantized.compute_dtype(no_bf16.quant, choose_precision(no_bf16.model, no_bf16.training, no_bf16.peft, CUDA,
                                                                    bf16_supported=False))
    on_cpu = parse_run_config([*QLORA, "--compute_dtype", "bfloat16"])
    assert quantized.compute_dtype(
        on_cpu.quant, choose_precision(on_cpu.model, on_cpu.training, on_cpu.peft, CPU)) is torch.bfloat16


@pytest.mark.parametrize("target, asked", [(CUDA, True), (CPU, False)], ids=["gpu", "cpu"])
def test_a_gpu_plan_answers_the_device_free_autocast_question_as_the_gpu_would(target, asked):
    """peft's bitsandbytes LoRA layers cast their input to float32 only when ``torch.is_autocast_enabled()``
    (CUDA's autocast) says no: a GPU plan, traced under CPU autocast, must not trace that cast."""
    step = prepare_step(flags(*QLORA), model_config("tiny"), target, "none")
    answers = []
    q_proj = step.model.base_model.model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_pre_hook(lambda *_: answers.append(torch.is_autocast_enabled()))
    step.run()
    assert answers == [asked] and torch.is_autocast_enabled() is False


def test_quantization_without_bitsandbytes_is_refused_before_anything_loads(tiny_model_dir, tmp_path, monkeypatch,
                                                                             capsys):
    monkeypatch.setattr(quantized, "bitsandbytes_installed", lambda: False)
    code = finetuning.main(["--model_name", str(tiny_model_dir), *QLORA, "--output_dir", str(tmp_path / "o")])
    assert code == 2
    assert "--quantization 4bit: needs bitsandbytes (pip install 'leantune[lowbit]'" in capsys.readouterr().err


def test_the_oom_advice_offers_a_4bit_base_to_a_lora_run_only():
    def advice(*argv):
        return " ".join(memory_fixes(parse_run_config(list(argv)), CUDA))

    assert "--quantization 4bit" in advice("--use_peft")
    assert "--quantization 4bit" not in advice(*QLORA)
    assert "--quantization 4bit" in advice("--use_peft", "--enable_fsdp")  # a 4-bit base shards
    assert "--quantization 4bit" not in advice("--use_peft", "--enable_fsdp", "--low_cpu_fsdp")
    assert "--quantization 4bit" not in advice()  # full fine-tuning cannot train a quantized base


def test_full_checkpointing_is_applied_once_on_a_quantized_base(tiny_model_dir):
    model = with_lora(_loaded_base(tiny_model_dir))
    report = apply_activation_checkpointing(model, FullCheckpointing())
    assert report.checkpointed_layers == model.config.num_hidden_layers


def test_a_4bit_plan_of_biased_linear_layers_equals_the_measured_step(family_dir):
    """Qwen2's q, k and v have biases: the measured model's converted layers keep them (they were left on meta)."""
    import torch

    from leantune.flags import parse_run_config
    from leantune.models.facts import run_model_facts
    from leantune.planning.fake_step import trace_step

    cfg = parse_run_config(["--model_name", str(family_dir("qwen2")), "--use_peft", "--lora_dropout", "0",
                            "--quantization", "4bit", "--batch_size_training", "2", "--context_length", "64"])
    config = run_model_facts(cfg.model).config
    cpu = torch.device("cpu")
    predicted, measured = trace_step(cfg, config, cpu, "none"), trace_step(cfg, config, cpu, "none", fake=False)
    assert predicted.peak_bytes == measured.peak_bytes and predicted.breakdown == measured.breakdown
