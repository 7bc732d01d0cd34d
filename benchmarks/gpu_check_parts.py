"""The parts of ``gpu_check.py``, in order of value; each takes the ``Check`` and returns what it found.

A part's runs are real leantune runs (``gpu_check_runs.Check.leantune``); the part fails when one
of them fails. The figures are measurements to read, not thresholds: nothing here passes or fails
on a number, except that every run must finish. ``gpu_check.py`` gives each its limit (``SCHEDULE``):
with the set-up they add up to at most 480 s, so one device call of the 15 minutes a session gets
holds the whole check, the machine's start-up included.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoConfig

from gpu_check_runs import Check, pytest_record, write_json
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
"""  # noqa: E501 (a long line in the probe's source above: kept whole, the string unchanged)
PROBE_LIMIT_S = 12


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
    and how the allocator rounds (with and without expandable segments). Each fact is written as it is found:
    a part stopped at its limit keeps what it had."""
    import inspect

    import peft
    import transformers

    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
             "peft": peft.__version__, "bitsandbytes": check.has_bitsandbytes, "python": sys.version.split()[0]}

    def found(**more) -> None:
        facts.update(more)
        write_json(check.work / "parts" / "device.json", {"facts": facts})

    try:
        from torch.nn.attention.varlen import varlen_attn
        found(varlen_signature=str(inspect.signature(varlen_attn)))
    except ImportError as err:
        found(varlen_signature=f"none: {err}")
    on_gpu = torch.cuda.is_available() and not check.dry_run
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        constants = measure_gpu_constants(device)  # first, before this process allocates anything else
        found(constants=constants.as_dict(), constants_line=constants.line())
        props = torch.cuda.get_device_properties(device)
        found(name=props.name, capability=list(torch.cuda.get_device_capability(device)),
              multiprocessors=props.multi_processor_count, total_mib=props.total_memory / 2**20,
              bf16_native=_bf16_supported(device), bf16_torch_default=torch.cuda.is_bf16_supported(),
              peak_tflops=device_peak_tflops(device))
    found(allocator={"default": _with_the_model(_probe_in_a_child(device, ""), expandable=False)})
    found(allocator={**facts["allocator"], "expandable_segments": _with_the_model(
        _probe_in_a_child(device, "expandable_segments:True"), expandable=True)})
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


GPU_MARK = re.compile(r"^\s*@pytest\.mark\.gpu\b|^pytestmark\s*=.*\bpytest\.mark\.gpu\b|marks=.*\bpytest\.mark\.gpu\b",
                      re.MULTILINE)


def gpu_marked_test_files() -> list[str]:
    """The test files holding a ``gpu``-marked test, relative to the checkout (pytest's working directory); those
    that use torchao last (its first use compiles for tens of seconds: the rest are recorded before it)."""
    root = Path(__file__).resolve().parent.parent
    marked = [path for path in sorted((root / "tests").glob("test_*.py"))
              if GPU_MARK.search(path.read_text(encoding="utf-8"))]
    marked.sort(key=lambda path: "torchao" in path.read_text(encoding="utf-8"))  # stable: alphabetical otherwise
    return [str(path.relative_to(root)) for path in marked]


def part_cuda_tests(check: Check) -> dict:
    """The tests marked ``gpu`` (skipped on a CPU), and the memory tests whose CUDA branches a CPU never takes
    (named files: collecting every test would import what the image lacks); every failure is reported, and every
    test's outcome is in its log as it ends (verbose) and in a JUnit XML file."""
    if importlib.util.find_spec("pytest") is None:
        return {"runs": [], "skipped": "pytest is not installed here: the CUDA tests were not run"}
    runs = [pytest_record("pytest_gpu_marked", check, ["-m", "gpu", *gpu_marked_test_files()])]
    if not check.dry_run:
        runs.append(pytest_record("pytest_memory", check, ["tests/test_cuda_counters.py", "tests/test_step_peak.py",
                                                           "tests/test_gpu_constants.py"]))
    return {"runs": runs}


REFERENCE_FULL = "reference_batch_full"


def _reference_flags(check: Check, save_state: bool = True) -> list[str]:
    """The report's workload with full checkpointing, as the reference part runs it (its state saved at step 2,
    which the resume part resumes)."""
    return LORA + ["--batch_size_training", str(check.sizes.batch), "--enable_activation_checkpointing",
                   *(["--save_steps", "2"] if save_state else [])]


def part_reference(check: Check) -> dict:
    """The report's workload, batch 11 at 2048 (LoRA r8 q/v, bf16), without and with full checkpointing, as
    leantune runs it by default (varlen attention): peak allocated and reserved against the plan at step 2,
    step time, tokens/s and MFU beside the report's. The checkpointed run saves its state at step 2, which
    the ``resume`` part resumes."""
    s = check.sizes
    return {"runs": [check.leantune("reference_batch_none", LORA + ["--batch_size_training", str(s.batch)], s.steps),
                     check.leantune(REFERENCE_FULL, _reference_flags(check), s.steps)],
            "report": REFERENCE_REPORT}


def part_qlora(check: Check) -> dict:
    """QLoRA (a 4-bit base, bitsandbytes' CUDA kernels) with full checkpointing, planned and checked at step 2."""
    if not check.has_bitsandbytes:
        return {"runs": [], "skipped": "bitsandbytes is not usable here: give --wheels (benchmarks/gpu_wheels.py)"}
    flags = LORA + ["--quantization", "4bit", "--enable_activation_checkpointing",
                    "--batch_size_training", str(check.sizes.batch)]
    return {"runs": [check.leantune("qlora_4bit_full", flags, check.sizes.short_steps)]}


def part_compile(check: Check) -> dict:
    """``--compile`` with selective_ops (the checkpoint inside each compiled layer): compile time, graph breaks,
    step time and peak against the eager plan."""
    flags = LORA + ["--enable_activation_checkpointing", "--activation_checkpointing_mode", "selective_ops",
                    "--compile", "--batch_size_training", str(check.sizes.small_batch)]
    return {"runs": [check.leantune("compile_selective_ops", flags, check.sizes.short_steps)]}


def part_lean_optimizers(check: Check) -> dict:
    """Full fine-tuning, batch 2, full checkpointing, ``--optimizer auto`` under 20 GB: the plans put plain
    AdamW at 21.6 GiB and AdamW stepped in backward at 19.0 for the 1B shape, so auto picks the step in
    backward (torch's AdamW, no bitsandbytes needed): the rung's choice, its plan at step 2 and its speed."""
    budget = "0.5" if check.dry_run else "20"
    flags = ["--batch_size_training", str(check.sizes.small_batch), "--enable_activation_checkpointing",
             "--optimizer", "auto", "--memory_budget_gb", budget]
    return {"runs": [check.leantune("lean_optimizer_auto", flags, check.sizes.short_steps)]}


def part_attention(check: Check) -> dict:
    """The reference's checkpointed run with ``--attn_implementation sdpa``: packing apart then makes
    transformers build the dense mask from the restarting position ids, against varlen's flash kernel in
    ``reference_batch_full`` (the same shape and steps)."""
    flags = [*_reference_flags(check, save_state=False), "--attn_implementation", "sdpa"]
    return {"runs": [check.leantune("attention_sdpa", flags, check.sizes.steps)]}


def part_fsdp(check: Check) -> dict:
    """FSDP2 on one rank under torchrun (NCCL on a GPU): full fine-tuning with the shards in host memory
    (``--fsdp_cpu_offload``), the model saved from its shards and read back; its ``fsdp: sharded`` line
    gives the rank's peak while loading and sharding."""
    s = check.sizes
    flags = ["--enable_fsdp", "--batch_size_training", str(s.small_batch), "--save_model", "true",
             *check.gpu_only("--fsdp_cpu_offload")]
    saved = check.runs / "fsdp_one_rank"
    try:
        run = check.leantune("fsdp_one_rank", flags, s.short_steps, processes=1)
        run["saved_files"] = sorted(p.name for p in saved.glob("*.safetensors")) if saved.is_dir() else []
        if run["rc"] == 0:
            run["saved_config_reads"] = AutoConfig.from_pretrained(saved).model_type
    finally:
        for weights in saved.glob("*.safetensors"):  # 5 GB of random weights, read back: not kept
            weights.unlink()
    return {"runs": [run]}


def part_resume(check: Check) -> dict:
    """The reference's checkpointed run resumed from its state at step 2, to its last step: the losses after
    step 2 against the run never stopped (step 3 should be equal; later ones within what a GPU's attention
    backward, whose sums are not ordered, leaves)."""
    state = check.runs / REFERENCE_FULL / "checkpoint-2"
    if not state.is_dir():
        return {"runs": [], "skipped": f"no state at {state}: the reference part did not save one"}
    run = check.leantune("resume_reference", _reference_flags(check) + ["--resume_from_checkpoint", str(state)],
                         check.sizes.steps)
    whole, resumed = (_step_losses(check.runs / name) for name in (REFERENCE_FULL, "resume_reference"))
    common = sorted(set(whole) & set(resumed), key=int)
    differences = {step: abs(resumed[step] - whole[step]) / max(abs(whole[step]), 1e-12) for step in common}
    return {"runs": [run], "losses_never_stopped": whole, "losses_resumed": resumed,
            "step_3_equal": "3" in common and resumed["3"] == whole["3"],
            "max_relative_difference": max(differences.values()) if differences else None}


def _step_losses(out_dir: Path) -> dict:
    """Step -> loss of the steps after 2 in a run's metrics.json (empty when there is none)."""
    metrics = out_dir / "metrics.json"
    if not metrics.is_file():
        return {}
    steps = json.loads(metrics.read_text())["train_steps"]
    return {str(row["step"]): row["loss"] for row in steps if row["step"] > 2}


# name -> part; gpu_check.py's SCHEDULE and ON_REQUEST give their order and limits.
PARTS = {"device": part_device, "cuda_tests": part_cuda_tests, "reference": part_reference, "qlora": part_qlora,
         "compile": part_compile, "resume": part_resume, "fsdp": part_fsdp, "attention": part_attention,
         "lean_optimizers": part_lean_optimizers}
