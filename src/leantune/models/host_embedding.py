"""``--offload_embedding``: the frozen input embedding kept in host memory, its rows gathered there.

A LoRA run never trains the input embedding, yet a GPU holds all of it: vocabulary x hidden in
16 bits, 1.08 GiB for gpt-oss (201,088 x 2,880), 1.93 GiB for Llama 4 Scout (202,048 x 5,120).
A step reads only its batch's rows. Here the embedding module stays on the host: each batch's token
ids go to the host (a few KiB), the module's own forward gathers their rows there (so a class that
scales its embeddings still does), and the rows, batch x seq x hidden, are copied to the device.
One copy each way per forward (the ids' is a wait on a GPU, once a forward); nothing flows back into
a frozen embedding. transformers' ``model.device`` reads the first parameter, often the embedding's:
it then says the host, which leantune's training never reads.

Refused where the rows would be wrong or a weight would train: tied embeddings (the LM head reads the
same tensor on the device), a trainable embedding (full fine-tuning), FSDP (each rank shards it).
"""

from __future__ import annotations

import functools

import torch

from leantune.config import ConfigError
from leantune.memory.tracker import ON_HOST

HOST = torch.device("cpu")


def offload_embedding(model: torch.nn.Module) -> None:
    """Keep ``model``'s input embedding on the host, its output copied to where the rest of the model is."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is not None and head.weight is embedding.weight:
        raise ConfigError("--offload_embedding: this model ties its input embedding to its LM head, which needs the "
                          "weight on the device; drop --offload_embedding")
    if any(p.requires_grad for p in embedding.parameters()):
        raise ConfigError("--offload_embedding: the input embedding trains in this run; the flag keeps a frozen "
                          "embedding (LoRA) on the host")
    device = next(p.device for p in model.parameters() if not _is_embedding_weight(p, embedding))
    if any(p.device != HOST for p in embedding.parameters()):  # the planner's fake weights are on the host already
        embedding.to(HOST)
    for param in embedding.parameters():
        setattr(param, ON_HOST, True)  # not the device's bytes (the planner's fake trace has them on the host too)
    embedding.register_forward_pre_hook(ids_to_host, with_kwargs=True)
    embedding.register_forward_hook(functools.partial(rows_to, device))


def ids_to_host(_module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The embedding's forward pre-hook: its token ids (positional or ``input=``) to the host. A wait on a GPU: the
    ids are read where they are (a few KiB), once a forward."""
    if args:
        return (args[0].to(HOST), *args[1:]), kwargs
    return args, {**kwargs, "input": kwargs["input"].to(HOST)}


def rows_to(device: torch.device, _module, _args, rows: torch.Tensor) -> torch.Tensor:
    """The embedding's forward hook: the gathered rows to ``device``, where the rest of the model is."""
    return rows.to(device, non_blocking=True)


def describe_host_embedding(model: torch.nn.Module) -> str:
    """The start-up line on the embedding ``offload_embedding`` keeps on the host."""
    kept = [p for p in model.get_input_embeddings().parameters() if getattr(p, ON_HOST, False)]
    held = sum(p.numel() * p.element_size() for p in kept)
    return (f"embedding: kept in host memory (--offload_embedding; {held / 2**20:,.1f} MiB not on the device): each "
            "batch's rows are gathered there and copied over")


def _is_embedding_weight(param: torch.Tensor, embedding: torch.nn.Module) -> bool:
    return any(param is own for own in embedding.parameters())
