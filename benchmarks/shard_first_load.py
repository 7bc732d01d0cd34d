"""Host memory of each rank while a 4-bit base loads under FSDP2: read shard-first against loaded whole.

    python benchmarks/shard_first_load.py --json docs/results/shard_first_load.json

The same Llama-shaped model (hidden 1024, 12 layers, MLP 4096: 206M parameters, 784 MiB in float32)
is saved twice: as safetensors, which each rank reads shard-first (its own rows, quantized as they
are read), and as a ``pytorch_model.bin`` pickle, which cannot be read in slices, so each rank loads
the whole base, quantizes it and then keeps its shard (what every run did before shard-first, from
safetensors too, and what one that cannot read slices still does). Each rank also says how many of
the checkpoint's bytes it read. Each run builds the trainer on 2 (then 4) gloo
ranks; as the sharding line is logged (loaded and sharded, before the start-up checks that run the
model), each rank reports its process's peak resident memory so far (``VmHWM``) and what it holds
(``VmRSS``). A process that imports leantune and builds nothing is measured as the baseline, and the
same run on leantune's built-in tiny model (4M parameters) as the run's own cost without a model to
speak of.

Runtime on 2 cores: about three minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=8)
FLAGS = ["--use_peft", "--quantization", "4bit", "--enable_fsdp", "--context_length", "128",
         "--num_workers_dataloader", "0", "--save_model", "false"]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(folder: str, flags: list[str]) -> None:
    """One rank: the trainer built as a run builds it, its memory read as the sharding line is logged (loading
    and sharding done; the start-up checks that run the model come after)."""
    import contextlib

    from leantune.builders.sharding import start_distributed
    from leantune.flags import parse_run_config
    from leantune.distributed.context import close_distributed
    from leantune.finetuning import build_trainer

    seen: dict = {}

    def log(line: str) -> None:
        if line.startswith("model: "):
            seen["model_line"] = line
        if line.startswith("fsdp: FSDP2"):
            seen.update(peak_kib=_status_kib("VmHWM"), held_kib=_status_kib("VmRSS"), shard_first="shard-first" in line,
                        read=line.split("shard-first: ", 1)[1].split(")", 1)[0] if "shard-first: " in line else "")

    with tempfile.TemporaryDirectory() as output:
        cfg = parse_run_config([*flags, "--output_dir", output])
        dist = start_distributed(cfg.distributed, cfg.model)
        try:
            with contextlib.ExitStack() as stack:
                build_trainer(cfg, stack, log, dist).close()
        finally:
            close_distributed(dist)
    (Path(folder) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))


def baseline_kib() -> int:
    """Peak resident memory of a process that imports what a rank imports and builds nothing."""
    code = ("import leantune.finetuning, bitsandbytes, peft; "
            "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def measure(model_dir: Path, ranks: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="leantune-shard-first-") as folder:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(ranks),
                   __file__, "--worker", folder, "--model_name", str(model_dir), *FLAGS]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        if result.returncode != 0:
            raise RuntimeError(f"the {ranks}-rank load failed:\n{result.stderr[-3000:]}")
        return [json.loads((Path(folder) / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def save_models(folder: Path) -> tuple[Path, Path, int]:
    """The model as safetensors and as a pickle; its float32 bytes."""
    import torch
    from safetensors.torch import load_file

    from leantune.models.tiny import make_tiny_model

    tensors_dir = make_tiny_model(folder / "safetensors", seed=0, **SHAPE)
    pickled = folder / "pickle"
    shutil.copytree(tensors_dir, pickled)
    state = load_file(pickled / "model.safetensors")
    torch.save(state, pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    return tensors_dir, pickled, sum(t.numel() * 4 for t in state.values())


def run_all() -> dict:
    from leantune.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as folder:
        tensors_dir, pickled, float_bytes = save_models(Path(folder))
        tiny = make_tiny_model(Path(folder) / "tiny", seed=0)
        cases = [("tiny model", tiny, 2)] + [(how, model_dir, ranks) for ranks in (2, 4)
                                             for how, model_dir in (("shard-first", tensors_dir), ("whole", pickled))]
        rows = []
        for how, model_dir, ranks in cases:
            each = measure(model_dir, ranks)
            assert all(rank["shard_first"] == (how != "whole") for rank in each), each
            rows.append({"load": how, "ranks": ranks, "peak_mib_per_rank": [r["peak_kib"] / 1024 for r in each],
                         "held_mib_per_rank": [r["held_kib"] / 1024 for r in each], "read": [r["read"] for r in each],
                         "parameters": _parameters(each[0]["model_line"])})
    return {"model": SHAPE, "float32_mib": float_bytes / 2**20, "baseline_peak_mib": baseline_kib() / 1024,
            "rows": rows}


def _parameters(model_line: str) -> str:
    """The parameter count a run's model line gives (``model: NAME (205.81M parameters, ...``)."""
    return model_line.split(" (", 1)[1].split(" parameters", 1)[0]


def print_table(result: dict) -> None:
    print(f"model: {result['float32_mib']:.0f} MiB in float32; a process that builds nothing peaks at "
          f"{result['baseline_peak_mib']:.0f} MiB")
    print(f"{'load':12} {'ranks':>5} {'peak MiB (each rank)':>30} {'held after sharding MiB':>30}")
    for row in result["rows"]:
        peaks = ", ".join(f"{v:.0f}" for v in row["peak_mib_per_rank"])
        held = ", ".join(f"{v:.0f}" for v in row["held_mib_per_rank"])
        print(f"{row['load']:12} {row['ranks']:>5} {peaks:>30} {held:>30}")
        for note in filter(None, row["read"]):
            print(f"{'':18} {note}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:  # one rank, started by torchrun
        worker(argv[1], argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    result = run_all()
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
