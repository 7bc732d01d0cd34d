"""GPU readings that cannot be taken on a CPU, with ``torch.cuda`` stood in for: the context and cuBLAS
workspace measured at start-up, and a MIG slice's used memory."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from leantune.memory import stats
from leantune.memory.gpu_constants import measure_gpu_constants
from leantune.memory.stats import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES

MIB = 2**20
GIB = 2**30
GPU = torch.device("cuda", 0)


class FakeCuda:
    """The driver and allocator counters of a GPU: 80 GiB, a context, and a workspace the first matmul makes."""

    def __init__(self, context: int, workspace: int, reserved_before: int = 0):
        self.context, self.workspace, self.allocated, self.reserved = context, workspace, 0, reserved_before

    def synchronize(self, device=None):
        pass

    def memory_allocated(self, device=None):
        return self.allocated

    def memory_reserved(self, device=None):
        return self.reserved

    def mem_get_info(self, device=None):
        return 80 * GIB - self.context - self.reserved, 80 * GIB

    def matmul(self, device):
        self.allocated += self.workspace
        self.reserved += 2 * self.workspace  # the allocator reserves more than the workspace asks


def test_the_context_and_workspace_are_measured_and_set_against_the_assumptions():
    cuda = FakeCuda(context=470 * MIB, workspace=32 * MIB + 1024 * 1024)
    constants = measure_gpu_constants(GPU, cuda, cuda.matmul)
    assert constants.context_bytes == 470 * MIB  # used less reserved: the allocator's reservation is not context
    assert constants.cublas_workspace_bytes == 33 * MIB
    assert constants.line() == (
        f"gpu constants: CUDA context 470 MiB (the planner assumes {CUDA_CONTEXT_BYTES // MIB} MiB: -42 MiB) at "
        f"start-up, other processes on this GPU included; cuBLAS workspace 33 MiB (the planner assumes "
        f"{CUBLAS_WORKSPACE_BYTES // MIB} MiB: +1 MiB)")
    assert constants.as_dict()["context_mib"] == 470.0


def test_a_workspace_made_before_is_not_read_as_zero_bytes():
    cuda = FakeCuda(context=500 * MIB, workspace=0)
    line = measure_gpu_constants(GPU, cuda, cuda.matmul).line()
    assert line.endswith("cuBLAS workspace not seen (made before, outside the allocator, or set to 0 by "
                         "CUBLAS_WORKSPACE_CONFIG)")


def test_nothing_is_measured_off_cuda():
    assert measure_gpu_constants(torch.device("cpu"), cuda=None, first_matmul=None) is None


@pytest.mark.parametrize("name, expected_used", [("NVIDIA H100 80GB HBM3", 70 * GIB),
                                                 ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 10 * GIB)],
                         ids=["whole-gpu", "mig-slice"])
def test_a_mig_slice_reads_its_own_used_memory_not_nvml_s_parent_gpu(name, expected_used):
    module = SimpleNamespace(get_device_properties=lambda device: SimpleNamespace(total_memory=40 * GIB),
                             get_device_name=lambda device: name,
                             device_memory_used=lambda device: 70 * GIB,  # NVML: the parent GPU's use
                             mem_get_info=lambda device: (30 * GIB, 40 * GIB))  # the driver: the slice's own
    assert stats._device_used_bytes(module, GPU) == (expected_used, 40 * GIB)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_readings_are_of_a_plausible_size():
    """In a fresh process, as at a run's start-up: no matmul has made the workspace yet."""
    code = ("import json, torch; from leantune.memory.gpu_constants import measure_gpu_constants; "
            "print(json.dumps(measure_gpu_constants(torch.device('cuda', 0)).as_dict()))")
    found = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1])
    assert 50 < found["context_mib"] < found["device_total_mib"]
    assert 0 < found["cublas_workspace_mib"] <= 256
