"""Fine-tune the tiny local Llama with and without activation checkpointing and compare.

    python examples/single_gpu_activation_checkpointing.py            # CPU or the first GPU
    python examples/single_gpu_activation_checkpointing.py --use_peft # LoRA instead of full fine-tuning

For each setting it runs a short fine-tune through the same code as ``leantune finetune`` and
prints: activation memory after one forward (live tensor bytes, counted exactly by
``ActivationMeter`` on the CPU, whatever device trains), the peak during forward+backward, the
median step time (the first, warm-up, step left out) and the final loss. The measured step is the
trainer's own (``build_model`` and ``forward_backward``, the meter read in its ``after_forward`` hook).
Losses are the same with and without checkpointing: it changes memory and time, not the maths.
Both runs use the plain loss (``--loss_chunk_size 0``) so that only checkpointing differs; by
default leantune chunks the loss, with or without checkpointing (docs/activation_checkpointing_modes.md).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from leantune.flags import parse_run_config
from leantune.builders.model import build_model, loss_function
from leantune.finetuning import run
from leantune.memory.meter import ActivationMeter
from leantune.model_structure import unwrap_model
from leantune.precision import choose_precision
from leantune.training.step import forward_backward


def measure_activations(cfg, batch: int, seq: int) -> tuple[int, int]:
    """(bytes alive after the forward, peak bytes over forward+backward) for one batch.

    The model, LoRA, checkpointing and loss are built by leantune from ``cfg``, on the CPU (the
    meter counts tensors, so the bytes are those of any device), and the step is the trainer's.
    """
    precision = choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu"))
    model, _ = build_model(cfg, precision, log=lambda _line: None)
    lm_head = unwrap_model(model).get_output_embeddings()
    loss_fn = loss_function(model, cfg.training.loss_chunk_size, sharded=False)
    ids = torch.randint(3, lm_head.weight.shape[0], (batch, seq))
    meter = ActivationMeter.for_model(model)
    after_forward = []
    with meter:
        forward_backward(model, lm_head, ids, ids, loss_fn, precision,
                         after_forward=lambda: after_forward.append(meter.live_bytes()))
    return after_forward[0], meter.peak_bytes


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--use_peft", action="store_true", help="LoRA instead of full fine-tuning")
    parser.add_argument("--steps", type=int, default=30, help="training batches per run")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--context_length", type=int, default=512)
    args = parser.parse_args(argv)

    rows = []
    for checkpointing in (False, True):
        with tempfile.TemporaryDirectory() as out:
            argv = ["--batch_size_training", str(args.batch_size), "--context_length", str(args.context_length),
                    "--max_train_step", str(args.steps), "--num_epochs", "1", "--lr", "1e-3",
                    "--num_workers_dataloader", "0", "--run_validation", "false", "--save_model", "false",
                    "--loss_chunk_size", "0", "--output_dir", out]
            argv += ["--use_peft"] if args.use_peft else []
            argv += ["--enable_activation_checkpointing"] if checkpointing else []
            cfg = parse_run_config(argv)
            results = run(cfg, log=lambda _line: None)
            after_forward, peak = measure_activations(cfg, args.batch_size, args.context_length)
        rows.append((checkpointing, after_forward, peak, results))

    kind = "LoRA" if args.use_peft else "full fine-tuning"
    print(f"\ntiny Llama, {kind}, batch {args.batch_size} x {args.context_length} tokens, {args.steps} steps")
    print(f"{'checkpointing':<14}{'activations':>13}{'peak':>11}{'step time':>11}{'final loss':>12}")
    base_step = rows[0][3]["median_step_time_s"]
    for checkpointing, after_forward, peak, results in rows:
        step = results["median_step_time_s"]
        print(f"{'on' if checkpointing else 'off':<14}{after_forward / 2**20:>9.1f} MiB{peak / 2**20:>7.1f} MiB"
              f"{step:>9.3f} s{results['last_loss']:>12.4f}")
    (_, act_off, peak_off, _), (_, act_on, peak_on, res_on) = rows
    print(f"checkpointing: activations x{act_on / act_off:.2f}, peak x{peak_on / peak_off:.2f}, "
          f"step time x{res_on['median_step_time_s'] / base_step:.2f}")
    print(f"same final loss with and without: {rows[0][3]['last_loss'] == res_on['last_loss']}")
    return rows


if __name__ == "__main__":
    main()
