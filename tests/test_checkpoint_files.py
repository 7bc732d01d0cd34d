"""Resuming never runs code from a checkpoint: every file a resume reads is loaded without arbitrary unpickling."""

from __future__ import annotations

import random

import numpy
import pytest
import torch

from leantune import finetuning
from leantune.config import ConfigError
from leantune.training.checkpoint_files import load_checkpoint_file, unpickler_warning
from leantune.training.state import capture_rng, restore_rng

RUN = ["--lr", "3e-3", "--context_length", "64", "--batch_size_training", "2", "--max_train_step", "2",
       "--save_steps", "1", "--run_validation", "false", "--save_model", "false", "--num_workers_dataloader", "0",
       "--use_peft"]


class CreatesAFile:
    """Unpickled, it would open (so create) ``path``: what a hostile checkpoint file could do instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("name", ["rng_state.pth", "optimizer.pt", "scheduler.pt"])
def test_a_hostile_file_in_a_checkpoint_is_refused_in_one_line_and_runs_nothing(name, tiny_model_dir, tmp_path,
                                                                                 capsys):
    saved = tmp_path / "saved"
    assert finetuning.main(["--model_name", str(tiny_model_dir), *RUN, "--output_dir", str(saved)]) == 0
    marker = tmp_path / "created-by-the-checkpoint"
    torch.save({"ranks": [CreatesAFile(marker)], "state": CreatesAFile(marker)}, saved / "checkpoint-1" / name)
    capsys.readouterr()
    code = finetuning.main(["--model_name", str(tiny_model_dir), *RUN, "--output_dir", str(tmp_path / "resumed"),
                            "--resume_from_checkpoint", str(saved / "checkpoint-1")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not marker.exists()  # 2: the flag points at a state to refuse
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert (f"--resume_from_checkpoint {saved / 'checkpoint-1'}: {name} holds more than tensors and plain values "
            "(it names io.open); loading it could run code, so leantune refuses it") in err


def test_rng_states_are_saved_as_plain_values_and_old_ones_still_load(tmp_path):
    """NumPy's state is saved as a list (loads with weights_only); a state saved as NumPy's array (before) too."""
    for numpy_state in ("new", "old"):
        state = capture_rng(torch.device("cpu"))
        if numpy_state == "old":
            state["numpy"] = numpy.random.get_state()
        torch.save({"ranks": [state]}, tmp_path / "rng_state.pth")
        loaded = load_checkpoint_file(tmp_path / "rng_state.pth", numpy_arrays=True)["ranks"][0]
        draws = []
        for _ in range(2):
            restore_rng(loaded, torch.device("cpu"))
            draws.append((random.random(), numpy.random.rand(), torch.rand(1).item()))
        assert draws[0] == draws[1], numpy_state
    assert isinstance(capture_rng(torch.device("cpu"))["numpy"][1], list)
    with pytest.raises(ConfigError, match="holds more than tensors and plain values"):  # arrays only where asked
        state["numpy"] = numpy.random.get_state()
        torch.save({"ranks": [state]}, tmp_path / "optimizer.pt")
        load_checkpoint_file(tmp_path / "optimizer.pt")


def test_a_resume_on_a_torch_with_the_unpickler_flaw_says_so():
    assert "CVE-2026-24747, fixed in torch 2.10" in unpickler_warning("2.9.1+cu128")
    assert unpickler_warning("2.10.0") is None and unpickler_warning("2.13.0+cpu") is None


def test_no_source_file_loads_a_pickle_that_could_run_code():
    """``torch.load`` only with ``weights_only=True``, and no ``pickle.load``, anywhere in src/."""
    from pathlib import Path

    for path in (Path(__file__).resolve().parent.parent / "src").rglob("*.py"):
        text = path.read_text()
        assert "pickle.load(" not in text and "weights_only=False" not in text, path
        for line in (line for line in text.splitlines() if "torch.load(" in line and "``" not in line):
            assert "weights_only=True" in line, (path, line)


def test_a_damaged_or_foreign_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "scheduler.pt").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"scheduler.pt cannot be read \(.*\): the state is damaged"):
        load_checkpoint_file(tmp_path / "scheduler.pt")
    state = capture_rng(torch.device("cpu"))
    state["numpy"] = ("MT19937", numpy.zeros(3, dtype=numpy.float64), 0, 0, 0.0)  # an array leantune never saves
    torch.save({"ranks": [state]}, tmp_path / "rng_state.pth")
    with pytest.raises(ConfigError, match=r"rng_state.pth holds (more than tensors and plain values|a NumPy float64)"):
        load_checkpoint_file(tmp_path / "rng_state.pth", numpy_arrays=True)


def test_a_state_saved_on_a_gpu_loads_on_the_cpu(tmp_path, monkeypatch):
    """Tensors tagged with a CUDA device (a state saved by a GPU run) are read into host memory."""
    with monkeypatch.context() as patched:
        patched.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"state": {0: {"exp_avg": torch.ones(3)}}}, tmp_path / "optimizer.pt")
    loaded = load_checkpoint_file(tmp_path / "optimizer.pt")
    assert loaded["state"][0]["exp_avg"].device.type == "cpu" and torch.equal(loaded["state"][0]["exp_avg"],
                                                                               torch.ones(3))


class _DtypeByName:
    """int64, pickled through the generic ``numpy.dtype`` constructor (which weights_only allows) rather than its
    own class (which it refuses)."""

    with_state = False

    def __reduce__(self):
        state = ((3, "<", None, None, None, -1, -1, 0),) if self.with_state else ()
        return numpy.dtype, ("i8", False, True), *state


class _Int64Array:
    """A NumPy int64 array pickled with ``_DtypeByName``: what a crafted file could hold."""

    def __reduce__(self):
        core = getattr(numpy, "_core", None) or numpy.core
        return (core.multiarray._reconstruct, (numpy.ndarray, (0,), b"b"),
                (1, (3,), _DtypeByName(), False, numpy.zeros(3, dtype=numpy.int64).tobytes()))


def test_numpy_arrays_are_checked_wherever_they_sit_and_only_where_allowed(tmp_path):
    good = numpy.zeros(3, dtype=numpy.uint32)
    for nested in ({"a": [good, (good, {"b": good})]}, [good], (good,)):
        torch.save(nested, tmp_path / "rng_state.pth")
        load_checkpoint_file(tmp_path / "rng_state.pth", numpy_arrays=True)
    bad = _Int64Array()  # its dtype made by the allowed numpy.dtype: only leantune's own check can refuse it
    for nested in ({"a": [good, {"b": bad}]}, [bad], (good, bad)):
        torch.save(nested, tmp_path / "rng_state.pth")
        with pytest.raises(ConfigError, match="rng_state.pth holds a NumPy int64 array, which leantune never saves"):
            load_checkpoint_file(tmp_path / "rng_state.pth", numpy_arrays=True)
    with pytest.raises(ConfigError, match=r"holds more than tensors and plain values \(it names "
                                          r"numpy\.(_core|core)\.multiarray\._reconstruct\)"):
        load_checkpoint_file(tmp_path / "rng_state.pth")  # arrays only where asked
    _DtypeByName.with_state = True  # its byte order set too: torch's unpickler names the int64 dtype's class
    try:
        torch.save([_Int64Array()], tmp_path / "rng_state.pth")
    finally:
        _DtypeByName.with_state = False
    with pytest.raises(ConfigError, match=r"rng_state.pth holds more than tensors and plain values \(it names "
                                          r"numpy.dtypes.Int64DType\); loading it could run code"):
        load_checkpoint_file(tmp_path / "rng_state.pth", numpy_arrays=True)


def test_a_hostile_file_is_refused_even_where_torch_is_told_to_unpickle_everything(tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD changes torch.load's default only: leantune asks for weights_only itself."""
    marker = tmp_path / "created"
    torch.save({"state": CreatesAFile(marker)}, tmp_path / "optimizer.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ConfigError, match="holds more than tensors and plain values"):
        load_checkpoint_file(tmp_path / "optimizer.pt")
    assert not marker.exists()


def test_a_damaged_files_reason_is_its_errors_first_line_cut_short(tmp_path):
    from leantune.training.checkpoint_files import _unreadable

    err = RuntimeError("WeightsUnpickler error: " + "x" * 200 + "\nsecond line")
    assert str(_unreadable("--resume_from_checkpoint ck: optimizer.pt", err)) == (
        f"--resume_from_checkpoint ck: optimizer.pt cannot be read (RuntimeError: {'x' * 120}): the state is "
        "damaged; resume from another one, or start the run afresh")
    assert "(EOFError: the end)" in str(_unreadable("w", EOFError("the end")))
    assert unpickler_warning("2.9") is not None and unpickler_warning("3.0.0") is None
    assert unpickler_warning("2.6.0a0+ecf3bae40a.nv25.01") is not None  # NVIDIA's builds
    assert unpickler_warning("2.10.0rc1") is None and unpickler_warning("2.9.1rc2+cu126") is not None


def test_the_numpy_constructor_is_allowed_under_its_current_and_its_old_name():
    from leantune.training.checkpoint_files import _numpy_uint32_arrays

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # NumPy 2 warns where numpy.core is read
        allowed = _numpy_uint32_arrays()
    reconstruct = allowed[0]
    assert reconstruct.__module__ in ("numpy._core.multiarray", "numpy.core.multiarray")
    assert (reconstruct, "numpy.core.multiarray._reconstruct") in allowed and numpy.ndarray in allowed
