"""Flag parsing: the cookbook command, config files, and errors that name the flag."""

from __future__ import annotations

import json

import pytest

from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.optimizers import ENTRIES as OPTIMIZERS

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


# A valid, non-default value for every flag the parser accepts, with the flags it needs, and what the
# parsed config then holds: {flag: (argv, {field of RunConfig.flat(): value})}. A flag added to the
# config without an entry here fails test_every_flag_is_accepted_with_a_valid_value.
CKPT = ["--enable_activation_checkpointing"]
FSDP = ["--enable_fsdp"]
FLAG_VALUES = {
    "model_name": (["--model_name", "m"], {"model_name": "m"}),
    "tokenizer_name": (["--tokenizer_name", "t"], {"tokenizer_name": "t"}),
    "model_dtype": (["--model_dtype", "bfloat16"], {"model_dtype": "bfloat16"}),
    "device": (["--device", "cpu"], {"device": "cpu"}),
    "optimizer": (["--optimizer", "anyprecision"], {"optimizer": "anyprecision"}),
    "pure_bf16": (["--pure_bf16"], {"pure_bf16": True, "model_dtype": "bfloat16"}),
    "optimizer_in_backward": (["--optimizer_in_backward"], {"optimizer_in_backward": True}),
    "attn_implementation": (["--attn_implementation", "eager"], {"attn_implementation": "eager"}),
    "dataset": (["--dataset", "custom_dataset", "--data_path", "d.jsonl"], {"dataset": "custom_dataset"}),
    "data_path": (["--data_path", "d.jsonl"], {"data_path": "d.jsonl"}),
    "column_map": (["--column_map", "output=answer"], {"column_map": "output=answer"}),
    "dataset_cache": (["--dataset_cache", "false"], {"dataset_cache": False}),
    "no_dataset_cache": (["--no_dataset_cache"], {"dataset_cache": False}),
    "chat_template": (["--dataset", "chat_dataset", "--chat_template", "t.jinja"], {"chat_template": "t.jinja"}),
    "assistant_turns": (["--dataset", "chat_dataset", "--assistant_turns", "last"], {"assistant_turns": "last"}),
    "custom_dataset_file": (["--dataset", "custom_dataset", "--custom_dataset_file", "d.py"],
                            {"custom_dataset_file": "d.py"}),
    "custom_dataset_train_split": (["--dataset", "custom_dataset", "--custom_dataset.file", "d.py",
                                    "--custom_dataset_train_split", "training"],
                                   {"custom_dataset_train_split": "training"}),
    "custom_dataset_test_split": (["--dataset", "custom_dataset", "--custom_dataset.file", "d.py",
                                   "--custom_dataset_test_split", "test"], {"custom_dataset_test_split": "test"}),
    "batching_strategy": (["--batching_strategy", "padding"], {"batching_strategy": "padding"}),
    "packed_examples": (["--packed_examples", "concatenated"], {"packed_examples": "concatenated"}),
    "overlong_examples": (["--overlong_examples", "drop"], {"overlong_examples": "drop"}),
    "context_length": (["--context_length", "128"], {"context_length": 128}),
    "val_fraction": (["--val_fraction", "0.2"], {"val_fraction": 0.2}),
    "num_workers_dataloader": (["--num_workers_dataloader", "0"], {"num_workers_dataloader": 0}),
    "batch_size_training": (["--batch_size_training", "2"], {"batch_size_training": 2}),
    "val_batch_size": (["--val_batch_size", "3"], {"val_batch_size": 3}),
    "gradient_accumulation_steps": (["--gradient_accumulation_steps", "2"], {"gradient_accumulation_steps": 2}),
    "gradient_clipping": (["--gradient_clipping"], {"gradient_clipping": True}),
    "gradient_clipping_threshold": (["--gradient_clipping_threshold", "0.5"], {"gradient_clipping_threshold": 0.5}),
    "num_epochs": (["--num_epochs", "1"], {"num_epochs": 1}),
    "max_train_step": (["--max_train_step", "5"], {"max_train_step": 5}),
    "max_eval_step": (["--max_eval_step", "2"], {"max_eval_step": 2}),
    "lr": (["--lr", "0.001"], {"lr": 0.001}),
    "weight_decay": (["--weight_decay", "0.1"], {"weight_decay": 0.1}),
    "gamma": (["--gamma", "0.9"], {"gamma": 0.9}),
    "seed": (["--seed", "7"], {"seed": 7}),
    "use_fp16": (["--use_fp16"], {"use_fp16": True}),
    "mixed_precision": (["--mixed_precision", "false"], {"mixed_precision": False}),
    "no_mixed_precision": (["--no_mixed_precision"], {"mixed_precision": False}),
    "run_validation": (["--run_validation", "false"], {"run_validation": False}),
    "no_run_validation": (["--no_run_validation"], {"run_validation": False}),
    "loss_chunk_size": (["--loss_chunk_size", "0"], {"loss_chunk_size": 0}),
    "tiled_mlp": (["--tiled_mlp", "2048"], {"tiled_mlp": "2048"}),
    "rope_scaling_factor": (["--rope_scaling_factor", "4"], {"rope_scaling_factor": 4.0}),
    "output_router_logits": (["--output_router_logits"], {"output_router_logits": True}),
    "lora_router": (["--use_peft", "--lora_router"], {"lora_router": True}),
    "freeze_LLM_only": (["--freeze_LLM_only"], {"freeze_LLM_only": True}),
    "freeze_layers": (["--freeze_layers"], {"freeze_layers": True}),
    "num_freeze_layers": (["--freeze_layers", "--num_freeze_layers", "2"], {"num_freeze_layers": 2}),
    "lora_parts": (["--use_peft", "--lora_parts", "vision_encoder"], {"lora_parts": ["vision_encoder"]}),
    "skip_nonfinite_steps": (["--skip_nonfinite_steps", "2"], {"skip_nonfinite_steps": 2}),
    "compile": (["--compile"], {"compile": True}),
    "use_peft": (["--use_peft"], {"use_peft": True}),
    "peft_method": (["--peft_method", "lora"], {"peft_method": "lora"}),  # its only choice, also the default
    "from_peft_checkpoint": (["--use_peft", "--from_peft_checkpoint", "ckpt"], {"from_peft_checkpoint": "ckpt"}),
    "lora_r": (["--lora_r", "4"], {"lora_r": 4}),
    "quantization": (["--quantization", "4bit", "--use_peft"], {"quantization": "4bit", "use_peft": True}),
    "quant_type": (["--quant_type", "fp4", "--quantization", "4bit", "--use_peft"], {"quant_type": "fp4"}),
    "compute_dtype": (["--compute_dtype", "bfloat16", "--quantization", "4bit", "--use_peft"],
                      {"compute_dtype": "bfloat16"}),
    "use_double_quant": (["--use_double_quant", "false", "--quantization", "4bit", "--use_peft"],
                         {"use_double_quant": False}),
    "no_use_double_quant": (["--no_use_double_quant", "--quantization", "4bit", "--use_peft"],
                            {"use_double_quant": False}),
    "quant_storage": (["--quant_storage", "bfloat16", "--quantization", "4bit", "--use_peft"],
                      {"quant_storage": "bfloat16"}),
    "lora_alpha": (["--lora_alpha", "8"], {"lora_alpha": 8}),
    "lora_dropout": (["--lora_dropout", "0.1"], {"lora_dropout": 0.1}),
    "lora_target_modules": (["--lora_target_modules", "q_proj", "k_proj"],
                            {"lora_target_modules": ["q_proj", "k_proj"]}),
    "enable_activation_checkpointing": (CKPT, {"enable_activation_checkpointing": True}),
    "activation_checkpointing_use_reentrant": ([*CKPT, "--activation_checkpointing_use_reentrant"],
                                               {"activation_checkpointing_use_reentrant": True}),
    "activation_checkpointing_mode": ([*CKPT, "--activation_checkpointing_mode", "selective_ops"],
                                      {"activation_checkpointing_mode": "selective_ops"}),
    "activation_checkpointing_every_n": ([*CKPT, "--activation_checkpointing_every_n", "3"],
                                         {"activation_checkpointing_every_n": 3,
                                          "activation_checkpointing_mode": "every_n"}),
    "activation_checkpointing_layers": ([*CKPT, "--activation_checkpointing_layers", "full=1,selective_ops=1"],
                                        {"activation_checkpointing_layers": "full=1,selective_ops=1",
                                         "activation_checkpointing_mode": "layer_mix"}),
    "activation_offload_max_pinned_gb": ([*CKPT, "--activation_checkpointing_mode", "offload",
                                          "--activation_offload_max_pinned_gb", "2.5"],
                                         {"activation_offload_max_pinned_gb": 2.5}),
    "enable_memory_monitoring": (["--enable_memory_monitoring"], {"enable_memory_monitoring": True}),
    "memory_monitoring_interval": (["--memory_monitoring_interval", "0.2"], {"memory_monitoring_interval": 0.2}),
    "memory_budget_gb": (["--memory_budget_gb", "12.5"], {"memory_budget_gb": 12.5}),
    "memory_snapshot": (["--memory_snapshot"], {"memory_snapshot": True}),
    "offload_embedding": (["--offload_embedding", "--use_peft"], {"offload_embedding": True}),
    "offload_experts": (["--offload_experts", "2", "--quantization", "4bit", "--use_peft"], {"offload_experts": 2}),
    "auto_batch_size": (["--auto_batch_size"], {"auto_batch_size": True}),
    "target_global_batch_size": (["--target_global_batch_size", "8"],  # 8 rows / the default batch of 4
                                 {"target_global_batch_size": 8, "gradient_accumulation_steps": 2}),
    "return_host_memory": (["--return_host_memory", "off"], {"return_host_memory": "off"}),
    "enable_fsdp": (FSDP, {"enable_fsdp": True}),
    "fsdp_cpu_offload": ([*FSDP, "--fsdp_cpu_offload"], {"fsdp_cpu_offload": True}),
    "low_cpu_fsdp": ([*FSDP, "--low_cpu_fsdp"], {"low_cpu_fsdp": True}),
    "output_dir": (["--output_dir", "o"], {"output_dir": "o"}),
    "save_model": (["--save_model", "false"], {"save_model": False}),
    "no_save_model": (["--no_save_model"], {"save_model": False}),
    "save_metrics": (["--save_metrics"], {"save_metrics": True}),
    "peak_tflops": (["--peak_tflops", "989.5"], {"peak_tflops": 989.5}),
    "use_tensorboard": (["--use_tensorboard"], {"use_tensorboard": True}),
    "use_wandb": (["--use_wandb"], {"use_wandb": True}),
    "wandb_project": (["--wandb_project", "p"], {"wandb_project": "p"}),
    "save_steps": (["--save_steps", "10"], {"save_steps": 10}),
    "save_total_limit": (["--save_total_limit", "2"], {"save_total_limit": 2}),
    "resume_from_checkpoint": (["--resume_from_checkpoint", "latest"], {"resume_from_checkpoint": "latest"}),
    "overwrite_output_dir": (["--overwrite_output_dir"], {"overwrite_output_dir": True}),
    "config": (["--config", "{config_file}"], {"seed": 11, "lr": 0.25}),  # the file holds seed: 11, lr: 0.25
}
SAME_AS_DEFAULT = {"peft_method"}  # no other valid value to give


def parser_flags() -> list[str]:
    """Every flag the finetune parser accepts, by its underscore spelling (the dash aliases are the same actions)."""
    from leantune.flags import build_parser

    return [action.option_strings[0][2:] for action in build_parser()._actions
            if action.option_strings and action.option_strings[0] != "-h"]


# an optimizer's own switch (registry entry's ``switch``) sets --optimizer to its entry
FLAG_VALUES.update({entry.switch: ([f"--{entry.switch}"], {"optimizer": entry.name})
                    for entry in OPTIMIZERS.values() if entry.switch})


@pytest.mark.parametrize("flag", parser_flags())
def test_every_flag_is_accepted_with_a_valid_value(flag, tmp_path):
    if flag not in FLAG_VALUES:
        pytest.fail(f"--{flag} has no test value: add it to FLAG_VALUES in tests/test_config.py "
                    "(a valid, non-default value, the flags it needs, and the parsed fields it sets)")
    argv, expected = FLAG_VALUES[flag]
    assert f"--{flag}" in argv, f"FLAG_VALUES[{flag!r}] does not pass --{flag}"
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps({"seed": 11, "lr": 0.25}))
    flat = parse_run_config([str(config_file) if arg == "{config_file}" else arg for arg in argv]).flat()
    assert {name: flat[name] for name in expected} == expected
    defaults = parse_run_config([]).flat()
    if flag not in SAME_AS_DEFAULT:  # the value changed the config: the flag is not silently ignored
        assert any(defaults[name] != value
                   for name, value in expected.items()), f"--{flag}: {expected} are the defaults"


def test_flag_values_lists_only_flags_that_exist():
    stale = sorted(set(FLAG_VALUES) - set(parser_flags()))
    assert not stale, f"FLAG_VALUES has entries for flags the parser does not have: {stale}"


def test_the_listed_flags_are_accepted_together():
    argv = ("--model_name m --tokenizer_name t --batch_size_training 2 --val_batch_size 3 --batching_strategy padding "
            "--context_length 128 --gradient_accumulation_steps 2 --gradient_clipping "
            "--gradient_clipping_threshold 0.5 "
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
    (["--dataset", "custom_dataset"], r"--data_path: custom_dataset needs data"),
    (["--from_peft_checkpoint", "x"], r"--from_peft_checkpoint: needs --use_peft"),
    (["stray"], r"unexpected argument"),
    (["--activation_checkpointing_mode", "offload"],
     r"offload has no effect without --enable_activation_checkpointing"),
    (["--enable_activation_checkpointing", "--activation_checkpointing_mode", "selective_ops",
      "--activation_checkpointing_use_reentrant"], r"selective_ops: needs non-reentrant checkpointing"),
    (["--enable_activation_checkpointing", "--activation_checkpointing_mode", "offload",
      "--activation_checkpointing_use_reentrant"], r"offload: needs non-reentrant checkpointing"),
    (["--enable_activation_checkpointing", "--activation_checkpointing_mode", "full",
      "--activation_checkpointing_every_n", "3"],
     r"--activation_checkpointing_every_n: applies to .* every_n, not full"),
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


def test_a_flag_that_implies_another_sections_value_never_changes_a_shared_section():
    """--pure_bf16, --compile and --target_global_batch_size settle a value of another section: the run gets a copy
    with it, and the section the caller passed (which another config may share) is what it was."""
    import dataclasses

    from leantune.config import MemoryConfig, ModelConfig, RunConfig, TrainingConfig

    model, training = ModelConfig(), TrainingConfig(pure_bf16=True, compile=True)
    memory = MemoryConfig(target_global_batch_size=8)
    run = RunConfig(model=model, training=training, memory=memory)
    assert (run.model.model_dtype, run.training.tiled_mlp, run.training.gradient_accumulation_steps) == (
        "bfloat16", "off", 2)
    assert (model.model_dtype, training.tiled_mlp, training.gradient_accumulation_steps) == ("auto", "auto", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.training.lr = 1.0  # a changed run is a new one: dataclasses.replace
    assert parse_run_config(["--optimizer", "AdamW", "--tiled_mlp", " AUTO "]).training.optimizer == "adamw"
