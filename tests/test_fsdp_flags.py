"""``--enable_fsdp`` in one process is a real one-rank FSDP2 run, and every FSDP flag is in force or refused.

One process (``python -m leantune.finetuning``, in-process here) shards over a process group of
its own (gloo on the CPU): its losses, gradient norms, saved model and resumed runs must equal
the same run without FSDP. The flag walk runs each FSDP flag set with one process and with two
(torchrun, gloo) and asserts the start-up line that shows it in force, or the one-line refusal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leantune.flags import parse_run_config
from leantune.finetuning import main, run
from test_distributed import DIST_GRAD_NORM_RTOL, DIST_LOSS_TOL, FAST, step_losses, torchrun

QUICK = ["--context_length", "128", "--num_workers_dataloader", "0", "--max_train_step", "1",
         "--batch_size_training", "1", "--run_validation", "false", "--save_model", "false"]
IN_FORCE = "fsdp: FSDP2 over {processes}, each decoder layer and the model+loss root a unit"
OFFLOAD_ON_CPU = ("--fsdp_cpu_offload: moves the shards from GPUs to host memory; training on the CPU, they are "
                  "there already. Drop the flag")

# name: (flags, what one process shows, what two processes show); "runs: TEXT" or "refused: TEXT"
FLAG_WALK = {
    "no flag": ([], "runs: ", "refused: --enable_fsdp: launched with 2 processes; add --enable_fsdp"),
    "enable_fsdp": (["--enable_fsdp"], f"runs: {IN_FORCE}", f"runs: {IN_FORCE}"),
    "low_cpu_fsdp": (["--enable_fsdp", "--low_cpu_fsdp"],
                     "runs: --low_cpu_fsdp: the one process read the weights itself, nothing to broadcast",
                     "runs: rank 0 read the weights and broadcast them"),
    "fsdp_cpu_offload": (["--enable_fsdp", "--fsdp_cpu_offload"], f"refused: {OFFLOAD_ON_CPU}",
                         f"refused: {OFFLOAD_ON_CPU}"),
    "offload without fsdp": (["--fsdp_cpu_offload"], "refused: --fsdp_cpu_offload: needs --enable_fsdp",
                             "refused: --fsdp_cpu_offload: needs --enable_fsdp"),
    "low_cpu without fsdp": (["--low_cpu_fsdp"], "refused: --low_cpu_fsdp: needs --enable_fsdp",
                             "refused: --low_cpu_fsdp: needs --enable_fsdp"),
    "fp16": (["--enable_fsdp", "--use_fp16"], "refused: --use_fp16: not with --enable_fsdp",
             "refused: --use_fp16: not with --enable_fsdp"),
    "pure_bf16": (["--enable_fsdp", "--fsdp_config.pure_bf16"], "runs: precision: bfloat16 weights on the CPU",
                  "runs: precision: bfloat16 weights on the CPU"),
    "anyprecision": (["--enable_fsdp", "--optimizer", "anyprecision", "--pure_bf16"],
                     "runs: optimizer: leantune's AnyPrecisionAdamW", "runs: optimizer: leantune's AnyPrecisionAdamW"),
    # the tiny model's rows are 64 elements: every weight keeps float32 moments sharded, and the start-up line says so
    "8-bit optimizer": (["--enable_fsdp", "--optimizer", "adamw_8bit"],
                        "runs: keep float32 moments (8 bytes a parameter): their rows are not whole 256-element blocks",
                        "runs: keep float32 moments (8 bytes a parameter): their rows are not whole 256-element "
                        "blocks"),
    "in backward": (["--enable_fsdp", "--optimizer_in_backward"], "runs: each weight stepped in backward",
                    "runs: each weight stepped in backward"),
    "auto batch": (["--enable_fsdp", "--auto_batch_size", "--memory_budget_gb", "2", "--target_global_batch_size",
                    "4"], "runs: batch size: auto chose", "runs: batch size: auto chose"),
    "4-bit base": (["--enable_fsdp", "--use_peft", "--quantization", "4bit"], "runs: quantization: ",
                   "runs: quantization: "),
    "8-bit base": (["--enable_fsdp", "--use_peft", "--quantization", "8bit"],
                   "refused: --quantization 8bit: not with --enable_fsdp", "refused: --quantization 8bit: not with"),
    "hsdp": (["--enable_fsdp", "--fsdp_config.hsdp", "true"], "refused: --hsdp is a llama-cookbook flag",
             "refused: --hsdp is a llama-cookbook flag"),
    "sharding strategy": (["--enable_fsdp", "--sharding_strategy", "FULL_SHARD"],
                          "refused: --sharding_strategy is a llama-cookbook flag",
                          "refused: --sharding_strategy is a llama-cookbook flag"),
    "cookbook checkpointing": (["--enable_fsdp", "--fsdp_activation_checkpointing", "true"],
                               "refused: --fsdp_activation_checkpointing is a llama-cookbook flag",
                               "refused: --fsdp_activation_checkpointing is a llama-cookbook flag"),
}


def _check_outcome(expected: str, flags: list[str], failed: bool, stdout: str, stderr: str, processes: int) -> None:
    kind, _, text = expected.partition(": ")
    text = text.format(processes="1 process" if processes == 1 else f"{processes} processes")
    if kind == "runs":
        assert not failed, stderr[-3000:]
        assert text in stdout
        in_force = IN_FORCE.format(processes="1 process" if processes == 1 else f"{processes} processes")
        assert (in_force in stdout) == ("--enable_fsdp" in flags)
    else:
        assert failed, stdout[-2000:]
        assert f"leantune: error: {text}" in stderr
        assert "Traceback" not in stderr.split("leantune: error")[0]  # torchrun's own report may follow


@pytest.mark.parametrize("case", sorted(FLAG_WALK))
def test_fsdp_flags_in_one_process_are_in_force_or_refused(case, tiny_model_dir, tmp_path, capsys):
    flags, expected, _ = FLAG_WALK[case]
    code = main(["--model_name", str(tiny_model_dir), *QUICK, *flags, "--output_dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code in (0, 2)  # 2: a flag to fix
    _check_outcome(expected, flags, code != 0, out, err, processes=1)
    assert not torch.distributed.is_initialized()  # no outcome leaves the one-rank group behind


@pytest.mark.parametrize("case", sorted(FLAG_WALK))
def test_fsdp_flags_in_two_processes_are_in_force_or_refused(case, tiny_model_dir, tmp_path):
    flags, _, expected = FLAG_WALK[case]
    result = torchrun(["--model_name", str(tiny_model_dir), *QUICK, *flags, "--output_dir", str(tmp_path)])
    _check_outcome(expected, flags, result.returncode != 0, result.stdout, result.stderr, processes=2)


CASES = {
    "lora": ["--use_peft", "--lora_dropout", "0", "--enable_activation_checkpointing", "--max_train_step", "3"],
    "full-ft-selective-accumulation-clipping": [
        "--enable_activation_checkpointing", "--activation_checkpointing_mode", "selective_ops",
        "--gradient_accumulation_steps", "2", "--gradient_clipping", "true", "--max_train_step", "3",
        "--enable_memory_monitoring"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_process_fsdp_gives_the_losses_and_model_of_the_same_run_without_it(case, tiny_model_dir, tmp_path):
    common = ["--model_name", str(tiny_model_dir), *FAST, *CASES[case], "--batch_size_training", "2"]
    logs: list[str] = []
    run(parse_run_config([*common, "--output_dir", str(tmp_path / "plain")]), log=lambda _: None)
    run(parse_run_config([*common, "--enable_fsdp", "--output_dir", str(tmp_path / "fsdp")]), log=logs.append)
    assert any(line.startswith(IN_FORCE.format(processes="1 process")) for line in logs)
    assert not torch.distributed.is_initialized()
    plain, fsdp = step_losses(tmp_path / "plain"), step_losses(tmp_path / "fsdp")
    assert len(plain) == len(fsdp) >= 2
    assert fsdp == pytest.approx(plain, rel=0, abs=DIST_LOSS_TOL)
    norms = step_losses(tmp_path / "plain", "grad_norm"), step_losses(tmp_path / "fsdp", "grad_norm")
    assert norms[1] == pytest.approx(norms[0], rel=DIST_GRAD_NORM_RTOL, abs=0)
    if "--enable_memory_monitoring" in CASES[case]:  # one rank: the one-process file names
        assert (tmp_path / "fsdp" / "memory.jsonl").is_file() and not list((tmp_path / "fsdp").glob("memory.rank*"))
    saved = "adapter_model.safetensors" if "--use_peft" in CASES[case] else "model.safetensors"
    from safetensors.torch import load_file

    plain_weights, fsdp_weights = (load_file(tmp_path / name / saved) for name in ("plain", "fsdp"))
    assert sorted(plain_weights) == sorted(fsdp_weights)
    for key, value in plain_weights.items():
        torch.testing.assert_close(fsdp_weights[key], value, rtol=1e-5, atol=1e-6)


def test_one_process_fsdp_shards_the_model_and_the_optimizer_steps_the_shards(tiny_model_dir, tmp_path):
    """Equal losses alone would not show FSDP at work (an unsharded run gives them too): look at what trains."""
    import contextlib

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from leantune.builders.sharding import start_distributed
    from leantune.distributed.context import close_distributed
    from leantune.finetuning import build_trainer

    cfg = parse_run_config(["--model_name", str(tiny_model_dir), *QUICK, "--enable_fsdp", "--use_peft",
                            "--output_dir", str(tmp_path)])
    dist = start_distributed(cfg.distributed, cfg.model)
    try:
        assert dist.sharded and not dist.distributed and torch.distributed.is_initialized()
        with contextlib.ExitStack() as stack:
            trainer = build_trainer(cfg, stack, lambda _: None, dist)
            loss_model = trainer.step.loss_model
            layers = trainer.model.config.num_hidden_layers
            assert sum(isinstance(m, FSDPModule) for m in loss_model.modules()) == layers + 1  # each layer, the root
            stepped = [p for group in trainer.step.optimizer.param_groups for p in group["params"]]
            assert stepped and all(isinstance(p, DTensor) for p in stepped)
            trainer.close()
    finally:
        close_distributed(dist)
    assert not torch.distributed.is_initialized()


def test_a_4bit_base_is_gathered_as_its_packed_bytes_under_bf16_mixed_precision(tiny_model_dir):
    """The GPU's default: FSDP2 gathers in bfloat16. The packed uint8 weights must arrive as stored (FSDP2
    casts floating-point parameters only), byte for byte, or bitsandbytes would read numbers as weights."""
    pytest.importorskip("bitsandbytes")
    from leantune.builders.sharding import start_distributed
    from leantune.builders.loss_and_optimizer import loss_model_for
    from leantune.distributed.context import close_distributed
    from leantune.distributed.fsdp import shard_model
    from leantune.models.loading import attach_lora, load_model
    from leantune.models.quantized import bnb_config, quantized_layers

    cfg = parse_run_config(["--model_name", str(tiny_model_dir), "--enable_fsdp", "--use_peft", "--quantization",
                            "4bit"])
    model = load_model(cfg.model, torch.bfloat16, "sdpa", bnb_config(cfg.quant, torch.bfloat16), torch.device("cpu"))
    model = attach_lora(model, cfg.peft)
    stored = {id(layer): layer.weight.detach().clone() for layer in quantized_layers(model)}
    seen = []
    for layer in quantized_layers(model):
        layer.register_forward_pre_hook(lambda layer, _args: seen.append(
            (layer.weight.dtype, torch.equal(layer.weight.detach(), stored[id(layer)]))))
    dist = start_distributed(cfg.distributed, cfg.model)
    try:
        loss_model = shard_model(loss_model_for(model, cfg.training, sharded=True), dist, torch.device("cpu"),
                                 torch.bfloat16, cpu_offload=False)
        ids = torch.randint(0, 100, (1, 16))
        with torch.autocast("cpu", torch.bfloat16):
            loss_model(ids, ids).backward()
    finally:
        close_distributed(dist)
    assert len(seen) == len(stored) > 0 and set(seen) == {(torch.uint8, True)}


def test_a_refusal_after_the_one_rank_group_exists_leaves_no_group_behind(tmp_path, capsys):
    """The model is looked at after the process group starts: its refusal must close the group."""
    assert main(["--model_name", str(tmp_path / "no-such-model"), *QUICK, "--enable_fsdp",
                 "--output_dir", str(tmp_path / "out")]) == 1  # a model to fix: exit code 1
    assert "leantune: error:" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_a_one_process_fsdp_state_resumes_exactly_with_and_without_fsdp(tiny_model_dir, tmp_path):
    """Saved by a one-rank FSDP run (full state dicts gathered from the shards); LoRA dropout draws from the RNG."""
    common = ["--model_name", str(tiny_model_dir), *FAST, "--use_peft", "--lora_dropout", "0.1", "--max_train_step",
              "4", "--batch_size_training", "2", "--run_validation", "false", "--save_model", "false"]
    quiet = lambda _: None  # noqa: E731
    run(parse_run_config([*common, "--enable_fsdp", "--save_steps", "2", "--output_dir", str(tmp_path / "whole")]),
        log=quiet)
    reference = step_losses(tmp_path / "whole")
    for name, extra in (("fsdp", ["--enable_fsdp"]), ("plain", [])):
        run(parse_run_config([*common, *extra, "--resume_from_checkpoint", str(tmp_path / "whole" / "checkpoint-2"),
                              "--output_dir", str(tmp_path / name)]), log=quiet)
        assert step_losses(tmp_path / name) == reference


def test_under_fsdp_the_model_waits_on_the_host_for_sharding(tiny_model_dir, monkeypatch):
    """The model is not moved to the device before sharding (the whole model may not fit it); the
    checkpointing policy is bound to the device it will train on, not to the host it waits on."""
    from leantune.builders.model import prepare_model
    from leantune.checkpointing.modes import offload
    from leantune.precision import choose_precision
    from transformers import AutoModelForCausalLM

    bound_to = []
    monkeypatch.setattr(offload, "ActivationOffloader", lambda device, *a, **k: bound_to.append(device))
    flags = ["--model_name", str(tiny_model_dir), "--enable_activation_checkpointing",
             "--activation_checkpointing_mode", "offload"]
    for fsdp in (["--enable_fsdp"], []):
        cfg = parse_run_config([*flags, *fsdp])
        on_gpu = dataclasses.replace(choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")),
                                     device=torch.device("cuda"))
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        if fsdp:
            model, _ = prepare_model(model, cfg, on_gpu)
            assert {p.device.type for p in model.parameters()} == {"cpu"}
            assert bound_to == [torch.device("cuda")]
            # a --low_cpu_fsdp rank other than 0 builds on the meta device: bound to the GPU all the same
            on_meta = AutoModelForCausalLM.from_config(model.config).to("meta")
            prepare_model(on_meta, cfg, on_gpu, place=lambda _model: None)
            assert bound_to == [torch.device("cuda")] * 2
        else:  # without FSDP the model is moved at once: on this machine there is nothing to move it to
            with pytest.raises((AssertionError, RuntimeError)):
                prepare_model(model, cfg, on_gpu)


def test_on_a_gpu_a_sharded_rank_says_what_it_holds_and_its_peak_while_loading(monkeypatch):
    """The reading the GPU check takes for item 1: a rank that had held the whole model shows it as its peak."""
    from leantune.builders.sharding import sharded_memory_line

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 310 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 700 * 2**20)
    assert sharded_memory_line(torch.device("cuda", 0)) == (
        "fsdp: sharded; 310 MiB allocated on cuda:0, peak 700 MiB while loading and sharding")
    # the memory monitor resets the counters between loading and sharding: loading's peak, read before, counts
    assert sharded_memory_line(torch.device("cuda", 0), peak_before=4900 * 2**20).endswith(
        "peak 4,900 MiB while loading and sharding")


def test_the_loading_peak_is_read_before_the_memory_monitor_resets_it(tiny_model_dir, tmp_path, monkeypatch):
    """The order that matters for the sharding line: the device's peak read, then the monitor built (it resets
    the peak counters), then the model sharded with the peak read before."""
    from leantune import finetuning

    events = []
    build_monitor, shard = finetuning.build_monitor, finetuning.shard
    monkeypatch.setattr(finetuning, "device_peak_bytes", lambda device: (events.append("peak read"), 123)[1])
    monkeypatch.setattr(finetuning, "build_monitor",
                        lambda *a, **k: (events.append("monitor"), build_monitor(*a, **k))[1])
    monkeypatch.setattr(finetuning, "shard", lambda *a, **k: (events.append(("shard", k["peak_before"])),
                                                                shard(*a, **k))[1])
    run(parse_run_config(["--model_name", str(tiny_model_dir), *QUICK, "--enable_fsdp", "--enable_memory_monitoring",
                          "--output_dir", str(tmp_path)]), log=lambda _: None)
    assert events == ["peak read", "monitor", ("shard", 123)]
