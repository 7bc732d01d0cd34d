"""Bad input is refused in the first seconds with a message naming the problem and the fix, no traceback.

Each case builds its files under ``tmp_path`` and gives the flags; the run must exit with the
code and print the text. Flags come after ``--model_name TINY --output_dir OUT`` so they override.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from leantune import finetuning


def _jsonl(lines):
    return "".join(line + "\n" for line in lines)


def _state(world_size: int = 1, budget_cut: bool = False, batches_seen: int = 8, **flags) -> str:
    """A trainer_state.json as a saved run writes it (its tensors are not read before these checks)."""
    from leantune.flags import parse_run_config

    config = {**parse_run_config(["--context_length", "128"]).flat(), **flags}
    return json.dumps({"format_version": 1, "world_size": world_size, "global_step": 4, "config": config,
                       "progress": {"budget_cut": budget_cut, "batches_seen": batches_seen}, "train_steps": [],
                       "epochs": []})


GOOD = json.dumps({"prompt": "Say hi.", "completion": "Hi there, friend."})
LONG_PROMPT = json.dumps({"prompt": "word " * 300, "completion": "ok"})

# id: (flags, {file name: content (str, or bytes)}, exit code, text in the error)
CASES = {
    "unknown flag": (["--batch_size", "4"], {}, 2, "unknown flag --batch_size; did you mean --batch_size_training?"),
    "cookbook-only flag": (["--use_fast_kernels", "true"], {}, 2, "--use_fast_kernels is a llama-cookbook flag"),
    "quantized full fine-tuning": (["--quantization", "4bit"], {}, 2,
                                   "--quantization 4bit: quantized base weights cannot be trained (full fine-tuning); "
                                   "add --use_peft"),
    "8-bit with fsdp": (["--quantization", "8bit", "--use_peft", "--enable_fsdp"], {}, 2,
                        "--quantization 8bit: not with --enable_fsdp (LLM.int8 keeps"),
    "float storage with fsdp": (["--quantization", "4bit", "--use_peft", "--enable_fsdp", "--quant_storage",
                                 "bfloat16"], {}, 2, "--quant_storage bfloat16: not with --enable_fsdp"),
    "4-bit with low_cpu_fsdp": (["--quantization", "4bit", "--use_peft", "--enable_fsdp", "--low_cpu_fsdp"], {}, 2,
                                "--quantization 4bit: not with --low_cpu_fsdp"),
    "4-bit option on 8-bit": (["--quantization", "8bit", "--use_peft", "--quant_type", "fp4"], {}, 2,
                              "--quant_type: applies to --quantization 4bit, not --quantization 8bit; drop it"),
    "4-bit option alone": (["--use_peft", "--quantization_config.quant_type", "fp4"], {}, 2,
                           "--quant_type: applies to --quantization 4bit, not an unquantized base; add "
                           "--quantization 4bit"),
    "single quantization on 8-bit": (["--quantization", "8bit", "--use_peft", "--no_use_double_quant"], {}, 2,
                                     "--no_use_double_quant: applies to --quantization 4bit, not --quantization 8bit"),
    "a cookbook section's other field": (["--quantization_config.lr", "0.1"], {}, 2,
                                         "unknown flag --quantization_config.lr"),
    "float16 compute on the cpu": (["--quantization", "4bit", "--use_peft", "--compute_dtype", "float16"], {}, 2,
                                   "--compute_dtype float16: needs a CUDA GPU, and this run is on cpu"),
    "not a number": (["--lr", "fast"], {}, 2, "--lr: invalid float value: 'fast'"),
    "zero lr": (["--lr", "0"], {}, 2, "--lr: must be positive (got 0.0)"),
    "zero batch": (["--batch_size_training", "0"], {}, 2, "--batch_size_training: must be at least 1 (got 0)"),
    "negative accumulation": (["--gradient_accumulation_steps", "-1"], {}, 2,
                              "--gradient_accumulation_steps: must be at least 1"),
    "context of one token": (["--context_length", "1"], {}, 2, "--context_length: must be at least 2 (got 1)"),
    "context beyond the model": (["--context_length", "4096"], {}, 2,
                                 "--context_length 4096: the model handles at most 2,048 positions "
                                 "(max_position_embeddings, with its RoPE scaling); use --context_length 2048 or less, "
                                 "or extend the positions with --rope_scaling_factor 2"),
    "val fraction above one": (["--val_fraction", "1.5"], {}, 2, "--val_fraction: must be in [0, 1) (got 1.5)"),
    "zero clipping threshold": (["--gradient_clipping_threshold", "0"], {}, 2,
                                "--gradient_clipping_threshold: must be positive"),
    "fp16 and bf16 weights": (["--use_fp16", "--model_dtype", "bfloat16"], {}, 2,
                              "--use_fp16: conflicts with --model_dtype bfloat16"),
    "adapter without peft": (["--from_peft_checkpoint", "somewhere"], {}, 2,
                             "--from_peft_checkpoint: needs --use_peft"),
    "mode without checkpointing": (["--activation_checkpointing_mode", "selective_ops"], {}, 2,
                                   "selective_ops has no effect without --enable_activation_checkpointing"),
    "negative save steps": (["--save_steps", "-1"], {}, 2, "--save_steps: must be 0"),
    "zero states kept": (["--save_total_limit", "0"], {}, 2, "--save_total_limit: must keep at least 1"),
    "negative skips": (["--skip_nonfinite_steps", "-2"], {}, 2, "--skip_nonfinite_steps: must be 0"),
    "resume and overwrite": (["--resume_from_checkpoint", "latest", "--overwrite_output_dir"], {}, 2,
                             "--overwrite_output_dir: conflicts with --resume_from_checkpoint"),
    "missing model dir": (["--model_name", "./no/such/model"], {}, 1, "model directory not found: ./no/such/model"),
    "model dir without config": (["--model_name", "{tmp}/empty_model"], {"empty_model/README": "x"}, 1,
                                 "has no config.json"),
    "unknown LoRA target": (["--use_peft", "--lora_target_modules", "qkv_proj"], {}, 1,
                            "--lora_target_modules: qkv_proj not found in LlamaForCausalLM; its linear layers are"),
    "all-linear with others": (["--use_peft", "--lora_target_modules", "all-linear", "q_proj"], {}, 2,
                               "--lora_target_modules: all-linear already names every linear layer"),
    "flash attention on the CPU": (["--attn_implementation", "flash_attention_2", "--device", "cpu"], {}, 2,
                                   "--attn_implementation flash_attention_2: needs a CUDA GPU"),
    "unknown attention": (["--attn_implementation", "fast"], {}, 2, "--attn_implementation"),
    "missing tokenizer": (["--tokenizer_name", "./no/such/tokenizer"], {}, 1,
                          "model directory not found: ./no/such/tokenizer"),
    "custom without file": (["--dataset", "custom_dataset"], {}, 2,
                            "--data_path: custom_dataset needs data: pass --data_path FILE.jsonl, or "
                            "--custom_dataset.file FILE.py"),
    "cookbook dataset file and data path": (["--dataset", "custom_dataset", "--custom_dataset.file", "d.py",
                                             "--data_path", "d.jsonl"], {}, 2,
                                            "--custom_dataset.file: conflicts with --data_path"),
    "cookbook dataset file for alpaca": (["--custom_dataset.file", "d.py"], {}, 2,
                                         "--custom_dataset.file: applies to --dataset custom_dataset, not "
                                         "alpaca_dataset"),
    "no cookbook dataset file": (["--dataset", "custom_dataset", "--custom_dataset.file", "{tmp}/none.py"], {}, 1,
                                 "--custom_dataset.file {tmp}/none.py: no Python file {tmp}/none.py"),
    "cookbook dataset file without its function": (["--dataset", "custom_dataset", "--custom_dataset.file",
                                                    "{tmp}/empty.py:rows"], {"empty.py": "x = 1\n"}, 1,
                                                   "empty.py defines no function rows(dataset_config, tokenizer, "
                                                   "split)"),
    "cookbook dataset row without ids": (["--dataset", "custom_dataset", "--custom_dataset.file", "{tmp}/rowless.py"],
                                         {"rowless.py": "def get_custom_dataset(c, t, split):\n"
                                                        "    return [{'text': 'x'}]\n"},
                                         1, "rowless.py train row 0: expected a mapping with input_ids (and labels); "
                                         "got ['text']"),
    "chat flag without chat data": (["--assistant_turns", "last"], {}, 2,
                                    "--assistant_turns: applies to --dataset chat_dataset, not alpaca_dataset"),
    "chat record without an answer": (["--dataset", "chat_dataset", "--data_path", "{tmp}/chat.jsonl"],
                                      {"chat.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n'}, 1,
                                      "chat.jsonl:1: no assistant turn to learn from"),
    "missing data file": (["--dataset", "custom_dataset", "--data_path", "{tmp}/nope.jsonl"], {}, 1,
                          "dataset file not found"),
    "not utf-8": (["--dataset", "custom_dataset", "--data_path", "{tmp}/latin1.jsonl"],
                  {"latin1.jsonl": (GOOD + "\n" + '{"text": "caf\xe9"}\n').encode("latin-1")}, 1,
                  "latin1.jsonl:2: not UTF-8 text (byte 0xe9"),
    "malformed line": (["--dataset", "custom_dataset", "--data_path", "{tmp}/bad.jsonl"],
                       {"bad.jsonl": _jsonl([GOOD, GOOD, '{"prompt": "x", "completion": '])}, 1,
                       "bad.jsonl:3: malformed JSON line"),
    "line not an object": (["--dataset", "custom_dataset", "--data_path", "{tmp}/list.jsonl"],
                           {"list.jsonl": _jsonl([GOOD, "[1, 2]"])}, 1,
                           "list.jsonl:2: expected a JSON object, got list"),
    "missing field": (["--dataset", "custom_dataset", "--data_path", "{tmp}/half.jsonl"],
                      {"half.jsonl": _jsonl([GOOD, json.dumps({"prompt": "only a prompt"})])}, 1,
                      "half.jsonl:2: field 'completion' is missing"),
    "empty field": (["--dataset", "custom_dataset", "--data_path", "{tmp}/empty.jsonl"],
                    {"empty.jsonl": _jsonl([GOOD, json.dumps({"prompt": "Say hi.", "completion": "  "})])}, 1,
                    "empty.jsonl:2: field 'completion' is empty"),
    "empty file": (["--dataset", "custom_dataset", "--data_path", "{tmp}/nothing.jsonl"], {"nothing.jsonl": "\n"}, 1,
                   "nothing.jsonl: no records found"),
    "alpaca without output": (["--data_path", "{tmp}/alpaca.json"],
                              {"alpaca.json": json.dumps([{"instruction": "Do it.", "output": "Done."},
                                                          {"instruction": "Do it."}])}, 1,
                              "alpaca.json:item 1: field 'output' is missing"),
    "every prompt beyond the context": (["--dataset", "custom_dataset", "--data_path", "{tmp}/long.jsonl",
                                         "--batching_strategy", "padding", "--context_length", "64",
                                         "--val_fraction", "0"],
                                        {"long.jsonl": _jsonl([LONG_PROMPT] * 6)}, 1,
                                        "every one of the 6 examples has its prompt fill --context_length 64"),
    "too few records to split": (["--dataset", "custom_dataset", "--data_path", "{tmp}/one.jsonl"],
                                 {"one.jsonl": _jsonl([GOOD])}, 1, "1 record(s) cannot be split with --val_fraction"),
    "output dir is a file": (["--output_dir", "{tmp}/a_file"], {"a_file": "x"}, 2, "is a file; give a directory"),
    "another run's state": (["--output_dir", "{tmp}/used"], {"used/checkpoint-20/trainer_state.json": "{}"}, 2,
                            "holds another run's training state (1 saved, checkpoint-20 the newest). Continue that run "
                            "with --resume_from_checkpoint latest, start over with --overwrite_output_dir"),
    "another run's model": (["--output_dir", "{tmp}/done"], {"done/adapter_model.safetensors": "x"}, 2,
                            "holds another run's model (adapter_model.safetensors). Start over with "
                            "--overwrite_output_dir, or pick another --output_dir"),  # no state: resume not offered
    "nothing to resume": (["--resume_from_checkpoint", "latest"], {}, 2,
                          "--resume_from_checkpoint latest: {tmp}/out holds no complete checkpoint-STEP training "
                          "state"),
    "resume a final model": (["--resume_from_checkpoint", "{tmp}/final"], {"final/config.json": "{}"}, 2,
                             "no trainer_state.json there, so it is not a complete training state"),
    "missing config file": (["--config", "{tmp}/run.yaml"], {}, 2, "--config: file not found"),
    "resume with another batch": (["--resume_from_checkpoint", "{tmp}/s/checkpoint-4", "--batch_size_training", "2"],
                                  {"s/checkpoint-4/trainer_state.json": _state(batch_size_training=8)}, 2,
                                  "--batch_size_training 8 -> 2"),
    "resume with another process count": (["--resume_from_checkpoint", "{tmp}/s/checkpoint-4"],
                                          {"s/checkpoint-4/trainer_state.json": _state(world_size=2)}, 2,
                                          "saved by 2 process(es), resumed with 1"),
    "memory snapshot on the CPU": (["--memory_snapshot"], {}, 2,
                                   "--memory_snapshot: records the CUDA allocator's history; this run is on cpu"),
    "output dir is the model dir": (["--output_dir", "{model}"], {}, 2,
                                    "is the --model_name directory; the run would write over what it reads"),
    "resume with nothing left to train": (["--resume_from_checkpoint", "{tmp}/s/checkpoint-4", "--max_train_step", "8"],
                                          {"s/checkpoint-4/trainer_state.json": _state(batches_seen=8)}, 2,
                                          "has trained 8 batches already, so nothing would be trained"),
    "resume past an early epoch end": (["--resume_from_checkpoint", "{tmp}/s/checkpoint-4", "--max_train_step", "20"],
                                       {"s/checkpoint-4/trainer_state.json": _state(budget_cut=True, max_train_step=8)},
                                       2, "ended its epoch early at --max_train_step 8"),
}


def _materialise(tmp_path, files):
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


@pytest.mark.parametrize("flags, files, code, text", CASES.values(), ids=CASES.keys())
def test_bad_input_is_refused_with_a_message_and_no_traceback(flags, files, code, text, tiny_model_dir, tmp_path,
                                                              capsys):
    _materialise(tmp_path, files)
    flags = [flag.replace("{tmp}", str(tmp_path)).replace("{model}", str(tiny_model_dir)) for flag in flags]
    argv = ["--model_name", str(tiny_model_dir), "--output_dir", str(tmp_path / "out"), "--num_workers_dataloader",
            "0", "--context_length", "128", *flags]
    assert finetuning.main(argv) == code
    err = capsys.readouterr().err
    assert text.replace("{tmp}", str(tmp_path)) in err
    assert err.startswith("leantune: error: ") and "Traceback" not in err


def test_at_least_25_cases():
    assert len(CASES) >= 25


def test_a_user_error_prints_one_line_from_the_console_script(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_jsonl([GOOD, GOOD, "{oops"]), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "leantune.finetuning", "--model_name", str(tiny_model_dir),
                           "--dataset", "custom_dataset", "--data_path", str(bad), "--output_dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"leantune: error: {bad}:3: malformed JSON line (Expecting property "
                                                "name enclosed in double quotes at column 2)"]
    assert "model:" not in done.stdout  # refused before the weights were loaded
