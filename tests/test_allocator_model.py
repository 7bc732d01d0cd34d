"""The caching allocator's segments, modelled: what a sequence of allocations and frees would reserve on a GPU."""

from __future__ import annotations

import pytest
import torch

from leantune.memory.allocator_model import AllocatorModel, expandable_segments_on, segment_bytes
from leantune.memory.tracker import StorageTracker

MIB = 2**20


def reserved(sizes_and_frees, expandable=False) -> int:
    """Reserved bytes after ``sizes_and_frees``: a positive number allocates that many bytes (keyed by its
    position), ``("free", i)`` frees the i-th allocation."""
    model = AllocatorModel(expandable)
    for key, step in enumerate(sizes_and_frees):
        if isinstance(step, tuple):
            model.free(step[1])
        else:
            model.allocate(key, step)
    return model.reserved


@pytest.mark.parametrize("request_bytes, segment", [
    (1, 2 * MIB), (MIB, 2 * MIB), (MIB + 1, 20 * MIB), (10 * MIB - 512, 20 * MIB), (10 * MIB - 1, 10 * MIB),
    (10 * MIB, 10 * MIB), (11 * MIB + 1, 12 * MIB), (101 * MIB, 102 * MIB)])
def test_a_new_segment_is_2_mib_small_20_mib_under_10_mib_else_the_request_rounded_to_2_mib(request_bytes, segment):
    """Of the request rounded to 512 bytes first: 10 MiB less one byte is a 10 MiB request."""
    assert segment_bytes(-(-request_bytes // 512) * 512) == segment
    assert reserved([request_bytes]) == segment


def test_small_requests_share_a_segment_and_the_pools_do_not_share():
    assert reserved([256 * 1024] * 8) == 2 * MIB  # eight 256 KiB blocks split from one 2 MiB segment
    assert reserved([256 * 1024] * 9) == 4 * MIB
    # a 1.5 MiB request is large: its 20 MiB segment takes no small request, however much is free in it
    assert reserved([int(1.5 * MIB), 256 * 1024]) == 22 * MIB
    assert reserved([int(1.5 * MIB)] * 13) == 20 * MIB  # 13 x 1.5 MiB split from one 20 MiB segment
    assert reserved([int(1.5 * MIB)] * 14) == 40 * MIB


def test_a_freed_block_is_reused_and_merges_with_its_free_neighbours():
    # two 30 MiB blocks freed side by side in one 60 MiB segment hold a 60 MiB request: nothing new reserved,
    # whichever is freed first (the second merges with the block before it, or the block after it)
    assert reserved([60 * MIB, ("free", 0), 30 * MIB, 30 * MIB, ("free", 2), ("free", 3), 60 * MIB]) == 60 * MIB
    assert reserved([60 * MIB, ("free", 0), 30 * MIB, 30 * MIB, ("free", 3), ("free", 2), 60 * MIB]) == 60 * MIB
    # not merged across segments: two freed 30 MiB segments cannot hold 60 MiB
    assert reserved([30 * MIB, 30 * MIB, ("free", 0), ("free", 1), 60 * MIB]) == 120 * MIB
    # a large block keeps a remainder of 1 MiB or less unsplit: 19.5 MiB + 0.75 MiB free is not split off
    assert reserved([int(19.5 * MIB) - 512 * 1024, 2 * MIB]) == 40 * MIB
    # exactly 1 MiB left is not split either (more than 1 MiB is the rule), and it shows: in a 40 MiB segment
    # [20 free][20 D], 19 MiB takes the free 20 whole; D freed is 20 MiB alone, too small for 20.5 MiB (a new
    # 22 MiB segment). Split, the 1 MiB left would merge with D into 21 MiB and hold it.
    assert reserved([40 * MIB, ("free", 0), 20 * MIB, 20 * MIB, ("free", 2), 19 * MIB, ("free", 3),
                     int(20.5 * MIB)]) == 62 * MIB


def test_the_smallest_free_block_that_holds_a_request_is_taken():
    # freed: a 40 MiB and a 24 MiB segment; a 24 MiB request takes the second, leaving 40 MiB for the next
    steps = [40 * MIB, 24 * MIB, ("free", 0), ("free", 1), 24 * MIB, 40 * MIB]
    assert reserved(steps) == 64 * MIB


def test_expandable_segments_grow_in_pages_of_2_and_20_mib():
    assert reserved([1], expandable=True) == 2 * MIB
    assert reserved([101 * MIB], expandable=True) == 120 * MIB  # 101 MiB mapped in 20 MiB pages
    # the case that fragments fixed segments: freed 30 MiB blocks side by side hold a 60 MiB request
    assert reserved([30 * MIB, 30 * MIB, ("free", 0), ("free", 1), 60 * MIB], expandable=True) == 60 * MIB
    # a request no free block holds goes at the end, over the free block there
    steps = [30 * MIB, 30 * MIB, ("free", 1), 50 * MIB]
    assert reserved(steps, expandable=True) == 80 * MIB
    assert reserved(steps) == 110 * MIB
    # a large block is split down to 512 bytes: the 0.5 MiB left of a reused 10 MiB block joins its neighbour
    steps = [10 * MIB, 10 * MIB, ("free", 0), int(9.5 * MIB), ("free", 1), int(10.25 * MIB)]
    assert reserved(steps, expandable=True) == 20 * MIB
    # the last page's room beyond a request is a free block, which best fit can choose
    assert reserved([10 * MIB, 6 * MIB, ("free", 0), 3 * MIB, 9 * MIB], expandable=True) == 20 * MIB


def test_saved_activations_freed_by_backward_while_its_temporaries_come_and_go_reserve_no_more():
    """Each temporary of backward takes the block of the activation just freed: the forward's moment is the peak."""
    model = AllocatorModel()
    for layer in range(16):
        model.allocate(layer, 96 * MIB)
    for layer in reversed(range(16)):
        model.free(layer)
        model.allocate(100 + layer, 96 * MIB)
        model.free(100 + layer)
    assert model.reserved == 16 * 96 * MIB


def test_the_allocator_settings_are_read_from_either_variable():
    assert expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable_segments_on({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments: true"})
    assert not expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not expandable_segments_on({})


def test_the_tracker_tells_the_model_of_each_storage_made_and_freed():
    model = AllocatorModel()
    with StorageTracker(round_to=512, allocator=model) as tracker:
        a = torch.empty(12 * MIB, dtype=torch.uint8)  # a segment of its own, 12 MiB
        b = a.view(-1, 2)  # a view: the same storage, not a second allocation
        del a, b
        c = torch.empty(12 * MIB, dtype=torch.uint8)  # the freed segment again: nothing new reserved
        d = torch.empty(100, dtype=torch.uint8)
        e = torch.empty(0)  # an empty storage takes no block
    assert tracker.live_bytes() == 12 * MIB + 512
    assert model.reserved == 12 * MIB + 2 * MIB
    del c, d, e


def test_a_key_allocated_twice_without_a_free_is_a_bug_said_at_once():
    model = AllocatorModel()
    model.allocate(1, MIB)
    with pytest.raises(ValueError, match="allocated twice"):
        model.allocate(1, MIB)


def test_an_empty_request_takes_no_block():
    model = AllocatorModel()
    model.allocate(1, 0)
    model.free(1)
    assert model.reserved == 0


def test_a_gpu_plan_s_fragmentation_is_the_modelled_reservation_beyond_the_traced_peak():
    from leantune.flags import parse_run_config
    from leantune.models.presets import model_config
    from leantune.planning.fake_step import trace_step
    from leantune.planning.plan import plan_from_trace

    cfg = parse_run_config(["--model_name", "tiny", "--use_peft", "--batch_size_training", "2", "--context_length",
                            "256", "--enable_activation_checkpointing", "--device", "cuda"])
    trace = trace_step(cfg, model_config("tiny"), torch.device("cuda"), "full")
    # the tiny model's hundreds of small tensors share 2 MiB segments, its large ones take 20 MiB ones
    assert trace.peak_bytes < trace.reserved_peak_bytes
    assert trace.reserved_peak_bytes % (2 * MIB) == 0
    plan = plan_from_trace("full", trace, cfg.training.batch_size_training, cfg.data.context_length,
                           torch.device("cuda"))
    assert plan.fragmentation_bytes == trace.reserved_peak_bytes - trace.peak_bytes
    assert trace_step(cfg, model_config("tiny"), torch.device("cpu"), "full").reserved_peak_bytes == 0  # no allocator
