"""GPU-only defaults run on a CPU with ``torch.cuda`` stood in for: the default memory budget and
the out-of-memory snapshot (written whole through a ``.partial`` file and a rename, or not at all).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leantune.flags import parse_run_config
from leantune.distributed.context import SINGLE_PROCESS
from leantune.memory.oom import SNAPSHOT_NAME, dump_snapshot
from leantune.planning.oom_advice import oom_report
from leantune.memory.stats import CUDA_CONTEXT_BYTES
from leantune.planning.plan import budget_bytes
from leantune.training.outputs import SNAPSHOT_STEPS, MemorySnapshot

MIB = 2**20
GIB = 2**30
GPU = torch.device("cuda", 0)


# ------------------------------------------------------------------ the default budget
def test_the_default_gpu_budget_is_its_free_memory_less_5_percent_plus_the_context(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (20 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: asked.append(device) or 34 * MIB)
    budget = budget_bytes(parse_run_config([]).memory, GPU)
    assert budget == int(20 * GIB * 0.95) + CUDA_CONTEXT_BYTES + 34 * MIB
    # 95% of 20 GiB free, plus the 512 MiB context and the 34 MiB reserved (the start-up's workspace) already in use
    assert budget == 20_401_094_656 + 536_870_912 + 35_651_584
    assert asked == [GPU, GPU]  # the device the run trains on


def test_a_given_budget_wins_and_without_a_usable_gpu_there_is_no_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("the driver was asked"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert budget_bytes(parse_run_config(["--memory_budget_gb", "2.5"]).memory, GPU) == int(2.5 * GIB)
    assert budget_bytes(parse_run_config([]).memory, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert budget_bytes(parse_run_config([]).memory, GPU) is None


# ------------------------------------------------------------------ the snapshot
def stand_in_cuda(monkeypatch, dump) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)


def test_the_snapshot_is_written_aside_and_renamed_into_place_whole(monkeypatch, tmp_path):
    out = tmp_path / "run"  # not there yet: the snapshot creates it
    final = out / SNAPSHOT_NAME
    written = []

    def dump(filename):
        written.append(filename)
        with open(filename, "wb") as f:
            f.write(b"first half|")
            written.append(final.exists())  # while it is being written, nothing is at the final name
            f.write(b"second half")

    stand_in_cuda(monkeypatch, dump)
    assert dump_snapshot(GPU, out) == final
    assert written == [str(out / f".{SNAPSHOT_NAME}.partial"), False]
    assert final.read_bytes() == b"first half|second half"
    assert [p.name for p in out.iterdir()] == [SNAPSHOT_NAME]  # no .partial left behind


def test_a_failed_snapshot_leaves_nothing_and_an_older_one_intact(monkeypatch, tmp_path):
    def dump(filename):
        Path(filename).write_bytes(b"half of it")
        raise RuntimeError("disk full")

    stand_in_cuda(monkeypatch, dump)
    assert dump_snapshot(GPU, tmp_path / "run") is None
    assert list((tmp_path / "run").iterdir()) == []
    (tmp_path / "run" / SNAPSHOT_NAME).write_bytes(b"an earlier snapshot")
    assert dump_snapshot(GPU, tmp_path / "run") is None
    assert [p.name for p in (tmp_path / "run").iterdir()] == [SNAPSHOT_NAME]
    assert (tmp_path / "run" / SNAPSHOT_NAME).read_bytes() == b"an earlier snapshot"


def test_no_snapshot_off_cuda(monkeypatch, tmp_path):
    stand_in_cuda(monkeypatch, lambda filename: pytest.fail("dumped a snapshot"))
    assert dump_snapshot(torch.device("cpu"), tmp_path / "run") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dump_snapshot(GPU, tmp_path / "run") is None
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("fails", [False, True])
def test_the_oom_report_names_the_snapshot_only_when_it_was_written(monkeypatch, tmp_path, fails):
    def dump(filename):
        if fails:
            raise RuntimeError("disk full")
        Path(filename).write_bytes(b"snapshot")

    stand_in_cuda(monkeypatch, dump)
    monkeypatch.setattr(torch.cuda, "memory_summary", lambda device=None, abbreviated=False: "SUMMARY TABLE")
    cfg = parse_run_config(["--output_dir", str(tmp_path)])
    report = oom_report(torch.OutOfMemoryError("CUDA out of memory."), cfg, GPU, "at step 2")
    assert report.startswith("out of memory on cuda:0 at step 2: CUDA out of memory.\nallocator summary:\n"
                             "SUMMARY TABLE")
    line = f"memory snapshot: {tmp_path / SNAPSHOT_NAME} (drag it into https://pytorch.org/memory_viz)"
    assert (line in report.splitlines()) is not fails
    assert "to fit, try in this order:" in report  # a failed snapshot never hides the fixes
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if fails else [SNAPSHOT_NAME])


def test_the_memory_snapshot_message_names_the_steps_it_recorded(monkeypatch, tmp_path):
    history = []
    stand_in_cuda(monkeypatch, lambda filename: Path(filename).write_bytes(b"snapshot"))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: history.append(kwargs))
    logged = []
    snapshot = MemorySnapshot(True, GPU, tmp_path, SINGLE_PROCESS, logged.append)
    snapshot.start(steps_done=0)
    for step in range(1, SNAPSHOT_STEPS + 2):
        snapshot.after_step(step)  # written after step 3, once
    snapshot.write(SNAPSHOT_STEPS + 1)  # at close: nothing more
    # recording started (Python stacks only: C++ ones slow every allocation) and stopped, once
    assert history == [{"max_entries": 100_000, "stacks": "python"}, {"enabled": None}]
    assert snapshot.covered == (1, 2, 3)  # slower steps: the summary's medians leave them out
    assert (tmp_path / "memory_snapshot.pickle").read_bytes() == b"snapshot"
    assert logged == [f"memory snapshot of steps 1-3: {tmp_path / 'memory_snapshot.pickle'} "
                      "(drag it into https://pytorch.org/memory_viz)"]


def test_a_run_shorter_than_the_snapshot_names_the_steps_it_had(monkeypatch, tmp_path):
    stand_in_cuda(monkeypatch, lambda filename: Path(filename).write_bytes(b"snapshot"))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: None)
    logged = []
    snapshot = MemorySnapshot(True, GPU, tmp_path, SINGLE_PROCESS, logged.append)
    snapshot.start(steps_done=0)
    snapshot.after_step(1)
    snapshot.write(1)  # the run ended (or failed) after one step
    assert logged[0].startswith("memory snapshot of steps 1-1: ")
    assert MemorySnapshot(True, torch.device("cpu"), tmp_path).steps == 0  # CUDA only


def test_a_run_resumed_past_the_snapshot_records_and_writes_nothing(monkeypatch, tmp_path):
    history, logged = [], []
    stand_in_cuda(monkeypatch, lambda filename: Path(filename).write_bytes(b"snapshot"))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: history.append(kwargs))
    snapshot = MemorySnapshot(True, GPU, tmp_path, SINGLE_PROCESS, logged.append)
    snapshot.start(steps_done=SNAPSHOT_STEPS + 2)
    snapshot.after_step(SNAPSHOT_STEPS + 3)
    snapshot.write(SNAPSHOT_STEPS + 3)
    assert history == [] and logged == [] and list(tmp_path.iterdir()) == []


def test_a_run_resumed_within_the_snapshot_names_the_steps_it_recorded(monkeypatch, tmp_path):
    stand_in_cuda(monkeypatch, lambda filename: Path(filename).write_bytes(b"snapshot"))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: None)
    logged = []
    snapshot = MemorySnapshot(True, GPU, tmp_path, SINGLE_PROCESS, logged.append)
    snapshot.start(steps_done=1)  # resumed after step 1: steps 2 and 3 are recorded
    snapshot.after_step(2)
    snapshot.after_step(3)
    assert logged == [f"memory snapshot of steps 2-3: {tmp_path / 'memory_snapshot.pickle'} "
                      "(drag it into https://pytorch.org/memory_viz)"]
