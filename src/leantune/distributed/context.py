"""Which process this is, and the few collectives the trainer needs, the same code for one process or many.

The trainer never asks whether it is distributed: it sums through a ``DistContext``, which for a
single process (``SINGLE_PROCESS``) returns its input untouched, and logs through a function that
is silent on every rank but 0. Whether the model is sharded is a separate fact (``sharded``): with
``--enable_fsdp`` one process is a one-rank FSDP2 run, with a process group of its own.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from dataclasses import dataclass

import torch


class RanksDiverged(RuntimeError):
    """The ranks reached a collective asking for different things: a bug to stop at, never an aid's failure
    to pass over."""


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sharded: bool = False  # FSDP2 shards the model over these ranks (one rank included): a process group exists

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one process: collectives have others to wait for."""
        return self.world_size > 1

    def sum(self, value: float, device: torch.device) -> float:
        """``value`` summed over all ranks (a float64 all-reduce; the value itself for one process)."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        total = torch.tensor(float(value), dtype=torch.float64, device=device)
        dist.all_reduce(total)
        return float(total)

    def sum_all(self, values: list[float], device: torch.device) -> list[float]:
        """Each of ``values`` summed over all ranks, in one all-reduce."""
        if not self.distributed:
            return list(values)
        import torch.distributed as dist

        totals = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        return totals.tolist()

    def min_max(self, value: float, device: torch.device) -> tuple[float, float]:
        """The smallest and largest ``value`` over all ranks."""
        if not self.distributed:
            return value, value
        import torch.distributed as dist

        both = torch.tensor([-float(value), float(value)], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return -float(both[0]), float(both[1])

    def gather_object(self, obj) -> list:
        """Every rank's ``obj`` in rank order, on rank 0 (an empty list elsewhere; ``[obj]`` for one process)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        gathered = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered or []

    def from_main(self, compute, what: str = ""):
        """``compute()`` run on rank 0 alone, its result given to every rank; its error too, raised on
        every rank, so none waits for a result that will not come (``compute()`` itself for one process).

        A collective: every rank calls it at the same point. ``what`` names the result; a rank that
        asked for another than rank 0 computed is stopped with both names, rather than handed the
        wrong result.
        """
        if not self.distributed:
            return compute()
        import torch.distributed as dist

        outcome = [None]
        if self.is_main:
            try:
                outcome = [(what, True, compute())]
                pickle.dumps(outcome)  # what cannot be sent is an error to send
            except Exception as err:
                outcome = [(what, False, _picklable(err))]
        dist.broadcast_object_list(outcome, src=0)
        sent, succeeded, value = outcome[0]
        if sent != what:
            raise RanksDiverged(f"rank {self.rank} asked for {what!r} where rank 0 computed {sent!r}: the ranks "
                                "took different paths at start-up")
        if not succeeded:
            raise value
        return value

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def logger(self, log):
        """``log`` on rank 0, a function that drops its message elsewhere."""
        return log if self.is_main else (lambda *_args, **_kwargs: None)


SINGLE_PROCESS = DistContext()


def _picklable(err: Exception) -> Exception:
    """``err`` if it survives pickling (to be sent to the other ranks), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_type: str, sharded: bool = False, cpu_offload: bool = False) -> DistContext:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on the CPU); one process: nothing to join,
    unless the model is to be sharded (``--enable_fsdp``), which needs a group even of one.

    With CPU offload the gradients that clipping reduces live in host memory, which NCCL cannot
    reach: gloo serves the CPU tensors beside NCCL. A group of one needs no rendezvous: an
    in-memory store serves it, so ``python -m`` works as well as ``torchrun --nproc_per_node 1``.
    """
    world = launched_world_size()
    if world <= 1 and not sharded:
        return SINGLE_PROCESS
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "gloo" if device_type != "cuda" else ("cuda:nccl,cpu:gloo" if cpu_offload else "nccl")
        if world > 1:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), sharded=sharded)


def close_distributed(context: DistContext) -> None:
    """Leave the process group; the barrier first (measured: without it 12-25% of gloo runs abort at exit)."""
    if context.distributed or context.sharded:
        import torch.distributed as dist

        if dist.is_initialized():
            context.barrier()
            dist.destroy_process_group()


def tell_the_launcher(message: str) -> None:
    """Under torchrun, ``message`` as this worker's failure in torchrun's own report.

    torchrun ends a failed run with its report (and its own traceback, which a worker cannot
    stop); the report's root cause is the worker's error file (``TORCHELASTIC_ERROR_FILE``),
    else a link to torch's docs. Written here, the report ends with leantune's one line.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": message,
                          "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as file:
            json.dump(record, file)
    except OSError:  # the report then shows torch's link: nothing of the run is lost
        pass
