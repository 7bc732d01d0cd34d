"""Host memory of `leantune merge`: a model of SmolLM2-135M's shape saved in several shards, with a LoRA adapter.

    python benchmarks/merge_memory.py --json docs/results/merge_memory.json

Builds the model locally (random weights, bfloat16, LlamaConfig with SmolLM2-135M's shape: hidden 576,
30 layers, a 49,152-token vocabulary, tied embeddings), saves it in shards of at most 100 MB, and a
rank-16 adapter on every linear layer (B drawn, as a trained one). The merge runs in a process of
its own, which reports its resident memory just before merging (the interpreter, torch and
transformers: the baseline) and its peak (``VmHWM``) after. The target: the
peak under the baseline plus 1.5 x (the largest shard + the adapter). peft's ``merge_and_unload``,
for comparison, loads the whole model first.

Runtime on 2 cores: about a minute.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)
SHARD = "100MB"
TARGET = 1.5
MEASURE = """
import json, resource, sys
from pathlib import Path
from leantune.use.merge import merge_run
import transformers  # imported by the merge's tokenizer step: part of the baseline
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = rss()
merge_run(Path(sys.argv[1]), Path(sys.argv[2]), base=sys.argv[3], log=lambda _line: None)
# VmHWM, this process's own high-water mark: ru_maxrss would keep the parent's size from before the exec
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"baseline_bytes": before, "peak_bytes": peak}))
"""


def build(folder: Path) -> tuple[Path, Path]:
    """The sharded base and the run directory with its adapter."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from leantune.models.tiny import build_tokenizer

    torch.manual_seed(0)
    base, run = folder / "base", folder / "run"
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(base, max_shard_size=SHARD)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(base)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0))
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.01)
    peft.save_pretrained(run)
    tokenizer.save_pretrained(run)
    return base, run


def measure(run: Path, out: Path, base: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", MEASURE, str(run), str(out), str(base)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise SystemExit(f"merge failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="leantune-merge-") as folder:
        base, run = build(Path(folder))
        shards = sorted(base.glob("*.safetensors"))
        largest, adapter = max(p.stat().st_size for p in shards), (run / "adapter_model.safetensors").stat().st_size
        measured = measure(run, Path(folder) / "merged", base)
    used = measured["peak_bytes"] - measured["baseline_bytes"]
    limit = measured["baseline_bytes"] + TARGET * (largest + adapter)
    record = {"shape": SHAPE, "shards": len(shards), "largest_shard_bytes": largest, "adapter_bytes": adapter,
              **measured, "merge_bytes_above_baseline": used, "limit_bytes": int(limit),
              "meets_target": measured["peak_bytes"] <= limit}
    mib = 2**20
    print(f"{len(shards)} shards, largest {largest / mib:.1f} MiB; adapter {adapter / mib:.1f} MiB")
    print(f"baseline {measured['baseline_bytes'] / mib:.1f} MiB, "
          f"peak {measured['peak_bytes'] / mib:.1f} MiB: the merge "
          f"added {used / mib:.1f} MiB; limit {limit / mib:.1f} MiB "
          f"({'met' if record['meets_target'] else 'MISSED'})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
