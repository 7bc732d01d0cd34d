"""``--compile``: ``torch.compile`` on each decoder layer, its activation checkpointing inside the graph.

Each layer gets ``nn.Module.compile``, which compiles the layer's own call in place: no wrapper
module, so parameter names, saved states, PEFT and FSDP2 see the model they saw before. Hugging
Face (transformers 5.25, as tested) checkpoints a layer's ``forward`` inside that call, so the compiled graph
holds the checkpoint too (older releases checkpointed around ``__call__``, outside what
``nn.Module.compile`` compiles: the recompute would run eagerly around an opaque compiled layer,
so such a layer is refused with checkpointing on, ``check_checkpoint_inside``): full and every-N
recompute inside it, and selective_ops' policy is traced (its
decisions read the op alone, ``leantune.checkpointing.selective``). The layers share their code,
so one graph serves every layer alike (a checkpointed and an uncheckpointed layer, or training
and validation, make one each).

Two settings keep a compiled run equal to an eager one:

* ``fallback_random``: inductor would draw dropout masks with its own generator, so LoRA dropout
  would differ from eager's (and from a resumed run's); with it the masks are torch's own.
* ``skip_fwd_side_effects_in_bwd_under_checkpoint``: transformers' output-capturing hooks read a
  context variable inside each layer (to collect attentions or hidden states on request), which
  dynamo counts as a side effect it cannot replay in the recompute and refuses to trace the
  checkpoint at all (the layer would run eagerly). Training never requests those outputs.

The first step compiles (tens of seconds on a CPU); ``compile_line`` says how long it took.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from leantune.config import ConfigError
from leantune.model_structure import decoder_layers


def _compiler(device_type: str) -> tuple[str, str, list[str]]:
    """What torch.compile needs on ``device_type``: inductor builds C++ kernels on the CPU, and on a GPU
    Triton builds each kernel's launcher with a C compiler (the language, its variable, its usual names)."""
    if device_type == "cpu":
        return "C++", "CXX", ["g++", "c++", "clang++"]
    return "C", "CC", ["gcc", "cc", "clang"]


def compiler_found(device_type: str) -> bool:
    _, variable, names = _compiler(device_type)
    return any(shutil.which(name) for name in [os.environ.get(variable, ""), *names] if name)


def check_can_compile(device_type: str, flag: str = "--compile", instead: str = "drop --compile") -> None:
    """Refuse early, with the fix, what would otherwise fail in the middle of the first step."""
    if not compiler_found(device_type):
        needed, variable, names = _compiler(device_type)
        raise ConfigError(f"{flag}: torch.compile on the {device_type.upper()} builds {needed} code, and no "
                          f"{needed} compiler was found ({', '.join(names)} or ${variable}). "
                          f"Install one (e.g. apt install g++) or {instead}")


def compile_decoder_layers(model: torch.nn.Module) -> str:
    """Compile each decoder layer of ``model`` in place; returns the line that says so."""
    import torch._dynamo.config

    # dynamo reads this while it traces, so it cannot be scoped to these layers: it stays on in the process
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # torch >= 2.9
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    layers = decoder_layers(model)
    check_checkpoint_inside(layers)
    for layer in layers:
        layer.compile(options={"fallback_random": True})  # inductor's setting for these graphs only
    compiled = sum(layer._compiled_call_impl is not None for layer in layers)  # counted, not assumed
    return (f"compile: torch.compile on each of the {compiled} decoder layers (checkpointing inside the graph); "
            "they compile during the first step")


def check_checkpoint_inside(layers: list[torch.nn.Module]) -> None:
    """Refuse checkpointed layers whose class checkpoints around its own ``__call__``: ``nn.Module.compile``
    compiles what ``Module.__call__`` runs, so that checkpoint would stay outside the compiled graph."""
    import transformers

    outside = sorted({type(layer).__name__ for layer in layers if getattr(layer, "gradient_checkpointing", False)
                      and type(layer).__call__ is not torch.nn.Module.__call__})
    if outside:
        raise ConfigError(f"--compile with activation checkpointing: {', '.join(outside)} (transformers "
                          f"{transformers.__version__}) checkpoints around its __call__, outside what torch.compile "
                          "compiles, so the recompute would run eagerly around the compiled layer. Upgrade "
                          "transformers to a release whose layers checkpoint their forward (5.25 does), or drop "
                          "--compile or --enable_activation_checkpointing")


def compile_line(step: int, step_s: float, metrics: Optional[dict] = None, counters: Optional[dict] = None) -> str:
    """What compiling cost, after this process's first step (``step``: its number, after a resumed state's).

    ``metrics`` and ``counters`` default to torch's own, which count everything this process compiled.
    """
    if metrics is None or counters is None:
        from torch._dynamo import utils

        metrics, counters = utils.compilation_time_metrics, utils.counters
    spent = _compile_seconds(metrics)
    graphs = counters["stats"].get("unique_graphs", 0)
    line = f"compile: step {step} took {step_s:.1f} s"
    line += f", {spent:.1f} s of it compiling {graphs} graph(s)" if spent is not None else f" ({graphs} graph(s))"
    breaks = sum(counters["graph_break"].values())
    if breaks:
        reason = next(iter(counters["graph_break"]))
        line += (f"; {breaks} graph break(s), where the layers run eagerly: e.g. {reason.splitlines()[0]} "
                 "(TORCH_LOGS=graph_breaks shows each)")
    return line


def _compile_seconds(metrics: dict) -> Optional[float]:
    """Dynamo's and the lazily compiled backward's time, as torch records them (None: not recorded)."""
    forward = metrics.get("_compile.compile_inner")
    if not forward:
        return None
    return sum(forward) + sum(metrics.get("compile_fx.<locals>.bw_compiler", ()))
