"""The ``leantune`` console script: ``leantune COMMAND [flags]``.

Each command lives in its own module with a ``main(argv)``, loaded when the command is run (by
name, from ``COMMANDS``): ``leantune --help`` and ``leantune report`` answer without importing
torch and transformers, which take seconds. This dispatcher imports no leantune module itself.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple, Sequence


class Command(NamedTuple):
    module: str  # defines main(argv) -> exit code
    summary: str


COMMANDS = {
    "finetune": Command("leantune.finetuning",
                        "fine-tune a model (the same flags as python -m leantune.finetuning)"),
    "plan": Command("leantune.planning.plan_command", "predict a run's peak memory per checkpointing mode, without "
                                             "allocating it (same flags as finetune)"),
    "make-tiny-model": Command("leantune.models.tiny_command",
                               "build the tiny local Llama and its tokenizer in DIR (no download)"),
    "merge": Command("leantune.use.merge", "fold a LoRA run's adapter into its base: leantune merge RUN_DIR OUT_DIR "
                                           "[--model_name BASE] [--dtype D]"),
    "generate": Command("leantune.use.generate", "try a model, a merged model or a LoRA run: leantune generate "
                                                 "--model_name DIR [--prompt TEXT | --chat]"),
    "report": Command("leantune.report.report_command",
                      "plot and summarise runs: leantune report OUTPUT_DIR [OUTPUT_DIR ...] [--out DIR]"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: leantune COMMAND [flags]\n\ncommands:")
        for name, command in COMMANDS.items():
            print(f"  {name:<16} {command.summary}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"leantune: error: unknown command {name!r}; commands are {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[name].module).main(rest)


if __name__ == "__main__":
    sys.exit(main())
