"""The typed configuration tree: the single source of every default.

Each section is a dataclass whose fields are command-line flags (names and meanings follow
llama-cookbook's ``train_config`` where it has them). ``RunConfig`` joins the sections and checks
what spans several of them. ``leantune.flags`` turns flags and config files into a ``RunConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal, Optional

from leantune.checkpointing.modes import AUTO, policy_class
from leantune.optimizers import ALIASES as OPTIMIZER_ALIASES
from leantune.optimizers import AUTO as AUTO_OPTIMIZER
from leantune.optimizers import optimizer_choices, optimizer_entry, optimizer_help
from leantune.config.checkpointing import CheckpointingConfig
from leantune.config.checks import ConfigError, flag_help, require, settle
from leantune.config.data import DataConfig
from leantune.config.memory import MemoryConfig, offload_conflicts
from leantune.config.peft import ALL_LINEAR, LORA_PARTS, PeftSettings
from leantune.config.quantization import QuantizationConfig, quantization_conflicts

# The default --model_name: a tiny Llama that ``leantune.models.tiny`` builds locally on first use.
DEFAULT_MODEL_NAME = "leantune-tiny-llama"


@dataclass(frozen=True)
class ModelConfig:
    model_name: str = field(default=DEFAULT_MODEL_NAME, metadata=flag_help(
        f"Local model directory or hub id. '{DEFAULT_MODEL_NAME}' builds a tiny Llama locally (no download)."))
    tokenizer_name: Optional[str] = field(default=None, metadata=flag_help(
        "Tokenizer directory or hub id; defaults to --model_name."))
    model_dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(default="auto", metadata=flag_help(
        "Dtype of the loaded weights. auto: float32, except that on a GPU the frozen LoRA base weights take "
        "bfloat16 with --mixed_precision on a bf16-capable GPU (float32 under --use_fp16)."))
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=flag_help(
        "Where to train. auto: the GPU of this process's LOCAL_RANK when CUDA is available, else the CPU."))
    attn_implementation: Literal["auto", "varlen", "sdpa", "eager", "flex_attention", "flash_attention_2",
                                 "sinks"] = field(
        default="auto", metadata=flag_help(
            "Attention kernel (transformers' names, and leantune's varlen: causal attention within each example "
            "of a row, no mask, memory linear in the context). auto: varlen where the model supports SDPA and "
            "attends over the whole context, sdpa where it has a sliding window (its mask holds the window; "
            "with examples packed apart a batch x S x S one), else eager (Gemma 2), whose batch x heads x seq x "
            "seq scores per layer the plan shows; a model with attention sinks (gpt-oss) takes leantune's sinks "
            "(SDPA with the sink logits as one key more, no scores kept). flex_attention and flash_attention_2 "
            "need a CUDA GPU (flash_attention_2 also the flash-attn package)."))

    rope_scaling_factor: Optional[float] = field(default=None, metadata=flag_help("Extend the model's positions this "
        "many times by RoPE interpolation (its positions and RoPE scaling factor multiplied; linear if none)."))
    output_router_logits: bool = field(default=False, metadata=flag_help(
        "A mixture of experts: train on its own loss with the router's load-balancing term (cross-entropy + "
        "router_aux_loss_coef x load balancing over real tokens), as transformers' output_router_logits does; "
        "on also when the model's config.json has it on. The term is logged per step."))

    def __post_init__(self):
        require(bool(self.model_name.strip()), "model_name", "must not be empty")
        require(self.rope_scaling_factor is None or self.rope_scaling_factor > 1, "rope_scaling_factor",
                 f"must be more than 1 (got {self.rope_scaling_factor})")


@dataclass(frozen=True)
class TrainingConfig:
    batch_size_training: int = field(default=4, metadata=flag_help("Rows per training batch."))
    val_batch_size: int = field(default=1, metadata=flag_help("Rows per validation batch."))
    gradient_accumulation_steps: int = field(default=1, metadata=flag_help("Batches per optimizer step."))
    gradient_clipping: bool = field(default=False, metadata=flag_help("Clip the gradient norm."))
    gradient_clipping_threshold: float = field(default=1.0, metadata=flag_help("Maximum gradient norm when clipping."))
    num_epochs: int = field(default=3, metadata=flag_help("Passes over the training data."))
    max_train_step: int = field(default=0, metadata=flag_help(
        "Stop after this many training batches in all (0: no limit), as in llama-cookbook."))
    max_eval_step: int = field(default=0, metadata=flag_help("Validation batches per evaluation (0: all)."))
    lr: float = field(default=1e-4, metadata=flag_help("The optimizer's learning rate."))
    weight_decay: float = field(default=0.0, metadata=flag_help("The optimizer's decoupled weight decay."))
    # a name the registry holds when the section is built (not a Literal fixed at import: an entry registered
    # later, from a test, is a choice too); ``flags`` gives --optimizer the registry's choices and help
    optimizer: str = field(default="adamw", metadata=flag_help(optimizer_help()))
    optimizer_in_backward: bool = field(default=False, metadata=flag_help(
        "Step each weight as soon as its gradient is complete in backward and free that gradient, so the "
        "full set of gradients never exists. Needs one batch per step (no gradient accumulation), no "
        "--gradient_clipping (the global norm is known only after every weight has stepped) and no "
        "--use_fp16 (the loss scaler checks all gradients before any step); a non-finite step stops the run."))
    pure_bf16: bool = field(default=False, metadata=flag_help(
        "llama-cookbook's flag: bfloat16 weights, trainable ones too (--model_dtype bfloat16); pair it with "
        "--optimizer anyprecision, whose compensated update keeps what bfloat16 weights round away. With "
        "--use_peft the adapters stay float32 (peft keeps them so): it only halves the frozen base."))
    gamma: float = field(default=0.85, metadata=flag_help("Learning-rate decay per epoch (StepLR)."))
    seed: int = field(default=42, metadata=flag_help("Seed for initialisation, shuffling and dropout."))
    use_fp16: bool = field(default=False, metadata=flag_help("float16 autocast with loss scaling (CUDA only)."))
    mixed_precision: bool = field(default=True, metadata=flag_help(
        "bfloat16 autocast on GPUs that support it; float32 on the CPU."))
    run_validation: bool = field(default=True, metadata=flag_help("Validate after each epoch."))
    loss_chunk_size: Optional[int] = field(default=None, metadata=flag_help(
        "Tokens per chunk of the chunked cross-entropy (the full-vocabulary logits never exist at once); "
        "0: plain loss; default: chunked, about 64 MiB of float32 logits a chunk, or a quarter of a trained "
        "float32 head's gradient when that is more (with or without checkpointing)."))
    tiled_mlp: str = field(default="auto", metadata=flag_help(
        "Run each decoder layer's MLP and norms over sequence tiles, recomputed in backward: no batch x context x "
        "intermediate tensor (one more MLP forward a step). auto: tiles of hidden_size tokens when a row holds "
        "more than two (over 8192 tokens for an 8B; never with --compile); off; N: tiles of N tokens."))
    compile: bool = field(default=False, metadata=flag_help(
        "torch.compile each decoder layer (with its activation checkpointing, any mode but offload); "
        "the first step compiles (tens of seconds), later steps run the compiled layers. Losses equal "
        "eager's within float32 rounding, LoRA dropout included (docs/compile.md)."))
    skip_nonfinite_steps: int = field(default=0, metadata=flag_help(
        "Optimizer steps whose loss or gradient norm is NaN/inf that may be skipped (with a warning each) "
        "before the run stops; 0: stop at the first one, naming the step and its examples."))

    def __post_init__(self):
        settle(self, "optimizer", OPTIMIZER_ALIASES.get(self.optimizer, self.optimizer))  # the cookbook: AdamW
        require(self.optimizer in optimizer_choices(), "optimizer",
                f"invalid choice: {self.optimizer!r} (choose from {', '.join(optimizer_choices())})")
        for name in ("batch_size_training", "val_batch_size", "gradient_accumulation_steps", "num_epochs"):
            value = getattr(self, name)
            require(value >= 1, name, f"must be at least 1 (got {value})")
        require(self.max_train_step >= 0, "max_train_step", "must be 0 (no limit) or more")
        require(self.max_eval_step >= 0, "max_eval_step", "must be 0 (no limit) or more")
        require(self.lr > 0, "lr", f"must be positive (got {self.lr})")
        require(self.weight_decay >= 0, "weight_decay", "must be 0 or more")
        require(0 < self.gamma <= 1, "gamma", f"must be in (0, 1] (got {self.gamma})")
        require(self.gradient_clipping_threshold > 0, "gradient_clipping_threshold", "must be positive")
        require(self.skip_nonfinite_steps >= 0, "skip_nonfinite_steps",
                 f"must be 0 (stop at the first) or more (got {self.skip_nonfinite_steps})")
        require(self.loss_chunk_size is None or self.loss_chunk_size >= 0, "loss_chunk_size",
                 f"must be 0 (plain loss) or a positive number of tokens (got {self.loss_chunk_size})")
        settle(self, "tiled_mlp", str(self.tiled_mlp).strip().lower())
        require(self.tiled_mlp in ("off", "auto") or self.tiled_mlp.isdigit() and int(self.tiled_mlp) > 0,
                 "tiled_mlp", f"must be off, auto or a positive number of tokens per tile (got {self.tiled_mlp!r})")


@dataclass(frozen=True)
class DistributedConfig:
    enable_fsdp: bool = field(default=False, metadata=flag_help(
        "Shard parameters, gradients and optimizer state with FSDP2 over the processes torchrun starts "
        "(--nproc_per_node, --nnodes); --batch_size_training stays per process."))
    fsdp_cpu_offload: bool = field(default=False, metadata=flag_help(
        "With --enable_fsdp: keep the sharded parameters, gradients and optimizer state in host memory."))
    low_cpu_fsdp: bool = field(default=False, metadata=flag_help(
        "With --enable_fsdp: only rank 0 loads the weights; the others build the model on the meta device and "
        "receive their shards from rank 0, so host memory per node does not grow with the process count."))

    def __post_init__(self):
        require(self.enable_fsdp or not self.fsdp_cpu_offload, "fsdp_cpu_offload", "needs --enable_fsdp")
        require(self.enable_fsdp or not self.low_cpu_fsdp, "low_cpu_fsdp", "needs --enable_fsdp")


@dataclass(frozen=True)
class OutputConfig:
    output_dir: str = field(default="out/leantune", metadata=flag_help("Where the model, metrics and memory log go."))
    save_model: bool = field(default=True, metadata=flag_help("Save the adapter (LoRA) or the full model at the end."))
    save_metrics: bool = field(default=False, metadata=flag_help("Write per-step metrics to metrics.json."))
    peak_tflops: Optional[float] = field(default=None, metadata=flag_help(
        "The device's peak dense bf16 TFLOP/s for MFU and HFU (default: a table of common GPUs; on the CPU or an "
        "unknown GPU no MFU is reported unless this is given)."))
    use_tensorboard: bool = field(default=False, metadata=flag_help(
        "Log the per-step and per-epoch metrics (metrics.json's names) to OUTPUT_DIR/tensorboard."))
    use_wandb: bool = field(default=False, metadata=flag_help(
        "Log the metrics to Weights & Biases (offline unless WANDB_MODE=online), as llama-cookbook's flag."))
    wandb_project: str = field(default="leantune", metadata=flag_help("The Weights & Biases project with --use_wandb."))
    save_steps: int = field(default=0, metadata=flag_help(
        "Save the training state (weights or adapter, optimizer, scheduler, scaler, RNG states, data position) "
        "to OUTPUT_DIR/checkpoint-STEP every this many optimizer steps and at the end; 0: only when stopped "
        "by SIGTERM/SIGINT."))
    save_total_limit: Optional[int] = field(default=None, metadata=flag_help(
        "Keep only the newest this many checkpoint-STEP directories (default: keep all)."))
    resume_from_checkpoint: Optional[str] = field(default=None, metadata=flag_help(
        "Continue a run exactly from a saved training state: a checkpoint-STEP directory, or 'latest' "
        "(the newest in --output_dir)."))
    overwrite_output_dir: bool = field(default=False, metadata=flag_help(
        "Train into an --output_dir that holds another run's model or training state (its checkpoint-STEP "
        "directories are deleted first)."))

    def __post_init__(self):
        require(bool(self.output_dir.strip()), "output_dir", "must not be empty")
        require(self.peak_tflops is None or 0 < self.peak_tflops < float("inf"), "peak_tflops",
                 f"must be a positive number of TFLOP/s (got {self.peak_tflops})")
        require(self.save_steps >= 0, "save_steps",
                 f"must be 0 (save only when stopped) or more (got {self.save_steps})")
        require(self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit",
                 f"must keep at least 1 training state (got {self.save_total_limit})")
        require(not (self.resume_from_checkpoint and self.overwrite_output_dir), "overwrite_output_dir",
                 "conflicts with --resume_from_checkpoint (resuming continues the run in --output_dir); drop one")
        require(self.resume_from_checkpoint is None or bool(self.resume_from_checkpoint.strip()),
                 "resume_from_checkpoint", "give a checkpoint-STEP directory or 'latest'")


SECTIONS = (ModelConfig, DataConfig, TrainingConfig, PeftSettings, QuantizationConfig, CheckpointingConfig,
            MemoryConfig, DistributedConfig, OutputConfig)


@dataclass(frozen=True)
class RunConfig:
    """Every section of a run; built by ``leantune.flags.parse_run_config``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    peft: PeftSettings = field(default_factory=PeftSettings)
    quant: QuantizationConfig = field(default_factory=QuantizationConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self):
        # What one flag implies for another section is settled here, once, as the run is built: a section is
        # replaced by a copy (never changed), so a section shared with another config stays what it was.
        if self.training.pure_bf16:
            require(not self.training.use_fp16, "pure_bf16", "conflicts with --use_fp16 (float16 autocast); drop one")
            require(self.model.model_dtype in ("auto", "bfloat16"), "pure_bf16",
                     f"means bfloat16 weights; conflicts with --model_dtype {self.model.model_dtype}; drop one")
            settle(self, "model", replace(self.model, model_dtype="bfloat16"))
        if self.training.use_fp16 and self.model.model_dtype == "bfloat16":
            raise ConfigError("--use_fp16: conflicts with --model_dtype bfloat16; pick one half-precision type")
        self._check_optimizer_flags()
        dc = self.distributed
        offload_conflicts(self.memory, self.peft.use_peft or self.peft.freeze_LLM_only, self.quant.quantization,
                          dc.enable_fsdp)
        quantization_conflicts(self.quant, self.peft.use_peft, dc.enable_fsdp, dc.low_cpu_fsdp,
                               self.peft.freeze_LLM_only)
        mode = self.checkpointing.activation_checkpointing_mode
        if self.training.compile and mode not in (None, AUTO) and not policy_class(mode).compiles:
            raise ConfigError(f"--compile: not with --activation_checkpointing_mode {mode} (its hooks act while the "
                              "layer runs, which a compiled graph does not expose); use full or selective_ops, "
                              "or drop --compile")
        if self.training.compile:  # a compiled layer cannot run autograd inside its backward: auto is off
            require(self.training.tiled_mlp in ("off", "auto"), "tiled_mlp", f"{self.training.tiled_mlp}: not with "
                     "--compile yet (the layers would run eagerly); drop one")
            settle(self, "training", replace(self.training, tiled_mlp="off"))
        if self.distributed.enable_fsdp and self.training.use_fp16:
            raise ConfigError("--use_fp16: not with --enable_fsdp (float16 needs a sharded loss scaler); "
                              "use --mixed_precision (bfloat16)")
        target = self.memory.target_global_batch_size
        if target is not None and not self.memory.auto_batch_size:
            batch = self.training.batch_size_training
            require(target % batch == 0, "target_global_batch_size",
                     f"{target} is not a multiple of --batch_size_training {batch}; pick a multiple or add "
                     f"--auto_batch_size")
            require(self.training.gradient_accumulation_steps in (1, target // batch), "gradient_accumulation_steps",
                     f"conflicts with --target_global_batch_size {target} (which sets it to {target // batch}); "
                     f"drop one")
            settle(self, "training", replace(self.training, gradient_accumulation_steps=target // batch))

    def _check_optimizer_flags(self) -> None:
        """The optimizer options against the flags they cannot work with, naming both."""
        tc = self.training
        unsharded = tc.optimizer == AUTO_OPTIMIZER or not optimizer_entry(tc.optimizer).sharded
        if self.distributed.enable_fsdp and unsharded:
            flag = "--optimizer auto" if tc.optimizer == AUTO_OPTIMIZER else optimizer_entry(tc.optimizer).flag
            raise ConfigError(f"{flag}: not with --enable_fsdp yet (untested on sharded parameters); drop one")
        entry = None if tc.optimizer == AUTO_OPTIMIZER else optimizer_entry(tc.optimizer)
        for flag, why in ([] if entry is None else optimizer_conflicts(entry, tc, self.model.model_dtype,
                                                                       self.memory.target_global_batch_size)):
            raise ConfigError(f"{entry.flag}: not with {flag}: {why}; drop one")
        if tc.optimizer_in_backward and (conflicts := self.in_backward_conflicts()):
            raise ConfigError("--optimizer_in_backward: not with {}: {}; drop one".format(*conflicts[0]))

    def in_backward_conflicts(self) -> list[tuple[str, str]]:
        """The flags of this run that ``--optimizer_in_backward`` cannot work with, each with why."""
        tc = self.training
        conflicts = [
            (tc.gradient_accumulation_steps > 1, f"--gradient_accumulation_steps {tc.gradient_accumulation_steps}",
             "each weight steps when its gradient of one batch is complete; use one batch a step"),
            (self.memory.target_global_batch_size is not None, "--target_global_batch_size",
             "it may accumulate gradients over several batches; pick --batch_size_training yourself"),
            (tc.gradient_clipping, "--gradient_clipping",
             "the global gradient norm is known only after every weight has stepped"),
            (tc.use_fp16, "--use_fp16", "the loss scaler must see every gradient before any step; use bfloat16"),
            (self.model.model_dtype == "float16" and not tc.use_fp16, "--model_dtype float16",
             "float16 weights train with a loss scaler, which must see every gradient before any step; use bfloat16"),
            (tc.skip_nonfinite_steps > 0, f"--skip_nonfinite_steps {tc.skip_nonfinite_steps}",
             "a step's updates are applied during backward, before its loss and norm are checked, so it cannot be "
             "skipped (a non-finite step stops the run, nothing saved from it)"),
        ]
        return [(flag, why) for conflict, flag, why in conflicts if conflict]

    def flat(self) -> dict:
        """All flags and their values, for logs and the metrics file."""
        return {name: value for section in vars(self).values() for name, value in _flag_values(section).items()}


def _flag_values(section) -> dict:
    """A section's flags by name: its fields, or what it lists (the checkpointing modes' flags are no fields)."""
    if hasattr(type(section), "flag_values"):
        return section.flag_values()
    return {f.name: getattr(section, f.name) for f in fields(section)}


def optimizer_conflicts(entry, tc: TrainingConfig, model_dtype: str,
                        target_global_batch_size: Optional[int] = None) -> list[tuple[str, str]]:
    """The flags an optimizer ``entry`` cannot work with that a run sets, each with why: its training conflicts;
    where it refuses --use_fp16, --model_dtype float16 too (float16 weights train with the same loss scaler); where
    it refuses gradient accumulation, --target_global_batch_size too (which sets the accumulation)."""
    found = entry.conflicts_in(tc)
    why = dict(entry.conflicts)
    if why.get("use_fp16") and model_dtype == "float16" and not tc.use_fp16:
        found.append(("--model_dtype float16", why["use_fp16"]))
    if why.get("gradient_accumulation_steps") and target_global_batch_size is not None:
        found.append((f"--target_global_batch_size {target_global_batch_size}",
                      f"it may accumulate over several batches: {why['gradient_accumulation_steps']}"))
    return found


__all__ = ["ALL_LINEAR", "DEFAULT_MODEL_NAME", "LORA_PARTS", "SECTIONS", "CheckpointingConfig", "ConfigError",
           "DataConfig", "DistributedConfig", "MemoryConfig", "ModelConfig", "OutputConfig", "PeftSettings",
           "QuantizationConfig", "RunConfig", "TrainingConfig", "optimizer_conflicts"]
