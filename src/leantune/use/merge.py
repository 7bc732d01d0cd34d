"""``leantune merge RUN_DIR OUT_DIR [--model_name BASE] [--dtype bfloat16|float16|float32]``.

Folds the LoRA adapter a run saved into its base and writes a Hugging Face model directory: the
base's safetensors shards (same names, same index), its config and generation config, and the
run's tokenizer (with its chat template). One tensor at a time (``models.merging``), so host memory
stays near the adapter plus the largest weight; an adapter with LoRA on a mixture of experts'
fused expert tensors is folded by peft's ``merge_and_unload`` into the whole base model instead
(``merge_whole_model``). The directory appears whole or not at all: it is written beside
``OUT_DIR`` under a hidden name and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

from leantune.models.merging import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, DTYPE_CHOICES, INDEX, RUN_FACTS, MergeRefused,
                                     base_shards, check_pairs_fit, load_adapter, merge_shards, merge_whole_model,
                                     read_adapter_config)


PROCESSOR_CONFIG = "processor_config.json"  # what a processor's save_pretrained writes beside its tokenizer


def merge_run(run_dir: Path, out_dir: Path, base: Optional[str] = None, dtype: Optional[str] = None,
              log: Callable[[str], None] = print) -> Path:
    """Merge ``run_dir``'s adapter into ``base`` (the adapter's own base by default), writing ``out_dir``."""
    _check_run_dir(run_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise MergeRefused(f"{out_dir} exists and is not empty; choose a new directory for the merged model")
    config = read_adapter_config(run_dir)
    base_dir = resolve_base(base or config.get("base_model_name_or_path"), run_dir)
    facts = json.loads((run_dir / RUN_FACTS).read_text()) if (run_dir / RUN_FACTS).is_file() else {}
    base_config = json.loads((base_dir / "config.json").read_text())
    if base_config.get("quantization_config"):
        raise MergeRefused(f"{base_dir} is a quantized checkpoint; merge onto the unquantized base, given with "
                           "--model_name")
    if facts.get("model_type") and facts["model_type"] != base_config.get("model_type"):
        raise MergeRefused(f"the adapter was trained on a {facts['model_type']} model, {base_dir} is a "
                           f"{base_config.get('model_type')}; give its base with --model_name")
    # LoRA on fused expert tensors, or an image-and-text model (its stored names are not its own): merged whole
    whole = bool(config.get("target_parameters")) or bool(base_config.get("vision_config"))
    if not whole:
        lora = load_adapter(run_dir)[1]
        shards = base_shards(base_dir)
        check_pairs_fit(lora, base_dir, shards, str(base_dir))
    if facts.get("quantization") == "4bit":
        log(f"the adapter was trained on a 4-bit ({facts.get('quant_type', 'nf4')}) base: merged onto the "
            f"unquantized weights of {base_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.merging-", dir=out_dir.parent))
    try:
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 would keep the model from other users once renamed
        if whole:
            merged = merge_whole_model(base_dir, run_dir, staging, base_config, DTYPE_CHOICES.get(dtype), log)
            _write_tokenizer(base_dir, run_dir, staging)
        else:
            weight_map, total = merge_shards(base_dir, staging, shards, lora, DTYPE_CHOICES.get(dtype), log)
            _write_companions(base_dir, run_dir, staging, base_config, dtype)
            if (base_dir / INDEX).is_file():  # a base in several shards has one, and one shard may
                _write_index(base_dir, staging, weight_map, total)
            merged = f"{len(lora.pairs)} LoRA pairs"
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    loads_with = "AutoModelForImageTextToText" if base_config.get("vision_config") else "AutoModelForCausalLM"
    log(f"merged {merged} into {base_dir}'s weights; wrote {out_dir} (loads with {loads_with}.from_pretrained; try "
        f"it: leantune generate --model_name {out_dir})")
    return out_dir


def _check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise MergeRefused(f"{run_dir}: no such directory; give the --output_dir of a LoRA run")
    if not (run_dir / ADAPTER_WEIGHTS).is_file() or not (run_dir / ADAPTER_CONFIG).is_file():
        what = ("it holds a whole model (a full fine-tune): nothing to merge, use it as it is"
                if any(run_dir.glob("model*.safetensors")) else "give the --output_dir of a LoRA run")
        raise MergeRefused(f"{run_dir} has no {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}; {what}")


def resolve_base(name: Optional[str], run_dir: Path) -> Path:
    """The base's local directory: a path as it is, a hub name through the local cache (downloaded if missing)."""
    if not name:
        raise MergeRefused(f"{run_dir / ADAPTER_CONFIG} names no base model; give it with --model_name")
    if Path(name).is_dir():
        return Path(name)
    if name.startswith((".", "/", "~")) or name.count("/") != 1 or Path(name.split("/")[0]).is_dir():
        raise MergeRefused(f"base model {name!r}: no such directory (a relative path is read from where you run "
                           "this, which may not be where training ran); give it with --model_name")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.safetensors", "*.json"]))
    except Exception as err:  # not found, no network: one line
        raise MergeRefused(f"base model {name!r}: not a directory, and the hub could not give it ({type(err).__name__}"
                           "); give a local directory with --model_name") from None


def _write_index(base_dir: Path, out: Path, weight_map: dict, total: int) -> None:
    """The base's index with the merged tensors' bytes (its other metadata kept)."""
    metadata = json.loads((base_dir / INDEX).read_text()).get("metadata", {})
    (out / INDEX).write_text(json.dumps({"metadata": {**metadata, "total_size": total}, "weight_map": weight_map},
                                        indent=2))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_companions(base_dir: Path, run_dir: Path, out: Path, base_config: dict, dtype: Optional[str]) -> None:
    """The config (with the dtype written), the generation config and the tokenizer (``_write_tokenizer``)."""
    config = dict(base_config)
    if dtype is not None:  # transformers 5 reads "dtype"; older configs spell it "torch_dtype"
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (base_dir / "generation_config.json").is_file():
        shutil.copyfile(base_dir / "generation_config.json", out / "generation_config.json")
    _write_tokenizer(base_dir, run_dir, out)


def _write_tokenizer(base_dir: Path, run_dir: Path, out: Path) -> None:
    """The run's tokenizer where it saved one (its tokenizer_config.json, which save_pretrained writes with every
    tokenizer), otherwise the base's; an image-and-text model's processor with it (the run's, else the base's)."""
    from transformers import AutoProcessor, AutoTokenizer

    has_tokenizer = (run_dir / "tokenizer_config.json").is_file()
    AutoTokenizer.from_pretrained(run_dir if has_tokenizer else base_dir).save_pretrained(out)
    for source in (run_dir, base_dir):
        if (source / PROCESSOR_CONFIG).is_file():
            AutoProcessor.from_pretrained(source).save_pretrained(out)
            return


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="leantune merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a LoRA run's --output_dir (adapter_model.safetensors)")
    parser.add_argument("out_dir", type=Path, help="where the merged model goes (new or empty)")
    parser.add_argument("--model_name", help="the base model (a directory or a hub name); default: the adapter's own")
    parser.add_argument("--dtype", choices=sorted(DTYPE_CHOICES), help="the merged weights' dtype; default: the base's")
    args = parser.parse_args(argv)
    try:
        merge_run(args.run_dir, args.out_dir, args.model_name, args.dtype)
    except (MergeRefused, OSError) as err:
        print(f"leantune: error: {err}", file=sys.stderr)
        return 2
    return 0
