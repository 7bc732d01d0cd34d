"""``leantune report OUTPUT_DIR [OUTPUT_DIR ...] [--out DIR]``: plot and summarise finished runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from leantune.report.plots import ReportError, load_run, write_report


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="leantune report", description=__doc__.splitlines()[0].replace("``", ""))
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
