"""The parts of ``gpu_check.py``, in order of value; each takes the ``Check`` and returns what it found.

A part's runs are real leantune runs (``gpu_check_runs.Check.leantune``); the part fails when one
of them fails. The figures are measurements to read, not thresholds: nothing here passes or fails
on a number, except that every run must finish.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoConfig

from gpu_check_runs import Check, pytest_record
from leantune.memory.allocator_model import AllocatorModel
from leantune.memory.gpu_constants import measure_gpu_constants
from leantune.precision import _bf16_supported
from leantune.report.flops import device_peak_tflops

LORA = ["--use_peft", "--peft_method", "lora"]  # r 8 on q_proj and v_proj: leantune's defaults, the report's
# The report this project answers (Llama-3.2-1B LoRA, context 2048, one 80 GB GPU).
REFERENCE_REPORT = {"batch_11_no_checkpointing": {"peak_gb": 77, "step_time_s": 1.09, "tokens_per_s": 20859,
                                                  "mfu": 0.50},
                    "batch_11_checkpointing": {"peak_gb": 45, "step_time_s": 1.65},
                    "batch_19_checkpointing": {"tokens_per_s": 23583, "mfu": 0.56}}
# How much each allocation size adds to the allocator's reservation, from an emptied cache: sizes around the
# caching allocator's thresholds (small pool up to 1 MiB in 2 MiB segments, large pool below 10 MiB in 20 MiB
# segments, 2 MiB rounding above). Run in a fresh process of its own (torch alone: it must start fast) for each
# allocator setting.
PROBE = """
import json, sys, torch
device = torch.device(sys.argv[1])
on_gpu = device.type == "cuda"
rows = []
for size in (256 * 1024, 1536 * 1024, 9 * 2**20, 11 * 2**20 + 1, 101 * 2**20 + 1):
    if on_gpu:
        torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device) if on_gpu else 0
    block = torch.empty(size, dtype=torch.uint8, device=device)
    rows.append({"asked_bytes": size, "reserved_more_bytes": (torch.cuda.memory_reserved(device) if on_gpu else 0) - before})
    del block
print(json.dumps(rows))
"""
PROBE_LIMIT_S = 20


def _probe_in_a_child(device: torch.device, alloc_conf: str) -> list[dict] | dict:
    """``PROBE`` in a fresh process whose allocator ``PYTORCH_CUDA_ALLOC_CONF`` configures; its error instead
    where the setting cannot work (expandable segments need the driver's virtual memory calls)."""
    try:
        result = subprocess.run([sys.executable, "-c", PROBE, str(device)], capture_output=True, text=True,
                                timeout=PROBE_LIMIT_S, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf})
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {PROBE_LIMIT_S} s"}
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-3:]}
    return json.loads(result.stdout.splitlines()[-1])


def part_device(check: Check) -> dict:
    """Versions; on a GPU: its name, the MFU peak leantune uses, bf16, the measured context and workspace,
    and how the allocator rounds (with and without expandable segments)."""
    import peft
    import transformers

    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
             "peft": peft.__version__, "bitsandbytes": check.has_bitsandbytes, "python": sys.version.split()[0]}
    on_gpu = torch.cuda.is_available() and not check.dry_run
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        constants = measure_gpu_constants(device)  # first, before this process allocates anything else
        props = torch.cuda.get_device_properties(device)
        facts.update(name=props.name, capability=list(torch.cuda.get_device_capability(device)),
                     multiprocessors=props.multi_processor_count, total_mib=props.total_memory / 2**20,
                     bf16_native=_bf16_supported(device), bf16_torch_default=torch.cuda.is_bf16_supported(),
                     peak_tflops=device_peak_tflops(device), constants=constants.as_dict(),
                     constants_line=constants.line())
    facts["allocator"] = {"default": _with_the_model(_probe_in_a_child(device, ""), expandable=False),
                          "expandable_segments": _with_the_model(_probe_in_a_child(device, "expandable_segments:True"),
                                                                 expandable=True)}
    return {"facts": facts}


def _with_the_model(rows, expandable: bool):
    """Each probe's row with what the planner's allocator model reserves for the same request, from empty."""
    if not isinstance(rows, list):
        return rows
    for row in rows:
        model = AllocatorModel(expandable)
        model.allocate(0, row["asked_bytes"])
        row["modelled_bytes"] = model.reserved
    return rows


def part_reference(check: Check) -> dict:
    """The report's workload: batch 11 without and with checkpointing, offload (bf16, monitoring, the memory
    snapshot, MFU and the plan check at step 2), and the largest batch that fits, as leantune runs them."""
    s, ac = check.sizes, ["--enable_activation_checkpointing"]
    batch = ["--batch_size_training", str(s.batch)]
    # The report's 80 GB card (its context aside), and at most 32 rows: the search traces each batch it tries.
    budget = "0.08" if check.dry_run else "76"
    auto = ["--auto_batch_size", "--memory_budget_gb", budget, "--target_global_batch_size", str(s.target_batch)]
    runs = [check.leantune("reference_batch_none", LORA + batch, s.steps),
            check.leantune("reference_batch_full", LORA + batch + ac, s.steps),
            check.leantune("reference_batch_offload", LORA + batch + ac + check.gpu_only(
                "--activation_checkpointing_mode", "offload", "--memory_snapshot"), s.steps + 3),
            check.leantune("reference_auto_batch_full", LORA + ac + auto, s.steps),
            check.leantune("reference_auto_batch_auto_mode", LORA + ac + auto + ["--activation_checkpointing_mode",
                                                                                  "auto"], s.steps)]
    offloaded = check.runs / "reference_batch_offload"
    return {"runs": runs, "report": REFERENCE_REPORT,
            "snapshot_bytes": (offloaded / "memory_snapshot.pickle").stat().st_size
            if (offloaded / "memory_snapshot.pickle").is_file() else None,
            "report_md_written": (offloaded / "report.md").is_file()}


def part_cuda_tests(check: Check) -> dict:
    """The tests marked ``gpu`` (skipped on a CPU) and the memory tests whose CUDA branches a CPU never takes."""
    # Named files: collecting every test would import what the GPU machine's image lacks (datasets).
    if importlib.util.find_spec("pytest") is None:
        return {"runs": [], "skipped": "pytest is not installed here: the CUDA tests were not run"}
    runs = [pytest_record("pytest_gpu_marked", check, ["-m", "gpu", "tests/test_offload.py",
                                                       "tests/test_gpu_constants.py", "tests/test_loss.py"])]
    if not check.dry_run:
        runs.append(pytest_record("pytest_memory", check, ["tests/test_memory.py", "tests/test_cuda_counters.py",
                                                           "tests/test_step_peak.py"]))
    return {"runs": runs}


def part_full_finetuning(check: Check) -> dict:
    """Full fine-tuning of the 1B shape, 4 x 2048: the chunked loss against the plain one (time and peak),
    each with the plan checked at step 2; then chunks four times as long (fewer passes over the float32
    head gradient, more memory: whether a chunk sized from the memory budget would pay)."""
    s = check.sizes
    batch = ["--batch_size_training", str(s.full_batch)]
    return {"runs": [check.leantune("full_chunked_loss", batch, s.steps),
                     check.leantune("full_plain_loss", batch + ["--loss_chunk_size", "0"], s.steps),
                     check.leantune("full_chunked_loss_2048", batch + ["--loss_chunk_size", "2048"], s.steps)]}


def part_lean(check: Check) -> dict:
    """QLoRA and the lean optimizers on the 1B shape, each planned and checked at step 2 (bitsandbytes's
    runs only when it is installed: ``--bitsandbytes_wheels``)."""
    s, batch = check.sizes, ["--batch_size_training", str(check.sizes.small_batch)]
    runs = [check.leantune("lean_anyprecision_pure_bf16", batch + ["--optimizer", "anyprecision", "--pure_bf16"],
                           s.short_steps),
            check.leantune("lean_optimizer_in_backward", batch + ["--optimizer_in_backward"], s.short_steps)]
    skipped = None
    if check.has_bitsandbytes:
        runs += [check.leantune("lean_adamw_8bit", batch + ["--optimizer", "adamw_8bit"], s.short_steps),
                 check.leantune("lean_qlora_4bit", batch + LORA + ["--quantization", "4bit"], s.short_steps)]
    else:
        skipped = "bitsandbytes is not installed: --optimizer adamw_8bit and --quantization 4bit were not run"
    return {"runs": runs, "skipped": skipped}


def part_fsdp(check: Check) -> dict:
    """FSDP2 on one rank under torchrun (NCCL on a GPU): full fine-tuning with CPU offload, the model saved
    from its shards and read back. Where the host has several GPUs (two gloo ranks in the dry run), the
    same run over all of them, not offloaded: each rank's peak while loading and sharding (the whole
    model would show in it), and the device's memory beyond the allocator, NCCL's buffers included."""
    s = check.sizes
    flags = ["--enable_fsdp", "--batch_size_training", str(s.small_batch), "--save_model", "true",
             *check.gpu_only("--fsdp_cpu_offload")]
    saved, run = check.runs / "fsdp_one_rank", None
    try:
        run = check.leantune("fsdp_one_rank", flags, s.short_steps, processes=1)
        run["saved_files"] = sorted(p.name for p in saved.glob("*.safetensors")) if saved.is_dir() else []
        if run["rc"] == 0:
            run["saved_config_reads"] = AutoConfig.from_pretrained(saved).model_type
    finally:
        for weights in saved.glob("*.safetensors"):  # 5 GB of random weights, read back: not kept
            weights.unlink()
    ranks = 2 if check.dry_run else torch.cuda.device_count()
    if ranks < 2:
        return {"runs": [run], "skipped": "one GPU: FSDP over several ranks (NCCL's buffers, per-rank peaks) not run"}
    spread = check.leantune(f"fsdp_{ranks}_ranks", ["--enable_fsdp", "--batch_size_training", str(s.small_batch)],
                            s.short_steps, processes=ranks)
    return {"runs": [run, spread]}


def part_fp16(check: Check) -> dict:
    """float16 autocast with the gradient scaler, through the trainer (LoRA)."""
    batch = ["--batch_size_training", str(check.sizes.small_batch)]
    return {"runs": [check.leantune("fp16_grad_scaler", LORA + batch + ["--use_fp16"], check.sizes.short_steps)]}


# name -> (part, seconds it may take on one H200)
PARTS = {"device": (part_device, 90), "reference": (part_reference, 330), "cuda_tests": (part_cuda_tests, 120),
         "full_finetuning": (part_full_finetuning, 210), "lean": (part_lean, 200), "fsdp": (part_fsdp, 210),
         "fp16": (part_fp16, 60)}
