"""Build the folder of wheels the GPU machine's image lacks, for ``gpu_check.py --wheels DIR``.

    python benchmarks/gpu_wheels.py --out gpu_wheels          # here, with a package index; then carry gpu_wheels

The GPU image (Python 3.12, CUDA PyTorch 2.11 built for CUDA 13.0, transformers 5.17; no package index)
lacks what leantune's check needs: transformers >= 5.25 with the hub client it imports (huggingface_hub 2.x,
which talks through httpx2), peft at the version tested here, bitsandbytes (QLoRA, 8-bit AdamW) and torchao
(4-bit AdamW). Everything a device call carries counts against 64 MiB, and bitsandbytes' wheel alone is 43 MB
(its CUDA libraries for every CUDA release): its wheel is rebuilt with the library of the image's CUDA and the
CPU one only. The folder is checked against the limit before it is called done.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# The versions this checkout is tested with (CI installs them here), and their needs that the image's own
# versions may not meet; numpy, torch, safetensors, tokenizers, pyyaml, tqdm, packaging, psutil, accelerate
# are the image's own.
WHEELS = ("transformers==5.25.0", "huggingface_hub==2.4.0", "httpx2==2.17.0", "httpcore2==2.17.0",
          "truststore==0.10.5", "kernels==0.19.1", "tomlkit==0.15.3", "click==8.5.1", "hf-xet==1.8.0",
          "regex==2026.12.2", "anyio==4.16.0", "idna==3.21", "peft==0.21.2", "bitsandbytes==0.50.2",
          "torchao==0.18.0")
CARRY_LIMIT = 64 << 20  # what one device call carries, the checkout included
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def download(requirement: str, out: Path, python: str) -> None:
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "--dest", str(out),
                    requirement], check=True)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def keep_one_cuda(wheel: Path, cuda: str) -> Path:
    """bitsandbytes' wheel rebuilt with ``libbitsandbytes_cuda{cuda}.so`` and the CPU library only (the one
    bitsandbytes loads is named by ``torch.version.cuda``); its RECORD rewritten to match."""
    keep = {f"libbitsandbytes_cuda{cuda}.so", "libbitsandbytes_cpu.so"}
    staged = wheel.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(staged, "w", zipfile.ZIP_DEFLATED) as target:
        names = [name for name in source.namelist() if not (Path(name).name.startswith("libbitsandbytes_")
                                                            and Path(name).name not in keep)]
        if not any(Path(name).name == f"libbitsandbytes_cuda{cuda}.so" for name in names):
            raise SystemExit(f"{wheel.name} has no library for CUDA {cuda}: give --cuda as torch.version.cuda "
                             "without its dot (13.0 -> 130)")
        record = next(name for name in names if name.endswith(".dist-info/RECORD"))
        lines = []
        for name in names:
            if name != record:
                data = source.read(name)
                target.writestr(source.getinfo(name), data)
                lines.append(_record_line(name, data))
        target.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
    staged.replace(wheel)
    return wheel


def build(out: Path, python: str, cuda: str) -> int:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for requirement in WHEELS:
        download(requirement, out, python)
    keep_one_cuda(next(out.glob("bitsandbytes-*.whl")), cuda)
    total = sum(path.stat().st_size for path in out.iterdir())
    for path in sorted(out.iterdir()):
        print(f"{path.stat().st_size / 2**20:7.1f} MiB  {path.name}")
    print(f"{total / 2**20:7.1f} MiB  in all (a device call carries {CARRY_LIMIT >> 20} MiB, the checkout included)")
    return 0 if total < CARRY_LIMIT else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_wheels"), help="the folder to fill (emptied first)")
    parser.add_argument("--python", default="3.12", help="the GPU image's Python (its wheels' tag)")
    parser.add_argument("--cuda", default="130", help="the image's torch.version.cuda without its dot")
    args = parser.parse_args(argv)
    return build(args.out, args.python, args.cuda)


if __name__ == "__main__":
    sys.exit(main())
