"""Flags and config files → ``RunConfig``.

``transformers.HfArgumentParser`` builds argparse from the config dataclasses. A YAML or JSON file
given with ``--config`` is turned into flags placed *before* the command line's, so the command
line overrides it and both go through the same type checks and error messages.
"""

from __future__ import annotations

import argparse

import difflib
import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Sequence

from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from leantune.config import SECTIONS, ConfigError, QuantizationConfig, RunConfig, TrainingConfig
from leantune.optimizers import ENTRIES as OPTIMIZERS
from leantune.optimizers import optimizer_choices, optimizer_help

# llama-cookbook flags a migrating user may pass that leantune does not implement (yet). Saying so
# beats "unknown flag", and silently accepting them would make a run mean something else.
COOKBOOK_ONLY_FLAGS = {
    "use_fast_kernels": "leantune uses PyTorch SDPA attention by default",
    "one_gpu": "leantune trains on one device unless torchrun starts several processes with --enable_fsdp",
    "use_profiler": "the profiler hook is not supported yet",
    "flop_counter": "leantune counts every step's FLOPs itself: MFU and HFU per step on a GPU it knows, or with "
                    "--peak_tflops T",
    "save_optimizer": "the optimizer is part of the training state saved with --save_steps N",
    "dist_checkpoint_root_folder": "distributed checkpoints are on the roadmap",
    "dist_checkpoint_folder": "distributed checkpoints are on the roadmap",
    # llama-cookbook's fsdp_config fields (also given as --fsdp_config.FIELD)
    "sharding_strategy": "leantune always shards fully (FSDP2, FULL_SHARD's behaviour); drop the flag",
    "hsdp": "hybrid sharding (HSDP) is not supported: --enable_fsdp shards over every process",
    "sharding_group_size": "hybrid sharding (HSDP) is not supported: --enable_fsdp shards over every process",
    "replica_group_size": "hybrid sharding (HSDP) is not supported: --enable_fsdp shards over every process",
    "checkpoint_type": "the training state is saved as full state dicts gathered on rank 0 (--save_steps N)",
    "fsdp_activation_checkpointing": "--enable_activation_checkpointing checkpoints the same way with and "
                                     "without FSDP",
}

# The cookbook's fsdp_config fields leantune has as flags of its own, or refuses above by name.
_FSDP_CONFIG_FIELDS = {"mixed_precision", "use_fp16", "fsdp_cpu_offload", "pure_bf16", "optimizer",
                       "sharding_strategy", "hsdp", "sharding_group_size", "replica_group_size", "checkpoint_type",
                       "fsdp_activation_checkpointing"}


# llama-cookbook also takes a config dataclass's field as --CONFIG.FIELD: --quantization_config.quant_type nf4
# (leantune's --quant_type), --custom_dataset.file F (leantune's --custom_dataset_file), --fsdp_config.pure_bf16.
# CONFIG -> (the prefix of leantune's flag, the fields taken).
COOKBOOK_SECTIONS = {"quantization_config": ("", {f.name for f in fields(QuantizationConfig)}),
                     "custom_dataset": ("custom_dataset_", {"file", "train_split", "test_split"}),
                     "fsdp_config": ("", _FSDP_CONFIG_FIELDS)}


def _without_section_prefix(token: str) -> str:
    """``--quantization_config.quant_type`` -> ``--quant_type``, ``--custom_dataset.file`` ->
    ``--custom_dataset_file`` (the cookbook's spelling of leantune's flag); any other dotted flag is left as
    it is (and is an unknown flag)."""
    section, dot, rest = token.removeprefix("--").partition(".")
    if token.startswith("--") and dot and section in COOKBOOK_SECTIONS:
        prefix, taken = COOKBOOK_SECTIONS[section]
        if rest.partition("=")[0] in taken:
            return f"--{prefix}{rest}"
    return token


class _Parser(HfArgumentParser):
    def error(self, message):  # argparse would print the 40-flag usage and exit
        raise ConfigError(message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default where it means something: not "None" (the help says what unset means), and not on a
    --no_FLAG (its default is the positive flag's)."""

    def _get_help_string(self, action):
        if action.default is None or any(option.startswith("--no_") for option in action.option_strings):
            return action.help or ""
        return super()._get_help_string(action)


def _parsed_sections() -> list[type]:
    """What the parser builds each section's flags from: the section, or the dataclass it makes for the parser
    now (``CheckpointingConfig.parser_section``: the registered checkpointing modes' flags, a test's included)."""
    return [section.parser_section() if hasattr(section, "parser_section") else section for section in SECTIONS]


def build_parser(prog: str = "leantune finetune") -> HfArgumentParser:
    parser = _Parser(_parsed_sections(), prog=prog, allow_abbrev=False, formatter_class=_HelpFormatter,
                     description="Fine-tune a Hugging Face decoder (full fine-tuning, LoRA or QLoRA) with as little "
                                 "accelerator memory as it can: on one GPU or the CPU, or sharded over several GPUs "
                                 "with FSDP2 under torchrun (--enable_fsdp).")
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON file of flag: value pairs; flags override it.")
    optimizer = next(action for action in parser._actions if "--optimizer" in action.option_strings)
    # the registry as it is now, not as it was when the config was imported: an entry registered since is a choice
    optimizer.choices, optimizer.help = optimizer_choices(), optimizer_help()
    for entry in OPTIMIZERS.values():
        if entry.switch:  # a switch of the optimizer's own, e.g. --optimizer_cpu_offload
            parser.add_argument(f"--{entry.switch}", type=string_to_bool, nargs="?", const=True, default=False,
                                metavar="BOOL", help=f"The same as --optimizer {entry.name}.")
    for action in parser._actions:
        negative = next((option for option in action.option_strings if option.startswith("--no_")), None)
        if negative:
            action.help = f"The same as --{negative[5:]} false."
    return parser


def known_flags(parser: HfArgumentParser) -> list[str]:
    return sorted(opt[2:] for action in parser._actions for opt in action.option_strings
                  if opt.startswith("--") and opt != "--help")


def parse_run_config(argv: Sequence[str] | None = None) -> RunConfig:
    """Parse command-line flags (and an optional ``--config`` file) into a ``RunConfig``.

    Raises ``ConfigError`` naming the flag for unknown flags, invalid values and failed checks.
    """
    import sys

    argv = [_without_section_prefix(token) for token in (sys.argv[1:] if argv is None else argv)]
    parser = build_parser()
    config_path, argv = _take_config_flag(argv)
    file_args = _config_file_args(Path(config_path), parser) if config_path else []
    *sections, remaining = parser.parse_args_into_dataclasses(
        args=file_args + argv, return_remaining_strings=True, look_for_args_file=False)
    if remaining:
        raise ConfigError(_unknown_flags_message(remaining, parser))
    sections, extras = sections[:len(SECTIONS)], sections[len(SECTIONS):]
    sections = [parsed if isinstance(parsed, section) else section(**vars(parsed))  # a section's parser dataclass
                for section, parsed in zip(SECTIONS, sections)]
    sections = [_with_optimizer_switches(s, *extras) if isinstance(s, TrainingConfig) else s for s in sections]
    return RunConfig(*sections)


def _with_optimizer_switches(training: TrainingConfig, extras: argparse.Namespace | None = None) -> TrainingConfig:
    """An optimizer's own switch given: ``--optimizer`` becomes its entry (from AdamW, the default, only)."""
    switched = [entry for entry in OPTIMIZERS.values() if entry.switch and getattr(extras, entry.switch, False)]
    for entry, before in zip(switched, [training.optimizer] + [e.name for e in switched]):
        if before not in ("adamw", entry.name):
            raise ConfigError(f"--{entry.switch}: not with --optimizer {before} (it is --optimizer {entry.name}); "
                              "drop one")
    return replace(training, optimizer=switched[-1].name) if switched else training


def _take_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    rest, path = [], None
    it = iter(argv)
    for token in it:
        if token == "--config":
            path = next(it, None)
            if path is None:
                raise ConfigError("--config: expected a file path")
        elif token.startswith("--config="):
            path = token.split("=", 1)[1]
        else:
            rest.append(token)
    return path, rest


def _config_file_args(path: Path, parser: HfArgumentParser) -> list[str]:
    if not path.is_file():
        raise ConfigError(f"--config: file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as err:  # yaml and json raise different types; both mean "not parseable"
        raise ConfigError(f"--config: cannot parse {path}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of flag names to values")
    valid = known_flags(parser)
    args: list[str] = []
    for key, value in data.items():
        key = _without_section_prefix(f"--{key}")[2:]
        if key not in valid:
            raise ConfigError(f"--config: {path}: {_describe_unknown(str(key), valid)}")
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        args += [f"--{key}", *(str(v).lower() if isinstance(v, bool) else str(v) for v in values)]
    return args


def _unknown_flags_message(remaining: list[str], parser: HfArgumentParser) -> str:
    valid = known_flags(parser)
    flags = [tok for tok in remaining if tok.startswith("-")]
    if not flags:
        return f"unexpected argument(s) {remaining}: leantune takes only --flag value pairs"
    return "; ".join(_describe_unknown(tok.lstrip("-").split("=", 1)[0], valid) for tok in flags)


def _describe_unknown(name: str, valid: list[str]) -> str:
    if name in COOKBOOK_ONLY_FLAGS:
        return f"--{name} is a llama-cookbook flag leantune does not support: {COOKBOOK_ONLY_FLAGS[name]}"
    # A truncated flag (--batch_size for --batch_size_training) is the commonest slip; prefer a flag
    # that starts with what was typed over the closest spelling.
    close = sorted((f for f in valid if f.startswith(name)), key=len)[:1]
    close = close or difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f"; did you mean --{close[0]}?" if close else "; see --help for the flags"
    return f"unknown flag --{name}{hint}"
