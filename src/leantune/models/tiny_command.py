"""``leantune make-tiny-model DIR``: a tiny local model (a Llama, or --family) and its tokenizer, written with
``save_pretrained``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from leantune.models.tiny import FAMILIES, MOE_FAMILIES, TINY_SHAPE, make_tiny_model


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="leantune make-tiny-model",
                                     description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("dir", help="output directory (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument("--family", choices=[*FAMILIES, *MOE_FAMILIES], default="llama",
                        help="the decoder family, dense or a mixture of experts (default llama)")
    for name, default in TINY_SHAPE.items():
        parser.add_argument(f"--{name}", type=int, default=default, help=f"the config's {name}")
    args = parser.parse_args(argv)
    shape = {name: getattr(args, name) for name in TINY_SHAPE}
    try:
        path = make_tiny_model(args.dir, seed=args.seed, family=args.family, **shape)
    except (FileExistsError, ValueError) as err:
        print(f"leantune: error: {err}", file=sys.stderr)
        return 2
    print(f"saved a tiny {args.family} ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}) and its "
          f"tokenizer to {path}; use it with --model_name {path}")
    return 0
