"""``--quantization 4bit|8bit`` and its options: the frozen base held in 4 or 8 bits (QLoRA).

The flags are llama-cookbook's (``--quantization`` and its ``quantization_config``'s fields, which
the cookbook also takes as ``--quantization_config.FIELD``); the defaults are QLoRA's (NF4, double
quantization), where the cookbook defaults to FP4 without double quantization.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from leantune.config.checks import ConfigError, flag_help, require

# flag -> default (a default cannot be told from the same value given, so only other values are checked)
FOUR_BIT_OPTIONS = {"quant_type": "nf4", "compute_dtype": "auto", "use_double_quant": True, "quant_storage": "uint8"}


@dataclass(frozen=True)
class QuantizationConfig:
    quantization: Optional[Literal["4bit", "8bit"]] = field(default=None, metadata=flag_help(
        "Hold the frozen base weights quantized (bitsandbytes; needs --use_peft: QLoRA trains LoRA adapters on "
        "them). 4bit: NF4 blocks of 64 with double quantization, dequantized one layer at a time for each "
        "matmul; 8bit: LLM.int8. The LM head and the embeddings stay in the weights' dtype."))
    quant_type: Literal["nf4", "fp4"] = field(default="nf4", metadata=flag_help(
        "4bit: the 4-bit data type. nf4 (QLoRA's NormalFloat, leantune's default) or fp4 (llama-cookbook's default)."))
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(default="auto", metadata=flag_help(
        "4bit: the dtype the weights are dequantized to for each matmul. auto: the run's autocast dtype "
        "(bfloat16 on a bf16 GPU, float16 with --use_fp16), else the weights' dtype (float32 on the CPU)."))
    use_double_quant: bool = field(default=True, metadata=flag_help(
        "4bit: quantize the per-block scales too (8 bits in blocks of 256), about 0.37 bits a weight saved."))
    quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = field(default="uint8", metadata=flag_help(
        "4bit: the dtype the packed 4-bit weights are stored as (the same bytes). FSDP1 needed it to match the "
        "other weights' dtype; FSDP2 (--enable_fsdp) shards each weight apart and takes uint8 only."))

    def __post_init__(self):
        changed = [flag for flag, default in FOUR_BIT_OPTIONS.items() if getattr(self, flag) != default]
        for flag in changed:
            flag = flag if flag != "use_double_quant" else "no_use_double_quant"
            require(self.quantization == "4bit", flag,
                     f"applies to --quantization 4bit, not {self._described()}; "
                     + ("drop it" if self.quantization else "add --quantization 4bit"))

    def _described(self) -> str:
        return f"--quantization {self.quantization}" if self.quantization else "an unquantized base"

    @property
    def enabled(self) -> bool:
        return self.quantization is not None


def quantization_conflicts(quant: QuantizationConfig, use_peft: bool, enable_fsdp: bool, low_cpu_fsdp: bool,
                           frozen_language_model: bool = False) -> None:
    """Refuse, naming both flags, what a quantized base cannot train with (``frozen_language_model``:
    ``--freeze_LLM_only``, whose frozen language model may be quantized)."""
    if not quant.enabled:
        return
    flag = f"--quantization {quant.quantization}"
    if not (use_peft or frozen_language_model):
        raise ConfigError(f"{flag}: quantized base weights cannot be trained (full fine-tuning); add --use_peft "
                          "to train LoRA adapters on the quantized base (QLoRA), or for an image-and-text model "
                          "--freeze_LLM_only (its frozen language model quantized, the vision side trained)")
    if not enable_fsdp:
        return
    if quant.quantization == "8bit":
        raise ConfigError(f"{flag}: not with --enable_fsdp (LLM.int8 keeps its weights' outlier statistics beside "
                          "the codes, which FSDP2 would not shard with them); use --quantization 4bit")
    if quant.quant_storage != "uint8":
        # FSDP2's mixed precision casts floating-point parameters to the gathering dtype: packed bytes
        # stored as floats of another dtype would be converted as numbers, not carried as bytes
        raise ConfigError(f"--quant_storage {quant.quant_storage}: not with --enable_fsdp (FSDP2 casts floating-point "
                          "weights to the dtype it gathers in, which would convert the packed bytes as numbers); "
                          "drop it (uint8, which FSDP2 gathers as it is)")
    if low_cpu_fsdp:
        raise ConfigError(f"{flag}: not with --low_cpu_fsdp; drop it: under --enable_fsdp each rank reads and "
                          "quantizes only its own rows of a 4-bit base's safetensors checkpoint (shard-first), and "
                          "where the checkpoint cannot be read so (a start-up note says why), rank 0's quantization "
                          "state cannot be broadcast into the other ranks' empty shards")
