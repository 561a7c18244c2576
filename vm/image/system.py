"""The I/O of an image build: commands, chroots, tarballs, trees, the vmlinux inside a bzImage.

Chroot commands run in a private mount namespace (`unshare --mount`): the /proc, /sys and /dev mounts they need
exist only there and vanish with the command, so an interrupted build never leaves the host's /dev bind-mounted
into a tree that is about to be deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import lzma
import os
import shutil
import signal
import subprocess
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from wakeful.vm.image.recipe import ImageError

__all__ = [
    "CommandRunner",
    "copy_overlay",
    "extract_vmlinux",
    "kill_tree_processes",
    "pack_tree",
    "remove_tree",
    "sha256_file",
    "unpack_tree",
]

CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
              "DEBIAN_FRONTEND": "noninteractive", "DEBCONF_NONINTERACTIVE_SEEN": "true"}
_NAMESPACED_CHROOT = """set -e
tree=$1; shift
mount -t proc proc "$tree/proc"
mount -t sysfs sysfs "$tree/sys"
mount --rbind /dev "$tree/dev"
exec chroot "$tree" "$@"
"""


class CommandRunner:
    """Runs commands with their output streamed (redacted) into a log and to `on_line`; failures raise.

    `redact` strings (the mirror's address) never reach the log, the screen or an error message."""

    def __init__(self, log: Path, *, redact: Sequence[str] = (), on_line: Callable[[str], None] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.log = log
        self.redact = [r for r in redact if r]
        self.on_line = on_line
        self.env = dict(env) if env is not None else None

    def clean(self, text: str) -> str:
        for secret in self.redact:
            text = text.replace(secret, "<mirror>")
        return text

    def run(self, argv: Sequence[str], *, what: str, env: Mapping[str, str] | None = None) -> str:
        """Run `argv`, return its (redacted) output; a non-zero exit raises `command_failed` with the last lines."""
        full_env = {**os.environ, **(self.env or {}), **(env or {})}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        tail: deque[str] = deque(maxlen=15)
        lines: list[str] = []
        with self.log.open("a") as log:
            log.write(self.clean(f"$ {' '.join(argv)}\n"))
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, text=True, errors="replace")
            try:
                assert proc.stdout is not None
                for raw in proc.stdout:
                    line = self.clean(raw.rstrip("\n"))
                    log.write(line + "\n")
                    tail.append(line)
                    lines.append(line)
                    if self.on_line and line.strip():
                        self.on_line(line)
                code = proc.wait()
            except BaseException:
                _stop(proc)
                raise
        if code != 0:
            shown = "\n  ".join(tail)
            raise ImageError("command_failed", f"{what} failed (exit {code}); last lines:\n  {shown}\n"
                                               f"full log: {self.log}")
        return "\n".join(lines)

    def chroot(self, tree: Path, argv: Sequence[str], *, what: str) -> str:
        """Run `argv` inside `tree` with /proc, /sys and /dev mounted in a private mount namespace."""
        wrapped = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _NAMESPACED_CHROOT,
                   "wakeful-chroot", str(tree), "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in CHROOT_ENV.items()),
                   *argv]
        try:
            return self.run(wrapped, what=what)
        finally:
            kill_tree_processes(tree)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop a child we started (Ctrl-C, an error while reading its output), by its PID."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kill_tree_processes(tree: Path) -> list[int]:
    """Kill processes whose root directory is inside `tree` (daemons a package script left behind). Returns PIDs.

    Only the build starts processes in its own temporary trees, so these are ours."""
    tree = tree.resolve()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            root = Path(os.readlink(entry / "root"))
        except OSError:
            continue
        if root == tree or tree in root.parents:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


def _mounts_under(path: Path) -> list[Path]:
    path = path.resolve()
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = Path(line.split()[4].encode().decode("unicode_escape"))
        if point == path or path in point.parents:
            found.append(point)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def remove_tree(path: Path) -> None:
    """Delete a build tree; first unmount anything mounted under it, and never delete through a mount."""
    if not path.exists() and not path.is_symlink():
        return
    kill_tree_processes(path)
    for point in _mounts_under(path):
        subprocess.run(["umount", "--lazy", str(point)], check=False, capture_output=True)
    left = _mounts_under(path)
    if left:
        raise ImageError("mounted", f"{left[0]} is still mounted; unmount it and delete {path} by hand")
    shutil.rmtree(path)


@contextlib.contextmanager
def temp_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A directory under `parent` that is removed however the block ends."""
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f"{prefix}{os.getpid()}-{os.urandom(3).hex()}"
    path.mkdir()
    try:
        yield path
    finally:
        remove_tree(path)


_TAR_FLAGS = ["--numeric-owner", "--xattrs", "--xattrs-include=*", "--use-compress-program=zstd -T0 -1"]


def pack_tree(runner: CommandRunner, tree: Path, tarball: Path) -> None:
    """Tar a tree with numeric owners and extended attributes, zstd-compressed."""
    runner.run(["tar", "--create", "--file", str(tarball), "--sort=name", *_TAR_FLAGS, "-C", str(tree), "."],
               what=f"packing {tree.name}")


def unpack_tree(runner: CommandRunner, tarball: Path, tree: Path) -> None:
    tree.mkdir(parents=True, exist_ok=True)
    runner.run(["tar", "--extract", "--file", str(tarball), "--same-permissions", "--same-owner", *_TAR_FLAGS,
                "-C", str(tree)], what=f"unpacking {tarball.name}")


def copy_overlay(source: Path, tree: Path) -> list[str]:
    """Copy recipe files into the tree, owned by root, 0755 if executable in the recipe else 0644."""
    copied = []
    for path in sorted(source.rglob("*")):
        target = tree / path.relative_to(source)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        shutil.copyfile(path, target)
        os.chown(target, 0, 0)
        target.chmod(0o755 if path.stat().st_mode & 0o111 else 0o644)
        copied.append("/" + path.relative_to(source).as_posix())
    return copied


def clamp_mtimes(tree: Path, epoch: int) -> int:
    """Set every time newer than `epoch` to `epoch` (SOURCE_DATE_EPOCH semantics). Returns how many changed."""
    changed = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in [*dirnames, *filenames, ""]:
            path = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(path)
            if st.st_mtime > epoch or st.st_atime > epoch:
                os.utime(path, (min(st.st_atime, epoch), min(st.st_mtime, epoch)), follow_symlinks=False)
                changed += 1
    return changed


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The uncompressed kernel (ELF, with a PVH entry) inside a Debian bzImage, whose payload is xz."""
    start = bzimage.find(b"\xfd7zXZ\x00")
    if start < 0:
        raise ImageError("kernel", "the kernel image has no xz payload (expected a Debian bzImage)")
    elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bzimage[start:])
    if not elf.startswith(b"\x7fELF"):
        raise ImageError("kernel", "the kernel's xz payload is not an ELF vmlinux")
    return elf


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
