"""MFU and HFU: the arithmetic, the device table, and the numbers a run records (issue 10, part)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from helpers import llama_training_flops
from torch.utils.flop_counter import FlopCounterMode, addmm_flop, sdpa_backward_flop_count, sdpa_flop_count

from leantune.builders.model import build_model
from leantune.builders.loss_and_optimizer import loss_model_for
from leantune.flags import parse_run_config
from leantune.finetuning import run
from leantune.models.presets import model_config
from leantune.model_structure import unwrap_model
from leantune.planning.flops import count_token_flops
from leantune.precision import choose_precision
from leantune.report.flops import PEAK_BF16_TFLOPS, TokenFlops, device_peak_tflops


def _token_flops(argv: list[str]) -> TokenFlops:
    cfg = parse_run_config(argv)
    return count_token_flops(cfg, model_config(cfg.model.model_name), torch.device("cpu"))


SEQ = 128
# LoRA (the default r=8 on q_proj and v_proj, frozen base and LM head) on one row of the tiny test
# model (d=64, f=128, 2 layers, 4 heads of 16, 2 KV heads, vocabulary 1987), counted by hand as
# torch's formulas count (2 FLOPs per multiply-add; SDPA 2 matmuls forward, 5 backward):
#   forward: base linears 2*200,896*128 = 51,429,376; LoRA 2*128*2*(512+512+512+256) = 917,504;
#            SDPA 2 layers*2*2,097,152 = 8,388,608
#   backward: LM head input gradient only 2*1987*64*128 = 32,555,008; base input gradients
#            2*128*(28,672+36,864) = 16,777,216 (layer 0's q/k/v get none: their input, the frozen
#            embedding's output, needs no gradient); LoRA weight and input gradients 1,572,864;
#            SDPA 2*5*2,097,152 = 20,971,520
# = 132,612,096, and FlopCounterMode on a real step agrees (test below).
LORA_ROW_FLOPS = 132_612_096


def _real_step_flops(cfg) -> tuple[int, dict]:
    """FLOPs of a real forward + backward of one full row of ``cfg``'s model and loss, by torch's FlopCounterMode.

    Independent of leantune's traced step (fake tensors, its own FLOP tracker, the TrainStep): the
    real model, PyTorch's counter. Torch's table knows the CPU SDPA kernels only under their CUDA
    names and lacks the in-place addmm_ the chunked loss accumulates the LM head's gradient with.
    """
    aten = torch.ops.aten
    mapping = {
        aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v),
        aten.addmm_: lambda self, a, b, *args, out_shape=None, **kwargs: addmm_flop(self, a, b),
    }
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")),
                           log=lambda _line: None)
    loss_model = loss_model_for(model, cfg.training, sharded=False)
    vocab = unwrap_model(model).get_output_embeddings().weight.shape[0]
    ids = torch.randint(3, vocab, (1, cfg.data.context_length), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False, custom_mapping=mapping)
    with counter:
        loss_model(ids, ids.clone()).backward()
    return counter.get_total_flops(), {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def test_mfu_arithmetic_against_a_hand_computed_case():
    # 1B-like: 6 GFLOPs per token of model FLOPs, 8 with recompute; 20,000 tokens in 1.2 s on one 989.5 TFLOP/s GPU
    flops = TokenFlops(model=6e9, hardware=8e9)
    got = flops.utilisation(tokens=20_000, seconds=1.2, peak_tflops=989.5)
    assert got["model_tflops_per_s"] == pytest.approx(100.0)  # 6e9 * 20e3 / 1.2 = 1e14
    assert got["mfu"] == pytest.approx(100.0 / 989.5)
    assert got["hfu"] == pytest.approx(8 / 6 * 100.0 / 989.5)
    # eight processes sharing the work: the same tokens over eight devices' peak
    assert flops.utilisation(20_000, 1.2, 989.5, processes=8)["mfu"] == pytest.approx(100.0 / 989.5 / 8)


def test_the_peak_comes_from_the_flag_or_the_table(monkeypatch):
    assert device_peak_tflops(torch.device("cpu")) is None  # no MFU on the CPU unless asked
    assert device_peak_tflops(torch.device("cpu"), override=2.5) == 2.5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, peak in (("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H200", 989.5),
                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 366.5), ("NVIDIA L4", 121.0),
                       ("NVIDIA H200 NVL", 835.5), ("NVIDIA L40", None), ("NVIDIA A10G", None), ("NVIDIA A10", 125.0),
                       ("Some Future GPU", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert device_peak_tflops(torch.device("cuda")) == peak, name
    assert set(PEAK_BF16_TFLOPS) >= {"H100", "H200", "A100"}


def test_a_mig_slice_gets_the_peak_of_its_share_of_the_gpu(monkeypatch):
    """A MIG slice's name names the whole GPU; its SM count says which share of it the run has."""
    import types

    from leantune.report.flops import FULL_GPU_SMS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3 MIG 3g.40gb")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
        multi_processor_count=60))
    assert device_peak_tflops(torch.device("cuda")) == pytest.approx(989.5 * 60 / 132)
    assert set(FULL_GPU_SMS) == set(PEAK_BF16_TFLOPS)


def test_recompute_counts_in_hfu_only(tiny_model_dir):
    common = ["--model_name", str(tiny_model_dir), "--context_length", str(SEQ)]
    config = model_config(str(tiny_model_dir))
    none = _token_flops(common)
    full = _token_flops([*common, "--enable_activation_checkpointing"])
    plain = _token_flops([*common, "--loss_chunk_size", "0"])
    # Absolute values, counted by hand: 183,648,256 FLOPs for the row of 128 tokens with the chunked
    # loss (the LM head on all 128 positions), 182,885,248 with the plain loss (127 positions have
    # a next token); exact in binary floating point.
    assert none.model * SEQ == llama_training_flops(config, SEQ) == 183_648_256
    assert plain.model * SEQ == llama_training_flops(config, SEQ, loss_tokens=SEQ - 1) == 182_885_248
    assert none.model == none.hardware and plain.model == plain.hardware
    # MFU's FLOPs are the model's, whatever the mode (the chunked loss's addmm_ counted too)
    assert full.model == none.model
    # The recompute: every layer's forward again (non-reentrant checkpointing stops once what backward
    # needs is back, so less than the whole forward: here all but down_proj, 23,068,672 FLOPs)
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layer_weights = (d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d
                     + 3 * d * config.intermediate_size)
    layer_forward = 2 * layer_weights * SEQ + 2 * 2 * heads * SEQ * SEQ * head_dim
    down_proj = 2 * config.intermediate_size * d * SEQ
    assert layers * (layer_forward - down_proj) <= (full.hardware - full.model) * SEQ <= layers * layer_forward
    lora = _token_flops([*common, "--use_peft"])
    assert lora.model * SEQ == lora.hardware * SEQ == LORA_ROW_FLOPS  # no weight gradients for the frozen base
    # selective_ops recomputes only elementwise ops and down_proj, an op of its own (RecomputedLinear) that
    # keeps its inputs after it multiplies: the recompute reaches it, so each layer's down_proj runs again
    selective = _token_flops([*common, "--enable_activation_checkpointing", "--activation_checkpointing_mode",
                              "selective_ops"])
    assert selective.model == none.model and (selective.hardware - selective.model) * SEQ == layers * down_proj


@pytest.mark.parametrize("flags", [[], ["--loss_chunk_size", "0"], ["--enable_activation_checkpointing"],
                                   ["--use_peft"], ["--use_peft", "--enable_activation_checkpointing"]],
                         ids=["none", "plain-loss", "full", "lora", "lora-full"])
def test_traced_flops_equal_flop_counter_mode_on_a_real_step(tiny_model_dir, flags):
    """What the fake step traces (recompute included) is what torch's own counter counts on a real step."""
    cfg = parse_run_config(["--model_name", str(tiny_model_dir), "--context_length", str(SEQ), *flags])
    flops = count_token_flops(cfg, model_config(cfg.model.model_name), torch.device("cpu"))
    real, per_op = _real_step_flops(cfg)
    assert per_op["aten._scaled_dot_product_flash_attention_for_cpu_backward"] > 0  # attention is counted
    assert flops.hardware * SEQ == real


def test_a_run_with_a_peak_records_mfu_and_hfu_per_step(tiny_model_dir, tmp_path):
    lines = []
    argv = ["--model_name", str(tiny_model_dir), "--context_length", "128", "--max_train_step", "3", "--num_epochs",
            "1", "--num_workers_dataloader", "0", "--run_validation", "false", "--save_metrics", "--save_model",
            "false", "--enable_activation_checkpointing", "--peak_tflops", "1.0", "--output_dir", str(tmp_path)]
    results = run(parse_run_config(argv), log=lines.append)
    assert any(line.startswith("mfu: against 1.0 TFLOP/s peak;") for line in lines)
    steps = json.loads((tmp_path / "metrics.json").read_text())["train_steps"]
    # FLOPs per token not from count_token_flops itself: the hand count (model) and torch's counter
    # on a real checkpointed step (hardware)
    model_flops = llama_training_flops(model_config(str(tiny_model_dir)), SEQ) / SEQ
    hardware_flops = _real_step_flops(parse_run_config(argv))[0] / SEQ
    assert hardware_flops > model_flops
    for step in steps:
        seconds, tokens = step["step_time_s"], step["input_tokens"]
        assert step["mfu"] == pytest.approx(model_flops * tokens / seconds / 1e12, rel=1e-12)
        assert step["hfu"] == pytest.approx(hardware_flops * tokens / seconds / 1e12, rel=1e-12)
        assert step["model_tflops_per_s"] == pytest.approx(model_flops * tokens / seconds / 1e12, rel=1e-12)
    assert results["median_mfu"] == pytest.approx(statistics.median(s["mfu"] for s in steps[1:]))  # warm-up left out
    assert "MFU " in next(line for line in lines if line.startswith("epoch 1 step 1/"))


def test_no_mfu_on_the_cpu_without_a_peak(tiny_model_dir, tmp_path):
    argv = ["--model_name", str(tiny_model_dir), "--context_length", "128", "--max_train_step", "1", "--num_epochs",
            "1", "--num_workers_dataloader", "0", "--run_validation", "false", "--save_metrics", "--save_model",
            "false", "--output_dir", str(tmp_path)]
    results = run(parse_run_config(argv), log=lambda _line: None)
    assert "mfu" not in json.loads((tmp_path / "metrics.json").read_text())["train_steps"][0]
    assert results["median_mfu"] is None
