"""What ``gpu_check.py`` finds on the machine before anything heavy is imported: the versions there, the wheels it
carried installed beside the image's packages, and one line naming whatever it still needs.

Only the standard library and ``packaging`` (which transformers needs, so any machine that could run the
check has it) are used here, so that a machine whose
transformers is too old, or that has no GPU, still gets a ``gpu_check.json`` saying so within seconds.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Callable

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# What the check reports the versions of (read from the installed metadata: nothing is imported).
WATCHED = ("torch", "triton", "transformers", "peft", "huggingface_hub", "tokenizers", "safetensors", "accelerate",
           "bitsandbytes", "torchao", "datasets", "numpy", "pytest", "psutil", "packaging")
# leantune's requirements that no part of the check needs (its JSON and JSONL data need no ``datasets``).
NOT_NEEDED_BY_THE_CHECK = {"datasets"}
# Installed packages whose own requirements are checked too: an old hub client breaks transformers' import.
CHECKED_DEEPLY = ("transformers", "peft")
ALSO_WANTED = {"bitsandbytes": "the qlora part and the 8-bit tests", "torchao": "the 4-bit AdamW test"}


def versions() -> dict:
    """Each watched distribution's version where it is installed (the first found on the path, as imports find)."""
    found = {}
    for name in WATCHED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def leantune_requirements() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def unmet(requirements: list[str], version_of: Callable[[str], str] = metadata.version) -> list[str]:
    """Each requirement the installed versions do not meet, as ``requirement (found X)`` or ``(not installed)``;
    requirements of an extra, or for another platform, are not asked for."""
    missing = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            found = version_of(requirement.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{requirement} (not installed)")
            continue
        if not requirement.specifier.contains(found, prereleases=True):
            missing.append(f"{requirement} (found {found})")
    return missing


def unmet_for_the_check(version_of: Callable[[str], str] = metadata.version,
                        requires_of: Callable[[str], list] = metadata.requires) -> list[str]:
    """leantune's requirements the check needs, and those of transformers and peft, that are not met."""
    wanted = [text for text in leantune_requirements() if Requirement(text).name not in NOT_NEEDED_BY_THE_CHECK]
    missing = unmet(wanted, version_of)
    for name in CHECKED_DEEPLY:
        try:
            own = requires_of(name) or []
        except metadata.PackageNotFoundError:
            continue  # said above, as one of leantune's own
        missing += [f"{line} for {name}" for line in unmet(own, version_of)]
    return missing


def install_wheels(wheels: Path, site: Path) -> str:
    """The carried wheels installed into ``site`` (no index, no dependencies: the folder holds what is needed),
    put first on this process's path and its children's, ahead of the image's own versions."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return f"--wheels {wheels}: no wheels there (python benchmarks/gpu_wheels.py --out {wheels} builds them)"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                             "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                             *map(str, found)], capture_output=True, text=True)
    if result.returncode != 0:
        return f"installing {len(found)} wheels from {wheels} failed: {result.stderr.strip()[-400:]}"
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    importlib.invalidate_caches()
    return f"installed {len(found)} wheels from {wheels} into {site}"


def _in_a_child(statement: str, limit_s: float) -> subprocess.CompletedProcess | None:
    """``statement`` run in a fresh interpreter with this path; None when it gave no answer in ``limit_s``."""
    try:
        return subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return None


def imports_in_a_child(statement: str, limit_s: float = 120) -> str | None:
    """None where ``statement`` runs in a fresh interpreter with this path; else its last error line."""
    result = _in_a_child(statement, limit_s)
    if result is None:
        return f"no answer in {limit_s:.0f} s"
    if result.returncode == 0:
        return None
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit {result.returncode}"


def cuda_device_count() -> tuple[int, str]:
    """CUDA devices torch sees, asked in a child (this process keeps no CUDA context), and torch's version."""
    result = _in_a_child("import torch; print(torch.cuda.device_count(), torch.__version__)", 120)
    if result is None:
        return 0, "torch gave no answer in 120 s"
    if result.returncode != 0:
        return 0, "torch does not import"
    count, version = result.stdout.split()[-2:]
    return int(count), version


def needs(dry_run: bool) -> list[str]:
    """Everything the check needs and lacks, each named; empty when it can run."""
    missing = unmet_for_the_check()
    if not missing:
        error = imports_in_a_child("import transformers, peft, leantune.finetuning")
        if error:
            missing.append(f"leantune does not import: {error}")
    if not dry_run:
        count, torch_version = cuda_device_count()
        if count == 0:
            missing.append(f"a CUDA device (torch {torch_version} sees none; --dry_run runs the check on the CPU)")
    return missing


def needs_line(missing: list[str]) -> str:
    if not missing:
        return "gpu_check has what it needs"
    return ("gpu_check needs: " + "; ".join(missing) + ". Wheels for the GPU image: python benchmarks/gpu_wheels.py "
            "--out gpu_wheels here, then gpu_check.py --wheels gpu_wheels there")


def optional_lines() -> dict:
    """bitsandbytes and torchao: whether each imports here (their CUDA libraries load), and what lacks them."""
    lines = {}
    for package, used_by in ALSO_WANTED.items():
        error = imports_in_a_child(f"import {package}")
        lines[package] = (f"{package}: installed" if error is None
                          else f"{package}: not usable ({error}): {used_by} skipped")
    return lines
