"""The ``leantune`` console script: ``leantune finetune ...`` and ``leantune make-tiny-model DIR``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from leantune.finetuning import main as finetune_main
from leantune.models.tiny import TINY_SHAPE, make_tiny_model
from leantune.planning.cli import main as plan_main
from leantune.report.plots import ReportError, load_run, write_report

COMMANDS = {
    "finetune": "fine-tune a model (the same flags as python -m leantune.finetuning)",
    "plan": "predict a run's peak memory per checkpointing mode, without allocating it (same flags as finetune)",
    "make-tiny-model": "build the tiny local Llama and its tokenizer in DIR (no download)",
    "report": "plot and summarise runs: leantune report OUTPUT_DIR [OUTPUT_DIR ...] [--out DIR]",
}


def _report(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="leantune report", description=COMMANDS["report"])
    parser.add_argument("runs", nargs="+", help="output directories of runs (with metrics.json)")
    parser.add_argument("--out", help="where report.png and report.md go (default: the run's directory, or the "
                                      "current one for several runs)")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(path) for path in args.runs]
        out = Path(args.out) if args.out else (Path(args.runs[0]) if len(runs) == 1 else Path("."))
        png, md = write_report(runs, out, "report" if len(runs) == 1 else "comparison")
    except ReportError as err:
        print(f"leantune: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {png} and {md}")
    return 0


def _make_tiny_model(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="leantune make-tiny-model", description=COMMANDS["make-tiny-model"])
    parser.add_argument("dir", help="output directory (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    for name, default in TINY_SHAPE.items():
        parser.add_argument(f"--{name}", type=int, default=default, help=f"LlamaConfig.{name}")
    args = parser.parse_args(argv)
    shape = {name: getattr(args, name) for name in TINY_SHAPE}
    try:
        path = make_tiny_model(args.dir, seed=args.seed, **shape)
    except (FileExistsError, ValueError) as err:
        print(f"leantune: error: {err}", file=sys.stderr)
        return 2
    print(f"saved a tiny Llama ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}) and its "
          f"tokenizer to {path}; use it with --model_name {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: leantune COMMAND [flags]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:<16} {text}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "finetune":
        return finetune_main(rest)
    if command == "plan":
        return plan_main(rest)
    if command == "make-tiny-model":
        return _make_tiny_model(rest)
    if command == "report":
        return _report(rest)
    print(f"leantune: error: unknown command {command!r}; commands are {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
