"""Loading the model and tokenizer (local directory or hub id) and attaching LoRA."""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import re
import socket
import urllib.parse
import warnings
from pathlib import Path
from typing import Optional

import torch

from leantune.config import ALL_LINEAR, DEFAULT_MODEL_NAME, ModelConfig, PeftSettings
from leantune.models.moe import LoraTargets, expert_tensor_targets, is_router, moe_lora_targets, router_targets
from leantune.models.quantized import bitsandbytes_installed
from leantune.model_structure import model_class
from leantune.models.tiny import TINY_CHAT_TEMPLATE, ensure_default_model
from leantune.optional import import_bitsandbytes


class ModelLoadError(RuntimeError):
    """The model or tokenizer cannot be loaded; the message names what and suggests a fix."""


def resolve_model_path(name: str, flag: str = "--model_name") -> str:
    """The directory or hub id to load: builds the default tiny model on first use.

    A name that looks like a filesystem path (absolute, ``./``, ``../``, ``~``) must exist: trying it
    on the hub would only hide the typo behind a network error.
    """
    if name == DEFAULT_MODEL_NAME:
        return str(ensure_default_model())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: pass a directory written by save_pretrained")
        return str(path)
    if path.exists():
        raise ModelLoadError(f"--model_name {name} is a file; pass the model's directory")
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        raise ModelLoadError(f"model directory not found: {name} (check --model_name)")
    check_hub_id(name, flag)
    return name  # a hub id such as meta-llama/Llama-3.2-1B


def check_hub_id(name: str, flag: str = "--model_name") -> None:
    """A hub id is handed to transformers only when its files are in the local cache or the hub answers: with
    neither, transformers would retry for half a minute and then fail in its own words. One line instead."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return  # cached: transformers reads it offline as well
    except ValueError:  # not a valid repo id: transformers' own message says so
        return
    unreachable = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _hub_unreachable(constants.ENDPOINT)
    if not unreachable:
        return
    near = difflib.get_close_matches(name, [DEFAULT_MODEL_NAME], n=1, cutoff=0.8) if "/" not in name else []
    if near:
        raise ModelLoadError(f"{flag} {name}: no such directory, and not in the local Hugging Face cache; "
                             f"did you mean {near[0]} (leantune's built-in tiny model)?")
    raise ModelLoadError(f"{flag} {name}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
                         f"hub cannot be asked ({unreachable}): download it where there is network "
                         f"(huggingface-cli download {name}) and pass its directory, or point HF_HOME at a cache "
                         "that holds it")


@functools.lru_cache(maxsize=4)
def _hub_unreachable(endpoint: str, timeout: float = 3.0) -> Optional[str]:
    """Why the hub cannot be reached (None when it answers, or when a proxy stands between: not probed).
    Asked once a process (the config, the tokenizer and the weights each resolve the name)."""
    url = urllib.parse.urlparse(endpoint)
    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy") if url.scheme == "https" else \
        ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    if any(os.environ.get(name) for name in proxies):
        return None
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
    except OSError as err:
        return f"{url.hostname} did not answer: {err.strerror or type(err).__name__}"
    return None


def load_tokenizer(mc: ModelConfig):
    from transformers import AutoTokenizer

    source = resolve_model_path(mc.tokenizer_name or mc.model_name,
                                "--tokenizer_name" if mc.tokenizer_name else "--model_name")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load the tokenizer from {source!r}: {err}") from None
    if mc.model_name == DEFAULT_MODEL_NAME and not tokenizer.chat_template:  # built before it had one
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return with_pad_token(tokenizer)


def with_pad_token(tokenizer):
    """``tokenizer`` with a pad token: EOS when it has none. Llama tokenizers ship without one; padded positions
    are masked out of the loss, so reusing EOS for them changes nothing that is learned."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(mc: ModelConfig, dtype: torch.dtype, attention: str, quantized=None,
               device: Optional[torch.device] = None, model_config=None, experts=contextlib.nullcontext):
    """The model's weights in ``dtype``, built with the ``attention`` implementation (resolved from
    ``--attn_implementation`` by ``models.facts.run_model_facts``).

    ``quantized``: a ``BitsAndBytesConfig``; its Linear layers are then quantized as they load, onto
    ``device`` (where a quantized model must be loaded: bitsandbytes quantizes on the way there).
    ``config``: the model's config as the run changed it (``--rope_scaling_factor``), else its own.
    ``experts``: a context the load runs in (``experts_quantized_as_loaded``: 4-bit experts as they load).
    """
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    source = resolve_model_path(mc.model_name)
    hf_logging.disable_progress_bar()  # leantune prints one line about the model instead
    placement = {} if quantized is None else {"quantization_config": quantized, "device_map": {"": str(device)}}
    if model_config is not None:
        placement["config"] = model_config
    try:
        auto_class = model_class(model_config if model_config is not None else AutoConfig.from_pretrained(source))
        with experts():
            model = auto_class.from_pretrained(source, dtype=dtype, attn_implementation=attention, **placement)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"cannot load a causal LM from {source!r}: {err}. Pass a local directory saved with "
            "save_pretrained, or a hub id with network access.") from None
    model.config.use_cache = False  # training never reads a KV cache; building one wastes memory
    return model


def attach_lora(model, peft: PeftSettings, kept_off: tuple[list[str], str] = ([], "")):
    """Wrap ``model`` with a LoRA adapter: a new one, or the one in ``--from_peft_checkpoint``. ``kept_off``: the
    modules LoRA may not go in and the parts it may, said (an image-and-text model's, ``lora_kept_off``)."""
    if bitsandbytes_installed():  # peft imports it: first here, without its warning about a hub kernel
        import_bitsandbytes()
    from peft import PeftModel

    with warnings.catch_warnings():
        # peft still calls transformers' deprecated `is_gradient_checkpointing`; the warning is
        # about peft's code, not the user's, and is fixed by upgrading peft.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if peft.from_peft_checkpoint:
            path = Path(peft.from_peft_checkpoint)
            if not (path / "adapter_config.json").is_file():
                raise ModelLoadError(f"--from_peft_checkpoint {path}: no adapter_config.json there")
            return PeftModel.from_pretrained(model, str(path), is_trainable=True)
        return _new_lora(model, peft, kept_off)


def _new_lora(model, peft: PeftSettings, kept_off: tuple[list[str], str]):
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, peft)
    modules = ALL_LINEAR if targets.modules == (ALL_LINEAR,) else list(targets.modules)
    off, model._leantune_lora_parts = kept_off  # the log's line reads where LoRA may go
    lora = LoraConfig(r=peft.lora_r, lora_alpha=peft.lora_alpha, lora_dropout=peft.lora_dropout, target_modules=modules,
                      target_parameters=list(targets.parameters) or None, bias="none", task_type="CAUSAL_LM",
                      exclude_modules=rf"^({'|'.join(map(re.escape, off))})(\..*)?$" if off else None)
    return get_peft_model(model, lora)


def lora_targets(model: torch.nn.Module, peft: PeftSettings) -> LoraTargets:
    """What ``--lora_target_modules`` wraps in ``model`` (also one on the meta device), checked: every name is one
    of its linear layers or (a mixture of experts) its fused expert tensors; ``ModelLoadError`` naming them if not."""
    all_linear = peft.lora_target_modules == [ALL_LINEAR]
    linear = linear_layer_names(model)
    experts, found_routers = expert_tensor_targets(model), router_targets(model)
    routers = set(found_routers[0]) | {p.split(".")[0] for p in found_routers[1]}
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()} | set(experts)
    if experts:  # a mixture of experts: its experts module itself (or an MLP block) is no target
        names = set(linear) | set(experts) | routers
    missing = [] if all_linear else [m for m in peft.lora_target_modules if m not in names]
    if missing:
        choices = ' '.join([*(n for n in linear if n not in routers), *experts])
        where = "is no linear layer or expert tensor of" if experts else "not found in"
        raise ModelLoadError(f"--lora_target_modules: {' '.join(missing)} {where} {type(model).__name__}; its "
                             f"linear layers{' and expert tensors' if experts else ''} are {choices}. Name some of "
                             f"them, e.g. --lora_target_modules {' '.join(linear[:2])}, or --lora_target_modules "
                             f"{ALL_LINEAR}")
    named_routers = [m for m in peft.lora_target_modules if m in routers]
    if named_routers:
        raise ModelLoadError(f"--lora_target_modules: {' '.join(named_routers)} is the router of "
                             f"{type(model).__name__}'s experts; LoRA on the routers comes with --lora_router")
    if peft.lora_router and not routers:
        raise ModelLoadError(f"--lora_router: {type(model).__name__} has no router (not a mixture of experts); "
                             "drop the flag")
    if peft.lora_router and any(type(m).__name__ == "Llama4Router" for m in model.modules()):
        raise ModelLoadError(f"--lora_router: {type(model).__name__}'s router returns its scores with its logits, "
                             "which peft's LoRA on a linear layer cannot wrap; drop the flag (its routers stay frozen)")
    targets = moe_lora_targets(peft.lora_target_modules, linear, experts, found_routers, all_linear, peft.lora_router)
    if targets is None:
        return LoraTargets((ALL_LINEAR,) if all_linear else tuple(peft.lora_target_modules))
    if targets.parameters and peft.lora_dropout:
        raise ModelLoadError(f"--lora_dropout {peft.lora_dropout:g} with LoRA on {', '.join(targets.parameters)}: "
                             "peft's LoRA on a fused expert tensor adds B·A to the weight, so it has no input of its "
                             "own to drop; pass --lora_dropout 0, or target the linear layers alone")
    return targets


def describe_lora(model: torch.nn.Module) -> Optional[str]:
    """The run log's line on what the adapter wraps (None without one): modules, parameters and trainable count."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return None
    modules = config.target_modules
    modules = modules if isinstance(modules, str) else ", ".join(sorted(modules or ()))
    parameters = sorted(config.target_parameters or ())  # peft keeps them as a set
    wrapped = sum(1 for name, _ in model.named_modules() if name.endswith(".lora_A"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    routers = [name for name, module in model.named_modules() if is_router(module)]
    line = (f"lora: r {config.r}, alpha {config.lora_alpha:g}, dropout {config.lora_dropout:g} on modules "
            f"{modules or '-'}")
    if parameters:
        line += f" and parameters {', '.join(parameters)} (each expert its own low-rank pair)"
    line += f": {wrapped} places, {trainable:,} trainable parameters"
    allowed = getattr(model.get_base_model(), "_leantune_lora_parts", "")
    if allowed:  # an image-and-text model: the parts it may go on
        line += f"; on the {allowed}"
    if routers:  # a wrapped router sits as its LoRA layer's base_layer
        wrapped_router = any(name.endswith(".base_layer") for name in routers)
        line += f"; routers {'with LoRA (--lora_router)' if wrapped_router else 'frozen (--lora_router trains them)'}"
    return line


def check_lora_targets(model: torch.nn.Module, peft: PeftSettings) -> None:
    """Every ``--lora_target_modules`` name is a module or expert tensor of ``model`` (``lora_targets``)."""
    lora_targets(model, peft)


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The names LoRA can target: every linear layer's last name part but the output head's, sorted."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head})


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(_weights_in(p) for p in model.parameters())


def _weights_in(param: torch.Tensor) -> int:
    """The weights a parameter holds: a packed 4-bit one holds two a byte (its ``quant_state`` knows the shape)."""
    state = getattr(param, "quant_state", None)
    if state is not None:
        return state.shape.numel()
    if type(param).__name__ == "Params4bit" and param.dtype == torch.uint8:  # packed, its state made as it shards
        return param.numel() * 2
    return param.numel()
