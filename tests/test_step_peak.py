"""StepPeakMeter: one meter for any trainer's step — what existed at the start plus what the step made."""

from __future__ import annotations

import torch

from leantune.flags import parse_run_config
from leantune.memory.step_peak import StepPeakMeter

MIB = 2**20


def test_the_cpu_meter_counts_the_model_its_optimizer_state_and_what_the_step_allocates():
    model = torch.nn.Linear(256, 256, bias=False)  # 256 KiB of float32 weights
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()  # state: two 256 KiB moments and a step count
    state = sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values())
    with StepPeakMeter(torch.device("cpu"), model, optimizer) as meter:
        block = torch.empty(MIB, dtype=torch.uint8)
        del block
        after_free = torch.empty(MIB // 2, dtype=torch.uint8)  # the freed MiB is no longer counted
    start = 2 * 256 * 256 * 4 + state  # weights + their gradient (kept from the step) + the state
    assert meter.peak_bytes == start + MIB
    assert meter.budget_bytes_used == meter.peak_bytes and meter.reserved_bytes is None
    del after_free


def test_another_models_tensors_are_not_counted():
    """Several configurations stay resident while one is measured (the CPU benchmark interleaves them)."""
    measured, other = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(1024, 1024, bias=False)
    batch = torch.ones(2, 64)
    with StepPeakMeter(torch.device("cpu"), measured, inputs=[batch]) as meter:
        out = measured(batch)
    assert other.weight.numel() and meter.peak_bytes == 64 * 64 * 4 + 2 * batch.untyped_storage().nbytes()
    assert out.untyped_storage().nbytes() == batch.untyped_storage().nbytes()


def test_on_a_gpu_the_allocator_is_read_and_the_budget_counts_reserved_plus_the_measured_context(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4 * MIB)
    from leantune.memory import gpu_constants

    # the context this run measured at start-up (other processes on the GPU included): 898 MiB
    monkeypatch.setattr(gpu_constants, "_MEASURED_CONTEXT", {})
    gpu_constants.remember_context(torch.device("cuda", 0), gpu_constants.GpuConstants(898 * MIB, 0, 80_000 * MIB))
    with StepPeakMeter(torch.device("cuda"), torch.nn.Linear(2, 2)) as meter:
        calls.append("step")
    assert calls == ["sync", "reset", "step", "sync"]  # the step's queued work is waited for on both sides
    assert meter.peak_bytes == 3 * MIB and meter.reserved_bytes == 4 * MIB
    assert meter.budget_bytes_used == 4 * MIB + 898 * MIB  # measured, not the planner's assumed 512 MiB
    # the default budget and a plan count the same context: what the batch check compares is like for like
    from leantune.planning.plan import budget_bytes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000 * MIB, 80_000 * MIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * MIB)
    expected = int(1000 * MIB * 0.95) + 898 * MIB + 2 * MIB
    assert budget_bytes(parse_run_config([]).memory, torch.device("cuda", 0)) == expected
    assert gpu_constants.context_bytes(torch.device("cuda", 1)) == 512 * MIB  # not measured there: the assumption
