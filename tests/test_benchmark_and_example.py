"""The benchmark's interface (flags, JSON records, plot), that its cases are leantune's own (config,
precision, model preparation, step), and the example run, at toy sizes."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from pathlib import Path

import pytest
import torch

from leantune.loss import ChunkedCrossEntropy, auto_chunk_size
from leantune.memory.meter import ActivationMeter
from leantune.precision import Precision, choose_precision

ROOT = Path(__file__).resolve().parents[1]


def run_precision(cfg, device, **kwargs):
    """``choose_precision`` of a whole run's sections."""
    return choose_precision(cfg.model, cfg.training, cfg.peft, device, **kwargs)


def _load(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_benchmark_writes_one_record_per_kind_and_mode(tmp_path, capsys):
    bench = _load("benchmarks/activation_checkpointing.py")
    out = tmp_path / "ac.json"
    assert bench.main(["--preset", "tiny", "--kind", "both", "--batch_size", "1", "--context_length", "64",
                       "--steps", "1", "--warmup", "0", "--device", "cpu", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    modes = ["none", "full", "every_n", "selective_ops"]  # offload needs CUDA
    assert [(r["kind"], r["mode"]) for r in records] == [(k, m) for k in ("full", "lora") for m in modes]
    for r in records:
        assert {"kind", "mode", "activation_bytes", "peak_bytes", "step_time_s", "tokens_per_s", "device"} <= r.keys()
        assert r["device"] == "cpu" and r["activation_bytes"] > 0 and r["step_time_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(64 / r["step_time_s"])
    by_mode = {(r["kind"], r["mode"]): r for r in records}
    for kind in ("full", "lora"):
        assert by_mode[(kind, "full")]["activation_bytes"] < by_mode[(kind, "none")]["activation_bytes"]
        assert by_mode[(kind, "none")]["activation_bytes_ratio"] == 1.0
    assert out.with_suffix(".png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "offload: skipped" in printed and "targets (issue #3):" in printed


def test_benchmark_rejects_unknown_modes():
    bench = _load("benchmarks/activation_checkpointing.py")
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "none,partial"])


def test_benchmark_cases_are_configured_by_leantunes_flags():
    bench = _load("benchmarks/activation_checkpointing.py")
    args = bench.parse_args(["--preset", "tiny", "--every_n", "3", "--device", "cpu"])
    lora = bench.case_config(args, "lora", "every_n", "chunked")
    assert lora.peft.use_peft and lora.checkpointing.mode == "every_n"
    assert lora.checkpointing.activation_checkpointing_every_n == 3
    assert lora.training.loss_chunk_size == auto_chunk_size(2048)  # the case names its loss explicitly
    full = bench.case_config(args, "full", "none", "plain")
    assert not full.peft.use_peft and full.checkpointing.mode is None and full.training.loss_chunk_size == 0
    # What choose_precision makes of them on a bf16 GPU (described, never touched): LoRA's frozen
    # base in bf16, full fine-tuning with float32 master weights, both under bf16 autocast.
    gpu = torch.device("cuda")
    assert (run_precision(lora, gpu, bf16_supported=True).weight_dtype,
            run_precision(lora, gpu, bf16_supported=True).compute_dtype) == (torch.bfloat16, torch.bfloat16)
    assert (run_precision(full, gpu, bf16_supported=True).weight_dtype,
            run_precision(full, gpu, bf16_supported=True).compute_dtype) == (torch.float32, torch.bfloat16)


def test_benchmark_lora_case_on_the_cpu_is_float32_without_autocast():
    bench = _load("benchmarks/activation_checkpointing.py")
    args = bench.parse_args(["--preset", "tiny", "--kind", "lora", "--device", "cpu"])
    case = bench.make_case(args, "lora", "full", "chunked", torch.device("cpu"))
    assert case.precision == run_precision(bench.case_config(args, "lora", "full", "chunked"), torch.device("cpu"))
    assert case.precision.weight_dtype is torch.float32 and case.precision.compute_dtype is None
    assert {p.dtype for p in case.model.parameters()} == {torch.float32}
    assert case.layers == "4/4" and isinstance(case.loss_fn, ChunkedCrossEntropy)


def test_benchmark_weights_and_autocast_come_from_choose_precision(monkeypatch):
    """Whatever choose_precision decides is what the benchmark's model and step use."""
    bench = _load("benchmarks/activation_checkpointing.py")
    decided = []

    def bf16_everywhere(mc, tc, peft, device, bf16_supported=None):
        decided.append(Precision(device, torch.bfloat16, torch.bfloat16, False, "bf16 for the test"))
        return decided[-1]

    monkeypatch.setattr(bench, "choose_precision", bf16_everywhere)
    args = bench.parse_args(["--preset", "tiny", "--kind", "lora", "--device", "cpu"])
    case = bench.make_case(args, "lora", "none", "chunked", torch.device("cpu"))
    assert case.precision is decided[-1]
    base = [p for name, p in case.model.named_parameters() if "lora_" not in name]
    assert {p.dtype for p in base} == {torch.bfloat16}
    autocast_seen = []
    q_proj = next(m for name, m in case.model.named_modules() if name.endswith("q_proj"))
    q_proj.register_forward_hook(lambda *_: autocast_seen.append(
        (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    ids = torch.randint(3, 2048, (1, 32))
    meter = ActivationMeter.for_model(case.model)
    with meter:
        assert bench.step(case, ids, meter) > 0  # read in forward_backward's after_forward hook
    assert autocast_seen and set(autocast_seen) == {(True, torch.bfloat16)}


def test_example_runs_and_checkpointing_changes_nothing_but_memory(capsys):
    example = _load("examples/single_gpu_activation_checkpointing.py")
    rows = example.main(["--steps", "2", "--batch_size", "2", "--context_length", "64"])
    (off, act_off, _, res_off), (on, act_on, _, res_on) = rows
    assert (off, on) == (False, True) and act_on < act_off
    assert res_on["last_loss"] == res_off["last_loss"]
    assert "same final loss with and without: True" in capsys.readouterr().out


def test_monitoring_overhead_benchmark_interleaves_and_writes_its_record(tiny_model_dir, tmp_path, monkeypatch, capsys):
    bench = _load("benchmarks/monitoring_overhead.py")
    out = tmp_path / "overhead.json"
    monkeypatch.setattr("sys.argv", ["monitoring_overhead.py", "--model_name", str(tiny_model_dir), "--context_length",
                                     "64", "--batch_size", "1", "--rounds", "3", "--steps", "1", "--warmup", "1",
                                     "--json", str(out)])
    bench.main()
    record = json.loads(out.read_text())
    assert record["steps_each"] == 3 and record["rounds"] == 3
    assert 0 < record["record_s"] and 0 < record["sampler_cpu_share"] < 1
    assert "noise floor" in capsys.readouterr().out
    assert [t.name for t in threading.enumerate() if t.name == "leantune-rss-sampler"] == []  # every sampler stopped


def test_memory_budget_benchmark_finds_each_largest_fitting_batch_and_times_it(tmp_path, capsys):
    """Issue #11's benchmark at toy size: leantune's modes, auto and the Hugging Face Trainer under one budget."""
    bench = _load("benchmarks/memory_budget.py")
    out = tmp_path / "budget.json"
    assert bench.main(["--preset", "tiny", "--budget_mib", "60", "--steps", "1", "--warmup", "0", "--device", "cpu",
                       "--scan_batches", "1,2", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    scan = [r for r in records if r["tool"] == "leantune_batch_scan"]
    assert [(r["mode"], r["batch_size"]) for r in scan] == [("none", 1), ("none", 2)]
    assert all(r["tokens_per_s"] == pytest.approx(r["batch_size"] * 64 / r["step_time_s"]) for r in scan)
    records = [r for r in records if r not in scan]
    assert [(r["tool"], r["mode"]) for r in records] == [
        ("leantune", "none"), ("leantune", "full"), ("leantune", "selective_ops"), ("leantune", "auto"),
        ("hf_trainer", "none"), ("hf_trainer", "full")]
    budget = 60 * 2**20
    for r in records:
        assert {"tool", "mode", "batch_size", "peak_bytes", "tokens_per_s"} <= r.keys()
        assert r["batch_size"] >= 1 and r["fits"] and r["peak_bytes"] <= budget, r
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] * 64 / r["step_time_s"])
        if r["mode"] != "auto":  # measured: the answer fits and the next batch does not
            measured = {int(b): nbytes for b, nbytes in r["measured_bytes"].items()}
            assert measured[r["batch_size"]] == r["peak_bytes"] <= budget < measured[r["batch_size"] + 1], r
    by = {(r["tool"], r["mode"]): r for r in records}
    # checkpointing buys batch under the same budget, and the planner's guess was the leantune search's start
    assert by[("leantune", "full")]["batch_size"] > by[("leantune", "none")]["batch_size"]
    assert by[("leantune", "none")]["first_guess"] >= 1
    assert by[("leantune", "auto")]["checkpointing"] in ("none", "full", "selective_ops", "every_n")
    assert out.with_suffix(".png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "targets (issue #11):" in printed and "  auto chose " in printed
    assert "batch scan, leantune none (budget ignored): batch 1 " in printed


def test_memory_budget_benchmark_needs_a_budget_on_the_cpu(capsys):
    bench = _load("benchmarks/memory_budget.py")
    assert bench.main(["--preset", "tiny", "--device", "cpu"]) == 2
    assert "--budget_mib: the CPU has no memory size" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["tiny", "small", "Llama-3.2-1B"])
def test_memory_budget_benchmark_builds_every_presets_config(preset):
    """The GPU default (Llama-3.2-1B) carries its own token ids; the benchmark's tokenizer's replace them."""
    from leantune.models.tiny import build_tokenizer

    bench = _load("benchmarks/memory_budget.py")
    tokenizer = build_tokenizer()
    config = bench.model_config(preset, tokenizer)
    assert config.bos_token_id == tokenizer.bos_token_id and config.pad_token_id == tokenizer.pad_token_id
    assert config.hidden_size == bench.SHAPES[preset]["hidden_size"] and config.use_cache is False
    assert bench.CONTEXT[preset] <= config.max_position_embeddings


def _hf_case(tiny_model_dir, tmp_path):
    bench = _load("benchmarks/memory_budget.py")
    from budget_hf_trainer import HFTrainerCase

    from leantune.flags import parse_run_config

    cfg = parse_run_config(["--model_name", str(tiny_model_dir), "--use_peft", "--context_length", "64", "--device",
                            "cpu", "--output_dir", str(tmp_path / "hf")])
    return HFTrainerCase(str(tiny_model_dir), cfg, run_precision(cfg, torch.device("cpu")), bench.full_rows(cfg),
                         checkpointing=False)


def test_the_hf_trainer_takes_turns_and_ends_early_when_released(tiny_model_dir, tmp_path):
    """Its thread steps only when given a turn, and finish() ends a run whose turns were not all taken."""
    case = _hf_case(tiny_model_dir, tmp_path)
    case.start(batch=2, steps=5)
    thread = case._thread
    assert case.step() > 0 and case.step() > 0  # two of the five steps
    finisher = threading.Thread(target=case.finish)
    finisher.start()
    finisher.join(timeout=60)
    assert not finisher.is_alive() and not thread.is_alive()
    assert case.model is None


def test_an_error_in_the_hf_trainers_step_reaches_the_caller(tiny_model_dir, tmp_path):
    case = _hf_case(tiny_model_dir, tmp_path)
    case.start(batch=2, steps=3)
    case.step()
    case.model.get_base_model().model.layers[0].self_attn.q_proj.forward = None  # the next step fails
    with pytest.raises(TypeError):
        case.step()
    case.finish()


def test_a_turn_beyond_the_hf_trainers_last_step_is_an_error_not_an_old_time(tiny_model_dir, tmp_path):
    case = _hf_case(tiny_model_dir, tmp_path)
    case.start(batch=2, steps=2)
    assert case.step() > 0 and case.step() > 0
    with pytest.raises(RuntimeError, match="ended before another step"):
        case.step()
    case.finish()


def test_the_compile_benchmark_times_eager_and_compiled_and_reads_the_heap(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run as a script: it imports its neighbour
    bench = _load("benchmarks/compile.py")
    heap = bench.HeapBytes(torch.device("cpu"))
    before = heap.live_bytes()
    block = torch.empty(8 * 2**20, dtype=torch.uint8)
    assert heap.live_bytes() - before >= block.numel()  # what compiled code allocates is counted too
    out = tmp_path / "compile.json"
    assert bench.main(["--preset", "tiny", "--kind", "lora", "--modes", "none", "--steps", "1", "--json",
                       str(out)]) == 0
    eager, compiled = json.loads(out.read_text())
    assert (eager["case"], compiled["case"]) == ("eager", "compiled")
    assert compiled["compile_s"] > 0 and compiled["speedup"] > 0 and 0 < compiled["activation_ratio"] <= 1.5
    assert "lora  none" in capsys.readouterr().out
