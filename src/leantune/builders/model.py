"""The model a run trains, and the loss it trains on, made from the config.

``prepare_model`` is the one recipe: LoRA attached, placed, activation checkpointing applied once.
The run calls it on loaded weights, the benchmarks on random ones and the planner on fake ones,
so all three train the same thing.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch

from leantune.builders.loaders import image_batches
from leantune.checkpointing import (CheckpointingReport, apply_activation_checkpointing, inspect_checkpointing,
                                    policy_from_config)
from leantune.config import PeftSettings, RunConfig
from leantune.loss import IDENTITY, ChunkedCrossEntropy, Pieces, PlainCrossEntropy, effective_chunk_size, every_piece
from leantune.models.attention import describe_attention
from leantune.models.experts import use_leantune_experts
from leantune.models.facts import (ModelFacts, logit_transform, meta_model, position_limit, run_model_facts,
                                   text_config)
from leantune.models.host_embedding import describe_host_embedding, offload_embedding
from leantune.models.loading import attach_lora, count_parameters, describe_lora, load_model, load_tokenizer
from leantune.models.moe import RouterLoss, expert_tensor_targets
from leantune.models.quantized import (describe_quantization, prepare_quantized_for_training, quantized_layers,
                                       run_bnb_config)
from leantune.models.quantized_experts import (describe_quantized_experts, expert_shapes_for_peft,
                                               experts_quantized_as_loaded, offload_experts, quantize_experts)
from leantune.models.skeleton import quantized_skeleton
from leantune.models.image_text import (checkpointable_vision_layers, describe_parts, freeze_language_model,
                                        lora_kept_off, trained_in_float32)
from leantune.model_structure import decoder_layers, decoder_of, freeze_first_layers, image_text_base, unwrap_model
from leantune.models.tiled_mlp import mlp_of, tile_mlps, tile_tokens, tiled_tokens
from leantune.precision import Precision


def loss_function(model: torch.nn.Module, loss_chunk_size: Optional[int], *, sharded: bool,
                  pieces: Pieces = every_piece):
    """``model``'s loss: chunked cross-entropy of ``--loss_chunk_size`` tokens (None: sized to the head) unless 0
    asks for the plain loss, either applying what the model's forward does to its logits (read from its config).
    ``sharded``: under FSDP; ``pieces``: how the chunks are walked (every one; the planner passes its sampling)."""
    hf_model = unwrap_model(model)
    head = hf_model.get_output_embeddings().weight
    transform = logit_transform(hf_model.config)
    # A float32 head that trains has its gradient summed chunk by chunk: larger chunks, fewer passes over it.
    # Not under FSDP, whose mixed precision (bf16 on a GPU) gives the forward a bfloat16 copy of the head
    # (its gradient is then made by blocks).
    summed = head.numel() * 4 if (head.requires_grad and head.dtype == torch.float32
                                  and not sharded) else 0
    chunk = effective_chunk_size(loss_chunk_size, head.shape[0], summed)
    return ChunkedCrossEntropy(chunk, transform, pieces) if chunk > 0 else PlainCrossEntropy(transform)


def describe_loss(loss_fn, router_loss: Optional[RouterLoss] = None) -> str:
    transform = getattr(loss_fn, "transform", IDENTITY)
    of_logits = "" if transform.is_identity else f"; {transform.describe()}, as the model's own forward does"
    if isinstance(loss_fn, ChunkedCrossEntropy):
        line = (f"loss: chunked cross-entropy, {loss_fn.chunk_size} tokens per chunk "
                f"(logits of at most one chunk exist at a time, none are kept for backward{of_logits})")
    else:
        line = f"loss: plain cross-entropy (full-vocabulary float32 logits kept for backward{of_logits})"
    if router_loss is not None:
        line += f" + {router_loss.describe()}, as the model's own loss adds it (logged each step)"
    return line


def prepare_model(model: torch.nn.Module, cfg: RunConfig, precision: Precision,
                  place: Optional[Callable[[torch.nn.Module], None]] = None, pieces: Pieces = every_piece
                  ) -> tuple[torch.nn.Module, CheckpointingReport]:
    """Make a Hugging Face causal LM, already in the precision's weight dtype, ready to train as ``cfg`` says.

    LoRA attached (with ``--use_peft``), moved to the precision's device (left on the host under
    ``--enable_fsdp``, whose sharding moves it; or placed by ``place``:
    the planner turns a meta-device model into fake tensors there), activation checkpointing
    applied (the registry's policy for ``cfg``), in train mode; ``pieces``: how a tiled MLP walks its tiles
    (every one; the planner passes its sampling). Returns the model to train (the PEFT wrapper with LoRA) and
    what inspection of its layers finds.
    """
    if cfg.peft.use_peft:
        kept_off = lora_kept_off(model, cfg.peft.lora_parts, image_batches(cfg.data, model.config))
        with expert_shapes_for_peft(model):  # experts quantized as they loaded: peft reads their 3-D shapes
            model = attach_lora(model, cfg.peft, kept_off)
    elif cfg.peft.freeze_LLM_only:
        freeze_language_model(model)
        if cfg.model.model_dtype == "auto":  # a bfloat16 frozen base; what trains keeps float32 weights
            trained_in_float32(model)
    elif cfg.peft.freeze_layers:
        freeze_first_layers(model, cfg.peft.num_freeze_layers)
    if not cfg.distributed.enable_fsdp:  # FSDP2 shards parameters by rows: packed experts would split their blocks
        quantize_experts(model, cfg.quant)  # after LoRA: peft reads the tensors' shapes
    use_leantune_experts(model)  # a mixture of experts: frozen experts get no gradient, LoRA's path apart
    if place is None:
        # a quantized base is loaded where it trains (it cannot move); under FSDP the model stays on
        # the host and fully_shard moves one unit at a time (the whole model may not fit the device)
        if not quantized_layers(model) and not cfg.distributed.enable_fsdp:
            model.to(precision.device)
    else:
        place(model)
    if cfg.memory.offload_embedding:  # after the placement, which would move it back
        offload_embedding(unwrap_model(model))
    offload_experts(model, cfg.memory.offload_experts)
    prepare_quantized_for_training(model)
    hidden = text_config(unwrap_model(model).config).hidden_size
    tokens = tile_tokens(cfg.training.tiled_mlp, cfg.data.context_length, hidden)
    # inside the layers, so every checkpointing mode wraps the layer around it; not yet under image batches (an
    # image-and-text model's text rows are tiled: its vision layers never run on them)
    if tokens and not image_batches(cfg.data, unwrap_model(model).config):
        tile_mlps(model, tokens, pieces)
    if image_text_base(model) is not None:
        checkpointable_vision_layers(model)  # Llama 3.2 Vision's encoder layers, checkpointed as the decoder's
    policy = policy_from_config(cfg.checkpointing)
    # bound to where it trains, not where its weights are now (the host under FSDP, meta on a
    # --low_cpu_fsdp rank, fake tensors in the planner)
    report = (apply_activation_checkpointing(model, policy, precision.device) if policy
              else inspect_checkpointing(model))
    return model.train(), report


def build_model(cfg: RunConfig, precision: Precision, log=print, facts: Optional[ModelFacts] = None,
                on_meta: bool = False, tokenizer=None, timed_next: bool = False, shard_first: bool = False):
    """Tokenizer and model on the precision's device, with LoRA and checkpointing applied as configured.

    ``facts``: the model's, as the run read them (its attention implementation); read here when not
    given. ``on_meta``: build the model from its config on the meta device, no weight read (a rank
    that will receive its shards from rank 0, ``--low_cpu_fsdp``). ``tokenizer``: one already loaded.
    ``shard_first``: a 4-bit base's skeleton, each rank's shards read and quantized as FSDP shards it
    (``distributed.shard_first``); LoRA's weights made as a whole load makes them.
    """
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
    facts = facts if facts is not None else run_model_facts(cfg.model, precision.device.type,
                                                            compiled=cfg.training.compile)
    if on_meta:
        on_meta_device = meta_model(facts.config, precision.weight_dtype, cpu_stand_in=False)  # it will train
        model, report = prepare_model(on_meta_device, cfg, precision, place=lambda _model: None)
    elif shard_first:
        quantized = run_bnb_config(cfg.quant, precision, facts.config, cfg.peft.freeze_LLM_only)
        skeleton = quantized_skeleton(facts.config, precision.weight_dtype, quantized)
        model, report = prepare_model(skeleton, cfg, precision, place=lambda _model: None)
    else:
        # under FSDP a quantized base is quantized in host memory too, and fully_shard moves its shards
        loads_on = torch.device("cpu") if cfg.distributed.enable_fsdp else precision.device
        # one GPU: 4-bit experts quantized as they load (under FSDP they stay in 16 bits)
        experts = (contextlib.nullcontext if cfg.distributed.enable_fsdp
                   else functools.partial(experts_quantized_as_loaded, cfg.quant))
        quantized = run_bnb_config(cfg.quant, precision, facts.config, cfg.peft.freeze_LLM_only)
        loaded = load_model(cfg.model, precision.weight_dtype, facts.attention, quantized, loads_on,
                            model_config=(facts.config if cfg.model.rope_scaling_factor
                                          or cfg.model.output_router_logits else None),
                            experts=experts)
        model, report = prepare_model(loaded, cfg, precision)
    trainable, total = count_parameters(model)
    log(f"model: {cfg.model.model_name} ({total / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable, "
        f"{str(precision.weight_dtype).removeprefix('torch.')} weights, "
        f"{describe_attention(unwrap_model(model).config._attn_implementation)}) "
        f"{_where(cfg.distributed.enable_fsdp, shard_first)}{precision.device}")
    for line in _what_trains(model, cfg.peft):
        log(line)
    experts_line = describe_quantized_experts(model)
    if experts_line is not None:
        log(experts_line)
    elif cfg.quant.quantization == "4bit" and expert_tensor_targets(model):
        log("quantization: the fused expert tensors stay in the weights' dtype under --enable_fsdp (4-bit experts "
            "are not sharded yet); train on one GPU for 4-bit experts")
    if cfg.memory.offload_embedding:
        log(describe_host_embedding(unwrap_model(model)))
    if cfg.quant.enabled and not shard_first:  # a shard-first base is quantized as it is sharded: said then
        log(describe_quantization(cfg.quant, model))
    if not timed_next:  # auto's candidates are timed next: the line that says what is in force comes then
        log(report.summary_line())
    if cfg.model.rope_scaling_factor:
        log(f"positions: {position_limit(facts.config):,}, extended {cfg.model.rope_scaling_factor:g}x by RoPE "
            f"interpolation (--rope_scaling_factor; {facts.config.rope_parameters.get('rope_type')} scaling)")
    tokens = tiled_tokens(model)
    if tokens:
        log(_tiling_line(model, tokens, cfg.training.tiled_mlp))
    return model, tokenizer


def _what_trains(model: torch.nn.Module, peft: PeftSettings) -> list[str]:
    """The start-up lines on what trains: LoRA's places, an image-and-text model's parts, frozen layers."""
    lines = [line for line in (describe_lora(model),) if line is not None]
    if image_text_base(model) is not None:
        lines.append(describe_parts(model))
    if peft.freeze_layers:
        lines.append(f"frozen: the first {peft.num_freeze_layers} of {len(decoder_of(model).layers)} decoder layers "
                     f"(--freeze_layers --num_freeze_layers {peft.num_freeze_layers}); the rest of the model trains")
    return lines


def _tiling_line(model: torch.nn.Module, tokens: int, setting: str) -> str:
    if mlp_of(decoder_layers(model)[0]) is None:  # a mixture of experts: its block runs whole
        return (f"tiled MLP: every decoder layer's norms in tiles of {tokens} tokens (--tiled_mlp {setting}); its "
                "experts block runs whole (its router's logits are collected once a layer)")
    return (f"tiled MLP: every decoder layer's MLP in tiles of {tokens} tokens (--tiled_mlp {setting}): no batch x "
            "context x intermediate tensor; one more MLP forward in backward")


def _where(enable_fsdp: bool, shard_first: bool) -> str:
    if shard_first:
        return "read shard-first (each rank its own rows, quantized as they are read) onto "
    return "on the host until FSDP shards it onto " if enable_fsdp else "on "
