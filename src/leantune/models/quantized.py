"""A quantized frozen base (``--quantization 4bit|8bit``): bitsandbytes' Linear layers, made the way
transformers makes them, from loaded weights, random ones or the planner's fake ones.

A run loads its base through ``from_pretrained(quantization_config=...)``, as any QLoRA user does.
The planner and the measurements build the same layers with transformers' own quantizer
(``quantize_linear_layers``: the same layers converted, the LM head and embeddings left as they
are) and bitsandbytes' own ``quantize_4bit``, on fake tensors where it plans: the packed weights
and their quantization state are what bitsandbytes makes, not a formula.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from leantune.config import ConfigError, QuantizationConfig
from leantune.memory.tracker import carried_tensors
from leantune.model_structure import (cross_attention_layers, decoder_of, is_image_text, model_class,
                                       outside_the_language_model)
from leantune.optional import import_bitsandbytes, installed
from leantune.precision import Precision


def bitsandbytes_installed() -> bool:
    return installed("bitsandbytes")


def require_bitsandbytes(flag: str, alternative: str) -> None:
    """Refuse ``flag`` clearly where bitsandbytes is not installed, naming the fix and ``alternative``."""
    if not bitsandbytes_installed():
        raise ConfigError(f"{flag}: needs bitsandbytes (pip install 'leantune[lowbit]', or pip install "
                          f"bitsandbytes); {alternative}")


def compute_dtype(quant: QuantizationConfig, precision: Precision) -> torch.dtype:
    """The dtype a 4-bit layer dequantizes its weight to for each matmul (``--compute_dtype``).

    auto: the autocast dtype, else the weights' (float32 on the CPU). bitsandbytes' matmul has no
    autocast rule: it runs in whatever dtype its layer casts to, so a compute dtype other than the
    step's would run the base's matmuls apart from the rest of it (float32: slower; float16: without
    the loss scaling the rest of the step would need). Such a choice is refused, naming the fix.
    """
    run_dtype = precision.compute_dtype or precision.weight_dtype
    if quant.compute_dtype == "auto":
        return run_dtype
    dtype, device = getattr(torch, quant.compute_dtype), precision.device.type
    flag = f"--compute_dtype {quant.compute_dtype}"
    if dtype is torch.float16 and device != "cuda":
        raise ConfigError(f"{flag}: needs a CUDA GPU, and this run is on {device}; use --compute_dtype auto "
                          "(float32) or bfloat16")
    if precision.compute_dtype is not None and dtype is not precision.compute_dtype:
        autocast = str(precision.compute_dtype).removeprefix("torch.")
        raise ConfigError(f"{flag}: this run computes in {autocast} (autocast), and bitsandbytes' matmul would run "
                          f"apart from it in {quant.compute_dtype}; use --compute_dtype auto or {autocast}")
    if device == "cuda" and precision.compute_dtype is None and dtype is not torch.float32:
        raise ConfigError(f"{flag}: this GPU run computes in float32 (--mixed_precision off, or no bfloat16 on this "
                          "GPU); use --compute_dtype auto, or --use_fp16 for float16 with loss scaling")
    return dtype


def bnb_config(quant: QuantizationConfig, compute: torch.dtype, kept: Sequence[str] = ()):
    """transformers' ``BitsAndBytesConfig`` for ``quant``, dequantizing to ``compute`` (4bit); ``kept``: modules
    left unquantized (transformers' own choice, the LM head, when empty)."""
    from transformers import BitsAndBytesConfig

    skip = {"llm_int8_skip_modules": list(kept)} if kept else {}
    if quant.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant.quant_type,
                              bnb_4bit_compute_dtype=compute, bnb_4bit_use_double_quant=quant.use_double_quant,
                              bnb_4bit_quant_storage=getattr(torch, quant.quant_storage), **skip)


def run_bnb_config(quant: QuantizationConfig, precision: Precision, model_config=None, fusion_trains: bool = False):
    """The ``BitsAndBytesConfig`` a run loads its base (of ``model_config``) with, or None for an unquantized
    base; ``fusion_trains``: ``--freeze_LLM_only``, whose cross-attention layers train and so stay whole."""
    if not quant.enabled:
        return None
    require_bitsandbytes(f"--quantization {quant.quantization}", "or drop --quantization")
    import_bitsandbytes()
    return bnb_config(quant, compute_dtype(quant, precision), kept_unquantized(model_config, fusion_trains))


def kept_unquantized(model_config, fusion_trains: bool = False) -> tuple[str, ...]:
    """What stays in 16 bits beside the LM head: an image-and-text model's vision side (its base's parts beside the
    language model, found on a model built on the meta device), as QLoRA recipes keep it, and with
    ``fusion_trains`` its cross-attention layers; none for a text model."""
    if model_config is None or not is_image_text(model_config):
        return ()
    with torch.device("meta"):
        shape = model_class(model_config).from_config(model_config)
    decoder = decoder_of(shape)
    names = {id(module): name for name, module in shape.named_modules()}
    fusion = [names[id(layer)] for layer in cross_attention_layers(decoder)] if fusion_trains else []
    return (*outside_the_language_model(shape), *fusion, "lm_head")


def quantize_linear_layers(model: torch.nn.Module, model_config, weight_dtype: torch.dtype) -> torch.nn.Module:
    """Swap ``model``'s Linear layers for bitsandbytes' as transformers' quantizer does for ``config``
    (a ``BitsAndBytesConfig``), in place: the same layers, the LM head and tied weights left alone.

    Real weights are quantized where they are; a meta model's quantized weights stay on meta, in
    ``weight_dtype`` (the dtype a run loads them in), for the planner's ``fake_quantized_weight``.
    """
    from transformers.quantizers import AutoHfQuantizer

    originals = {name: (module.weight, module.bias) for name, module in model.named_modules()
                 if type(module) is torch.nn.Linear}
    quantizer = AutoHfQuantizer.from_config(model_config, pre_quantized=False)
    quantizer.preprocess_model(model, device_map={"": "cpu"})
    for name, module in model.named_modules():
        if name in originals and type(module) is not torch.nn.Linear:
            weight, bias = originals[name]
            module.weight = _quantized_like(module.weight, weight, weight_dtype)
            if bias is not None:  # the converted layer's bias is a new, empty one (Qwen2's q, k, v have biases)
                module.bias = bias
    # as after loading: the flags peft reads to wrap these layers in its bitsandbytes LoRA classes
    quantizer.postprocess_model(model)
    return model


def _quantized_like(meta_weight: torch.nn.Parameter, original: torch.Tensor, weight_dtype: torch.dtype):
    """``meta_weight``'s kind of bitsandbytes parameter holding ``original`` (quantized unless on meta)."""
    cls = type(meta_weight)
    settings = {key: value for key, value in vars(meta_weight).items() if key != "SCB"}
    data = original.detach().to(weight_dtype)
    param = cls(data, requires_grad=False, **settings)
    return param if data.device.type == "meta" else param.to(data.device)


def is_quantized_weight(param: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit or 8-bit weight (whether quantized yet or still on meta)."""
    return type(param).__name__ in ("Params4bit", "Int8Params") and type(param).__module__.startswith("bitsandbytes")


def fake_quantized_weight(weight: torch.nn.Parameter, fake, fake_mode) -> torch.nn.Parameter:
    """The fake parameter a meta 4-bit weight becomes: bitsandbytes' own ``quantize_4bit`` run on a fake
    weight of its shape and dtype, so the packed data and every quantization-state tensor (absmax, the
    double quantization's tables) are the ones it makes. ``fake``: meta tensor -> fake tensor.

    A fake tensor cannot become a ``Params4bit``; a plain parameter carrying ``quant_state`` is what
    ``Linear4bit.forward`` and ``matmul_4bit`` read. 8-bit (LLM.int8) is not planned: its outlier
    split depends on the data.
    """
    bnb = import_bitsandbytes()
    if not isinstance(weight, bnb.nn.Params4bit):
        raise ConfigError("--quantization 8bit: the planner cannot trace LLM.int8 (its outlier split depends on "
                          "the data); plan with --quantization 4bit, or pick --activation_checkpointing_mode and "
                          "--batch_size_training yourself")
    _warm_code_books(bnb)
    with fake_mode:
        packed, state = bnb.functional.quantize_4bit(
            fake(torch.empty(weight.shape, dtype=weight.dtype, device="meta")), blocksize=weight.blocksize,
            compress_statistics=weight.compress_statistics, quant_type=weight.quant_type,
            quant_storage=weight.quant_storage)
    param = torch.nn.Parameter(packed, requires_grad=False)
    param.quant_state = state
    return param


@functools.cache
def _warm_code_books(bnb) -> None:
    # quantize_4bit builds its 8-bit code book (double quantization) with .tolist(), which a fake
    # tensor cannot answer; one real call a process caches it, and every later call, fake ones too, reuses it.
    bnb.functional.quantize_4bit(torch.zeros(64, 64), compress_statistics=True)


def quantized_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The bitsandbytes Linear layers of ``model`` (none unless bitsandbytes is loaded)."""
    names = ("Linear4bit", "Linear8bitLt")
    return [m for m in model.modules() if type(m).__name__ in names and type(m).__module__.startswith("bitsandbytes")]


def prepare_quantized_for_training(model: torch.nn.Module) -> None:
    """Keep bitsandbytes' CPU inference path out of training.

    On a CPU with AVX512-BF16, a 4-bit layer run in eval mode without gradients (validation) repacks
    its weight in place for a CPU inference kernel; the next training forward then runs that kernel,
    which has no backward for the input, so the layers below would silently get no gradient.
    """
    for layer in quantized_layers(model):
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            layer.support_avx512bf16_for_cpu = False


def base_weight_bytes(model: torch.nn.Module) -> Optional[dict]:
    """Bytes of the quantized layers' weights (packed data and quantization state) and what the same
    weights take in bfloat16; None for an unquantized model."""
    layers = quantized_layers(model)
    if not layers:
        return None
    storages, sharded = {}, 0  # each storage once: an 8-bit weight's int8 codes are also its ``CB``
    for layer in layers:
        weight = layer.weight
        if hasattr(weight, "to_local"):  # sharded by FSDP2: the whole packed weight's bytes, its state on the layer
            sharded += weight.numel() * weight.element_size()
            tensors = carried_tensors(layer.quant_state)
        else:
            tensors = [weight, *carried_tensors(weight)]
        for tensor in tensors:
            storages[id(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
    bf16 = sum(layer.in_features * layer.out_features * 2 for layer in layers)
    return {"quantized_bytes": sharded + sum(storages.values()), "bf16_bytes": bf16}


def describe_quantization(quant: QuantizationConfig, model: torch.nn.Module) -> str:
    """The run's line about its quantized base: what, how, and its bytes against bfloat16's."""
    layers = quantized_layers(model)
    if quant.quantization == "4bit":
        state = getattr(layers[0].weight, "quant_state", None) or layers[0].quant_state  # on the layer once sharded
        double = ", double quantization" if state.nested else ""
        compute = str(layers[0].compute_dtype).removeprefix("torch.")
        how = f"{state.quant_type} blocks of {state.blocksize}{double}, {compute} compute"
    else:
        how = "LLM.int8"
    held = base_weight_bytes(model)
    kept = outside_the_language_model(model.get_base_model() if hasattr(model, "get_base_model") else model)
    return (f"quantization: {len(layers)} Linear layers in {quant.quantization} ({how}): "
            f"{held['quantized_bytes'] / 2**20:,.1f} MiB, {held['quantized_bytes'] / held['bf16_bytes']:.3f} of "
            f"their bfloat16 bytes; the LM head{', ' + ', '.join(kept) if kept else ''} and embeddings unquantized")
