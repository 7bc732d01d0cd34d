"""What a resumed run must share with the saved one: the flags that shape each step, the process count and the
optimizer state's layout. Anything else (epochs, step limit, logging, saving) may change."""

from __future__ import annotations

from pathlib import Path

from leantune.config import ConfigError, RunConfig
from leantune.optimizers import optimizer_entry
from leantune.training.state import STATE_FILE

# Flags that change what the next step computes: resuming with another value would not continue
# the same run, so it is refused. Others (epochs, step limit, logging, saving) may change.
TRAJECTORY_FLAGS = ("model_name", "tokenizer_name", "use_peft", "peft_method", "from_peft_checkpoint", "lora_r",
                    "lora_alpha", "lora_dropout", "lora_target_modules", "dataset", "data_path",
                    "custom_dataset_file", "column_map", "chat_template", "assistant_turns", "batching_strategy",
                    "packed_examples", "overlong_examples", "context_length", "val_fraction", "batch_size_training",
                    "gradient_accumulation_steps", "seed", "lr", "weight_decay", "gamma", "gradient_clipping",
                    "gradient_clipping_threshold", "use_fp16",
                    "mixed_precision", "model_dtype", "loss_chunk_size", "optimizer", "pure_bf16",
                    "optimizer_in_backward", "quantization", "quant_type", "use_double_quant", "compute_dtype")


def check_compatible(state: dict, flags: dict, path: Path, world_size: int = 1) -> None:
    """Refuse to resume with flags (by name) or a process count that would make the continuation a different run."""
    saved_world = state.get("world_size", 1)
    if saved_world != world_size:
        raise ConfigError(f"--resume_from_checkpoint {path}: saved by {saved_world} process(es), resumed with "
                          f"{world_size}; each step's data would differ. Launch {saved_world} process(es)")
    saved, now = state["config"], flags
    seen, limit = state["progress"].get("batches_seen", 0), now["max_train_step"]
    if limit and limit <= seen:
        raise ConfigError(f"--max_train_step {limit}: the saved state at {path} has trained {seen} batches already, "
                          f"so nothing would be trained; give a larger limit (or 0: none)")
    if state["progress"].get("budget_cut") and saved.get("max_train_step") != now["max_train_step"]:
        raise ConfigError(f"--resume_from_checkpoint {path}: the saved run ended its epoch early at --max_train_step "
                          f"{saved.get('max_train_step')} (the epoch's scheduler step and validation ran), so it "
                          "cannot continue exactly with another limit. Resume an earlier checkpoint-STEP, or keep "
                          "the limit")
    # a flag newer than the saved state: that run had its default (e.g. no --optimizer: AdamW)
    defaults = RunConfig().flat()
    was = {name: saved_value(saved, name, defaults) for name in TRAJECTORY_FLAGS}
    changed = [f"--{name} {was[name]!r} -> {now[name]!r}" for name in TRAJECTORY_FLAGS
               if _normal(was[name]) != _normal(now[name])]
    if changed:
        raise ConfigError(f"--resume_from_checkpoint {path}: these flags differ from the saved run, so it could not "
                          f"continue exactly: {'; '.join(changed)}. Pass the saved values (see {path / STATE_FILE})")
    _check_state_layout(saved_value(saved, "enable_fsdp", defaults), now, path)


def _check_state_layout(was_sharded: bool, now: dict, path: Path) -> None:
    """Refuse to switch --enable_fsdp where the optimizer's state is laid out otherwise on shards (8-bit AdamW)."""
    if was_sharded != now["enable_fsdp"] and optimizer_entry(now["optimizer"]).sharded_build is not None:
        said = "with" if was_sharded else "without"
        raise ConfigError(f"--resume_from_checkpoint {path}: saved {said} --enable_fsdp, and --optimizer "
                          f"{now['optimizer']} keeps its state in another layout on FSDP2's shards, so it cannot load "
                          f"here; resume {said} --enable_fsdp")


def saved_value(saved: dict, name: str, defaults: dict):
    """A flag's value in a saved run's config; for a flag newer than the state, what that run did: the default,
    except that packing was llama-cookbook's concatenation until --packed_examples came (apart makes other rows)."""
    if name in saved:
        return saved[name]
    if name == "packed_examples" and saved.get("batching_strategy", "packing") == "packing":
        return "concatenated"
    return defaults[name]


def _normal(value):
    return list(value) if isinstance(value, (list, tuple)) else value
