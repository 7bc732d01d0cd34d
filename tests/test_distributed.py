"""FSDP2 through torchrun on the CPU (gloo): the same losses as one process, one saved model, clean exits."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leantune.flags import parse_run_config
from leantune.data.batching import RankShard, ShuffledBatchSampler
from leantune.finetuning import run

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--context_length", "128", "--num_workers_dataloader", "0", "--num_epochs", "1", "--lr", "1e-3",
        "--save_metrics", "true"]
CASES = {
    # LoRA dropout draws different masks for 4 rows in one process than for 2 + 2 rows in two: off to compare
    "lora-full": ["--use_peft", "--lora_dropout", "0", "--enable_activation_checkpointing", "--max_train_step", "4"],
    "full-ft-selective-accumulation-clipping": [
        "--enable_activation_checkpointing", "--activation_checkpointing_mode", "selective_ops",
        "--gradient_accumulation_steps", "2", "--gradient_clipping", "true", "--max_train_step", "4"],
    "full-ft-no-checkpointing": ["--max_train_step", "3", "--enable_memory_monitoring"],
    # saves at step 2 and, after validation, the end state: validation's forward must leave the shards in place
    "full-ft-full": ["--enable_activation_checkpointing", "--max_train_step", "3", "--save_steps", "2"],
    "lora-selective": ["--use_peft", "--lora_dropout", "0", "--enable_activation_checkpointing",
                       "--activation_checkpointing_mode", "selective_ops", "--max_train_step", "3"],
    "lora-no-checkpointing": ["--use_peft", "--lora_dropout", "0", "--max_train_step", "3"],
    # each weight stepped by FSDP2's hook once its shard's gradient is reduced; the norm summed over the ranks
    "full-ft-in-backward": ["--optimizer_in_backward", "--enable_activation_checkpointing", "--max_train_step", "3"],
    # the 4-bit base sharded as packed bytes, its quantization state on every rank
    "qlora-full": ["--use_peft", "--lora_dropout", "0", "--quantization", "4bit", "--enable_activation_checkpointing",
                   "--max_train_step", "3"],
}


# Measured (one process at 1 and 2 threads, and with AVX2 kernels: ATEN_CPU_CAPABILITY=avx2
# MKL_ENABLE_INSTRUCTIONS=AVX2; the two ranks at 1 thread each): the losses agree within 1.27e-6
# (8.7e-7 with this machine's own kernels), float32 rounding of sums over about 1,000 tokens. The
# gradient norms agree within 1.7e-7 (relative) with LoRA, 1.6e-6 at the first step of full
# fine-tuning, and 1.06e-5 by its third: AdamW's first steps move every weight by about lr
# whatever the size of its gradient, so the rounding in near-zero gradients grows with the steps.
DIST_LOSS_TOL = 2e-6
DIST_GRAD_NORM_RTOL = 3e-5


def torchrun(argv: list[str], processes: int = 2, timeout: int = 240,
             pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(processes),
               "-m", "leantune.finetuning", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def injected(tmp_path, source: str) -> str:
    """A ``sitecustomize.py`` holding ``source``, which every process torchrun starts imports first: its folder,
    for ``torchrun(..., pythonpath=...)``."""
    folder = tmp_path / "inject"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(source)
    return str(folder)


def step_losses(path, key: str = "loss") -> list[float]:
    return [step[key] for step in json.loads((path / "metrics.json").read_text())["train_steps"]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_give_the_losses_of_one_process(case, tiny_model_dir, tmp_path):
    common = ["--model_name", str(tiny_model_dir), *FAST, *CASES[case]]
    run(parse_run_config([*common, "--batch_size_training", "4", "--output_dir", str(tmp_path / "one")]),
        log=lambda _: None)
    result = torchrun([*common, "--batch_size_training", "2", "--enable_fsdp", "--output_dir", str(tmp_path / "two")])
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(one) == len(two) > 0
    # The norm before clipping, in every case: AdamW hides a constant gradient scale from the losses
    # (doubled gradients moved them by less than 2e-5), a norm shows it at once.
    norms_one, norms_two = step_losses(tmp_path / "one", "grad_norm"), step_losses(tmp_path / "two", "grad_norm")
    assert norms_two == pytest.approx(norms_one, rel=DIST_GRAD_NORM_RTOL, abs=0)
    assert two == pytest.approx(one, rel=0, abs=DIST_LOSS_TOL)  # float32, another reduction order
    assert result.stdout.count("epoch 1: train loss") == 1  # logs from rank 0 only
    if "--quantization" in CASES[case]:  # the adapter alone, written once, equal to one process's
        from safetensors.torch import load_file

        read, whole = map(float, re.search(r"shard-first: rank 0 read ([\d.]+) MiB of the checkpoint's ([\d.]+) MiB",
                                           result.stdout).groups())
        assert 0.45 < read / whole < 0.55  # its half of every tensor (whole blocks of the 4-bit ones), no more

        one_adapter, two_adapter = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("one", "two"))
        assert sorted(two_adapter) == sorted(one_adapter) and all("lora_" in key for key in two_adapter)
        for key, value in one_adapter.items():
            torch.testing.assert_close(two_adapter[key], value, rtol=1e-4, atol=1e-6)
    if "--enable_memory_monitoring" in CASES[case]:
        assert (tmp_path / "two" / "memory.jsonl").is_file() and (tmp_path / "two" / "memory.rank1.jsonl").is_file()
        assert "across 2 ranks" in result.stdout


# bfloat16 weights and gradients: two ranks reduce their gradients in bfloat16 where one process sums in one
# backward, so each step rounds differently. Measured: losses within 2.5e-4 of one process over 4 steps, gradient
# norms equal (their bfloat16 resolution at 3.5 is 1.6e-2).
BF16_LOSS_TOL = 1e-3
BF16_GRAD_NORM_RTOL = 1e-2


def test_two_ranks_step_anyprecision_on_bf16_weights_as_one_process(tiny_model_dir, tmp_path):
    """AnyPrecisionAdamW with --pure_bf16 under FSDP2 steps each rank's shard (DTensors' local tensors)."""
    _four_steps_as_one_process(tiny_model_dir, ["--optimizer", "anyprecision", "--pure_bf16"], tmp_path,
                               BF16_LOSS_TOL, BF16_GRAD_NORM_RTOL)


def _four_steps_as_one_process(model_dir, flags: list[str], tmp_path, loss_tol: float, norm_rtol: float) -> None:
    """Four steps of ``flags`` on two ranks (batch 2 each) give one process's (batch 4) losses and gradient norms."""
    common = ["--model_name", str(model_dir), *FAST, *flags, "--enable_activation_checkpointing", "--max_train_step",
              "4"]
    run(parse_run_config([*common, "--batch_size_training", "4", "--output_dir", str(tmp_path / "one")]),
        log=lambda _: None)
    result = torchrun([*common, "--batch_size_training", "2", "--enable_fsdp", "--output_dir", str(tmp_path / "two")])
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(one) == len(two) == 4 and one[-1] < one[0]  # it trained
    assert two == pytest.approx(one, rel=0, abs=loss_tol)
    norms_one, norms_two = step_losses(tmp_path / "one", "grad_norm"), step_losses(tmp_path / "two", "grad_norm")
    assert norms_two == pytest.approx(norms_one, rel=norm_rtol, abs=0)


# 8-bit moments round each update to one of 256 codes: a gradient that differs in its last float32 bits (another
# reduction order) can take a neighbouring code. Measured over 4 steps: losses within 6e-7 of one process, gradient
# norms within 5.2e-5 (relative). With float32 moments in place of the 8-bit ones the losses part by 1e-4.
EIGHT_BIT_GRAD_NORM_RTOL = 1e-4


def test_two_ranks_step_adamw_8bit_as_one_process(block_aligned_model_dir, tmp_path):
    """bitsandbytes' 8-bit AdamW on each rank's shards: rows of 256 elements make a shard's blocks the whole
    weight's, so every weight keeps its 8-bit moments and steps as in one process."""
    _four_steps_as_one_process(block_aligned_model_dir, ["--optimizer", "adamw_8bit"], tmp_path, DIST_LOSS_TOL,
                               EIGHT_BIT_GRAD_NORM_RTOL)


def test_the_per_rank_plan_holds_each_ranks_measured_step(tiny_model_dir):
    """``leantune plan --enable_fsdp --world_size 2`` against two gloo ranks' second step, counted by the CPU allocator
    (``benchmarks/fsdp_plan_check.py``): LoRA with the peak in the loss, full fine-tuning with it in the backward
    (a chunked loss), QLoRA with it in the root's gather."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fsdp_plan_check", ROOT / "benchmarks" / "fsdp_plan_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    names = ("LoRA", "full fine-tuning, chunked loss", "QLoRA, chunked loss")
    rows = check.check(tiny_model_dir, {name: check.CASES[name] for name in names})
    assert [row["planned_peak_in"] for row in rows] == ["loss", "backward", "root gather"]
    for row in rows:
        plan, most = row["planned_bytes"], max(row["measured_bytes_per_rank"])
        # below: the allocator also counts a few small tensors the trace leaves out (measured: 11 KB in 4 MiB)
        assert most <= plan * 1.01, row
        # above: in the backward the plan holds the next layer gathered and the last one's gradients in flight while
        # a layer computes, as GPU streams overlap them; the CPU ranks run them in turn, and gloo's thread frees its
        # buffers early or late (measured: 2.3-9.1% above, a layer's all-gather output of 148 KB apart between runs)
        assert plan <= most * (1.01 if row["planned_peak_in"] == "loss" else 1.10), row


def test_the_adapter_saved_by_two_ranks_loads_in_one_process_and_generates(tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "adapter"
    result = torchrun(["--model_name", str(tiny_model_dir), *FAST, *CASES["lora-full"], "--batch_size_training", "2",
                       "--enable_fsdp", "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "adapter_model.safetensors").is_file() and not list(out.glob(".saving-*"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    trained = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert trained and any(p.abs().sum() > 0 for p in trained.values())  # B starts at zero: it was trained
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("Reverse the word: cat", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 5


def test_several_processes_need_enable_fsdp(tiny_model_dir, tmp_path):
    result = torchrun(["--model_name", str(tiny_model_dir), *FAST, "--max_train_step", "1",
                       "--output_dir", str(tmp_path)])
    assert result.returncode != 0
    assert "--enable_fsdp: launched with 2 processes; add --enable_fsdp" in result.stderr
    assert "Traceback" not in result.stderr.split("--enable_fsdp: launched")[0][-2000:]


def test_two_rank_runs_in_a_row_exit_cleanly(tiny_model_dir, tmp_path):
    """Four bare runs back to back: a teardown race (a rank leaving before the others' last collective) shows as a
    non-zero exit. Every other two-rank test in the suite (some forty launches) asserts a clean exit as well."""
    argv = ["--model_name", str(tiny_model_dir), *FAST, "--max_train_step", "1", "--batch_size_training", "1",
            "--run_validation", "false", "--save_model", "false", "--enable_fsdp"]
    codes = [torchrun([*argv, "--output_dir", str(tmp_path / str(i))]).returncode for i in range(4)]
    assert codes == [0] * 4


@pytest.mark.parametrize("size, batch, world", [(10, 2, 2), (9, 2, 2), (7, 2, 3), (5, 2, 2)])
def test_ranks_see_disjoint_parts_of_the_single_process_batches(size, batch, world):
    one = list(ShuffledBatchSampler(size, batch * world, shuffle=True, seed=3))
    shards = [RankShard(ShuffledBatchSampler(size, batch * world, shuffle=True, seed=3), r, world)
              for r in range(world)]
    per_rank = [list(shard) for shard in shards]
    assert len({len(batches) for batches in per_rank}) == 1 == len({len(shard) for shard in shards})
    for step, parts in enumerate(zip(*per_rank)):
        assert sorted(i for part in parts for i in part) == sorted(one[step])  # together: the one process's batch
        assert all(parts)  # no rank idles
    dropped = [b for b in one if len(b) < world]
    assert len(per_rank[0]) == len(one) - len(dropped)


def test_low_cpu_fsdp_trains_what_every_rank_loading_trains(tiny_model_dir, tmp_path):
    """Rank 1 builds on the meta device and receives rank 0's weights (and RoPE buffers): same losses."""
    common = ["--model_name", str(tiny_model_dir), *FAST, *CASES["full-ft-selective-accumulation-clipping"],
              "--batch_size_training", "2", "--enable_fsdp"]
    for name, extra in (("all-load", []), ("rank0-loads", ["--low_cpu_fsdp"])):
        result = torchrun([*common, *extra, "--output_dir", str(tmp_path / name)])
        assert result.returncode == 0, result.stderr[-3000:]
    assert step_losses(tmp_path / "rank0-loads") == step_losses(tmp_path / "all-load")


def test_rank_0_traces_the_step_and_the_other_ranks_receive_its_trace(tiny_model_dir, tmp_path):
    """The start-up traces (here the FLOP count MFU needs: the step with and without recompute) are
    made once, on rank 0, and rank 1 receives them. A trace rank 0 cannot make is rank 1's error too,
    not a trace rank 1 makes on its own (or a result it waits for)."""
    inject = injected(
        tmp_path,
        "import os\n"
        "import leantune.planning.fake_step as fake_step\n"
        "traced = fake_step.trace_step\n"
        "def counted(*args, **kwargs):\n"
        "    with open(os.environ['TRACE_LOG'], 'a') as log:\n"
        "        log.write('rank ' + os.environ['RANK'] + '\\n')\n"
        "    if os.environ.get('FAIL_TRACE'):\n"
        "        raise RuntimeError('no trace on rank ' + os.environ['RANK'])\n"
        "    return traced(*args, **kwargs)\n"
        "fake_step.trace_step = counted\n")
    common = ["--model_name", str(tiny_model_dir), *FAST, *CASES["lora-full"], "--max_train_step", "2",
              "--batch_size_training", "2", "--enable_fsdp", "--peak_tflops", "1", "--save_model", "false"]
    try:
        os.environ["TRACE_LOG"] = str(tmp_path / "traces.txt")
        result = torchrun([*common, "--output_dir", str(tmp_path / "out")], pythonpath=inject)
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / "traces.txt").read_text().splitlines() == ["rank 0"] * 2
        assert "mfu: against 1.0 TFLOP/s peak" in result.stdout
        os.environ.update(TRACE_LOG=str(tmp_path / "failed.txt"), FAIL_TRACE="1")
        failed = torchrun([*common, "--output_dir", str(tmp_path / "failed")], pythonpath=inject)
    finally:
        os.environ.pop("TRACE_LOG"), os.environ.pop("FAIL_TRACE", None)
    # the FLOP count is an aid: its error is reported (by rank 0) and the run goes on, on both ranks
    assert failed.returncode == 0, failed.stderr[-3000:]
    assert "mfu: not reported (RuntimeError: no trace on rank 0)" in failed.stdout
    assert (tmp_path / "failed.txt").read_text().splitlines() == ["rank 0"]


def test_a_result_from_rank_0_reaches_every_rank_with_its_error_and_a_different_request_is_stopped(tmp_path):
    """``DistContext.from_main`` over two gloo ranks: rank 1 never computes; rank 0's error is raised on both;
    a rank that asks for something else than rank 0 computed gets an error naming both, not rank 0's value."""
    script = tmp_path / "from_main.py"
    script.write_text(
        "import os, torch.distributed as dist\n"
        "from leantune.distributed.context import DistContext\n"
        "dist.init_process_group('gloo')\n"
        "ctx = DistContext(dist.get_rank(), dist.get_world_size())\n"
        "def outcome(compute, what):\n"
        "    try:\n"
        "        return repr(ctx.from_main(compute, what))\n"
        "    except Exception as err:\n"
        "        return f'{type(err).__name__}: {err}'\n"
        "def rank_0_only():\n"
        "    assert ctx.rank == 0, 'computed on rank 1'\n"
        "    return [1, 2]\n"
        "def failing():\n"
        "    raise ValueError('no trace')\n"
        "results = [outcome(rank_0_only, 'a'), outcome(failing, 'b'), outcome(rank_0_only, f'rank {ctx.rank}')]\n"
        "with open(f'rank{ctx.rank}.txt', 'w') as out:\n"
        "    out.write(' | '.join(results))\n"
        "dist.destroy_process_group()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                             str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # One file a rank: two ranks printing to one pipe interleave their lines.
    assert (tmp_path / "rank0.txt").read_text() == "[1, 2] | ValueError: no trace | [1, 2]"
    assert (tmp_path / "rank1.txt").read_text() == (
        "[1, 2] | ValueError: no trace | RanksDiverged: rank 1 asked for 'rank 1' where rank 0 computed "
        "'rank 0': the ranks took different paths at start-up")


def test_auto_mode_and_batch_under_fsdp_make_one_choice_for_every_rank(tiny_model_dir, tmp_path):
    """Rank 1 reads a smaller budget from its device than rank 0: both take the least, and choose alike."""
    inject = injected(
        tmp_path,
        "import os\n"
        "if os.environ.get('RANK') in ('0', '1'):\n"
        "    import leantune.planning.choose as choose\n"
        "    from leantune.planning import Planner\n"
        "    rank, plan, read = os.environ['RANK'], Planner.choose, choose.budget_bytes\n"
        "    if rank == '1':\n"
        "        choose.budget_bytes = lambda memory, device: read(memory, device) // 64\n"
        "    def recorded(planner, cfg):\n"
        "        memory = plan(planner, cfg)\n"
        "        with open(os.path.join(os.environ['CHOICES'], 'rank' + rank), 'w') as out:\n"
        "            out.write(f'{memory.plan.checkpointing}: {memory.cfg.checkpointing.mode} '\n"
        "                      f'{memory.cfg.training.batch_size_training} {memory.budget}')\n"
        "        return memory\n"
        "    Planner.choose = recorded\n")
    choices = tmp_path / "choices"
    choices.mkdir()
    os.environ["CHOICES"] = str(choices)
    try:
        result = torchrun(["--model_name", str(tiny_model_dir), *FAST, "--enable_fsdp", "--use_peft",
                           "--enable_activation_checkpointing", "--activation_checkpointing_mode", "auto",
                           "--auto_batch_size", "--memory_budget_gb", "64", "--target_global_batch_size", "4",
                           "--max_train_step", "2", "--output_dir", str(tmp_path / "out")], pythonpath=inject)
    finally:
        del os.environ["CHOICES"]
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = (choices / "rank0").read_text(), (choices / "rank1").read_text()
    assert first == second and first.endswith(f" {2**30}")  # rank 1's budget, 64 GiB / 64, on both
    assert "per rank of 2" in first  # chosen by one rank's plan
    assert "batch size: " in result.stdout and "per rank, from the per-rank plan" in result.stdout


def test_a_failure_on_one_rank_ends_every_rank_with_its_message(tiny_model_dir, tmp_path):
    """Rank 1 raises at its second step while rank 0 waits in a collective: the run must end, not hang."""
    inject = injected(
        tmp_path,
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import leantune.training.loop as train\n"
        "    step = train.Trainer.train_step\n"
        "    def failing(self, window):\n"
        "        if len(self.steps) == 1:\n"
        "            raise RuntimeError('injected failure')\n"
        "        return step(self, window)\n"
        "    train.Trainer.train_step = failing\n")
    result = torchrun(["--model_name", str(tiny_model_dir), *FAST, "--max_train_step", "4", "--batch_size_training",
                       "1", "--enable_memory_monitoring", "--enable_fsdp", "--output_dir", str(tmp_path / "out")],
                      timeout=120, pythonpath=inject)
    assert result.returncode != 0
    assert "leantune: error on rank 1 of 2: injected failure" in result.stderr


@pytest.mark.parametrize("kind", ["lora-dropout", "full-accumulation", "qlora", "anyprecision-bf16", "in-backward",
                                  "adamw-8bit"])
def test_sigterm_on_one_rank_stops_all_after_the_same_step_and_the_resumed_run_is_exact(kind, tiny_model_dir,
                                                                                        block_aligned_model_dir,
                                                                                        tmp_path):
    """Only rank 1 gets the signal; the ranks agree in each step, save one training state and stop.

    Resumed with two processes, every step's loss equals a two-process run never stopped: the
    optimizer state gathered from the shards and broadcast back, each rank's RNG (LoRA dropout
    draws per rank), and the position in the data.
    """
    flags = {"lora-dropout": ["--use_peft", "--lora_dropout", "0.1"],
             "full-accumulation": ["--gradient_accumulation_steps", "2"],
             "qlora": ["--use_peft", "--lora_dropout", "0.1", "--quantization", "4bit"],
             "anyprecision-bf16": ["--optimizer", "anyprecision", "--pure_bf16"],
             "in-backward": ["--optimizer_in_backward"],
             "adamw-8bit": ["--optimizer", "adamw_8bit"]}[kind]
    model = block_aligned_model_dir if kind == "adamw-8bit" else tiny_model_dir
    common = ["--model_name", str(model), *FAST, *flags, "--max_train_step", "12", "--batch_size_training",
              "1", "--enable_fsdp", "--save_model", "false"]
    reference = torchrun([*common, "--output_dir", str(tmp_path / "reference")])
    assert reference.returncode == 0, reference.stderr[-3000:]

    inject = injected(
        tmp_path,
        "import os, signal\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import leantune.training.loop as train\n"
        "    after = train.Trainer._after_step\n"
        "    def signalled(self):\n"
        "        if len(self.steps) == 2:\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "        return after(self)\n"
        "    train.Trainer._after_step = signalled\n")
    out = tmp_path / "out"
    stopped = torchrun([*common, "--output_dir", str(out)], timeout=120, pythonpath=inject)
    assert stopped.returncode != 0
    # sent after step 2's last collective, the signal is agreed on in step 3, after which all stop
    assert (f"leantune: error on rank 0 of 2: stopped by a signal to another rank after step 3; training state "
            f"saved to {out / 'checkpoint-3'}") in stopped.stderr
    assert ("leantune: error on rank 1 of 2: stopped by SIGTERM after step 3; training state saved by rank 0"
            in stopped.stderr)
    assert "exitcode  : 143" in stopped.stderr
    assert [s["step"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]] == [1, 2, 3]

    resumed = torchrun([*common, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert step_losses(out) == step_losses(tmp_path / "reference")
    assert len(step_losses(out)) == (6 if kind == "full-accumulation" else 12)


def test_a_signal_during_a_step_counts_for_that_step_on_every_rank(tiny_model_dir, tmp_path):
    """SIGTERM to rank 1 in the middle of step 2's forward: the step's all-reduce (after backward) carries
    it, so both ranks finish step 2, save it, and stop there rather than one step later."""
    inject = injected(
        tmp_path,
        "import os, signal\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import leantune.training.step as step\n"
        "    forward, calls = step.CausalLMLoss.forward, []\n"
        "    def signalled(self, *args, **kwargs):\n"
        "        if self.training:  # not the packing check's forwards (in eval mode)\n"
        "            calls.append(None)\n"
        "        if self.training and len(calls) == 3:  # the first is the loss self-check's, before weights load\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "        return forward(self, *args, **kwargs)\n"
        "    step.CausalLMLoss.forward = signalled\n")
    out = tmp_path / "out"
    stopped = torchrun(["--model_name", str(tiny_model_dir), *FAST, "--use_peft", "--max_train_step", "8",
                        "--batch_size_training", "1", "--enable_fsdp", "--save_model", "false", "--output_dir",
                        str(out)], timeout=120, pythonpath=inject)
    assert stopped.returncode != 0
    assert (f"leantune: error on rank 0 of 2: stopped by a signal to another rank after step 2; training state "
            f"saved to {out / 'checkpoint-2'}") in stopped.stderr, stopped.stderr[-3000:]
    assert [s["step"] for s in json.loads((out / "metrics.json").read_text())["train_steps"]] == [1, 2]


def test_two_ranks_train_expert_lora_and_the_routers_loss_as_one_process(moe_dir, tmp_path):
    """A mixture of experts under FSDP2: its experts (LoRA on the fused tensors, the low-rank path apart) are sharded
    as parameters; the losses and gradient norms are one process's. Each rank's router term is over its own rows,
    as data-parallel training computes it, so the logged router loss differs a little (its share of the loss, at
    coefficient 0.001, far less); the saved adapter loads in peft and generates."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    common = ["--model_name", str(moe_dir("qwen3_moe")), *FAST, "--use_peft", "--lora_dropout", "0",
              "--lora_target_modules", "all-linear", "--enable_activation_checkpointing", "--max_train_step", "3",
              "--output_router_logits"]
    run(parse_run_config([*common, "--batch_size_training", "4", "--output_dir", str(tmp_path / "one")]),
        log=lambda _: None)
    result = torchrun([*common, "--batch_size_training", "2", "--enable_fsdp", "--output_dir", str(tmp_path / "two")])
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(one) == len(two) == 3 and two == pytest.approx(one, rel=0, abs=1e-4)
    norms = step_losses(tmp_path / "one", "grad_norm"), step_losses(tmp_path / "two", "grad_norm")
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)
    assert step_losses(tmp_path / "two", "router_loss") == pytest.approx(step_losses(tmp_path / "one", "router_loss"),
                                                                         rel=1e-2)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe_dir("qwen3_moe")), str(tmp_path / "two"))
    assert any("experts" in n and "lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())
    generated = model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == 6


# On a GPU, one NCCL rank: the FSDP2 paths the CPU runs over gloo, with CUDA's kernels and streams (gpu_check's
# cuda_tests part runs them).
GPU_FSDP_CASES = {
    # the 4-bit base read shard-first, quantized by bitsandbytes' CUDA kernels as each rank's rows are read
    "qlora-shard-first": ["--use_peft", "--lora_dropout", "0", "--quantization", "4bit",
                          "--enable_activation_checkpointing"],
    # 8-bit AdamW stepped in backward from FSDP2's hook, on its reduce-scatter stream, without a device-wide wait
    "adamw-8bit-in-backward": ["--optimizer", "adamw_8bit", "--optimizer_in_backward",
                               "--enable_activation_checkpointing"],
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", sorted(GPU_FSDP_CASES))
def test_on_a_gpu_one_nccl_rank_trains(case, block_aligned_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "out"
    result = torchrun(["--model_name", str(block_aligned_model_dir), *FAST, "--max_train_step", "3",
                       "--batch_size_training", "2", "--enable_fsdp", *GPU_FSDP_CASES[case], "--output_dir", str(out)],
                      processes=1, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = step_losses(out)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    if case == "qlora-shard-first":
        assert "shard-first" in result.stdout + result.stderr
