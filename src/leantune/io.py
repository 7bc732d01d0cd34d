"""Writing outputs so that a crash never leaves a half-written file where a good one was."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def leantune_home() -> Path:
    """Where leantune keeps what it makes for itself (``$LEANTUNE_HOME``, else ``~/.cache/leantune``)."""
    return Path(os.environ.get("LEANTUNE_HOME", Path.home() / ".cache" / "leantune"))


@contextmanager
def atomic_file(path: str | Path):
    """Yield a temporary path beside ``path`` to write; on success it is renamed over ``path``, else removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, data) -> None:
    """Write JSON to a temporary file beside ``path`` and rename it over ``path``."""
    atomic_write_text(path, json.dumps(data, indent=2))


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def staged_directory(target: str | Path):
    """Yield an empty staging directory; on success move every file in it into ``target``.

    Files already in ``target`` (logs, metrics) stay; each saved file replaces its old version in
    one rename, so ``target`` holds either the old file or the complete new one, never a fragment.
    On an exception the staging directory is removed and ``target`` is untouched.
    """
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".saving-", dir=target))
    try:
        yield staging
        for item in sorted(staging.rglob("*")):
            if item.is_file():
                dest = target / item.relative_to(staging)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(item, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
