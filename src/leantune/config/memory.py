"""``--enable_memory_monitoring``, ``--memory_budget_gb`` and the other flags about the run's memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from leantune.config.checks import flag_help, require


@dataclass(frozen=True)
class MemoryConfig:
    enable_memory_monitoring: bool = field(default=False, metadata=flag_help(
        "Record CPU RSS and accelerator memory per step to memory.jsonl and print a summary."))
    memory_monitoring_interval: float = field(default=0.05, metadata=flag_help(
        "Seconds the sampling thread sleeps between CPU RSS samples."))
    memory_budget_gb: Optional[float] = field(default=None, metadata=flag_help(
        "Memory the run may use, in GiB (2**30 bytes), for --activation_checkpointing_mode auto, "
        "--auto_batch_size and leantune plan. Default on a GPU: its free memory less 5%%; "
        "on the CPU it must be given."))
    memory_snapshot: bool = field(default=False, metadata=flag_help(
        "CUDA: record the allocator's history over the first 3 steps and write OUTPUT_DIR/memory_snapshot.pickle "
        "(open it in https://pytorch.org/memory_viz); an out-of-memory error also writes one."))
    auto_batch_size: bool = field(default=False, metadata=flag_help(
        "Train with the largest batch whose predicted peak fits the budget (confirmed by one real step first; "
        "under --enable_fsdp chosen by one rank's plan, not confirmed)."))
    target_global_batch_size: Optional[int] = field(default=None, metadata=flag_help(
        "Rows per optimizer step to keep whatever the batch size: sets --gradient_accumulation_steps to "
        "this divided by the batch size (with --auto_batch_size, the batch is a divisor of it). Under "
        "--enable_fsdp, one process's rows (the batch is per process)."))
    return_host_memory: Literal["auto", "on", "off"] = field(default="auto", metadata=flag_help(
        "Host allocations of 1 MiB or more are mapped on their own (glibc's mmap threshold fixed), so a freed "
        "tensor goes back to the system at once instead of staying in the process's heap: the process's memory "
        "follows its live tensors. Costs page faults: 8%% of a CPU step at 8,192 tokens, 65%% at 512. auto: on "
        "when training on the CPU with --context_length 4096 or more, where host memory is the device's memory; "
        "off on a GPU."))
    offload_embedding: bool = field(default=False, metadata=flag_help(
        "Keep the frozen input embedding in host memory (LoRA runs): each batch's token ids go to the host, their "
        "rows are gathered there and copied to the device (vocabulary x hidden off the GPU: 1.08 GiB for "
        "gpt-oss, 1.93 GiB for Llama 4 Scout in bfloat16). Not with tied embeddings or --enable_fsdp."))
    offload_experts: int = field(default=0, metadata=flag_help(
        "A mixture of experts under --quantization 4bit: keep the 4-bit expert tensors of this many MoE layers "
        "(the first ones) in pinned host memory, each chunk copied to the GPU as it is dequantized, in forward, "
        "recompute and backward (their bytes over the host link three times a step: slower steps). Their scales "
        "stay on the device. leantune plan shows what each layer takes off."))

    def __post_init__(self):
        require(self.offload_experts >= 0, "offload_experts",
                 f"a number of layers, 0 or more (got {self.offload_experts})")
        require(self.memory_monitoring_interval > 0, "memory_monitoring_interval",
                 f"must be positive seconds (got {self.memory_monitoring_interval})")
        require(self.memory_budget_gb is None or 0 < self.memory_budget_gb < float("inf"), "memory_budget_gb",
                 f"must be a positive number of GiB (got {self.memory_budget_gb})")
        require(self.target_global_batch_size is None or self.target_global_batch_size >= 1,
                 "target_global_batch_size", f"must be at least 1 (got {self.target_global_batch_size})")


def offload_conflicts(memory: MemoryConfig, use_peft: bool, quantization: Optional[str], enable_fsdp: bool) -> None:
    """What keeping weights in host memory needs from the other sections."""
    if memory.offload_embedding:
        require(use_peft, "offload_embedding", "keeps a frozen embedding on the host and needs --use_peft or "
                 "--freeze_LLM_only (full fine-tuning trains the embedding)")
        require(not enable_fsdp, "offload_embedding", "not with --enable_fsdp (each rank holds a shard of the "
                 "embedding); drop one")
    if memory.offload_experts:
        require(quantization == "4bit" and not enable_fsdp, "offload_experts", "keeps 4-bit expert tensors in host "
                 "memory: it needs --quantization 4bit on one GPU (the experts stay in 16 bits under --enable_fsdp)")
