"""The prepared GPU check (``benchmarks/gpu_check.py``) on the CPU: its dry run runs every part and every run
with tiny shapes and writes its results as on a GPU, so the first GPU minute is not spent on a typo; a part
at its limit is stopped with everything it started; the 1B shape it builds is a valid model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check_parts import PARTS, gpu_marked_test_files  # noqa: E402
from gpu_check_runs import gpu_shape  # noqa: E402

OUT_FILES = ["gpu_check.json", "gpu_check.txt", "logs.tar.gz"]  # the device machine sends back 8 files at most


def _check(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry_run", "--out", str(out),
                             "--work_dir", str(tmp_path / "work"), *flags], capture_output=True, text=True,
                            env={key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"})
    assert sorted(p.name for p in out.iterdir()) == OUT_FILES, result.stderr[-3000:]
    return result, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_writes_its_results(tmp_path):
    """About two and a half minutes on 2 cores."""
    import gpu_check

    result, check = _check(tmp_path, "--parts", ",".join(gpu_check.ALL_PARTS))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert check["dry_run"] is True and list(check["parts"]) == list(gpu_check.ALL_PARTS)
    assert {name: part["status"] for name, part in check["parts"].items()} == {name: "ok" for name in PARTS}
    assert check["missing"] == [] and check["found"]["torch"] == torch.__version__
    runs = [run for part in check["parts"].values() for run in part.get("runs", [])]
    trained = [run for run in runs if not run["run"].startswith("pytest")]
    with_bnb = check["bitsandbytes"] == "bitsandbytes: installed"
    assert check["parts"]["device"]["facts"]["varlen_signature"].startswith("(query")
    assert len(trained) == 7 + with_bnb and all(run["rc"] == 0 for run in runs)
    for run in trained:  # each read back from its own metrics.json and memory.jsonl
        assert run["median_step_time_s"] > 0 and run["steps"] >= 1 and run["max_cpu_rss_peak_mib"] > 100, run
        assert any(line.startswith("precision:") for line in run["told"]), run
    resume = check["parts"]["resume"]
    assert resume["step_3_equal"] and resume["max_relative_difference"] == 0  # exact on the CPU
    assert any(line.startswith("resumed from") for line in resume["runs"][0]["told"])
    compiled = check["parts"]["compile"]["runs"][0]
    assert any(line.startswith("compile: step 1 took") for line in compiled["told"]), compiled["told"]
    told = {run["run"]: " ".join(run["told"]) for run in trained}
    assert "varlen attention" in told["reference_batch_full"] and "varlen attention" not in told["attention_sdpa"]
    fsdp = check["parts"]["fsdp"]["runs"][0]
    assert fsdp["saved_files"] == ["model.safetensors"] and fsdp["saved_config_reads"] == "llama"
    assert not list((tmp_path / "work" / "runs" / "fsdp_one_rank").glob("*.safetensors"))  # read back, then deleted
    allocator, mib = check["parts"]["device"]["facts"]["allocator"], 2**20
    assert [row["modelled_bytes"] // mib for row in allocator["default"]] == [2, 20, 20, 12, 102]
    assert [row["modelled_bytes"] // mib for row in allocator["expandable_segments"]] == [2, 20, 20, 20, 120]
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as archive:
        logged = {Path(name).stem for name in archive.getnames()}
    assert {run["run"] for run in runs} <= logged and "part_reference" in logged
    assert "reference_batch_full" in result.stdout  # the table


def test_the_parts_fit_one_device_call_in_order_of_value():
    """``--list``: each part and its limit; with the set-up they fit the 480 s a device call leaves, and every
    part gets the whole of its limit even when each before it used all of its own."""
    listed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--list"],
                            capture_output=True, text=True, check=True).stdout.split("\n")
    rows = [line.split() for line in listed if line]
    limits = {row[0]: int(row[1]) for row in rows if len(row) == 2}
    assert {row[0] for row in rows if row[2:] == ["on_request"]} == {"attention", "lean_optimizers"}
    assert list(limits)[:4] == ["setup", "device", "cuda_tests", "reference"]
    assert {"qlora", "compile", "resume", "fsdp"} <= set(limits) and set(limits) - {"setup"} <= set(PARTS)
    import gpu_check

    spent = limits.pop("setup")
    for name, own in limits.items():
        assert min(own, 480 - spent - 2 * gpu_check.GRACE_S) == own, name
        spent += own
    assert spent + 2 * gpu_check.GRACE_S <= 480


def test_a_part_at_its_limit_is_stopped_and_keeps_the_runs_that_ended(tmp_path):
    result, check = _check(tmp_path, "--parts", "reference", "--part_limit_s", "12")
    part = check["parts"]["reference"]
    assert result.returncode == 1 and part["status"] == "timed out"
    # the run cut short is said; one that ended (the first, unless the machine is slow) keeps its figures
    assert part["runs"] and all(run["rc"] in (0, "stopped at its part's limit") for run in part["runs"])
    assert part["runs"][-1]["rc"] == "stopped at its part's limit"
    assert all(run["median_step_time_s"] > 0 for run in part["runs"] if run["rc"] == 0)
    left = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left


def test_stopping_a_part_reaches_a_worker_in_its_own_session_that_ignores_sigterm(tmp_path):
    """As torchrun starts its worker: a session of its own; and this one will not end on SIGTERM."""
    import gpu_check

    marker = tmp_path / "worker.pid"
    worker = ("import os, signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"pathlib.Path({str(marker)!r}).write_text(str(os.getpid())); time.sleep(600)")
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                               f"'-c', {worker!r}], start_new_session=True); time.sleep(600)"])
    for _ in range(200):
        if marker.is_file() and marker.read_text():
            break
        time.sleep(0.05)
    worker_pid = int(marker.read_text())
    gpu_check._stop_tree(leader)
    leader.wait(timeout=5)
    assert not psutil.pid_exists(worker_pid) or psutil.Process(worker_pid).status() == psutil.STATUS_ZOMBIE


def test_the_log_archive_keeps_small_logs_whole_and_the_ends_of_large_ones(tmp_path):
    import gpu_check

    small, large = tmp_path / "a.log", tmp_path / "b.log"
    small.write_bytes(b"short\n")
    large.write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))
    assert gpu_check.log_ends([small, large], 10**6) == [("a.log", b"short\n"), ("b.log", large.read_bytes())]
    (_, kept_small), (_, kept_large) = gpu_check.log_ends([small, large], 100)
    assert kept_small == b"short\n" and kept_large.endswith(b"line 999\n") and kept_large.startswith(b"line ")
    assert len(kept_small) + len(kept_large) <= 100


def test_no_part_starts_once_the_budget_is_spent(tmp_path):
    result, check = _check(tmp_path, "--budget_s", "0", "--parts", "device,reference")
    assert result.returncode == 1
    assert {part["status"] for part in check["parts"].values()} == {"not started"}


def test_the_gpu_check_shape_is_a_llama_with_the_reports_vocabulary_and_tied_head(tmp_path):
    from transformers import AutoModelForCausalLM

    from leantune.models.tiny import make_tiny_model

    small = dict(gpu_shape(), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", **small))
    assert model.config.vocab_size == 128_256 and model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.config.rope_parameters["rope_type"] == "llama3"
    with pytest.raises(ValueError, match="smaller than the tokenizer's"):
        make_tiny_model(tmp_path / "too-small", vocab_size=100)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_the_cuda_part_runs_every_gpu_marked_test_file():
    from gpu_check_parts import GPU_MARK

    names = {Path(name).name for name in gpu_marked_test_files()}
    assert {"test_lean_optimizers.py", "test_offload.py", "test_loss.py", "test_long_context.py",
            "test_gpu_constants.py"} <= names and "test_gpu_check.py" not in names
    mark = "pytest.mark." + "gpu"  # split, so that this file's own text holds no mark
    for marked in (f"@{mark}\ndef test_a(): ...", f"pytestmark = {mark}", f"pytest.param(1, marks={mark})"):
        assert GPU_MARK.search(marked), marked
    assert not GPU_MARK.search(f'text = "a string naming @{mark}"')


def _real_check(tmp_path: Path, *flags: str, pythonpath: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out),
                             "--work_dir", str(tmp_path / "work"), *flags], capture_output=True, text=True, env=env,
                            timeout=120)
    return result, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA device")
def test_without_a_gpu_the_check_says_so_and_stops_within_seconds(tmp_path):
    started = time.perf_counter()
    result, check = _real_check(tmp_path)
    assert result.returncode == 2 and time.perf_counter() - started < 120
    assert check["found"]["torch"] == torch.__version__ and check["parts"] == {}
    assert len(check["missing"]) == 1 and check["missing"][0].startswith("a CUDA device (torch ")
    assert check["needs"].startswith("gpu_check needs: a CUDA device") and check["needs"] in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == OUT_FILES


def test_an_image_with_an_older_transformers_is_named_with_what_it_needs(tmp_path):
    """The GPU image's transformers (5.17) seen first on the path: the line names it and the version wanted."""
    site = tmp_path / "image"
    info = site / "transformers-5.17.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.17.0\n")
    result, check = _real_check(tmp_path, "--dry_run", pythonpath=str(site))
    assert result.returncode == 2 and check["found"]["transformers"] == "5.17.0"
    assert check["missing"] == ["transformers<6,>=5.25 (found 5.17.0)"]
    assert "transformers<6,>=5.25 (found 5.17.0)" in check["needs"] and "gpu_wheels.py" in check["needs"]


def test_a_missing_or_old_requirement_is_named_and_extras_are_not_asked_for():
    from importlib.metadata import PackageNotFoundError

    import gpu_check_env

    installed = {"peft": "0.14.0", "torch": "2.11.0+cu130"}

    def version_of(name):
        if name not in installed:
            raise PackageNotFoundError(name)
        return installed[name]

    assert gpu_check_env.unmet(["torch>=2.6", "peft>=0.15", "bitsandbytes>=0.47", "wandb; extra == 'log'"],
                               version_of) == ["peft>=0.15 (found 0.14.0)", "bitsandbytes>=0.47 (not installed)"]
    needs = gpu_check_env.unmet_for_the_check(version_of, lambda name: ["huggingface-hub>=2.4.0"])
    assert "transformers<6,>=5.25 (not installed)" in needs and "datasets>=3 (not installed)" not in needs
    assert "huggingface-hub>=2.4.0 (not installed) for peft" in needs


def test_the_versions_found_are_written_before_anything_else_can_fail(tmp_path, monkeypatch):
    import gpu_check
    import gpu_check_env

    def broken(dry_run):
        raise RuntimeError("the needs could not be read")

    monkeypatch.setattr(gpu_check_env, "needs", broken)
    args = gpu_check.parse_args(["--out", str(tmp_path / "out"), "--work_dir", str(tmp_path / "work")])
    with pytest.raises(RuntimeError, match="could not be read"):
        gpu_check.prepare(args, time.perf_counter())
    written = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert written["found"]["torch"] == torch.__version__ and written["parts"] == {}


def test_the_carried_bitsandbytes_wheel_keeps_the_images_cuda_library_and_a_valid_record(tmp_path):
    """bitsandbytes' wheel holds a library for every CUDA release (43 MB): the carried one keeps the image's and
    the CPU's, and its RECORD lists exactly what is left, with each file's hash (pip installs it)."""
    import base64
    import hashlib
    import zipfile

    import gpu_wheels

    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-any.whl"
    files = {"bitsandbytes/__init__.py": b"", **{f"bitsandbytes/libbitsandbytes_{name}.so": name.encode() * 100
                                                 for name in ("cuda128", "cuda130", "cpu", "rocm64")}}
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr("bitsandbytes-0.50.2.dist-info/RECORD", "stale\n")
    gpu_wheels.keep_one_cuda(wheel, "130")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        record = archive.read("bitsandbytes-0.50.2.dist-info/RECORD").decode().splitlines()
    kept = {"bitsandbytes/__init__.py", "bitsandbytes/libbitsandbytes_cuda130.so",
            "bitsandbytes/libbitsandbytes_cpu.so"}
    assert names == kept | {"bitsandbytes-0.50.2.dist-info/RECORD"}
    digest = base64.urlsafe_b64encode(hashlib.sha256(b"cuda130" * 100).digest()).rstrip(b"=").decode()
    assert f"bitsandbytes/libbitsandbytes_cuda130.so,sha256={digest},700" in record
    assert {line.split(",")[0] for line in record} == names
    with pytest.raises(SystemExit, match="no library for CUDA 126"):
        gpu_wheels.keep_one_cuda(wheel, "126")
