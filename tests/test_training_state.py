"""The training-state directory's bookkeeping: crash repair, abandoned states, out-of-memory recognition."""

from __future__ import annotations

import torch

from leantune.memory.oom import is_out_of_memory
from leantune.planning.oom_advice import memory_fixes
from leantune.flags import parse_run_config
from leantune.training.state import STATE_FILE, recover_replaced, saved_states, set_aside_newer


def _state(path, step: int):
    path.mkdir(parents=True)
    (path / STATE_FILE).write_text(f'{{"global_step": {step}}}')
    return path


def test_a_state_moved_aside_by_an_interrupted_replace_is_put_back(tmp_path):
    _state(tmp_path / "checkpoint-2", 2)
    _state(tmp_path / ".checkpoint-4.replaced-123", 4)  # the crash hit between the two renames
    _state(tmp_path / ".checkpoint-6.replaced-9.deleting-9", 6)  # half deleted: never put back
    _state(tmp_path / ".checkpoint-2.replaced-7", 2)  # its replacement exists: stays aside
    recover_replaced(tmp_path)
    assert [step for step, _ in saved_states(tmp_path)] == [2, 4]
    assert (tmp_path / ".checkpoint-6.replaced-9.deleting-9").exists()


def test_resuming_an_older_state_sets_the_newer_ones_aside(tmp_path):
    for step in (2, 4, 6):
        _state(tmp_path / f"checkpoint-{step}", step)
    lines = []
    set_aside_newer(tmp_path, 2, lines.append)
    assert [step for step, _ in saved_states(tmp_path)] == [2]  # 'latest' and rotation see only these
    assert sorted(p.name.split(".abandoned-")[0] for p in tmp_path.glob("*.abandoned-*")) == ["checkpoint-4",
                                                                                               "checkpoint-6"]
    assert len(lines) == 2 and lines[0].startswith("resuming from step 2: the newer checkpoint-4 is kept as")


def test_out_of_memory_is_recognised_in_its_several_forms():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                                         "memory: you tried to allocate 1099511627776 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only the allocators' errors


def test_an_out_of_memory_in_validation_suggests_a_smaller_validation_batch_first():
    cfg = parse_run_config(["--val_batch_size", "8", "--use_peft", "--enable_activation_checkpointing"])
    fixes = memory_fixes(cfg, torch.device("cuda"), in_validation=True)
    assert fixes[0] == "a smaller validation batch: --val_batch_size 4"


class _Saves:
    """A model or tokenizer that writes nothing: the RNG is what this state is about."""

    def save_pretrained(self, *args, **kwargs):
        pass


def _draws() -> tuple:
    import random

    import numpy

    return torch.rand(3).tolist(), random.random(), float(numpy.random.rand())


def _rank_saves_and_restores_its_own_rng(rank: int, world: int, store_path: str, root: str) -> None:
    import random

    import numpy
    import torch.distributed as dist

    from leantune.distributed.context import DistContext
    from leantune.training.state import StateParts, TrainingStateStore

    import datetime

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a rank that fails ends the other's wait
    try:
        for _ in range(rank + 1):  # the ranks draw differently (their own dropout masks, their own data)
            torch.rand(5), random.random(), numpy.random.rand()
        layer = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(layer.parameters())
        parts = StateParts(_Saves(), True, _Saves(), optimizer,
                           torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1),
                           None, layer, DistContext(rank=rank, world_size=world))
        state = TrainingStateStore(root, log=lambda _: None)
        state.save(1, parts, {"global_step": 1})
        expected = _draws()  # what this rank draws after the save
        _draws()
        dist.barrier()
        state.load(state.root / "checkpoint-1", parts)
        assert _draws() == expected, rank
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_each_rank_resumes_its_own_random_state(tmp_path):
    """Rank 1 drew differently before the save: it resumes its own RNG (torch, Python, NumPy), not rank 0's."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_saves_and_restores_its_own_rng, args=(2, str(tmp_path / "store"), str(tmp_path / "state")),
             nprocs=2)
