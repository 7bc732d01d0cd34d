"""A 4-bit base loaded shard-first under FSDP2: each rank reads and quantizes only its own rows of every
weight, so no rank, on the host or the device, ever holds the whole model.

The model arrives as a skeleton (``models.skeleton``): LoRA's weights and the buffers real, the base's
weights stand-ins. ``ShardFirstLoad.keep`` takes what is real and puts the stand-ins on meta;
``fully_shard`` then shards meta tensors; ``fill`` gives the shards memory where they train and fills
each from its source: what was kept (LoRA, the same values a whole load makes), the checkpoint's rows
(embeddings, norms, the LM head) or the rows quantized here (``models.quantized_slices``), whose
blocks' scales every rank then joins into the weight's whole quantization state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from leantune.distributed.context import DistContext
from leantune.distributed.fsdp import attach_quantization_state, materialize
from leantune.models.checkpoint_slices import CheckpointSlices
from leantune.models.quantized import quantized_layers
from leantune.models.quantized_slices import covering_elements, owned_blocks, quant_state, quantize_bytes
from leantune.models.skeleton import is_stand_in, stand_ins_to_meta
from leantune.model_structure import unwrap_model


@dataclass(frozen=True)
class FourBitFormat:
    """How a 4-bit layer's weight is quantized, read from its stand-in before it goes to meta."""

    shape: tuple[int, int]  # (out, in), unpacked
    blocksize: int
    quant_type: str
    nested: bool


@dataclass
class ShardFirstLoad:
    """One shard-first load: ``keep`` before ``fully_shard``, ``fill`` after it."""

    checkpoint: CheckpointSlices
    weight_dtype: torch.dtype  # what the checkpoint's values are cast to before quantizing, as a whole load does
    kept: dict = field(default_factory=dict)
    formats: dict = field(default_factory=dict)
    whole_bytes: int = 0  # the checkpoint's bytes of the tensors filled: what a whole load reads

    def read_note(self, rank: int) -> str:
        """What this rank read of the checkpoint, against what a whole load reads (after ``fill``)."""
        return (f"rank {rank} read {self.checkpoint.bytes_read / 2**20:,.2f} MiB of the checkpoint's "
                f"{self.whole_bytes / 2**20:,.2f} MiB")

    def keep(self, loss_model: torch.nn.Module) -> None:
        """Hold the skeleton's real tensors (LoRA, buffers) by name and each 4-bit weight's format, then put
        the stand-ins on meta."""
        named = [*loss_model.named_parameters(), *loss_model.named_buffers()]
        # the tensors themselves: to_empty gives the module new ones, so these are not written over
        self.kept = {name: tensor.detach() for name, tensor in named
                     if tensor.device.type != "meta" and not is_stand_in(tensor)}
        for name, layer in _quantized_weight_names(loss_model).items():
            weight = layer.weight
            self.formats[name] = FourBitFormat((layer.out_features, layer.in_features), weight.blocksize,
                                               weight.quant_type, weight.compress_statistics)
        stand_ins_to_meta(loss_model)

    @torch.no_grad()
    def fill(self, loss_model: torch.nn.Module, context: DistContext, device: torch.device,
             cpu_offload: bool = False) -> None:
        """Give every shard memory where FSDP2 keeps it (``device``, or the host with ``cpu_offload``) and its
        values (a collective: every rank calls it)."""
        materialize(loss_model, device, cpu_offload)
        try:
            self._fill(loss_model, context, device)
        finally:
            self.checkpoint.close()

    def _fill(self, loss_model: torch.nn.Module, context: DistContext, device: torch.device) -> None:
        from torch.distributed.tensor import DTensor

        keys = checkpoint_keys(loss_model)
        layers = _quantized_weight_names(loss_model)
        for name, param in loss_model.named_parameters():
            sharded = isinstance(param, DTensor)
            local = param.to_local() if sharded else param
            start, stop = shard_rows(param.shape[0], context.rank, context.world_size) if sharded \
                else (0, param.shape[0])
            if local.shape[0] != stop - start:
                raise RuntimeError(f"{name}: FSDP2's shard has {local.shape[0]} rows where {stop - start} were "
                                   "expected; this torch shards otherwise than leantune's shard-first load reads")
            if name in self.kept:
                local.copy_(self.kept.pop(name)[start:stop])
            elif name not in keys:
                raise RuntimeError(f"{name}: neither kept from the skeleton nor a base weight the checkpoint holds; "
                                   "leantune's shard-first load cannot fill it (drop --enable_fsdp to load it whole)")
            else:
                begin, end = self.checkpoint.entry(keys[name])["data_offsets"]
                self.whole_bytes += end - begin
                if name in self.formats:
                    state = self._quantized(local, keys[name], self.formats[name], param.shape[0], context, device)
                    attach_quantization_state(layers[name], state, device)
                else:
                    local.copy_(self.checkpoint.rows(keys[name], start, stop))
        for name, buffer in loss_model.named_buffers():
            buffer.copy_(self.kept.pop(name))

    def _quantized(self, local: torch.Tensor, key: str, form: FourBitFormat, packed_rows: int,
                   context: DistContext, device: torch.device):
        """Fill ``local`` (this rank's packed bytes) from its blocks of checkpoint tensor ``key``; the weight's
        whole quantization state, from every rank's scales (a collective)."""
        numel = form.shape[0] * form.shape[1]
        start, stop = shard_rows(packed_rows, context.rank, context.world_size)
        first, last = covering_elements(start, stop, numel, form.blocksize)
        values = self.checkpoint.elements(key, first, last).to(self.weight_dtype)
        packed, scales = quantize_bytes(values, element_start=first, byte_start=start, byte_stop=stop, numel=numel,
                                        blocksize=form.blocksize, quant_type=form.quant_type)
        local.copy_(packed)
        absmax = _joined_scales(scales, numel, packed_rows, form.blocksize, context, device)
        return quant_state(absmax, form.shape, self.weight_dtype, form.blocksize, form.quant_type, form.nested)


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a first dimension of ``rows`` that FSDP2 gives ``rank`` of ``world`` (as
    ``torch.chunk`` cuts it: ceil(rows / world) each, the last ranks shorter or empty)."""
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def scale_counts(numel: int, packed_rows: int, blocksize: int, world: int) -> list[int]:
    """How many blocks' scales each rank keeps of a 4-bit weight of ``numel`` values (``packed_rows`` bytes)."""
    counts = []
    for rank in range(world):
        first, last = owned_blocks(*shard_rows(packed_rows, rank, world), numel, blocksize)
        counts.append(last - first)
    return counts


def join_padded(parts: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """The ranks' scales, each sent padded to the largest count, cut to their counts and joined in rank order."""
    return torch.cat([part[:count] for part, count in zip(parts, counts)])


def _joined_scales(scales: torch.Tensor, numel: int, packed_rows: int, blocksize: int, context: DistContext,
                   device: torch.device) -> torch.Tensor:
    """Every rank's blocks' scales joined in rank order, on the host: the whole weight's (a collective; the
    ranks' counts differ, so each sends its own padded to the largest, on the device its collectives serve)."""
    if context.world_size == 1:
        return scales
    import torch.distributed as dist

    counts = scale_counts(numel, packed_rows, blocksize, context.world_size)
    padded = torch.zeros(max(counts), dtype=torch.float32, device=device)
    padded[:scales.numel()] = scales.to(device)
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded)
    return join_padded(gathered, counts).cpu()


def _quantized_weight_names(loss_model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Each 4-bit layer of ``loss_model`` by its weight's parameter name."""
    layers = set(quantized_layers(loss_model))
    return {f"{name}.weight": module for name, module in loss_model.named_modules() if module in layers}


def checkpoint_keys(loss_model: torch.nn.Module) -> dict[str, str]:
    """Each of ``loss_model``'s parameter names (LoRA's aside) with the checkpoint's name for it: the Hugging
    Face model's own name, without peft's ``base_layer``."""
    hf_model = unwrap_model(loss_model.model)
    prefix = next(name for name, module in loss_model.named_modules() if module is hf_model)
    prefix = f"{prefix}." if prefix else ""
    keys = {}
    for name, _ in loss_model.named_parameters():
        if name.startswith(prefix) and ".lora_" not in name:
            keys[name] = name.removeprefix(prefix).replace(".base_layer.", ".")
    return keys
