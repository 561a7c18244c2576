"""The stages of an image build and the cache that keeps their outputs.

Each cached output is a directory `<cache>/<stage>-<key>/` holding the files and a `meta.json`; it is written
under a temporary name and renamed into place only when complete, so an interrupted build never leaves a
half-written entry that a later build would trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wakeful.vm.image.recipe import CaCert, ImageError, Recipe, Sources, Stage, sources_text
from wakeful.vm.image.system import (
    CommandRunner,
    clamp_mtimes,
    copy_overlay,
    extract_vmlinux,
    pack_tree,
    remove_tree,
    sha256_file,
    unpack_tree,
)

__all__ = ["Cache", "StageContext", "run_stage", "unpack_cached_tree"]

TARBALL = "rootfs.tar.zst"
META = "meta.json"
# Modules the initrd must carry to mount the root filesystem on a virtio disk.
INITRD_MUST_HAVE = ("virtio_blk", "virtio_pci", "ext4")


class Cache:
    """Stage outputs by key under one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def entry(self, stage: Stage, key: str) -> Path:
        return self.root / f"{stage.value}-{key}"

    def has(self, stage: Stage, key: str) -> bool:
        return (self.entry(stage, key) / META).is_file()

    def meta(self, stage: Stage, key: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.entry(stage, key) / META).read_text())
        return data

    def touch(self, stage: Stage, key: str) -> None:
        """Mark an entry as used now (pruning keeps the most recently used)."""
        os.utime(self.entry(stage, key) / META)

    @contextlib.contextmanager
    def store(self, stage: Stage, key: str, meta: dict[str, Any]) -> Iterator[Path]:
        """A temporary directory to fill; on success `meta` (which the block may extend) is written and the
        directory renamed into place. On failure it is deleted."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{stage.value}-{key}.tmp-{os.getpid()}-{os.urandom(3).hex()}"
        tmp.mkdir()
        try:
            yield tmp
            (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            final = self.entry(stage, key)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)

    def remove_stale(self) -> list[str]:
        """Delete leftovers of builds that were killed (the caller holds the build lock)."""
        stale = [p for p in self.root.glob("*") if ".tmp-" in p.name or p.name.startswith("work-")]
        for path in stale:
            remove_tree(path)
        return [p.name for p in stale]

    def prune(self, keep_keys: dict[Stage, str], keep: int = 2) -> list[str]:
        """Per stage, keep the entries this build used and the most recently used others, up to `keep`."""
        removed = []
        for stage in Stage:
            entries = [p for p in self.root.glob(f"{stage.value}-*") if (p / META).is_file()
                       and re.fullmatch(rf"{stage.value}-[0-9a-f]+", p.name)]
            entries.sort(key=lambda p: (p.name == f"{stage.value}-{keep_keys.get(stage)}",
                                        (p / META).stat().st_mtime), reverse=True)
            for path in entries[keep:]:
                shutil.rmtree(path)
                removed.append(path.name)
        return removed


@dataclass(kw_only=True)
class StageContext:
    recipe: Recipe
    sources: Sources
    ca: CaCert | None
    keys: dict[Stage, str]
    cache: Cache
    runner: CommandRunner
    tree: Path
    """The root filesystem being built (a temporary directory)."""
    work: Path
    """Scratch space next to the tree (the raw filesystem image)."""
    now: str
    """Build time, ISO 8601 UTC, recorded in the metadata of what this build makes."""


def unpack_cached_tree(ctx: StageContext, stage: Stage) -> None:
    unpack_tree(ctx.runner, ctx.cache.entry(stage, ctx.keys[stage]) / TARBALL, ctx.tree)
    ctx.cache.touch(stage, ctx.keys[stage])


def _store_tree(ctx: StageContext, stage: Stage, extra: dict[str, Any] | None = None) -> None:
    with ctx.cache.store(stage, ctx.keys[stage], {"built_at": ctx.now, **(extra or {})}) as out:
        pack_tree(ctx.runner, ctx.tree, out / TARBALL)


def _debootstrap(ctx: StageContext) -> str:
    ctx.tree.mkdir(parents=True, exist_ok=True)
    ctx.runner.run(["unshare", "--mount", "--propagation", "private", "--",
                    "debootstrap", f"--variant={ctx.recipe.variant}", "--components=main",
                    ctx.recipe.suite, str(ctx.tree), ctx.sources.mirror], what="debootstrap")
    _store_tree(ctx, Stage.DEBOOTSTRAP)
    return f"{ctx.recipe.suite} {ctx.recipe.variant}"


def _packages(ctx: StageContext) -> str:
    tree = ctx.tree
    (tree / "etc/apt/sources.list").unlink(missing_ok=True)
    (tree / "etc/apt/sources.list.d").mkdir(parents=True, exist_ok=True)
    (tree / "etc/apt/sources.list.d/debian.sources").write_text(sources_text(ctx.sources))
    resolv = tree / "etc/resolv.conf"
    resolv.unlink(missing_ok=True)
    shutil.copyfile("/etc/resolv.conf", resolv)
    policy = tree / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\n# no daemons start while the image is built\nexit 101\n")
    policy.chmod(0o755)
    copy_overlay(ctx.recipe.path / "pre-install", tree)
    try:
        apt = ["apt-get", "-y", "-o", "APT::Install-Recommends=false", "-o", "Dpkg::Options::=--force-confold"]
        ctx.runner.chroot(tree, ["apt-get", "update"], what="apt-get update")
        ctx.runner.chroot(tree, [*apt, "dist-upgrade"], what="apt-get dist-upgrade")
        ctx.runner.chroot(tree, [*apt, "install", *ctx.recipe.packages], what="apt-get install")
        ctx.runner.chroot(tree, ["apt-get", "clean"], what="apt-get clean")
        kernel = _kernel_version(tree)
        listing = ctx.runner.chroot(tree, ["lsinitramfs", f"/boot/initrd.img-{kernel}"], what="lsinitramfs")
        missing = [m for m in INITRD_MUST_HAVE if not re.search(rf"/{m}\.ko(\.\w+)?$", listing, re.MULTILINE)]
        if missing:
            raise ImageError("initrd", f"the initrd lacks {', '.join(missing)}: see pre-install/etc/initramfs-tools")
        query = ctx.runner.chroot(tree, ["dpkg-query", "-W", "-f", "${Package}\t${Version}\n"], what="dpkg-query")
    finally:
        policy.unlink(missing_ok=True)
        resolv.unlink(missing_ok=True)
        shutil.rmtree(tree / "var/lib/apt/lists", ignore_errors=True)
        (tree / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    versions = dict(sorted(line.split("\t", 1) for line in query.splitlines() if "\t" in line))
    _store_tree(ctx, Stage.PACKAGES, {"packages": versions, "kernel": kernel, "sources": ctx.sources.describe()})
    return f"{len(versions)} packages, kernel {kernel}; {ctx.sources.describe()}"


def _kernel_version(tree: Path) -> str:
    versions = sorted((p.name.removeprefix("vmlinuz-") for p in (tree / "boot").glob("vmlinuz-*")),
                      key=lambda v: [int(x) if x.isdigit() else x for x in re.split(r"[.-]", v)])
    if not versions:
        raise ImageError("kernel", "no /boot/vmlinuz-* in the tree: is linux-image-amd64 in packages.list?")
    return versions[-1]


def _configure(ctx: StageContext) -> str:
    copied = copy_overlay(ctx.recipe.path / "overlay", ctx.tree)
    script = ctx.tree / "tmp/wakeful-configure.sh"
    shutil.copyfile(ctx.recipe.path / "configure.sh", script)
    script.chmod(0o755)
    try:
        ctx.runner.chroot(ctx.tree, ["/bin/sh", "/tmp/wakeful-configure.sh"], what="configure.sh")
    finally:
        script.unlink(missing_ok=True)
    leftover = sorted(p.name for p in (ctx.tree / "etc/ssh").glob("ssh_host_*"))
    if leftover:
        raise ImageError("host_keys", f"host keys left in the image: {', '.join(leftover)}")
    _store_tree(ctx, Stage.CONFIGURE)
    return f"{len(copied)} recipe files installed"


def _ca(ctx: StageContext) -> str:
    if ctx.ca is None:
        return "no --ca-cert given: the image trusts no deployment CA"
    target = ctx.tree / "usr/local/share/ca-certificates/wakeful.crt"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(ctx.ca.pem)
    target.chmod(0o644)
    script = ctx.tree / "tmp/wakeful-ca.sh"
    shutil.copyfile(ctx.recipe.path / "ca.sh", script)
    try:
        ctx.runner.chroot(ctx.tree, ["/bin/sh", "/tmp/wakeful-ca.sh"], what="ca.sh")
    finally:
        script.unlink(missing_ok=True)
    return f"trusted {ctx.ca.subject} (sha256 {ctx.ca.fingerprint[:16]}…)"


def _kernel(ctx: StageContext) -> str:
    version = _kernel_version(ctx.tree)
    meta: dict[str, Any] = {"built_at": ctx.now, "kernel": version, "files": {}}
    with ctx.cache.store(Stage.KERNEL, ctx.keys[Stage.KERNEL], meta) as out:
        shutil.copyfile(ctx.tree / f"boot/vmlinuz-{version}", out / "vmlinuz")
        shutil.copyfile(ctx.tree / f"boot/initrd.img-{version}", out / "initrd.img")
        (out / "vmlinux").write_bytes(extract_vmlinux((out / "vmlinuz").read_bytes()))
        for name in ("vmlinuz", "initrd.img", "vmlinux"):
            (out / name).chmod(0o644)
            meta["files"][name] = {"sha256": sha256_file(out / name), "size": (out / name).stat().st_size}
    return f"{version}: initrd {meta['files']['initrd.img']['size'] / 2**20:.1f} MiB"


def _raw_path(ctx: StageContext) -> Path:
    return ctx.work / "root.raw"


def _filesystem(ctx: StageContext) -> str:
    epoch = ctx.recipe.source_date_epoch
    clamp_mtimes(ctx.tree, epoch)
    # A UUID and directory hash seed derived from the stage key, and a fixed superblock time: the same tree
    # gives the same filesystem metadata (file order inside it still follows the tree's directory order).
    fs_uuid = str(uuid.UUID(hex=(ctx.keys[Stage.FILESYSTEM] * 2)[:32]))
    env = {"SOURCE_DATE_EPOCH": str(epoch), "E2FSPROGS_FAKE_TIME": str(epoch)}
    ctx.runner.run(["mkfs.ext4", "-q", "-F", "-L", "wakeful-root", "-U", fs_uuid, "-E", f"hash_seed={fs_uuid}",
                    "-m", "1", "-d", str(ctx.tree), str(_raw_path(ctx)), f"{ctx.recipe.disk_size_mib}M"],
                   what="mkfs.ext4", env=env)
    return f"ext4 {ctx.recipe.disk_size_mib} MiB"


def _qcow2(ctx: StageContext) -> str:
    raw = _raw_path(ctx)
    meta: dict[str, Any] = {"built_at": ctx.now}
    try:
        with ctx.cache.store(Stage.QCOW2, ctx.keys[Stage.QCOW2], meta) as out:
            image = out / "base.qcow2"
            ctx.runner.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", "-o", "compat=1.1",
                            str(raw), str(image)], what="qemu-img convert")
            image.chmod(0o444)
            meta["files"] = {"base.qcow2": {"sha256": sha256_file(image), "size": image.stat().st_size}}
    finally:
        raw.unlink(missing_ok=True)
    return f"{meta['files']['base.qcow2']['size'] / 2**30:.2f} GiB"


_RUNNERS = {
    Stage.DEBOOTSTRAP: _debootstrap,
    Stage.PACKAGES: _packages,
    Stage.CONFIGURE: _configure,
    Stage.CA: _ca,
    Stage.KERNEL: _kernel,
    Stage.FILESYSTEM: _filesystem,
    Stage.QCOW2: _qcow2,
}


def run_stage(ctx: StageContext, stage: Stage) -> str:
    """Run one build stage against the context's tree; returns a one-line summary."""
    return _RUNNERS[stage](ctx)
