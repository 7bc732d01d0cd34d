"""Flag parsing: the cookbook command, config files, and errors that name the flag."""

from __future__ import annotations

import json

import pytest

from leantune.cli_args import parse_run_config
from leantune.config import ConfigError

COOKBOOK_COMMAND = (
    "--model_name M --enable_activation_checkpointing --enable_memory_monitoring --use_peft --peft_method lora "
    "--batch_size_training 4 --dataset alpaca_dataset --output_dir out/llama3-8b-checkpointed"
).split()


def test_the_cookbook_command_parses_to_what_it_says():
    cfg = parse_run_config(COOKBOOK_COMMAND)
    assert cfg.model.model_name == "M"
    assert cfg.checkpointing.enable_activation_checkpointing is True
    assert cfg.checkpointing.activation_checkpointing_use_reentrant is False
    assert cfg.memory.enable_memory_monitoring is True
    assert cfg.peft.use_peft is True and cfg.peft.peft_method == "lora"
    assert cfg.training.batch_size_training == 4
    assert cfg.data.dataset == "alpaca_dataset"
    assert cfg.output.output_dir == "out/llama3-8b-checkpointed"


def test_defaults_follow_llama_cookbook():
    cfg = parse_run_config([])
    t = cfg.training
    assert (t.batch_size_training, t.val_batch_size, t.num_epochs, t.lr, t.gamma, t.seed) == (4, 1, 3, 1e-4, 0.85, 42)
    assert (t.gradient_accumulation_steps, t.gradient_clipping, t.gradient_clipping_threshold) == (1, False, 1.0)
    assert (t.mixed_precision, t.use_fp16, t.run_validation, t.max_train_step) == (True, False, True, 0)
    assert cfg.data.batching_strategy == "packing"
    assert (cfg.peft.lora_r, cfg.peft.lora_alpha, cfg.peft.lora_dropout) == (8, 32, 0.05)
    assert cfg.peft.lora_target_modules == ["q_proj", "v_proj"]
    assert cfg.checkpointing.enable_activation_checkpointing is False
    assert cfg.memory.enable_memory_monitoring is False


def test_every_listed_flag_is_accepted():
    argv = ("--model_name m --tokenizer_name t --batch_size_training 2 --val_batch_size 3 --batching_strategy padding "
            "--context_length 128 --gradient_accumulation_steps 2 --gradient_clipping --gradient_clipping_threshold 0.5 "
            "--num_epochs 1 --max_train_step 5 --max_eval_step 2 --num_workers_dataloader 0 --lr 0.001 "
            "--weight_decay 0.1 --gamma 0.9 --seed 7 --use_fp16 --mixed_precision false --dataset custom_dataset "
            "--data_path d.jsonl --use_peft --peft_method lora --from_peft_checkpoint ckpt --output_dir o "
            "--save_model false --save_metrics --run_validation false --enable_activation_checkpointing "
            "--activation_checkpointing_use_reentrant --enable_memory_monitoring --memory_monitoring_interval 0.2 "
            "--lora_r 4 --lora_alpha 8 --lora_dropout 0.1 --lora_target_modules q_proj k_proj").split()
    flat = parse_run_config(argv).flat()
    assert flat["batching_strategy"] == "padding" and flat["gradient_clipping"] is True
    assert flat["mixed_precision"] is False and flat["run_validation"] is False and flat["save_model"] is False
    assert flat["activation_checkpointing_use_reentrant"] is True and flat["memory_monitoring_interval"] == 0.2
    assert flat["lora_target_modules"] == ["q_proj", "k_proj"] and flat["from_peft_checkpoint"] == "ckpt"


def test_checkpointing_modes_resolve():
    assert parse_run_config([]).checkpointing.mode is None
    assert parse_run_config(["--enable_activation_checkpointing"]).checkpointing.mode == "full"
    every = parse_run_config(["--enable_activation_checkpointing", "--activation_checkpointing_every_n", "3"])
    assert every.checkpointing.mode == "every_n" and every.checkpointing.activation_checkpointing_every_n == 3
    sel = parse_run_config(["--enable_activation_checkpointing", "--activation_checkpointing_mode", "selective_ops"])
    assert sel.checkpointing.mode == "selective_ops"


def test_comma_separated_target_modules():
    assert parse_run_config(["--lora_target_modules", "q_proj,k_proj,v_proj"]).peft.lora_target_modules == [
        "q_proj", "k_proj", "v_proj"]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_with_command_line_override(tmp_path, suffix):
    values = {"batch_size_training": 8, "lr": 0.002, "use_peft": True, "lora_target_modules": ["q_proj", "o_proj"]}
    path = tmp_path / f"run{suffix}"
    if suffix == ".yaml":
        import yaml

        path.write_text(yaml.safe_dump(values))
    else:
        path.write_text(json.dumps(values))
    cfg = parse_run_config(["--config", str(path), "--batch_size_training", "2"])
    assert cfg.training.batch_size_training == 2  # the command line wins
    assert cfg.training.lr == 0.002 and cfg.peft.use_peft is True
    assert cfg.peft.lora_target_modules == ["q_proj", "o_proj"]


def test_unknown_key_in_config_file_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("batch_size_trainin: 8\n")
    with pytest.raises(ConfigError, match=r"unknown flag --batch_size_trainin; did you mean --batch_size_training\?"):
        parse_run_config(["--config", str(path)])


@pytest.mark.parametrize("argv, message", [
    (["--batch_size", "4"], r"unknown flag --batch_size; did you mean --batch_size_training\?"),
    (["--enable_activation_checkpoint"], r"did you mean --enable_activation_checkpointing\?"),
    (["--learning_rate", "1e-4"], r"unknown flag --learning_rate"),
    (["--low_cpu_fsdp"], r"--low_cpu_fsdp: needs --enable_fsdp"),
    (["--fsdp_cpu_offload"], r"--fsdp_cpu_offload: needs --enable_fsdp"),
    (["--enable_fsdp", "--use_fp16"], r"--use_fp16: not with --enable_fsdp"),
    (["--batch_size_training", "0"], r"--batch_size_training: must be at least 1 \(got 0\)"),
    (["--batch_size_training", "four"], r"--batch_size_training.*invalid int value: 'four'"),
    (["--peft_method", "prefix"], r"--peft_method.*invalid choice: 'prefix'"),
    (["--batching_strategy", "bucket"], r"--batching_strategy.*invalid choice"),
    (["--context_length", "1"], r"--context_length: must be at least 2"),
    (["--lr", "0"], r"--lr: must be positive"),
    (["--memory_monitoring_interval", "0"], r"--memory_monitoring_interval: must be positive"),
    (["--dataset", "custom_dataset"], r"--data_path: custom_dataset needs a file"),
    (["--from_peft_checkpoint", "x"], r"--from_peft_checkpoint: needs --use_peft"),
    (["stray"], r"unexpected argument"),
    (["--activation_checkpointing_mode", "offload"], r"offload has no effect without --enable_activation_checkpointing"),
    (["--enable_activation_checkpointing", "--activation_checkpointing_mode", "selective_ops",
      "--activation_checkpointing_use_reentrant"], r"selective_ops: needs non-reentrant checkpointing"),
    (["--enable_activation_checkpointing", "--activation_checkpointing_mode", "offload",
      "--activation_checkpointing_use_reentrant"], r"offload: needs non-reentrant checkpointing"),
    (["--enable_activation_checkpointing", "--activation_checkpointing_mode", "full",
      "--activation_checkpointing_every_n", "3"], r"--activation_checkpointing_every_n: applies to .* every_n, not full"),
    (["--enable_activation_checkpointing", "--activation_checkpointing_every_n", "0"], r"must be at least 1"),
    (["--activation_checkpointing_mode", "partial"], r"--activation_checkpointing_mode.*invalid choice"),
    (["--loss_chunk_size", "-1"], r"--loss_chunk_size: must be 0 \(plain loss\) or a positive"),
])
def test_bad_input_names_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(argv)


def test_main_reports_config_errors_without_a_traceback(capsys):
    from leantune.finetuning import main

    assert main(["--batch_size_training", "0"]) == 2
    err = capsys.readouterr().err
    assert "leantune: error: --batch_size_training: must be at least 1 (got 0)" in err
    assert "Traceback" not in err
