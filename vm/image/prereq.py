"""What the build machine must have before a build starts: root, the commands, the keyring, disk space, a mirror.

Pure: the environment comes in as arguments (PATH, the effective uid, a free-space function), so the checker is
tested without touching the machine.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MIN_FREE_BYTES", "REQUIRED_COMMANDS", "Problem", "check_prerequisites", "free_bytes"]

GIB = 1 << 30
MIN_FREE_BYTES = 5 * GIB
"""A cold build holds the unpacked tree, two tarballs, the raw filesystem and the qcow2 at its peak."""

REQUIRED_COMMANDS: dict[str, str] = {
    # command: the Debian package that provides it
    "debootstrap": "debootstrap",
    "unshare": "util-linux",
    "chroot": "coreutils",
    "tar": "tar",
    "zstd": "zstd",
    "mkfs.ext4": "e2fsprogs",
    "qemu-img": "qemu-utils",
}
ARCHIVE_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")


@dataclass(frozen=True, kw_only=True)
class Problem:
    code: str
    message: str


def free_bytes(path: Path) -> int:
    """Free space on the filesystem that holds `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_prerequisites(*, euid: int, path: str, cache_dir: Path, free: Callable[[Path], int],
                        mirror: str | None, keyring: Path = ARCHIVE_KEYRING,
                        min_free: int = MIN_FREE_BYTES) -> list[Problem]:
    """Every reason the build cannot start, each naming what to do; empty when it can."""
    problems: list[Problem] = []
    if euid != 0:
        problems.append(Problem(code="not_root", message=(
            "building the image needs root (debootstrap, chroot and device nodes in the tree); run it as root")))
    missing = [(cmd, pkg) for cmd, pkg in REQUIRED_COMMANDS.items() if shutil.which(cmd, path=path) is None]
    for cmd, pkg in missing:
        problems.append(Problem(code="missing_command",
                                message=f"`{cmd}` is not on PATH; install the Debian package `{pkg}`"))
    if not keyring.exists():
        problems.append(Problem(code="missing_keyring", message=(
            f"{keyring} is missing (debootstrap checks the mirror's signatures with it); "
            "install the Debian package `debian-archive-keyring`")))
    if mirror is None:
        problems.append(Problem(code="no_mirror", message=(
            "no Debian mirror: /etc/apt/sources.list.d/debian.sources has no URIs line; pass --mirror URL")))
    available = free(cache_dir)
    if available < min_free:
        problems.append(Problem(code="low_disk_space", message=(
            f"{available / GIB:.1f} GiB free on the filesystem of {cache_dir}; "
            f"a build needs {min_free / GIB:.0f} GiB (free some space or pass another --data-dir)")))
    return problems
