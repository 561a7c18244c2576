"""qcow2 files through `qemu-img`: per-user overlays on the shared read-only base, and backing chains."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Protocol

from wakeful.vm.errors import HypervisorUnavailable, ImageMissing

__all__ = ["Disks", "QemuImg"]


class Disks(Protocol):
    def create_overlay(self, path: Path, *, backing: Path, size_bytes: int | None = None) -> None:
        """A new qcow2 at `path` backed by `backing` (never written); `size_bytes` grows the virtual size."""
        ...

    def virtual_size(self, path: Path) -> int:
        ...

    def backing_chain(self, path: Path) -> list[Path]:
        """`path` first, then each backing file down to the base."""
        ...


class QemuImg:
    def __init__(self, binary: str = "qemu-img") -> None:
        self._binary = binary

    def _run(self, *args: str) -> str:
        exe = shutil.which(self._binary)
        if exe is None:
            raise HypervisorUnavailable(f"{self._binary} is missing: apt-get install qemu-utils")
        done = subprocess.run([exe, *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise HypervisorUnavailable(f"qemu-img {args[0]} failed: {done.stderr.strip()}")
        return done.stdout

    def create_overlay(self, path: Path, *, backing: Path, size_bytes: int | None = None) -> None:
        if not backing.is_file():
            raise ImageMissing(f"the base image {backing} does not exist: build it with `wakeful image build`")
        args = ["create", "-q", "-f", "qcow2", "-b", str(backing.resolve()), "-F", "qcow2", str(path)]
        if size_bytes is not None:
            args.append(str(size_bytes))
        self._run(*args)

    def virtual_size(self, path: Path) -> int:
        return int(json.loads(self._run("info", "-U", "--output=json", str(path)))["virtual-size"])

    def backing_chain(self, path: Path) -> list[Path]:
        chain = json.loads(self._run("info", "-U", "--backing-chain", "--output=json", str(path)))
        return [Path(layer["filename"]) for layer in chain]
