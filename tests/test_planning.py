"""The planner: predictions equal what the same step holds on real tensors; its choices; its errors."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.memory.tracker import StorageTracker, persistent_bytes
from leantune.models.presets import (HUB_IDS, MOE_PRESETS, PRESETS, VISION_PRESETS, ModelShapeError, model_config,
                                     preset_name)
from leantune.planning import MemoryPlan, Planner
from leantune.planning.choose import run_budget
from leantune.planning.context import PlanContext
from leantune.planning.confirm import confirm_batch
from leantune.planning.fake_step import trace_step
from leantune.planning.plan import MIB, NCCL_BUFFER_BYTES, choose_mode, largest_batch, plan_modes, with_batch

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
TINY = ["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "128"]


def flags(*extra):
    return parse_run_config([*TINY, *extra])


def mode_flags(mode):
    return [] if mode == "none" else ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode]


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("mode", ["none", "full", "selective_ops"])
def test_prediction_equals_the_same_step_on_real_tensors(kind, mode):
    cfg = flags(*(["--use_peft"] if kind == "lora" else []))
    config = model_config("tiny")
    predicted = trace_step(cfg, config, CPU, mode)
    measured = trace_step(cfg, config, CPU, mode, fake=False)
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.breakdown == measured.breakdown
    assert predicted.flops == measured.flops > 0


@pytest.mark.parametrize("extra", [["--use_peft"], [], ["--pure_bf16", "--optimizer", "anyprecision"]],
                         ids=["lora-frozen-head", "float32-head-summed", "bf16-head-by-blocks"])
@pytest.mark.parametrize("chunk", ["32", "48"], ids=["even", "uneven"])
def test_a_trace_that_samples_the_loss_chunks_predicts_what_running_them_all_measures(extra, chunk):
    """Fake tensors run the first and last chunk (and backward block) only: the bytes and FLOPs are those of
    the same step on real tensors, which runs every chunk (8 or 6 of them here, the last of 16 tokens)."""
    from leantune import loss

    cfg = flags("--loss_chunk_size", chunk, *extra)
    chunks, chunk_loss = [], loss._chunk_loss
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loss, "_chunk_loss", lambda *args, **kwargs: chunks.append(1) or chunk_loss(*args, **kwargs))
        predicted = trace_step(cfg, model_config("tiny"), CPU, "full")
        sampled = len(chunks)
        measured = trace_step(cfg, model_config("tiny"), CPU, "full", fake=False)
    assert sampled == 3 and len(chunks) - sampled == -(-256 // int(chunk))  # first, second, last; real: every one
    assert predicted.peak_bytes == measured.peak_bytes and predicted.stage_peaks == measured.stage_peaks
    assert predicted.breakdown == measured.breakdown
    assert predicted.flops == measured.flops > 0


def test_sampling_the_loss_chunks_changes_no_byte_or_flop_of_a_gpu_plan(monkeypatch):
    """For a GPU target (bf16 autocast, float32 head summed chunk by chunk), sampled against every chunk run."""
    from leantune.planning.stand_ins import SampledPieces

    cfg = flags("--loss_chunk_size", "40")
    sampled = trace_step(cfg, model_config("tiny"), CUDA, "selective_ops")
    monkeypatch.setattr(SampledPieces, "counting", lambda self, counter: contextlib.nullcontext())
    every = trace_step(cfg, model_config("tiny"), CUDA, "selective_ops")
    assert (sampled.peak_bytes, sampled.stage_breakdowns, sampled.flops) == (every.peak_bytes, every.stage_breakdowns,
                                                                            every.flops)


@pytest.mark.parametrize("kind, target", [("lora", CPU), ("lora", CUDA)])
def test_prediction_is_within_a_fraction_of_a_percent_of_the_profilers_count(kind, target):
    """Independent of the tracker: PyTorch's profiler counts every allocation and free of the real step."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the measuring tools
    from measure_peak import profiled_peak_bytes

    cfg = flags("--use_peft", "--enable_activation_checkpointing", "--loss_chunk_size", "64")
    predicted = trace_step(cfg, model_config("tiny"), target, "full").peak_bytes
    measured = profiled_peak_bytes(cfg, model_config("tiny"), target, "full")
    assert measured["missed_bytes"] == 0  # the profiler saw every free of the step's own blocks
    # below the dispatcher, where no dispatch mode sees them: checkpointing's saved RNG state (5,056 B per layer)
    # and Python scalars wrapped as 0-dim tensors; on a GPU both live in host memory
    assert 0 <= measured["bytes"] - predicted <= 4 * 5120 + 16 * 512
    assert abs(predicted / measured["bytes"] - 1) < 0.05


def test_bf16_autocast_prediction_equals_real_bf16_step():
    """A GPU target traces with bf16 autocast and a bf16 LoRA base: the same step runs for real on the CPU."""
    cfg = flags("--use_peft", "--enable_activation_checkpointing", "--loss_chunk_size", "64")
    config = model_config("tiny")
    predicted = trace_step(cfg, config, CUDA, "full")
    measured = trace_step(cfg, config, CUDA, "full", fake=False)
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.peak_bytes % 512 == 0  # every storage rounded as the CUDA allocator rounds it


def test_breakdown_holds_what_the_step_keeps():
    cfg = flags()  # full fine-tuning, float32, AdamW: two fp32 states per trainable parameter
    plan = plan_modes(cfg, model_config("tiny"), CPU, ["full"])[0]
    assert plan.optimizer_state_bytes == 2 * plan.parameter_bytes + 4 * len(list(_tiny_params()))
    assert plan.parameter_bytes == sum(p.numel() * 4 for p in _tiny_params())
    parts = (plan.parameter_bytes + plan.gradient_bytes + plan.optimizer_state_bytes + plan.activation_bytes
             + plan.loss_bytes + plan.temporary_bytes + plan.other_bytes)
    assert parts == plan.peak_bytes == plan.traced_peak_bytes


def _tiny_params():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return list(AutoModelForCausalLM.from_config(model_config("tiny")).parameters())


def test_checkpointing_lowers_activations_and_adds_recompute():
    plans = {p.mode: p for p in plan_modes(flags("--use_peft"), model_config("tiny"), CPU,
                                           ["none", "full", "selective_ops"])}
    assert plans["full"].activation_bytes < plans["selective_ops"].activation_bytes < plans["none"].activation_bytes
    assert plans["full"].peak_bytes < plans["none"].peak_bytes
    assert plans["none"].recompute_flops == 0 < plans["full"].recompute_flops


def test_gpu_target_traces_the_gpu_precision(monkeypatch):
    """bf16 autocast with a bf16 LoRA base on a GPU planned from here; a GPU without bf16 is asked, not assumed."""
    from leantune.planning.fake_step import target_precision
    from leantune.planning.table import describe_run

    cpu, gpu = (plan_modes(flags("--use_peft"), model_config("tiny"), device, ["full"])[0] for device in (CPU, CUDA))
    params = _tiny_lora_params()
    lora = [p.numel() for name, p in params if "lora_" in name]
    base = [p.numel() for name, p in params if "lora_" not in name]
    assert len(lora) == 16 and sum(lora) == 28_672 and sum(base) == 4_000_000  # 4 layers x q, v x A, B
    assert cpu.parameter_bytes == 4 * (sum(base) + sum(lora))
    assert cpu.optimizer_state_bytes == 2 * 4 * sum(lora) + 4 * len(lora)  # exp_avg, exp_avg_sq, a float32 step each

    def block(nbytes):  # the CUDA caching allocator's rounding of each storage
        return -(-nbytes // 512) * 512

    # The frozen base in bfloat16, the adapters float32, each storage in 512-byte blocks: 8,114,688
    # bytes (every tiny tensor is a whole number of blocks already: 2 x 4,000,000 + 4 x 28,672)
    assert gpu.parameter_bytes == sum(block(2 * n) for n in base) + sum(block(4 * n) for n in lora) == 8_114_688
    # float32 Adam states of the adapters; each 4-byte step scalar takes a whole block
    assert gpu.optimizer_state_bytes == 2 * sum(block(4 * n) for n in lora) + len(lora) * 512 == 237_568
    # bf16 autocast over a bf16 base: the residual stream is bfloat16, a decoder layer's input 2 x 128 x 256 x 2 bytes
    traced = trace_step(flags("--use_peft"), model_config("tiny"), CUDA, "full")
    assert traced.layer_input_bytes == block(2 * 128 * 256 * 2) == 131_072
    assert trace_step(flags("--use_peft"), model_config("tiny"), CPU, "full").layer_input_bytes == 2 * 128 * 256 * 4
    lora = flags("--use_peft")
    precision = target_precision(lora.model, lora.training, lora.peft, CUDA)
    assert (precision.weight_dtype, precision.compute_dtype, precision.loss_scaling) == (torch.bfloat16, torch.bfloat16,
                                                                                          False)
    assert gpu.peak_bytes == (gpu.traced_peak_bytes + gpu.cuda_context_bytes + gpu.cublas_workspace_bytes
                              + gpu.fragmentation_bytes)
    assert "a bf16-capable GPU assumed" in describe_run(flags("--use_peft"), model_config("tiny"), CUDA)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100
    assert target_precision(lora.model, lora.training, lora.peft, CUDA).compute_dtype is None  # float32: no bf16 there


def _tiny_lora_params():
    from leantune.models.loading import attach_lora
    from leantune.models.facts import meta_model

    return list(attach_lora(meta_model(model_config("tiny"), torch.float32),
                            flags("--use_peft").peft).named_parameters())


def test_offload_is_derived_from_full_on_a_gpu_and_refused_on_the_cpu():
    cfg = parse_run_config(["--model_name", "small", "--batch_size_training", "2", "--context_length", "256",
                            "--use_peft"])
    plans = {p.mode: p for p in plan_modes(cfg, model_config("small"), CUDA, ["full", "offload"])}
    # 8 layers, inputs of 2 x 256 x 1024 bf16 = 1 MiB each: all but two live in host memory
    assert plans["full"].activation_bytes - plans["offload"].activation_bytes == 6 * MIB
    # the pinned pool holds every layer's input at the end of the forward (--max_context's flags cap it there)
    assert plans["offload"].offload_pool_bytes == plans["offload"].pinned_host_bytes == 8 * MIB
    assert plans["full"].offload_pool_bytes == 0
    with pytest.raises(ConfigError, match="--device cuda"):
        plan_modes(cfg, model_config("small"), CPU, ["offload"])


def test_choose_mode_prefers_least_recompute_that_fits():
    plans = plan_modes(flags("--use_peft"), model_config("tiny"), CPU, ["none", "full", "selective_ops"])
    peak = {p.mode: p.peak_bytes for p in plans}
    budget = peak["full"] + 1  # only full fits
    fitted = plan_modes(flags("--use_peft"), model_config("tiny"), CPU, ["none", "full", "selective_ops"], budget)
    assert choose_mode(fitted).mode == "full"
    roomy = plan_modes(flags("--use_peft"), model_config("tiny"), CPU, ["none", "full"], peak["none"])
    assert choose_mode(roomy).mode == "none"
    tight = plan_modes(flags("--use_peft"), model_config("tiny"), CPU, ["none", "full"], peak["full"] - 1)
    assert choose_mode(tight) is None


def test_largest_batch_is_the_boundary():
    cfg, config = flags("--use_peft", "--enable_activation_checkpointing"), model_config("tiny")
    at = {b: plan_modes(with_batch(cfg, b), config, CPU, ["full"])[0].peak_bytes for b in (5, 6)}
    batch, plan = largest_batch(cfg, config, CPU, "full", budget_bytes=at[5] + (at[6] - at[5]) // 2)
    assert batch == 5 and plan.peak_bytes == at[5]


def test_auto_mode_takes_the_least_recompute_that_fits(capsys):
    lora = ["--use_peft", "--enable_activation_checkpointing"]
    peaks = {p.mode: p.peak_bytes for p in plan_modes(flags(*lora), model_config("tiny"), CPU,
                                                      ["none", "full", "every_n", "selective_ops"])}
    assert peaks["none"] > peaks["selective_ops"]  # so a budget at selective_ops' peak leaves none out
    cfg = flags(*lora, "--activation_checkpointing_mode", "auto", "--memory_budget_gb",
                str(peaks["selective_ops"] / 2**30))
    memory = Planner.for_run(cfg, model_config(cfg.model.model_name), CPU, log=print).choose(cfg)
    assert memory.cfg.checkpointing.mode == "selective_ops" and memory.plan.peak_bytes == peaks["selective_ops"]
    assert "auto chose selective_ops" in capsys.readouterr().out


def test_auto_batch_keeps_the_global_batch_and_is_the_largest_that_fits():
    cfg = flags("--use_peft", "--enable_activation_checkpointing", "--auto_batch_size", "--target_global_batch_size",
                "12", "--memory_budget_gb", str(40 * MIB / 2**30))
    memory = Planner.for_run(cfg, model_config(cfg.model.model_name), CPU, log=lambda *_: None).choose(cfg)
    batch, accumulation = memory.cfg.training.batch_size_training, memory.cfg.training.gradient_accumulation_steps
    assert batch * accumulation == 12
    assert memory.plan.fits and memory.plan.batch_size == batch
    # planned as it runs: with the accumulation the target gives it
    again = plan_modes(memory.cfg, model_config("tiny"), CPU, ["full"], memory.budget)[0]
    assert again.peak_bytes == memory.plan.peak_bytes
    bigger = [d for d in (1, 2, 3, 4, 6, 12) if d > batch]
    if bigger:
        assert not plan_modes(with_batch(cfg, bigger[0]), model_config("tiny"), CPU, ["full"], memory.budget)[0].fits


def test_auto_finds_a_layer_mix_between_selective_and_full(capsys):
    cfg = parse_run_config(["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "256",
                            "--use_peft"])
    plans = {p.mode: p for p in plan_modes(cfg, model_config("tiny"), CPU, ["full", "selective_ops"])}
    budget = (plans["full"].peak_bytes + plans["selective_ops"].peak_bytes) / 2
    auto = parse_run_config(["--model_name", "tiny", "--batch_size_training", "2", "--context_length", "256",
                             "--use_peft", "--enable_activation_checkpointing", "--activation_checkpointing_mode",
                             "auto", "--memory_budget_gb", str(budget / 2**30)])
    memory = Planner.for_run(auto, model_config(auto.model.model_name), CPU, log=print).choose(auto)
    resolved, plan = memory.cfg, memory.plan
    assert resolved.checkpointing.mode == "layer_mix", capsys.readouterr().out
    layers = resolved.checkpointing.activation_checkpointing_layers
    assert layers.startswith("full=") and "selective_ops=" in layers
    assert plans["selective_ops"].peak_bytes > plan.peak_bytes <= budget
    assert plan.recompute_flops < plans["full"].flops - plan_modes(cfg, model_config("tiny"), CPU, ["none"])[0].flops


def test_auto_mode_fails_with_the_table_when_nothing_fits():
    cfg = flags("--enable_activation_checkpointing", "--activation_checkpointing_mode", "auto",
                "--memory_budget_gb", str(55 * MIB / 2**30))
    with pytest.raises(ConfigError, match="no mode fits") as err:
        Planner.for_run(cfg, model_config(cfg.model.model_name), CPU, log=lambda *_: None).choose(cfg)
    assert "predicted peak" in str(err.value) and "--batch_size_training" in str(err.value)


def test_auto_needs_a_budget_on_the_cpu():
    with pytest.raises(ConfigError, match="--memory_budget_gb"):
        auto = flags("--enable_activation_checkpointing", "--activation_checkpointing_mode", "auto")
        Planner.for_run(auto, model_config("tiny"), CPU).choose(auto)


def test_confirm_step_backs_off_once_on_oom():
    cfg = with_batch(flags("--auto_batch_size", "--memory_budget_gb", "1"), 8)
    plan = plan_modes(cfg, model_config("tiny"), CPU, ["none"])[0]
    memory = MemoryPlan(cfg, plan, 2**30)
    tried = []

    def oom(batch):
        tried.append(batch)
        raise torch.OutOfMemoryError("CUDA out of memory.")

    lines = []
    backed = confirm_batch(memory, model_config("tiny"), CPU, oom, log=lines.append)
    assert tried == [8] and backed.cfg.training.batch_size_training == 6 and backed.plan.batch_size == 6
    assert "ran out of memory" in lines[0] and "backing off once to 6" in lines[0]
    fine = confirm_batch(memory, model_config("tiny"), CPU, lambda batch: 1000, log=lines.append)
    assert fine.cfg.training.batch_size_training == 8 and "confirmed 8" in lines[-1]
    over = confirm_batch(MemoryPlan(cfg, plan, plan.peak_bytes), model_config("tiny"), CPU,
                         lambda batch: plan.peak_bytes, log=lines.append)
    assert over.cfg.training.batch_size_training == 6 and "needed" in lines[-1]


def test_the_real_confirm_step_leaves_the_run_as_it_was(load_tiny):
    from leantune.planning.confirm import confirm_step
    from leantune.precision import choose_precision

    cfg = flags("--use_peft")
    model = load_tiny()
    precision = choose_precision(cfg.model, cfg.training, cfg.peft, CPU)
    state = torch.get_rng_state()
    peak = confirm_step(model, cfg.training, cfg.data, precision)(3)
    assert torch.equal(state, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    params = sum(p.numel() * 4 for p in model.parameters())
    assert peak > params  # the weights plus what a 3 x 128 step holds
    assert confirm_step(model, cfg.training, cfg.data, precision)(6) > peak


def test_presets_and_hub_ids_resolve_offline():
    assert preset_name("meta-llama/Llama-3.1-8B-Instruct") == "Llama-3.1-8B"
    assert preset_name("llama-3.2-1b") == "Llama-3.2-1B"
    assert all(preset_name(hub) in {**PRESETS, **MOE_PRESETS, **VISION_PRESETS} for hub in HUB_IDS)
    moe = model_config("Qwen/Qwen3-30B-A3B")  # a mixture of experts' published shape, its own config class
    assert (type(moe).__name__, moe.num_experts, moe.moe_intermediate_size) == ("Qwen3MoeConfig", 128, 768)
    config = model_config("meta-llama/Llama-3.2-1B")
    assert (config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings) == (2048, 16, True)
    with pytest.raises(ModelShapeError, match="preset"):
        model_config("./no/such/dir")


@pytest.mark.parametrize("argv, message", [
    (["--model_name", "./missing-model"], "use a preset"),
    (["--model_name", "Llama-3.2-1B", "--context_length", "200000"], "--context_length 200000: the model handles"),
    (["--model_name", "Llama-3.2-1B", "--device", "cuda", "--memory_budget_gb", "1"], "below what the weights"),
    (["--memory_budget_gb", "-3"], "--memory_budget_gb: must be a positive"),
    (["--activation_checkpointing_mode", "offload", "--enable_activation_checkpointing", "--device", "cpu"],
     "plan it for one with --device cuda"),
    (["--enable_activation_checkpointing", "--activation_checkpointing_layers", "full=3"],
     "names 3 layers, the model has 4"),
    (["--target_global_batch_size", "10", "--batch_size_training", "4"], "not a multiple"),
])
def test_plan_command_errors_name_the_flag(argv, message, capsys):
    from leantune.planning.plan_command import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_command_json_and_table(capsys):
    from leantune.planning.plan_command import main

    assert main([*TINY, "--use_peft", "--memory_budget_gb", "0.03", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in records] == ["none", "full", "every_n", "selective_ops"]
    for record in records:
        assert record["peak_bytes"] > 0 and isinstance(record["fits"], bool)
        assert {"parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes", "loss_bytes",
                "temporary_bytes"} <= record.keys()
    assert main([*TINY, "--enable_activation_checkpointing", "--activation_checkpointing_mode", "full",
                 "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "-> full" in out and "none" not in out.splitlines()[1] and "CUDA context" in out


def test_persistent_bytes_counts_each_storage_once(load_tiny):
    model = load_tiny()
    optimizer = torch.optim.AdamW(model.parameters())
    expected = sum(p.numel() * 4 for p in model.parameters())
    assert persistent_bytes(model, optimizer) == {"parameter": expected, "gradient": 0, "optimizer_state": 0}
    model.get_input_embeddings().weight.sum().backward()
    assert persistent_bytes(model, optimizer)["gradient"] == model.get_input_embeddings().weight.numel() * 4
    # the breakdown is set against one device's allocator: what lives elsewhere (offloaded shards) is not in it
    assert persistent_bytes(model, optimizer, torch.device("cpu")) == persistent_bytes(model, optimizer)
    assert persistent_bytes(model, optimizer, torch.device("cuda", 0)) == dict.fromkeys(
        ("parameter", "gradient", "optimizer_state"), 0)


def test_tracker_counts_a_storage_once_and_frees_it():
    tracker = StorageTracker()
    with tracker:
        a = torch.ones(1000)
        view = a.view(10, 100)
        b = a * 2
        assert tracker.live_bytes("activation") == 8000
        del a
        assert tracker.live_bytes("activation") == 8000  # the view keeps the storage alive
        del view, b
        assert tracker.live_bytes("activation") == 0
    assert tracker.peak_bytes == 8000


def test_a_run_with_auto_mode_and_batch_trains_and_logs_the_breakdown(tiny_model_dir, tmp_path):
    from leantune.finetuning import run

    out = tmp_path / "auto"
    argv = ["--model_name", str(tiny_model_dir), "--use_peft", "--enable_activation_checkpointing",
            "--activation_checkpointing_mode", "auto", "--auto_batch_size", "--target_global_batch_size", "8",
            "--memory_budget_gb", str(48 * MIB / 2**30), "--enable_memory_monitoring", "--save_metrics", "true",
            "--context_length", "128", "--num_workers_dataloader", "0", "--num_epochs", "1", "--max_train_step", "4",
            "--save_model", "false", "--output_dir", str(out)]
    lines: list[str] = []
    run(parse_run_config(argv), log=lines.append)
    # one line says the choice: the plan's first choice is named as such, and the timed choice said once
    (chosen,) = [line for line in lines if line.startswith("activation checkpointing: auto chose")]
    assert ("the most tokens/s measured)" in chosen or "more than 5% faster)" in chosen), chosen
    assert not [line for line in lines if line.startswith(("batch size: auto chose", "activation checkpointing: on",
                                                           "activation checkpointing: off"))]
    plan_line = next(line for line in lines if line.startswith("auto: the plan's first choice is "))
    assert 8 % int(plan_line.split(" at batch ")[1].split()[0]) == 0
    batch = int(chosen.split(", batch ")[1].split()[0])  # the timed candidate's, which the run trains with
    assert f"{8 // batch} batches per optimizer step" in chosen
    assert any(line.startswith(f"batch size: confirmed {batch} with one real step") for line in lines), lines
    # the CPU has no allocator peak to set a prediction against: no plan line, no check line
    assert not [line for line in lines if line.startswith(("plan: predicted peak", "memory check"))]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["batch_size_training"] == batch
    assert metrics["config"]["gradient_accumulation_steps"] == 8 // batch  # --target_global_batch_size kept
    assert f"auto chose {metrics['config']['activation_checkpointing_mode'] or 'none'}, " in chosen
    rows = [json.loads(line) for line in (out / "memory.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        assert row["parameter_mib"] > 0 and row["gradient_mib"] > 0 and row["optimizer_state_mib"] > 0
        assert row["optimizer_state_mib"] == pytest.approx(2 * row["gradient_mib"], rel=0.01)  # AdamW: 2 states
    assert metrics["train_steps"][0]["parameter_mib"] == rows[1]["parameter_mib"]


def test_step_two_is_checked_against_the_plan_where_an_allocator_measures():
    from leantune.training.lines import plan_check_line as _plan_check_line

    line = _plan_check_line({"peak_allocated_mib": 1000.0}, predicted_bytes=1050 * 2**20)
    assert line == "memory check: step 2 peak allocated 1,000.0 MiB, plan predicted 1,050.0 MiB (+5.0%)"
    line = _plan_check_line({"peak_allocated_mib": 1000.0, "peak_reserved_mib": 1200.0}, 1050 * 2**20, 1140 * 2**20)
    assert line.endswith("(+5.0%); peak reserved 1,200.0 MiB, plan predicted 1,140.0 MiB (-5.0%)")


def test_per_rank_plan_under_fsdp_splits_the_model_state(capsys):
    from leantune.planning.plan_command import main
    from leantune.planning.per_rank import per_rank, sharding_shapes

    cfg = parse_run_config(["--model_name", "small", "--batch_size_training", "1", "--context_length", "128",
                            "--enable_activation_checkpointing"])
    config = model_config("small")
    whole = plan_modes(cfg, config, CUDA, ["full"])[0]
    shapes = sharding_shapes(cfg, config, CUDA, 4)
    layer = sum(p.numel() for p in _small_layer_params())
    root = sum(p.numel() for p in _small_params()) - config.num_hidden_layers * layer
    assert shapes.gathered_bytes == (root + 2 * layer) * 2  # bf16 under the GPU's mixed precision
    # the all-gather's input (a quarter of the layer) and output (all of it, while copied out)
    assert shapes.layer_in_flight_bytes == -(-layer * 2 // 4) + layer * 2
    # a unit's gradients: bf16 copied into a float32 buffer of the whole unit; its float32 quarter is the
    # sharded gradient itself, already in the trace's share
    assert shapes.root_reduce_bytes == root * (2 + 4) and shapes.layer_reduce_bytes == layer * (2 + 4)
    shared = per_rank(whole, 4, shapes)
    optimizer = shared.stage_breakdowns["optimizer"]
    assert shared.optimizer_state_bytes == -(-whole.stage_breakdowns["optimizer"]["optimizer_state"] // 4)
    assert optimizer["optimizer_state"] == shared.optimizer_state_bytes
    assert shared.peak_bytes < whole.peak_bytes and "per rank of 4" in shared.checkpointing
    assert shared.host_bytes == shared.pinned_host_bytes == 0  # without offload nothing is planned for the host
    # NCCL's buffers: an assumed term beside the context, for a rank with peers only
    assert shared.nccl_buffer_bytes == NCCL_BUFFER_BYTES and per_rank(whole, 1, shapes).nccl_buffer_bytes == 0
    assert shared.peak_bytes == (shared.traced_peak_bytes + shared.cuda_context_bytes + shared.cublas_workspace_bytes
                                 + NCCL_BUFFER_BYTES + shared.fragmentation_bytes)
    assert main(["--model_name", "small", "--enable_fsdp", "--device", "cuda"]) == 2
    assert "--world_size: with --enable_fsdp" in capsys.readouterr().err
    assert main(["--model_name", "small", "--world_size", "2", "--device", "cuda"]) == 2
    assert "--world_size: the processes FSDP shards over; add --enable_fsdp" in capsys.readouterr().err
    assert main(["--model_name", "small", "--enable_fsdp", "--world_size", "4", "--device", "cuda", "--json",
                 "--enable_activation_checkpointing", "--activation_checkpointing_mode", "full",
                 "--batch_size_training", "1", "--context_length", "128"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["peak_bytes"] == shared.peak_bytes and record["nccl_buffer_bytes"] == NCCL_BUFFER_BYTES
    assert main(["--model_name", "small", "--enable_fsdp", "--world_size", "4", "--device", "cuda",
                 "--batch_size_training", "1", "--context_length", "128"]) == 0
    printed = capsys.readouterr().out
    assert "NCCL buffers" in printed and "NCCL buffers: 512 MiB assumed per rank" in printed
    assert main(["--model_name", "small", "--device", "cuda", "--batch_size_training", "1", "--context_length",
                 "128"]) == 0
    assert "NCCL" not in capsys.readouterr().out  # one GPU: no row, no note


def test_per_rank_plan_of_a_4bit_base_gathers_packed_bytes_and_holds_the_quantization_state_whole():
    """QLoRA under FSDP2: the packed uint8 weights are sharded and gathered as stored (FSDP2 casts only
    floating-point parameters to bf16), and their quantization state, not a parameter, is whole on every
    rank; the planner's fake quantization has the bytes of bitsandbytes' real one."""
    pytest.importorskip("bitsandbytes")
    from leantune.memory.tracker import carried_tensors
    from leantune.models.loading import attach_lora
    from leantune.models.quantized import bnb_config, quantize_linear_layers, quantized_layers
    from leantune.model_structure import decoder_layers
    from leantune.planning.fake_step import real_model
    from leantune.planning.per_rank import per_rank, sharding_shapes

    cfg = parse_run_config(["--model_name", "small", "--use_peft", "--quantization", "4bit", "--enable_fsdp",
                            "--batch_size_training", "1", "--context_length", "128",
                            "--enable_activation_checkpointing"])
    config = model_config("small")
    shapes = sharding_shapes(cfg, config, CUDA, 2)
    real = quantize_linear_layers(real_model(config, torch.bfloat16), bnb_config(cfg.quant, torch.bfloat16),
                                  torch.bfloat16)
    states = {id(t): t for layer in quantized_layers(real) for t in carried_tensors(layer.weight)}
    assert shapes.replicated_bytes == sum(t.numel() * t.element_size() for t in states.values()) > 0
    layer = list(decoder_layers(attach_lora(real, cfg.peft))[0].parameters())
    stored = sum(p.numel() for p in layer if not p.is_floating_point())  # packed: one byte holds two weights
    assert stored == sum(layer.weight.numel() for layer in quantized_layers(decoder_layers(real)[0]))
    floating = sum(p.numel() * 2 for p in layer if p.is_floating_point())  # norms, LoRA: gathered in bf16
    assert shapes.layer_in_flight_bytes == -(-(stored + floating) // 2) + stored + floating
    whole = plan_modes(cfg, config, CUDA, ["full"])[0]
    unreplicated = dataclasses.replace(shapes, replicated_bytes=0)
    for offload, extra in ((False, shapes.replicated_bytes - -(-shapes.replicated_bytes // 2)),
                           (True, shapes.replicated_bytes)):  # offloaded, the shards are on the host, the state not
        with_state = per_rank(whole, 2, shapes, cpu_offload=offload).stage_breakdowns
        without = per_rank(whole, 2, unreplicated, cpu_offload=offload).stage_breakdowns
        assert all(with_state[stage]["parameter"] - without[stage]["parameter"] == extra for stage in with_state)


def test_the_step_two_check_under_fsdp_compares_with_one_ranks_plan():
    """Each rank measures its own peak: the run's prediction is the per-rank plan, not one process's."""
    from leantune.planning.choose import MemoryPlan
    from leantune.planning.fake_step import StepTraces
    from leantune.planning.per_rank import RankShare, per_rank, sharding_shapes

    flags = ["--model_name", "small", "--batch_size_training", "1", "--context_length", "128",
             "--enable_activation_checkpointing", "--enable_memory_monitoring"]
    config = model_config("small")
    for extra, world in (([], 1), (["--enable_fsdp"], 4), (["--enable_fsdp", "--fsdp_cpu_offload"], 1)):
        cfg = parse_run_config([*flags, *extra])
        whole = plan_modes(cfg, config, CUDA, ["full"])[0]
        expected, offload = whole, "--fsdp_cpu_offload" in extra
        if extra:
            expected = per_rank(whole, world, sharding_shapes(cfg, config, CUDA, world, offload), offload)
        # the lambda runs within this iteration (predicted_peak below reads it): no late binding
        share = RankShare(lambda: sharding_shapes(cfg, config, CUDA, world, offload), world, offload)  # noqa: B023
        traces = StepTraces(share=share if extra else None)  # as a run builds it
        predicted, reserved = Planner(config, CUDA, None, traces, lambda _: None).predicted_peak(MemoryPlan(cfg))
        assert predicted == expected.traced_peak_bytes + expected.cublas_workspace_bytes
        if not extra:  # one process: the reservation the allocator model replayed, and the workspace
            assert reserved == trace_step(cfg, config, CUDA, "full").reserved_peak_bytes + whole.cublas_workspace_bytes
        else:  # a rank's: derived, with the assumed fragmentation share
            assert reserved == predicted + expected.fragmentation_bytes
        assert (predicted < whole.traced_peak_bytes) == bool(extra)


def test_planning_the_shards_draws_nothing_from_the_runs_generator():
    """A run plans under FSDP after seeding (and, on a GPU, after building its model): the stand-in model's
    LoRA initialisation must not move the CPU generator, or the run's own draws would change."""
    from leantune.planning.per_rank import sharding_shapes

    cfg = parse_run_config(["--model_name", "tiny", "--use_peft", "--enable_fsdp"])
    torch.manual_seed(0)
    before = torch.get_rng_state()
    sharding_shapes(cfg, model_config("tiny"), CUDA, 2)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_step_in_backward_is_traced_as_backward():
    """--optimizer_in_backward steps each weight inside backward: those moments are backward's (where FSDP's
    per-rank plan adds the gathered layers and the reduce buffers), and there is no optimizer stage after it."""
    cfg = parse_run_config(["--model_name", "tiny", "--batch_size_training", "1", "--context_length", "64",
                            "--optimizer_in_backward", "--enable_activation_checkpointing"])
    plan = plan_modes(cfg, model_config("tiny"), CPU, ["full"])[0]
    assert "backward" in plan.stage_breakdowns and "optimizer" not in plan.stage_breakdowns
    assert plan.peak_bytes == max(sum(stage.values()) for stage in plan.stage_breakdowns.values())


def test_offloaded_the_host_holds_the_optimizer_state_also_when_it_steps_in_backward():
    """Stepped in backward there is no optimizer stage: the state the host holds is read from the stages it is in."""
    from leantune.planning.per_rank import per_rank, sharding_shapes

    cfg = parse_run_config(["--model_name", "tiny", "--batch_size_training", "1", "--context_length", "64",
                            "--optimizer_in_backward", "--enable_activation_checkpointing", "--enable_fsdp",
                            "--fsdp_cpu_offload", "--device", "cuda"])
    config = model_config("tiny")
    whole = plan_modes(cfg, config, CUDA, ["full"])[0]
    shapes = sharding_shapes(cfg, config, CUDA, 1, cpu_offload=True)
    state = max(breakdown["optimizer_state"] for breakdown in whole.stage_breakdowns.values())
    assert state > 0 and "optimizer" not in whole.stage_breakdowns
    assert per_rank(whole, 1, shapes, cpu_offload=True).host_bytes == shapes.pinned_host_bytes + state


def test_auto_under_fsdp_chooses_by_one_ranks_plan():
    """Under FSDP auto compares each mode's per-rank plan with the budget: 2 GiB holds no mode of one
    process's full fine-tune of ``small`` (2.6 GiB), and a rank's share of 4 (1.3 GiB) without checkpointing."""
    from leantune.planning.fake_step import StepTraces
    from leantune.planning.per_rank import RankShare, sharding_shapes

    cfg = parse_run_config(["--model_name", "small", "--context_length", "128", "--enable_fsdp",
                            "--enable_activation_checkpointing", "--activation_checkpointing_mode", "auto",
                            "--memory_budget_gb", "2"])
    config = model_config("small")
    budget = run_budget(cfg.checkpointing, cfg.memory, cfg.training, CPU)
    with pytest.raises(ConfigError, match="no mode fits"):
        Planner(config, CPU, budget, None, lambda *_: None).choose(cfg)  # one process's plan: no share
    traces = StepTraces(share=RankShare(lambda: sharding_shapes(cfg, config, CPU, 4), 4, False))
    memory = Planner(config, CPU, budget, traces, lambda *_: None).choose(cfg)
    assert memory.cfg.checkpointing.mode is None and memory.plan.mode == "none"
    assert memory.plan.peak_bytes <= 2 * 2**30 and "per rank of 4" in memory.plan.checkpointing


def test_one_gpu_fsdp_cpu_offload_plans_the_device_and_the_host(capsys):
    """World 1 with --fsdp_cpu_offload: the device holds what is gathered and in flight, the host the rest."""
    from leantune.planning.plan_command import main
    from leantune.planning.per_rank import per_rank, sharding_shapes

    cfg = parse_run_config(["--model_name", "small", "--batch_size_training", "1", "--context_length", "128",
                            "--enable_activation_checkpointing", "--enable_fsdp", "--fsdp_cpu_offload"])
    config = model_config("small")
    whole = plan_modes(cfg, config, CUDA, ["full"])[0]
    shapes = sharding_shapes(cfg, config, CUDA, 1, cpu_offload=True)
    layer = sum(p.numel() for p in _small_layer_params())
    root = sum(p.numel() for p in _small_params()) - config.num_hidden_layers * layer
    largest = max(p.numel() for p in _small_layer_params()) * 4  # one weight's float32 shard copied in, then cast
    assert shapes.layer_in_flight_bytes == layer * 2 + layer * 2 + largest  # the all-gather's input and output
    assert shapes.root_gather_bytes == root * 2 + root * (2 + 2) + root_largest_bytes() * 4
    assert shapes.root_reduce_bytes == root * (4 + 4)  # the float32 buffer and its shard, waiting for the host
    offloaded = per_rank(whole, 1, shapes, cpu_offload=True)
    at_step = whole.stage_breakdowns["optimizer"]
    # pinned: every weight's float32 shard and its gradient's, each rounded up to a power of two
    pinned = sum(2 * (1 << (p.numel() * 4 - 1).bit_length()) for p in _small_params())
    assert offloaded.pinned_host_bytes == pinned >= at_step["parameter"] + at_step["gradient"]
    assert offloaded.host_bytes == pinned + at_step["optimizer_state"] + at_step["temporary"]
    assert offloaded.optimizer_state_bytes == 0 and offloaded.stage_breakdowns["optimizer"]["parameter"] == 0
    kept = per_rank(whole, 1, sharding_shapes(cfg, config, CUDA, 1))
    assert offloaded.peak_bytes < kept.peak_bytes - at_step["optimizer_state"]
    assert "FSDP, CPU offload" in offloaded.checkpointing
    flags = ["--model_name", "small", "--enable_fsdp", "--fsdp_cpu_offload", "--world_size", "1",
             "--enable_activation_checkpointing", "--batch_size_training", "1", "--context_length", "128"]
    assert main([*flags, "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "host memory, not in it" in out and "the optimizer steps on the CPU" in out
    assert main([*flags, "--device", "cpu"]) == 2  # as the run: the CPU has no device memory to offload from
    assert ("--fsdp_cpu_offload: moves the shards from GPUs to host memory; training on the CPU, they are there "
            "already. Plan it for a GPU with --device cuda") in capsys.readouterr().err


def root_largest_bytes() -> int:
    """The largest root parameter of ``small`` (its embedding or LM head), in elements."""
    from leantune.models.facts import meta_model
    from leantune.model_structure import decoder_layers

    model = meta_model(model_config("small"), torch.float32)
    layer_ids = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    return max(p.numel() for p in model.parameters() if id(p) not in layer_ids)


def _small_params():
    from leantune.models.facts import meta_model

    return list(meta_model(model_config("small"), torch.float32).parameters())


def _small_layer_params():
    from leantune.model_structure import decoder_layers
    from leantune.models.facts import meta_model

    return list(decoder_layers(meta_model(model_config("small"), torch.float32))[0].parameters())


def _stub_plans(monkeypatch, fits: dict):
    """``largest_batch`` answering from ``fits``: mode -> (batch, FLOPs per token)."""
    from types import SimpleNamespace

    import leantune.planning.choose as choose

    def largest(cfg, config, device, mode, budget, traces=None):
        batch, per_token = fits.get(mode, (0, 0))
        return batch, SimpleNamespace(flops=per_token * batch * 128, traced_tokens=batch * 128) if batch else None

    monkeypatch.setattr(choose, "largest_batch", largest)
    return choose


@pytest.mark.parametrize("fits, chosen", [
    # none fits a batch: no recompute beats a bigger batch bought with recompute
    ({"none": (2, 100), "selective_ops": (4, 100), "every_n": (8, 115), "full": (16, 133)}, ("none", 2)),
    # none does not fit: the mode that recomputes least, at its largest batch
    ({"selective_ops": (3, 100), "every_n": (8, 115), "full": (16, 133)}, ("selective_ops", 3)),
    ({"every_n": (8, 115), "full": (16, 133)}, ("every_n", 8)),
    ({"full": (16, 133)}, ("full", 16)),
    # FLOP counts within 2% are a tie, won by the mode that recomputes less; beyond it, the fewer FLOPs win
    ({"none": (2, 101.9), "selective_ops": (4, 100)}, ("none", 2)),
    ({"every_n": (8, 103), "full": (16, 100)}, ("full", 16)),
])
def test_auto_mode_and_batch_pick_the_least_compute_per_token(monkeypatch, fits, chosen):
    choose = _stub_plans(monkeypatch, fits)
    cfg = flags("--use_peft", "--enable_activation_checkpointing", "--activation_checkpointing_mode", "auto",
                "--auto_batch_size", "--memory_budget_gb", "1")
    lines: list[str] = []
    run_cfg, _ = choose.choose_mode_and_batch(PlanContext(None, torch.device("cpu"), 2**30, None, lines.append), cfg)
    assert ((run_cfg.checkpointing.mode or "none"), run_cfg.training.batch_size_training) == chosen
    if len(fits) == 1:  # the only candidate: the choice, said; else the candidates are timed and said then
        assert lines[-1].startswith(f"activation checkpointing: auto chose {chosen[0]} (batch {chosen[1]} in 1.00 GiB")
    else:
        assert lines[-1].startswith("largest batch that fits, per mode: ")


def test_a_run_traces_each_step_once_and_reads_the_model_config_once(tiny_model_dir, tmp_path, monkeypatch):
    """auto mode, the FLOP count (MFU) and the batch check all want traced steps: none is traced twice,
    and the model's config.json is read once for all of them."""
    import contextlib

    import leantune.models.facts as facts
    import leantune.planning.fake_step as fake_step
    from leantune.finetuning import build_trainer

    traced, reads = [], []
    trace = fake_step.trace_step
    monkeypatch.setattr(fake_step, "trace_step", lambda cfg, config, target, mode, fake=True: (
        traced.append(repr(fake_step.run_config_for_mode(cfg, mode))), trace(cfg, config, target, mode, fake))[1])
    auto_config = facts.AutoConfig

    class CountingAutoConfig:  # leantune's one reader of config.json; the planner's model_config must not run
        @staticmethod
        def from_pretrained(*args, **kwargs):
            reads.append(args)
            return auto_config.from_pretrained(*args, **kwargs)

    monkeypatch.setattr(facts, "AutoConfig", CountingAutoConfig)
    monkeypatch.setattr(facts, "model_config", lambda name: pytest.fail("a run read a preset or config again"))
    argv = ["--model_name", str(tiny_model_dir), "--use_peft", "--enable_activation_checkpointing",
            "--activation_checkpointing_mode", "auto", "--auto_batch_size", "--memory_budget_gb",
            str(48 * MIB / 2**30), "--peak_tflops", "1.0", "--context_length", "128", "--num_workers_dataloader", "0",
            "--output_dir", str(tmp_path)]
    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        trainer = build_trainer(parse_run_config(argv), stack, log=lines.append)
    assert any(line.startswith("mfu: against 1.0 TFLOP/s peak") for line in lines)
    assert trainer.parts.token_flops.model > 0
    assert len(traced) == len(set(traced)) > 2  # the FLOP count reused auto's traces of the chosen batch
    assert len(reads) == 1


def test_shared_traces_answer_what_fresh_traces_would():
    """A run's StepTraces hands each step its own trace: other batches, modes, flags or models are traced anew,
    and a batch search through it finds what it finds without it."""
    from leantune.planning.fake_step import StepTraces

    traces, config = StepTraces(), model_config("tiny")
    one, two = flags("--use_peft"), flags("--use_peft", "--batch_size_training", "3")
    assert traces.get(one, config, CPU, "full") is traces.get(one, config, CPU, "full")
    peaks = {traces.get(cfg, config, CPU, mode).peak_bytes for cfg in (one, two) for mode in ("none", "full")}
    peaks.add(traces.get(flags("--use_peft", "--lora_r", "16"), config, CPU, "full").peak_bytes)
    peaks.add(traces.get(one, model_config("small"), CPU, "full").peak_bytes)
    assert len(peaks) == 6  # every one a different step
    budget = 40 * MIB
    assert (largest_batch(one, config, CPU, "full", budget, StepTraces())
            == largest_batch(one, config, CPU, "full", budget))
    # keyed by what the model config says, not by which object holds it
    assert traces.get(one, model_config("tiny"), CPU, "full") is traces.get(one, config, CPU, "full")
    shallower = model_config("tiny")
    before = traces.get(one, shallower, CPU, "full").peak_bytes
    shallower.num_hidden_layers = 2  # changed in place: another model, another step
    assert traces.get(one, shallower, CPU, "full").peak_bytes < before


def test_grouped_heads_are_counted_as_the_querys_heads_by_a_formula_that_refuses_them(monkeypatch):
    """torch 2.11's SDPA FLOP formulas (the GPU image's) refuse key/value with fewer heads than the query, which
    varlen's SDPA per span passes (enable_gqa): the planner hands them the query's head count, the FLOPs the
    kernel spends, and so gets torch 2.13's own count for grouped heads."""
    from leantune.planning import flop_tracker

    def strict(query, key, value, *grad):
        assert query[1] == key[1] == value[1], "grouped heads refused"
        return 2 * query[0] * query[1] * query[2] * key[2] * (query[3] + value[3])

    monkeypatch.setattr(flop_tracker, "sdpa_flop_count", strict)
    monkeypatch.setattr(flop_tracker, "sdpa_backward_flop_count", lambda grad_out, q, k, v: strict(q, k, v))
    formulas = flop_tracker._cpu_attention_flops()
    aten = torch.ops.aten
    q, k, v = (torch.empty(2, heads, 16, 8, device="meta") for heads in (8, 2, 2))
    expected = 2 * 2 * 8 * 16 * 16 * 16
    assert formulas[aten._scaled_dot_product_flash_attention_for_cpu](q, k, v) == expected
    assert formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward](q, q, k, v) == expected


def test_the_planner_reads_the_budget_once_agreed_by_every_rank_and_shares_a_rank_plan_under_fsdp():
    """``Planner.for_run``: the budget every rank agrees on (the least), only when something is chosen; under FSDP
    its traces make every plan one rank's share."""
    from types import SimpleNamespace

    from leantune.planning.per_rank import RankShare

    ranks = SimpleNamespace(world_size=2, min_max=lambda value, device: (value // 2, value))  # the other rank's half
    auto = flags("--enable_activation_checkpointing", "--activation_checkpointing_mode", "auto", "--memory_budget_gb",
                 "1", "--enable_fsdp", "--use_peft")
    planner = Planner.for_run(auto, model_config("tiny"), CPU, ranks)
    assert planner.budget == 2**30 // 2 and planner.model_config.model_type == "llama" and planner.target == CPU
    assert isinstance(planner.traces.share, RankShare) and planner.traces.share.world_size == 2
    assert Planner.for_run(flags(), model_config("tiny"), CPU, ranks).budget is None  # nothing to choose: not read
    assert Planner.for_run(flags(), model_config("tiny"), CPU).traces.share is None  # one process: whole plans


def test_the_planners_flop_count_says_what_checkpointing_recomputes_and_never_stops_a_run(monkeypatch):
    from leantune.planning import planner as planner_module
    from leantune.planning.flops import count_token_flops

    cfg = flags("--enable_activation_checkpointing")
    config, lines = model_config("tiny"), []
    planner = Planner.for_run(cfg, config, CPU, log=lines.append)
    assert planner.token_flops(cfg, None) is None and lines == []  # no peak: nothing to measure against
    flops = planner.token_flops(cfg, 100.0)
    assert flops == count_token_flops(cfg, config, CPU)
    recompute = flops.hardware / flops.model - 1
    assert recompute > 0 and lines == [
        f"mfu: against 100.0 TFLOP/s peak; {flops.model / 1e9:,.3f} GFLOPs per token (+{recompute:.0%} recomputed by "
        "checkpointing, counted in HFU only)"]

    def untraceable(*_args):
        raise ValueError("the tracer cannot follow it\nsecond line")

    monkeypatch.setattr(planner_module, "count_token_flops", untraceable)
    assert planner.token_flops(cfg, 100.0) is None
    assert lines[-1] == "mfu: not reported (ValueError: the tracer cannot follow it)"
