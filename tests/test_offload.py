"""The activation offloader: a bounded best-fit pinned pool, prefetch bookkeeping, dedup by storage, the flag.

The CPU tests run the offloader's own pack/prefetch/copy-back code with its CUDA streams stood in
(``helpers.ImmediateStreams``: every copy done when issued, plain host buffers).
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from leantune.checkpointing import OffloadCheckpointing, apply_activation_checkpointing, policy_from_config
from leantune.checkpointing.offload import ActivationOffloader, _Saved, default_max_pinned_bytes
from leantune.checkpointing.pinned_pool import PinnedBufferPool
from leantune.flags import parse_run_config
from leantune.config import ConfigError

from conftest import TEST_SHAPE
from helpers import ImmediateStreams, gradients, make_batch

KiB, MiB = 1 << 10, 1 << 20


def _offloaded(model, cap=64 * MiB):
    apply_activation_checkpointing(model, OffloadCheckpointing(min_bytes=0, max_pinned_bytes=cap,
                                                               streams=ImmediateStreams()))
    return model._leantune_checkpoint_policy.offloader


def _assert_equal_grads(expected, actual):
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


# ------------------------------------------------------------------ the pool
def test_size_classes_are_powers_of_two_from_a_page():
    # torch's host allocator pins power-of-two blocks, so these are the bytes really pinned
    assert [PinnedBufferPool.size_class(n) for n in (1, 4096, 4097, 3 * MiB, 4 * MiB)] == [
        4096, 4096, 8192, 4 * MiB, 4 * MiB]


def test_pool_takes_the_smallest_free_buffer_at_most_one_class_up():
    pool = PinnedBufferPool(pin=False)
    a, b, c = pool.take(64 * KiB), pool.take(128 * KiB), pool.take(256 * KiB)
    for buffer in (c, b, a):
        pool.give_back(buffer, None)
    assert pool.take(40 * KiB) is a  # the smallest that holds it
    assert pool.take(40 * KiB) is b  # one class up (2x its 64 KiB class) is still a fit
    d = pool.take(40 * KiB)  # 256 KiB would pin 4x: a new 64 KiB buffer instead
    assert d.numel() == 64 * KiB and pool.allocations == 4 and pool.free_bytes == 256 * KiB


def test_pool_reuses_buffers_across_nearby_sizes():
    """Padded batches: each step asks for a slightly different size for every layer. An exact
    size-class pool (the old one: 2 MiB classes) pinned a new set per class: 12 buffers, 72 MiB here."""
    pool = PinnedBufferPool(pin=False)
    for size in (5 * MiB, 6 * MiB, 7 * MiB, 8 * MiB, 5 * MiB + 1234, 3 * MiB):
        taken = [pool.take(size) for _layer in range(4)]
        assert all(buffer.numel() >= size for buffer in taken)
        for buffer in taken:
            pool.give_back(buffer, None)
    assert pool.allocations == 4 and pool.held_bytes == pool.peak_held_bytes == 32 * MiB


def test_pool_at_its_cap_reuses_a_bigger_buffer_then_refuses():
    pool = PinnedBufferPool(pin=False, max_bytes=1 * MiB)
    pool.give_back(pool.take(512 * KiB), None)
    small = [pool.take(100 * KiB) for _ in range(4)]  # 4 x 128 KiB: exactly at the cap
    assert pool.held_bytes == 1 * MiB and all(b.numel() == 128 * KiB for b in small)
    assert pool.take(100 * KiB).numel() == 512 * KiB  # at the cap: the idle 512 KiB buffer serves it
    assert pool.take(100 * KiB) is None and pool.refusals == 1  # nothing idle to release
    assert pool.held_bytes == pool.peak_held_bytes == 1 * MiB and pool.releases == 0


def test_pool_releases_idle_buffers_oldest_first_to_stay_under_its_cap():
    pool = PinnedBufferPool(pin=False, max_bytes=1 * MiB)
    a, b, c, d = (pool.take(256 * KiB) for _ in range(4))
    for buffer in (a, b, c):
        pool.give_back(buffer, None)
    gone = [weakref.ref(a), weakref.ref(b)]
    del a, b
    big = pool.take(300 * KiB)  # a 512 KiB class: a and b (the oldest idle ones) make room
    assert big.numel() == 512 * KiB and pool.releases == 2 and pool.held_bytes == 1 * MiB
    assert all(ref() is None for ref in gone)  # really released: the pool kept no reference
    assert pool.take(200 * KiB) is c


# ------------------------------------------------------- the pool in training
def test_offload_moves_layer_inputs_reuses_buffers_and_frees_them(load_tiny):
    model = load_tiny()
    offloader = _offloaded(model)
    ids, labels = make_batch(model.config.vocab_size, seq=128)
    gradients(model, ids, labels)
    hidden_bytes = ids.numel() * model.config.hidden_size * 4
    assert offloader.offloaded_bytes == 2 * hidden_bytes  # one input per layer, nothing else
    assert offloader.pool.free_bytes == offloader.pool.held_bytes == 2 * hidden_bytes  # all back in the pool
    first_allocations = offloader.pool.allocations
    gradients(model, ids, labels)
    assert offloader.pool.allocations == first_allocations  # the second step reuses the buffers


def test_varying_batch_shapes_keep_the_pool_bounded_and_the_gradients_exact(load_tiny):
    plain, model = load_tiny(), load_tiny()
    cap = 1 * MiB
    offloader = _offloaded(model, cap)
    allocations = []
    for _round in range(2):
        for seq in (64, 96, 128, 80, 160):  # what --batching_strategy padding feeds the layers
            ids, labels = make_batch(model.config.vocab_size, seq=seq, seed=seq)
            _assert_equal_grads(gradients(plain, ids, labels), gradients(model, ids, labels))
            assert offloader.pool.free_bytes == offloader.pool.held_bytes  # every buffer returned
        allocations.append(offloader.pool.allocations)
    # 32 KiB (seq 64), 64 KiB (80..128) and 128 KiB (160) per layer, for 2 layers
    assert allocations == [6, 6] and offloader.pool.held_bytes == 2 * (32 + 64 + 128) * KiB
    assert offloader.pool.peak_held_bytes <= cap and offloader.fallbacks == 0


def test_a_full_pool_keeps_tensors_on_the_device_with_exact_gradients(load_tiny):
    plain, model = load_tiny(), load_tiny()
    cap = 100 * KiB  # room for one 64 KiB layer input, not two
    offloader = _offloaded(model, cap)
    ids, labels = make_batch(model.config.vocab_size, seq=128)
    with pytest.warns(RuntimeWarning, match=r"pinned pool is at its cap \(0.00 GiB\); a 0.1 MiB layer input stays"):
        actual = gradients(model, ids, labels)
    _assert_equal_grads(gradients(plain, ids, labels), actual)
    assert offloader.fallbacks == 1 and offloader.offloaded_bytes == 64 * KiB
    for seq in (64, 160, 96):  # other shapes under the same tight cap
        ids, labels = make_batch(model.config.vocab_size, seq=seq)
        _assert_equal_grads(gradients(plain, ids, labels), gradients(model, ids, labels))
    assert offloader.pool.peak_held_bytes <= cap and offloader.fallbacks > 1


# ------------------------------------------------------------------ prefetch
@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    from leantune.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-4", seed=0,
                           **{**TEST_SHAPE, "num_hidden_layers": 4})


def test_with_streams_stood_in_it_prefetches_the_layer_below_once_per_copy(four_layer_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(four_layer_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    offloader = _offloaded(model.train())
    trace = []
    start_copy_back, unpack = offloader._start_copy_back, offloader.unpack

    def traced_start(copy):
        trace.append(("copy back", copy.group))
        start_copy_back(copy)

    def traced_unpack(packed):
        if isinstance(packed, _Saved):
            trace.append(("unpack", packed.group))
        return unpack(packed)

    monkeypatch.setattr(offloader, "_start_copy_back", traced_start)
    monkeypatch.setattr(offloader, "unpack", traced_unpack)
    ids, labels = make_batch(model.config.vocab_size, seq=96)
    gradients(model, ids, labels)
    # Backward reaches layer 3 first: its copy starts on demand, layer 2's is prefetched with it,
    # and every later layer's copy was started one layer ahead.
    assert trace == [("unpack", 3), ("copy back", 3), ("copy back", 2), ("unpack", 2), ("copy back", 1),
                     ("unpack", 1), ("copy back", 0), ("unpack", 0)]
    assert offloader.copies_back == 4 and offloader.prefetch_hits == 4  # each copy brought back once
    assert offloader._groups == {}  # the group bookkeeping is used up
    assert offloader.pool.free_bytes == offloader.pool.held_bytes > 0  # the freed graph gave the buffers back


def test_copies_back_keep_at_most_the_two_layer_inputs_the_plan_assumes(four_layer_dir, monkeypatch):
    """The derived plan keeps two layer inputs on the device in backward (the layer recomputed and the one
    prefetched below it): the copies back never hold more, however many layers there are."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(four_layer_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    offloader = _offloaded(model.train())
    copies, most = [], [0]  # the storages of the copies back (weakly: a view keeps a storage, not its tensor)
    start_copy_back = offloader._start_copy_back

    def alive_bytes() -> int:
        return sum(nbytes for ref, nbytes in copies if not ref.expired())

    def counted_start(copy):
        start_copy_back(copy)
        storage = copy.prefetched[0].untyped_storage()
        copies.append((StorageWeakRef(storage), storage.nbytes()))
        most[0] = max(most[0], alive_bytes())

    monkeypatch.setattr(offloader, "_start_copy_back", counted_start)
    ids, labels = make_batch(model.config.vocab_size, seq=96)
    gradients(model, ids, labels)
    layer_input = ids.numel() * model.config.hidden_size * 4  # float32 hidden states of one layer
    assert offloader.copies_back == 4 and most[0] == 2 * layer_input
    assert alive_bytes() == 0  # each freed with the recompute that read it


# --------------------------------------------------------- dedup by storage
def test_views_of_one_storage_share_one_host_copy():
    offloader = ActivationOffloader(torch.device("cpu"), min_bytes=1024, max_pinned_bytes=64 * MiB,
                                    streams=ImmediateStreams())
    base, small = torch.randn(64, 64), torch.randn(4)
    assert offloader.pack(small) is small  # under min_bytes: stays
    views = [base, base, base[8:40], base.t(), base[:, 3:7]]  # the last two are not contiguous
    packed = [offloader.pack(view) for view in views]
    assert all(isinstance(p, _Saved) for p in packed) and len({id(p.copy) for p in packed}) == 1
    assert offloader.offloaded_bytes == base.numel() * 4 and offloader.pool.allocations == 1
    unpacked = [offloader.unpack(p) for p in packed]
    for view, back in zip(views, unpacked):
        assert torch.equal(back, view) and back.stride() == view.stride()
    assert offloader.copies_back == 1  # one copy back serves all five


def test_views_outside_the_copy_or_changed_since_get_their_own():
    offloader = ActivationOffloader(torch.device("cpu"), min_bytes=0, max_pinned_bytes=64 * MiB,
                                    streams=ImmediateStreams())
    base = torch.randn(64, 64)
    top, inside, bottom = (offloader.pack(v) for v in (base[:32], base[4:20], base[40:]))
    assert inside.copy is top.copy and bottom.copy is not top.copy
    assert offloader.offloaded_bytes == (32 + 24) * 64 * 4
    other = torch.randn(64, 64)
    assert offloader.pack(other).copy is not top.copy  # another storage
    base.add_(1)  # in place after the copy: the host copy is stale for what is saved from now on
    later = offloader.pack(base[2:10])
    assert later.copy is not top.copy
    assert torch.equal(offloader.unpack(later), base[2:10])
    with pytest.raises(RuntimeError, match="modified in place after it was saved"):
        offloader.unpack(top)  # saved before the change: refused, as autograd refuses it


# ------------------------------------------------------------- the flag
OFFLOAD = ["--enable_activation_checkpointing", "--activation_checkpointing_mode", "offload"]


def test_the_cap_flag_reaches_the_policy():
    cfg = parse_run_config(OFFLOAD + ["--activation_offload_max_pinned_gb", "2.5"])
    assert cfg.checkpointing.activation_offload_max_pinned_gb == 2.5
    assert policy_from_config(cfg.checkpointing).max_pinned_bytes == int(2.5 * 2**30)
    # the default, set by bind
    assert policy_from_config(parse_run_config(OFFLOAD).checkpointing).max_pinned_bytes is None


@pytest.mark.parametrize("argv, message", [
    (["--activation_offload_max_pinned_gb", "4"],
     r"--activation_offload_max_pinned_gb: applies to --activation_checkpointing_mode offload; add --enable_activ"),
    (["--enable_activation_checkpointing", "--activation_offload_max_pinned_gb", "4"],
     r"--activation_offload_max_pinned_gb: applies to --activation_checkpointing_mode offload, not full"),
    (["--enable_activation_checkpointing", "--activation_checkpointing_mode", "selective_ops",
      "--activation_offload_max_pinned_gb", "4"], r"offload, not selective_ops"),
    (OFFLOAD + ["--activation_offload_max_pinned_gb", "0"], r"--activation_offload_max_pinned_gb: must be a positive"),
    (OFFLOAD + ["--activation_offload_max_pinned_gb", "-1"], r"must be a positive number of GiB \(got -1.0\)"),
    (OFFLOAD + ["--activation_offload_max_pinned_gb", "inf"], r"must be a positive number of GiB"),
    (OFFLOAD + ["--activation_offload_max_pinned_gb", "nan"], r"must be a positive number of GiB"),
])
def test_bad_cap_flags_name_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(argv)


def test_the_default_cap_is_a_quarter_of_host_ram_per_local_process(load_tiny, monkeypatch):
    import psutil

    quarter = psutil.virtual_memory().total // 4
    assert default_max_pinned_bytes() == quarter
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_max_pinned_bytes() == quarter // 4
    report = apply_activation_checkpointing(load_tiny(), OffloadCheckpointing(streams=ImmediateStreams()))
    assert report.summary_line().endswith(f"to pinned host memory), at most {quarter / 4 / 2**30:.1f} GiB pinned")


def test_a_negative_cap_is_refused():
    with pytest.raises(ValueError, match="cap must be 0 or more bytes"):
        OffloadCheckpointing(max_pinned_bytes=-1)


# ------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:activation offload")
@pytest.mark.parametrize("cap", [64 * MiB, 200 * KiB], ids=["roomy", "tight"])
def test_offload_on_cuda_gives_the_plain_gradients(load_tiny, cap):
    plain, offloaded = load_tiny().cuda(), load_tiny().cuda()
    apply_activation_checkpointing(offloaded, OffloadCheckpointing(min_bytes=0, max_pinned_bytes=cap))
    offloader = offloaded._leantune_checkpoint_policy.offloader
    for seq in (256, 96, 160, 256):  # 128 KiB per layer input at 256: the tight cap holds one
        ids, labels = (t.cuda() for t in make_batch(plain.config.vocab_size, seq=seq, seed=seq))
        expected, actual = gradients(plain, ids, labels), gradients(offloaded, ids, labels)
        # bitwise on the CPU (streams stood in above); a GPU's attention backward may sum in another order per run
        assert expected.keys() == actual.keys() and expected
        for name in expected:
            torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.cuda.synchronize()
        assert offloader.pool.free_bytes == offloader.pool.held_bytes  # every buffer back after the step
    assert offloader.pool.peak_held_bytes <= cap and (offloader.fallbacks > 0) == (cap < MiB)
    assert offloader.copies_back == offloader.prefetch_hits > 0  # every copy back was started ahead


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:activation offload")
def test_offload_on_cuda_at_32k_tokens_moves_every_layer_input_and_gives_the_plain_gradients(load_tiny):
    """Long context, where offload is chosen: a 32,768-token row's layer inputs (8 MiB each here) all go to the
    pinned pool and come back ahead of their layers' backward, and the gradients are the plain ones."""
    plain, offloaded = load_tiny().cuda(), load_tiny().cuda()
    apply_activation_checkpointing(offloaded, OffloadCheckpointing(min_bytes=0, max_pinned_bytes=1 << 30))
    offloader = offloaded._leantune_checkpoint_policy.offloader
    ids, labels = (t.cuda() for t in make_batch(plain.config.vocab_size, seq=32768, seed=1, batch=1))
    expected, actual = gradients(plain, ids, labels), gradients(offloaded, ids, labels)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)
    torch.cuda.synchronize()
    layers = plain.config.num_hidden_layers
    assert offloader.fallbacks == 0 and offloader.copies_back == offloader.prefetch_hits >= layers - 1
    assert offloader.pool.free_bytes == offloader.pool.held_bytes


def test_a_saved_tensor_changed_in_place_after_it_was_offloaded_is_refused_at_backward():
    """Saved-tensor hooks skip autograd's version check; on CUDA the host copy may hold either value."""
    offloader = ActivationOffloader(torch.device("cpu"), min_bytes=0, max_pinned_bytes=MiB, streams=ImmediateStreams())
    x = torch.randn(64, 64, requires_grad=True)
    with offloader.group(0):
        y = x.exp()  # exp saves its output
    y.add_(1)
    with pytest.raises(RuntimeError, match=r"activation offload: a tensor saved for backward \(\[64, 64\], "
                                           r"torch.float32\) was modified in place after it was saved"):
        y.sum().backward()


def test_a_saved_tensor_changed_in_place_and_then_freed_is_refused_too():
    """The check must not need the tensor alive: changed in place, then its last reference dropped."""
    offloader = ActivationOffloader(torch.device("cpu"), min_bytes=0, max_pinned_bytes=MiB, streams=ImmediateStreams())
    x = torch.randn(64, 64, requires_grad=True)
    with offloader.group(0):
        y = x.exp()  # exp saves its output
    loss = y.sum()  # sum keeps no reference to y
    y.add_(1)
    del y  # only exp's saved (offloaded) copy is left
    with pytest.raises(RuntimeError, match="was modified in place after it was saved"):
        loss.backward()


def test_a_buffer_handed_out_again_waits_on_the_device_not_the_host():
    """The next copy into a buffer is queued behind the last copy out of it; the host never blocks."""

    class Event:
        def synchronize(self):
            raise AssertionError("the host blocked on a copy")

    waited = []
    pool = PinnedBufferPool(pin=False, max_bytes=8 * KiB, wait=waited.append)
    buffer, event = pool.take(4 * KiB), Event()
    pool.give_back(buffer, event)
    assert pool.take(4 * KiB) is buffer and waited == [event]
    pool.give_back(buffer, Event())
    assert pool.take(8 * KiB) is not None  # at the cap: the idle buffer is released, without a wait
    assert pool.releases == 1 and waited == [event]


def test_non_contiguous_tensors_kept_on_the_device_are_counted():
    offloader = ActivationOffloader(torch.device("cpu"), min_bytes=0, max_pinned_bytes=MiB, streams=ImmediateStreams())
    x = torch.randn(64, 32, requires_grad=True)
    with offloader.group(0):
        y = x.t().sin()  # sin saves its input, the transposed view
    assert offloader.stats()["kept_noncontiguous_bytes"] >= 64 * 32 * 4
    y.sum().backward()


def test_the_activation_meter_counts_only_the_models_device():
    """Offload's pinned host buffers are host memory, not a GPU's activations (a meta model stands in)."""
    from leantune.memory.meter import ActivationMeter

    model = torch.nn.Linear(4, 4, device="meta")
    with ActivationMeter.for_model(model) as meter:
        kept = torch.empty(MiB, dtype=torch.uint8)  # on the CPU: another device than the model's
    assert meter.live_bytes() == 0 and kept.numel() == MiB
    with ActivationMeter.for_model(torch.nn.Linear(4, 4)) as meter:
        kept = torch.empty(MiB, dtype=torch.uint8)
    assert meter.live_bytes() == MiB


def test_the_derived_offload_plan_lowers_a_stage_by_no_more_than_its_activations():
    """Backward's peak, with no layer input left in it, stays; forward's drops by the inputs moved; with the
    trace's moments by inputs alive, each moment drops by its own (less the two copied back)."""
    from leantune.planning.fake_step import StepTrace
    from leantune.planning.plan import offload_trace

    def held(activation, other):
        return {"activation": activation, "parameter": other}

    full = StepTrace(peak_bytes=120 * MiB, breakdown=held(0, 120 * MiB), flops=0, layer_input_bytes=8 * MiB,
                     num_layers=6, checkpointing="full",
                     stage_peaks={"forward": 110 * MiB, "backward": 120 * MiB, "optimizer": 90 * MiB},
                     stage_breakdowns={"forward": held(48 * MiB, 62 * MiB), "backward": held(0, 120 * MiB),
                                       "optimizer": held(0, 90 * MiB)})
    derived = offload_trace(full, max_pinned_bytes=1 << 40)  # 4 of the 6 inputs move (two stay: recomputing)
    assert derived.stage_peaks == {"forward": 78 * MiB, "backward": 120 * MiB, "optimizer": 90 * MiB}
    assert derived.peak_bytes == 120 * MiB and derived.breakdown == held(0, 120 * MiB)
    assert derived.stage_breakdowns["forward"] == held(16 * MiB, 62 * MiB)  # per stage, as the peaks
    # backward holding activations (recompute temporaries, an unknown share of inputs) stays as traced too
    late = dataclasses.replace(full, stage_breakdowns=dict(full.stage_breakdowns, backward=held(30 * MiB, 90 * MiB)))
    assert offload_trace(late, max_pinned_bytes=1 << 40).stage_peaks["backward"] == 120 * MiB
    bare = dataclasses.replace(full, stage_breakdowns={})  # no per-stage data: nothing is taken off
    assert offload_trace(bare, max_pinned_bytes=1 << 40).peak_bytes == 120 * MiB
    # with the moments the trace kept: backward peaks at its start (6 inputs alive), goes down the layers
    # (5 alive) and ends with none; each moment sheds its own inputs, and the highest is the stage's peak
    moments = {"backward": {6: held(48 * MiB, 72 * MiB), 5: held(40 * MiB, 78 * MiB), 0: held(0, 90 * MiB)}}
    counted = dataclasses.replace(full, stage_moments=moments,
                                  stage_breakdowns=dict(full.stage_breakdowns, backward=held(48 * MiB, 72 * MiB)))
    assert offload_trace(counted, max_pinned_bytes=1 << 40).stage_peaks == {
        "forward": 78 * MiB, "backward": 94 * MiB, "optimizer": 90 * MiB}  # 118 - 3 x 8 at 5 alive, not 120 - 4 x 8
    # no more than the pool holds, two 8 MiB buffers: then the start is the highest
    assert offload_trace(counted, max_pinned_bytes=16 * MiB).stage_peaks["backward"] == 104 * MiB
    # no more than the moment's activations: 20 MiB of them, though four 8 MiB inputs would move
    capped = dataclasses.replace(counted, stage_moments={"backward": {6: held(20 * MiB, 100 * MiB)}})
    assert offload_trace(capped, max_pinned_bytes=1 << 40).stage_peaks["backward"] == 100 * MiB
    # a moment above full's checked peak of the stage (a freed storage still counted): full's stage stands
    raised = dataclasses.replace(counted, stage_moments={"backward": {1: held(0, 130 * MiB)}})
    assert offload_trace(raised, max_pinned_bytes=1 << 40).stage_peaks["backward"] == 120 * MiB


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_the_trace_keeps_each_stage_s_moments_by_the_layer_inputs_alive(kind):
    """Every layer's input is alive through the forward and none at the optimizer step; backward goes from
    all to none. Offload's backward is no lower than its moments with nothing to move (small preset, full
    fine-tuning at 24 x 512: 3,581 MiB with two inputs left against 3,611 at the start, where taking full's
    peak alone and shedding six inputs said 3,323)."""
    from leantune.flags import parse_run_config
    from leantune.models.presets import model_config
    from leantune.planning.fake_step import trace_step
    from leantune.planning.plan import offload_trace

    flags = ["--use_peft", "--batch_size_training", "4"] if kind == "lora" else ["--batch_size_training", "24"]
    cfg = parse_run_config(["--model_name", "small", *flags, "--context_length", "512",
                            "--enable_activation_checkpointing"])
    config = model_config("small")
    full = trace_step(cfg, config, torch.device("cpu"), "full")
    layers = config.num_hidden_layers
    assert max(full.stage_moments["forward"]) == layers and set(full.stage_moments["optimizer"]) == {0}
    assert {0, layers} <= set(full.stage_moments["backward"])
    derived = offload_trace(full, max_pinned_bytes=1 << 40)
    # with two inputs or fewer alive offload moves none: those moments stay as they are
    unmoved = max(sum(held.values()) for alive, held in full.stage_moments["backward"].items() if alive <= 2)
    assert unmoved <= derived.stage_peaks["backward"] <= full.stage_peaks["backward"]
    if kind == "lora":  # backward peaks at its start, every input alive: offload lowers it
        assert derived.stage_peaks["backward"] < full.stage_peaks["backward"]


def test_an_in_place_write_through_the_base_of_a_saved_view_is_refused_too():
    offloader = ActivationOffloader(torch.device("cpu"), min_bytes=0, max_pinned_bytes=MiB, streams=ImmediateStreams())
    x = torch.randn(64, 64, requires_grad=True)
    base = x * 1
    with offloader.group(0):
        y = base[:32].sin()  # sin saves its input, a view whose own object dies here
    base.add_(1)  # the base shares the view's version counter
    with pytest.raises(RuntimeError, match="was modified in place after it was saved"):
        y.sum().backward()


def test_a_storage_kept_on_the_device_is_counted_once_by_its_bytes():
    offloader = ActivationOffloader(torch.device("cpu"), min_bytes=0, max_pinned_bytes=MiB, streams=ImmediateStreams())
    mask = torch.randn(1, 64, 64).expand(8, 64, 64)  # an expanded mask: 16 KiB of storage, 128 KiB of elements
    x = torch.randn(8, 64, 64, requires_grad=True)
    with offloader.group(0):
        for _ in range(3):  # saved by every layer
            (x * mask).sum()
    assert offloader.stats()["kept_noncontiguous_bytes"] == 64 * 64 * 4
