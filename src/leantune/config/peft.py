"""``--use_peft`` and the flags about what trains: LoRA's settings and places, and the cookbook's freezing flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from leantune.config.checks import flag_help, require, settle

# --lora_target_modules all-linear: every linear layer but the output head (peft's name and meaning).
ALL_LINEAR = "all-linear"
# An image-and-text model's parts LoRA may go on (--lora_parts), beside auto and all.
LORA_PARTS = ("auto", "all", "language_model", "cross_attention", "vision_encoder", "projector")


@dataclass(frozen=True)
class PeftSettings:
    use_peft: bool = field(default=False, metadata=flag_help("Train a LoRA adapter instead of all weights."))
    peft_method: Literal["lora"] = field(default="lora", metadata=flag_help("The adapter kind (LoRA)."))
    from_peft_checkpoint: str = field(default="", metadata=flag_help("Adapter directory to resume training from."))
    lora_r: int = field(default=8, metadata=flag_help("LoRA rank."))
    lora_alpha: int = field(default=32, metadata=flag_help("LoRA scaling numerator (scale = alpha / r)."))
    lora_dropout: float = field(default=0.05, metadata=flag_help("Dropout on the LoRA branch's input."))
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"], metadata=flag_help(
        "Module names to adapt, space- or comma-separated (e.g. q_proj v_proj or q_proj,k_proj), or all-linear: "
        "every linear layer but the output head (peft's meaning: Phi-3's fused qkv_proj and gate_up_proj too; in an "
        "image-and-text model, those of the parts --lora_parts allows). A mixture of experts: its fused expert tensors "
        "by name too "
        "(gate_up_proj, down_proj), and all-linear takes them, not its routers (--lora_router)."))
    lora_router: bool = field(default=False, metadata=flag_help(
        "A mixture of experts: LoRA on its routers too (left frozen by default, as Unsloth does)."))
    lora_parts: list[str] = field(default_factory=lambda: ["auto"], metadata=flag_help(
        "An image-and-text model: the parts LoRA may go on, space- or comma-separated: language_model, "
        "cross_attention (Llama 3.2 Vision's fusion layers, inside the language model), vision_encoder, projector, "
        "or all. auto: every part when the batches hold images (llama-cookbook's LoRA), the language model alone "
        "for text rows, which never run the vision side."))
    freeze_layers: bool = field(default=False, metadata=flag_help(
        "llama-cookbook's flag, without --use_peft: the first --num_freeze_layers decoder layers frozen, the rest "
        "of the model trained."))
    num_freeze_layers: int = field(default=1, metadata=flag_help(
        "With --freeze_layers: how many decoder layers, from the first, are frozen."))
    freeze_LLM_only: bool = field(default=False, metadata=flag_help(
        "llama-cookbook's flag for an image-and-text model, without --use_peft: its language model frozen (the "
        "head too) but for its cross-attention layers (Llama 3.2 Vision's fusion); the vision encoder and projector "
        "train."))

    @property
    def trains_vision_only(self) -> bool:
        """Only an image-and-text model's vision side (or its cross-attention layers, which images alone run)
        trains: --freeze_LLM_only, or --lora_parts without the language model."""
        named = set(self.lora_parts) - {"auto"}
        return self.freeze_LLM_only or (self.use_peft and bool(named) and not {"language_model", "all"} & named)

    def __post_init__(self):
        settle(self, "lora_target_modules", [m for item in self.lora_target_modules for m in item.split(",") if m])
        require(self.lora_r >= 1, "lora_r", f"must be at least 1 (got {self.lora_r})")
        require(self.lora_alpha > 0, "lora_alpha", "must be positive")
        require(0.0 <= self.lora_dropout < 1.0, "lora_dropout", "must be in [0, 1)")
        require(bool(self.lora_target_modules), "lora_target_modules", "name at least one module")
        require(ALL_LINEAR not in self.lora_target_modules or len(self.lora_target_modules) == 1,
                 "lora_target_modules", f"{ALL_LINEAR} already names every linear layer; give it alone")
        require(not self.from_peft_checkpoint or self.use_peft, "from_peft_checkpoint", "needs --use_peft")
        require(not self.lora_router or self.use_peft, "lora_router",
                 "puts LoRA on the routers and needs --use_peft (without it every weight trains, the routers too)")
        settle(self, "lora_parts", [m for item in self.lora_parts for m in item.split(",") if m])
        unknown = [part for part in self.lora_parts if part not in LORA_PARTS]
        require(not unknown, "lora_parts", f"{' '.join(unknown)} is not a part; choose from {', '.join(LORA_PARTS)}")
        require(len(self.lora_parts) == 1 or not {"auto", "all"} & set(self.lora_parts), "lora_parts",
                 "auto and all stand alone; give one of them, or name the parts")
        require(self.lora_parts == ["auto"] or self.use_peft, "lora_parts", "chooses where LoRA goes: needs --use_peft")
        require(self.num_freeze_layers >= 1, "num_freeze_layers", f"must be at least 1 (got {self.num_freeze_layers})")
        require(not (self.freeze_layers and self.use_peft), "freeze_layers",
                 "chooses what a full fine-tune trains; with --use_peft LoRA decides (llama-cookbook ignores it "
                 "there); drop one")
        require(not (self.freeze_layers and self.freeze_LLM_only), "freeze_layers",
                 "conflicts with --freeze_LLM_only (each chooses what trains); drop one")
        require(not (self.freeze_LLM_only and self.use_peft), "freeze_LLM_only",
                 "chooses what a full fine-tune trains; with --use_peft LoRA decides (llama-cookbook ignores it "
                 "there); drop one")
