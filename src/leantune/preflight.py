"""Checks that run before any heavy work, so a mistake costs seconds, not an hour of training.

Flag values are checked by the config dataclasses as they are parsed; what needs the file system
or the model's config is checked here, before the memory plan, the data and the weights load:
the output directory, the training state to resume, the context length against the model's
positions, the LoRA target modules against the model's layers, the decoder layers that
checkpointing needs, the optimizer's library and device, and that leantune's loss is the model's
own (``builders.own_loss``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from leantune.builders.own_loss import check_own_loss
from leantune.config import ConfigError, DataConfig, OutputConfig, PeftSettings, RunConfig
from leantune.models.attention import traceable_attention
from leantune.models.compiling import check_can_compile
from leantune.builders.loaders import image_batches
from leantune.models.facts import ModelFacts, run_model_facts
from leantune.models.image_text import check_image_text_class
from leantune.model_structure import is_image_text, text_config
from leantune.models.quantized import compute_dtype, require_bitsandbytes
from leantune.optimizers import AUTO, optimizer_entry
from leantune.optional import installed
from leantune.precision import choose_precision
from leantune.training.state import PREFIX, TrainingStateStore, recover_replaced, resolve_resume_path, saved_states

# Files that mean a finished run's model is in a directory (the Hugging Face layouts).
MODEL_FILES = ("adapter_model.safetensors", "model.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "adapter_model.bin")


def preflight(cfg: RunConfig, device_type: str = "cpu", log: Callable[[str], None] = print
              ) -> tuple[Optional[Path], ModelFacts]:
    """Refuse bad input early; returns the training state to resume from (if any) and the model's facts
    (for a run on ``device_type``: its attention implementation)."""
    check_output_dir(cfg.output, reads=(cfg.model.model_name, cfg.model.tokenizer_name, cfg.peft.from_peft_checkpoint))
    resume = None
    if cfg.output.resume_from_checkpoint:
        resume = resolve_resume_path(cfg.output.resume_from_checkpoint, cfg.output.output_dir)
    check_optimizer(cfg, device_type)
    facts = check_model_shape(cfg, device_type)
    check_image_text_run(cfg.peft, cfg.data, facts, [why for asks, why in NOT_WITH_IMAGES if asks(cfg)])
    stand_in = traceable_attention(facts.config, facts.attention)
    if stand_in != facts.attention:
        log(f"attention: {facts.attention}; the planner and the loss check build {stand_in} in its place "
            "(it has no CPU kernel; both keep O(sequence) per head for backward)")
    images = image_batches(cfg.data, facts.config)  # an image-and-text model's base runs them, checked so
    log(check_own_loss(cfg.training, facts, sharded=cfg.distributed.enable_fsdp, images=images).summary_line())
    return resume, facts


# What an image-and-text run (batches of the dataset file's collator) cannot take yet, and why.
NOT_WITH_IMAGES = (
    (lambda cfg: cfg.training.tiled_mlp not in ("auto", "off"), "--tiled_mlp: not for image-and-text runs yet"),
    (lambda cfg: cfg.memory.offload_experts, "--offload_experts: not for image-and-text runs yet"),
)


def check_image_text_run(peft: PeftSettings, data: DataConfig, facts: ModelFacts, refusals: list[str]) -> None:
    """An image-and-text model's class and what its run asks for: ``--freeze_LLM_only`` needs one, and batches of
    images (a dataset file with ``get_data_collator``) refuse what does not handle them yet (``refusals``: why,
    for each such flag the run sets)."""
    image_text = is_image_text(facts.config)
    if peft.freeze_LLM_only and not image_text:
        raise ConfigError(f"--freeze_LLM_only: {facts.architecture} is a language model alone (no vision tower to "
                          "train); drop the flag, or use --use_peft")
    if not image_text:
        return
    check_image_text_class(facts.shape)
    images = image_batches(data, facts.config)
    if peft.trains_vision_only and not images:
        flag = "--freeze_LLM_only" if peft.freeze_LLM_only else f"--lora_parts {' '.join(peft.lora_parts)}"
        raise ConfigError(f"{flag}: only the vision side trains, and the run's rows hold no image (text rows never "
                          "run it); give image rows (a dataset file with get_data_collator, or chat records with "
                          "images), or train the language model")
    if images and refusals:
        raise ConfigError(refusals[0])


def check_optimizer(cfg: RunConfig, device_type: str) -> None:
    """The optimizer's library and device (its registry entry's), and a quantized base's bitsandbytes."""
    entry = optimizer_entry(cfg.training.optimizer) if cfg.training.optimizer != AUTO else None
    if entry is not None and device_type not in entry.devices:
        raise ConfigError(f"{entry.flag}: {entry.devices_why}, and this run is on {device_type}; "
                          f"{entry.elsewhere}")
    if entry is not None and entry.package and not installed(entry.package):
        raise ConfigError(f"{entry.flag}: needs {entry.package} ({entry.install}); {entry.alternative}")
    if entry is not None and entry.compiles:
        check_can_compile(device_type, entry.flag, entry.alternative.removeprefix("or "))
    if cfg.quant.enabled:
        require_bitsandbytes(f"--quantization {cfg.quant.quantization}", "or drop --quantization (a bfloat16 base)")
        # refuses a mismatched one
        compute_dtype(cfg.quant, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device(device_type)))


def check_output_dir(output: OutputConfig, reads: tuple[Optional[str], ...] = ()) -> None:
    """A writable directory that holds no other run's model or training state (unless resuming or overwriting).

    ``reads``: what the run reads (--model_name, --tokenizer_name, --from_peft_checkpoint, in that order),
    none of which may be the directory it writes.
    """
    out = Path(output.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output_dir {out}: is a file; give a directory")
    for flag, path in zip(("model_name", "tokenizer_name", "from_peft_checkpoint"), reads):
        _refuse_same_dir(out, path, flag)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--output_dir {out}: cannot create it ({err.strerror}); pick a writable directory") from None
    recover_replaced(out)  # a state a crash left aside counts as one
    states = saved_states(out)
    models = [name for name in MODEL_FILES if (out / name).is_file()]
    if not (states or models) or output.resume_from_checkpoint:
        return
    if not output.overwrite_output_dir:
        held = (f"training state ({len(states)} saved, {states[-1][1].name} the newest)" if states
                else f"model ({models[0]})")
        # resuming is offered only where there is a state to resume (a finished run's model alone is not one)
        start = "Continue that run with --resume_from_checkpoint latest, start" if states else "Start"
        raise ConfigError(f"--output_dir {out}: holds another run's {held}. {start} over with "
                          "--overwrite_output_dir, or pick another --output_dir")


def _refuse_same_dir(out: Path, other: Optional[str], flag: str) -> None:
    """What the run reads must not be where it writes (and --overwrite_output_dir deletes)."""
    if other and Path(other).expanduser().is_dir() and Path(other).expanduser().resolve() == out.resolve():
        raise ConfigError(f"--output_dir {out}: is the --{flag} directory; the run would write over what it reads. "
                          "Pick another --output_dir")


def clear_previous_run(output: OutputConfig, log: Callable[[str], None] = print) -> None:
    """``--overwrite_output_dir``: the old run's training states and model go, once the new run is set up.

    Not earlier: a new run refused for a bad flag or file must not have deleted anything.
    Its logs and metrics stay until the new run's replace them.
    """
    out = Path(output.output_dir)
    removed = TrainingStateStore(out).remove_all()
    models = [path for path in out.glob("*") if path.name in MODEL_FILES or path.name == "adapter_config.json"
              or (path.name.startswith("model-") and path.suffix == ".safetensors")]
    for path in models:
        path.unlink()
    if removed or models:
        log(f"--overwrite_output_dir: deleted {len(removed)} training state(s) {PREFIX}* and {len(models)} model "
            f"file(s) of the previous run in {out}")


def check_model_shape(cfg: RunConfig, device_type: str = "cpu") -> ModelFacts:
    """The context length, LoRA targets and checkpointable layers against the model's config, read once here
    without loading a weight."""
    facts = run_model_facts(cfg.model, device_type, compiled=cfg.training.compile)
    facts.check_context_length(cfg.data.context_length)
    if cfg.peft.use_peft and not cfg.peft.from_peft_checkpoint:
        facts.check_lora_targets(cfg.peft)
    if cfg.checkpointing.enable_activation_checkpointing:
        facts.check_checkpointable()
    layers = text_config(facts.config).num_hidden_layers
    if cfg.peft.freeze_layers and cfg.peft.num_freeze_layers > layers:
        raise ConfigError(f"--num_freeze_layers {cfg.peft.num_freeze_layers}: {facts.architecture} has {layers} "
                          f"decoder layers; freeze at most {layers}")
    return facts
