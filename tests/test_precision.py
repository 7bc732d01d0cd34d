"""The precision decision over device kind x bf16 support x precision flags x LoRA, without a GPU."""

from __future__ import annotations

import pytest
import torch

from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.precision import choose_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (device, bf16 supported, flags, LoRA) -> (weights dtype, autocast dtype, loss scaling)
TABLE = [
    # the CPU: float32 whatever the precision flags say
    (CPU, False, [], False, (F32, None, False)),
    (CPU, False, [], True, (F32, None, False)),
    (CPU, False, ["--use_fp16"], True, (F32, None, False)),
    (CPU, False, ["--mixed_precision", "false"], True, (F32, None, False)),
    (CPU, False, ["--model_dtype", "bfloat16"], True, (BF16, None, False)),
    # a bf16 GPU, defaults: bf16 autocast; LoRA's frozen base in bf16, full fine-tuning keeps fp32 masters
    (CUDA, True, [], False, (F32, BF16, False)),
    (CUDA, True, [], True, (BF16, BF16, False)),
    # --use_fp16 on a bf16 GPU: fp16 autocast over float32 weights (not bf16, and not an fp16 base,
    # whose residual stream would run in fp16 outside autocast)
    (CUDA, True, ["--use_fp16"], False, (F32, F16, True)),
    (CUDA, True, ["--use_fp16"], True, (F32, F16, True)),
    (CUDA, True, ["--mixed_precision", "false"], False, (F32, None, False)),
    (CUDA, True, ["--mixed_precision", "false"], True, (F32, None, False)),
    # a GPU without bf16 (V100, T4): float32 unless --use_fp16
    (CUDA, False, [], False, (F32, None, False)),
    (CUDA, False, [], True, (F32, None, False)),
    (CUDA, False, ["--use_fp16"], False, (F32, F16, True)),
    (CUDA, False, ["--use_fp16"], True, (F32, F16, True)),
    # explicit weight dtypes: autocast follows them
    (CUDA, True, ["--model_dtype", "bfloat16"], False, (BF16, BF16, False)),
    (CUDA, True, ["--model_dtype", "float32"], True, (F32, BF16, False)),
    (CUDA, True, ["--model_dtype", "float16"], True, (F16, F16, True)),
    (CUDA, False, ["--model_dtype", "float32", "--use_fp16"], True, (F32, F16, True)),
]


def run_precision(cfg, device, **kwargs):
    """``choose_precision`` of a whole run's sections."""
    return choose_precision(cfg.model, cfg.training, cfg.peft, device, **kwargs)


def _cfg(flags, lora):
    return parse_run_config([*flags, *(["--use_peft"] if lora else [])])


@pytest.mark.parametrize("device, bf16, flags, lora, expected", TABLE,
                         ids=[f"{d.type}-bf16{b}-{'_'.join(f) or 'default'}-{'lora' if lora else 'full'}"
                              for d, b, f, lora, _ in TABLE])
def test_precision_table(device, bf16, flags, lora, expected):
    precision = run_precision(_cfg(flags, lora), device, bf16_supported=bf16)
    assert (precision.weight_dtype, precision.compute_dtype, precision.loss_scaling) == expected
    if precision.compute_dtype is F16:
        assert precision.weight_dtype in (F16, F32)  # never bf16 weights under an fp16 autocast
    if lora and precision.compute_dtype is BF16 and "--model_dtype" not in flags:
        assert precision.weight_dtype == BF16  # frozen base stored as it is computed


@pytest.mark.parametrize("device, bf16, flags, lora, message", [
    (CUDA, False, ["--model_dtype", "bfloat16"], True, "does not support bfloat16; use --use_fp16"),
    (CUDA, True, ["--model_dtype", "float16"], False, "float16 weights that train cannot be loss-scaled"),
])
def test_impossible_combinations_are_errors_naming_the_flag(device, bf16, flags, lora, message):
    with pytest.raises(ConfigError, match=message):
        run_precision(_cfg(flags, lora), device, bf16_supported=bf16)


def test_notes_say_what_is_in_force():
    assert run_precision(_cfg([], True), CPU).note == "float32 on the CPU"
    assert run_precision(_cfg(["--use_fp16"], True), CPU).note.endswith("(--use_fp16 needs a CUDA GPU; ignored)")
    assert run_precision(_cfg([], True), CUDA, bf16_supported=True).note == "bfloat16 autocast, bfloat16 weights"
    note = run_precision(_cfg(["--use_fp16"], False), CUDA, bf16_supported=True).note
    assert note == "float16 autocast with loss scaling, float32 weights"


def test_the_scaler_and_autocast_follow_the_decision():
    cpu = run_precision(_cfg([], False), CPU)
    assert cpu.make_scaler() is None
    with cpu.autocast():
        assert not torch.is_autocast_enabled("cpu")
    from leantune.precision import Precision

    fp16_cpu = Precision(CPU, F32, F16, True, "test stand-in")  # CPU stand-in for the GPU's fp16 path
    assert isinstance(fp16_cpu.make_scaler(), torch.amp.GradScaler)
    with fp16_cpu.autocast():
        assert torch.get_autocast_dtype("cpu") is F16 and torch.is_autocast_enabled("cpu")


def test_autocast_keeps_no_half_precision_copy_of_the_trainable_weights(monkeypatch):
    """Full fine-tuning, float32 weights, bf16 autocast (a GPU's default, traced on the CPU), full checkpointing:
    at the end of forward only the layers' inputs are held, not a bf16 copy of every weight (autocast's cache)."""
    from leantune.models.presets import model_config
    from leantune.planning.fake_step import trace_step
    from leantune.precision import Precision

    cfg = parse_run_config(["--model_name", "tiny", "--batch_size_training", "1", "--context_length", "64",
                            "--enable_activation_checkpointing", "--activation_checkpointing_mode", "full"])
    config = model_config("tiny")

    def forward_activations():
        trace = trace_step(cfg, config, torch.device("cuda"), "full")
        return trace.stage_breakdowns["forward"]["activation"]

    without_cache = forward_activations()
    monkeypatch.setattr(Precision, "autocast", lambda self: torch.autocast(self.device.type, dtype=self.compute_dtype))
    with_cache = forward_activations()
    h, kv = config.hidden_size, config.hidden_size * config.num_key_value_heads // config.num_attention_heads
    layer_weights = config.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size)
    assert with_cache - without_cache >= 0.9 * layer_weights * 2  # the bf16 copies of the layers' weights


@pytest.mark.parametrize("capability, bf16", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)],
                         ids=["V100", "T4", "A100", "H100"])
def test_bf16_is_chosen_by_compute_capability_not_emulation(monkeypatch, capability, bf16):
    """torch.cuda.is_bf16_supported() says yes on a V100 or T4 (emulated): those get float32 and the fp16 hint."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # what emulation would answer
    precision = run_precision(parse_run_config(["--use_peft"]), torch.device("cuda"))
    if bf16:
        assert precision.note.startswith("bfloat16 autocast")
    else:
        assert precision.note == "float32 (this GPU has no bfloat16; --use_fp16 halves it)"
