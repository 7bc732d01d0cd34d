"""Every decoder family leantune is tested on: its head's transform, attention, LoRA targets and loss check.

    python benchmarks/model_families.py                   # prints a table, writes docs/results/model_families.json

For each family of ``leantune.models.tiny.FAMILIES`` a tiny model is built locally with
``save_pretrained`` at each family's own default head fields (Gemma 2's soft-cap of 30, Cohere's
logit scale of 0.0625, ...; Granite's default ``logits_scaling`` is 1, so it is set to 4 here),
and read back as a run reads it. The table shows the attention ``auto`` takes, the transform
leantune applies to the logits, whether the default LoRA targets (q_proj, v_proj) exist and the
linear layers there are, and the self-check (``leantune.builders.own_loss``): leantune's loss
against the model's own ``forward(labels=...)``, the class built on the meta device with a
stand-in decoder and a small head, relative differences of the loss and of the gradients, and
its time. Then the same check on the configs of the public Llama 3 shapes (presets, no download):
its cost grows with the layers the meta device builds (16 to 80). Nothing here is timed against a
target; the tests (``tests/test_families.py``, ``tests/test_model_checks.py``) assert the equalities.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from leantune.builders.own_loss import check_own_loss
from leantune.flags import parse_run_config
from leantune.models.facts import plan_model_facts, run_model_facts
from leantune.models.loading import ModelLoadError, linear_layer_names
from leantune.models.tiny import FAMILIES, make_tiny_model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FIELDS = {"granite": dict(logits_scaling=4.0)}
PRESETS = ("Llama-3.2-1B", "Llama-3.1-8B", "Llama-3.1-70B")


def family_row(family: str, root: Path) -> dict:
    path = make_tiny_model(root / family, family=family, **SHAPE, **FIELDS.get(family, {}))
    cfg = parse_run_config(["--model_name", str(path)])
    facts = run_model_facts(cfg.model)
    try:
        facts.check_lora_targets(["q_proj", "v_proj"])
        default_targets = "yes"
    except ModelLoadError:
        default_targets = "no"
    linear = linear_layer_names(facts.shape)
    check = check_own_loss(cfg.training, facts, sharded=False)
    return dict(family=family, architecture=check.architecture, attention=facts.attention,
                transform=check.transform.describe(), default_lora_targets=default_targets, linear_layers=linear,
                loss_difference=check.loss_difference, gradient_difference=check.gradient_difference,
                check_seconds=round(check.seconds, 3))


def preset_row(name: str) -> dict:
    cfg = parse_run_config(["--model_name", name])
    started = time.perf_counter()
    check = check_own_loss(cfg.training, plan_model_facts(cfg.model, "cpu"), sharded=False)
    return dict(preset=name, loss_difference=check.loss_difference, gradient_difference=check.gradient_difference,
                check_seconds=round(check.seconds, 3), with_reading_seconds=round(time.perf_counter() - started, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="docs/results/model_families.json", help="where to write the results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        families = [family_row(family, Path(root)) for family in FAMILIES]
    presets = [preset_row(name) for name in PRESETS]
    print(f"{'family':8} {'architecture':20} {'attention':9} {'q/v':3} {'loss':>7} {'grads':>7} {'s':>5}  transform")
    for r in families:
        print(f"{r['family']:8} {r['architecture']:20} {r['attention']:9} {r['default_lora_targets']:3} "
              f"{r['loss_difference']:7.0e} {r['gradient_difference']:7.0e} {r['check_seconds']:5.2f}  "
              f"{r['transform']}")
    for r in presets:
        print(f"{r['preset']:29} check {r['check_seconds']:.2f} s "
              f"(with reading the shape {r['with_reading_seconds']:.2f} s), "
              f"loss {r['loss_difference']:.0e}, gradients {r['gradient_difference']:.0e}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(families=families, presets=presets), indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
