"""Build the tool computer's guest image: Debian bookworm from packages only, staged and cached.

    prerequisites → debootstrap → packages → configure → ca → kernel → filesystem → qcow2 → manifest

`build_image` checks everything it needs before doing any work, reuses every stage whose inputs did not
change (see `vm.image.recipe.stage_keys`), and installs `<data_dir>/images/<name>/` (base.qcow2, vmlinuz,
vmlinux, initrd.img, manifest.json) only when the build succeeded. Progress goes to a `Reporter`; the CLI
draws it, tests record it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path
from typing import Any, Protocol

from wakeful.vm.image.prereq import MIN_FREE_BYTES, Problem, check_prerequisites, free_bytes
from wakeful.vm.image.recipe import (
    STAGES,
    CaCert,
    ImageError,
    Stage,
    load_ca,
    load_recipe,
    mirror_id,
    plan_stages,
    probe_sources,
    read_configured_mirror,
    stage_keys,
)
from wakeful.vm.image.stages import Cache, StageContext, run_stage, unpack_cached_tree
from wakeful.vm.image.system import CommandRunner, remove_tree, temp_dir

__all__ = [
    "DEFAULT_RECIPE",
    "MANIFEST_FORMAT",
    "BuildEnv",
    "BuildOptions",
    "BuildResult",
    "ImageError",
    "PrerequisitesMissing",
    "Reporter",
    "Stage",
    "build_image",
    "image_checksum",
    "make_manifest",
]

# The recipe ships as package data (`images/guest` in a checkout): an installed package is a folder on disk.
DEFAULT_RECIPE = Path(str(files("wakeful.images") / "guest"))
MANIFEST_FORMAT = 1
OUTPUT_FILES = {"base.qcow2": 0o444, "vmlinuz": 0o644, "vmlinux": 0o644, "initrd.img": 0o644}


class PrerequisitesMissing(ImageError):
    """The machine lacks something the build needs; `problems` lists every one."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(problems[0].code, "; ".join(f"{p.code}: {p.message}" for p in problems))
        self.problems = problems


class Reporter(Protocol):
    def stage_started(self, stage: Stage, index: int, total: int, action: str) -> None: ...
    def stage_line(self, line: str) -> None: ...
    def stage_finished(self, stage: Stage, status: str, seconds: float, detail: str) -> None: ...
    def note(self, message: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    data_dir: Path
    """Output goes to `<data_dir>/images/<name>/`, the cache to `<data_dir>/images/.cache/`."""
    name: str = "guest"
    recipe_dir: Path = DEFAULT_RECIPE
    mirror: str | None = None
    """The Debian mirror; None: the first URIs line of the host's debian.sources."""
    ca_cert: Path | None = None
    """A PEM CA certificate to trust in the guest (system store and chromium's NSS db)."""
    use_cache: bool = True
    """False: run every stage again (the cache is still refreshed)."""


def _url_exists(url: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=15) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass(frozen=True, kw_only=True)
class BuildEnv:
    """The machine as the build sees it; tests pass their own."""

    euid: int = field(default_factory=os.geteuid)
    path: str = field(default_factory=lambda: os.environ.get("PATH", ""))
    free: Callable[[Path], int] = free_bytes
    min_free: int = MIN_FREE_BYTES
    sources_file: Path = Path("/etc/apt/sources.list.d/debian.sources")
    url_exists: Callable[[str], bool] = _url_exists
    monotonic: Callable[[], float] = time.monotonic
    now: Callable[[], datetime] = lambda: datetime.now(UTC)


@dataclass(frozen=True, kw_only=True)
class BuildResult:
    image_dir: Path
    checksum: str
    manifest: dict[str, Any]
    ran: tuple[Stage, ...]
    reused: tuple[Stage, ...]


def image_checksum(files: dict[str, dict[str, Any]]) -> str:
    """One checksum for the image: sha256 over the sorted `name sha256` lines of its files."""
    lines = "".join(f"{name} {files[name]['sha256']}\n" for name in sorted(files))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def make_manifest(*, name: str, recipe_hash: str, suite: str, mirror: str, sources: str, ca: CaCert | None,
                  kernel: str, cmdline: str, files: dict[str, dict[str, Any]], packages: dict[str, str],
                  keys: dict[Stage, str], built_at: str) -> dict[str, Any]:
    """manifest.json: what the image is made of and the checksums of its files (the mirror only by hash)."""
    return {
        "format": MANIFEST_FORMAT,
        "name": name,
        "checksum": image_checksum(files),
        "built_at": built_at,
        "recipe_hash": recipe_hash,
        "suite": suite,
        "mirror": mirror_id(mirror),
        "sources": sources,
        "ca": None if ca is None else {"sha256": ca.fingerprint, "subject": ca.subject},
        "kernel": {"version": kernel, "cmdline": cmdline},
        "files": files,
        "packages": packages,
        "stage_keys": {stage.value: key for stage, key in keys.items()},
    }


@contextmanager
def _build_lock(cache_root: Path) -> Iterator[None]:
    cache_root.mkdir(parents=True, exist_ok=True)
    with (cache_root / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ImageError("busy", f"another image build is running with the cache {cache_root}") from None
        yield


def build_image(options: BuildOptions, reporter: Reporter, env: BuildEnv | None = None) -> BuildResult:
    env = env or BuildEnv()
    images = options.data_dir / "images"
    cache = Cache(images / ".cache")
    total = len(STAGES)
    clock = env.monotonic

    # prerequisites: every refusal happens here, before anything is written
    started = clock()
    reporter.stage_started(Stage.PREREQUISITES, 1, total, "check")
    mirror = (options.mirror or read_configured_mirror(env.sources_file) or "").rstrip("/") or None
    recipe = load_recipe(options.recipe_dir)
    ca = load_ca(options.ca_cert) if options.ca_cert is not None else None
    problems = check_prerequisites(euid=env.euid, path=env.path, cache_dir=cache.root, free=env.free,
                                   mirror=mirror, min_free=env.min_free)
    if problems:
        raise PrerequisitesMissing(problems)
    assert mirror is not None
    if not env.url_exists(f"{mirror}/dists/{recipe.suite}/InRelease"):
        raise ImageError("mirror_unreachable", f"the mirror ({mirror_id(mirror)}) does not answer for "
                                               f"dists/{recipe.suite}/InRelease; check the network or pass --mirror")
    sources = probe_sources(mirror, recipe.suite, env.url_exists)
    keys = stage_keys(recipe, sources, ca.fingerprint if ca else None)
    reporter.stage_finished(Stage.PREREQUISITES, "ok", clock() - started, f"apt sources: {sources.describe()}")
    if sources.security_uri is None or not sources.updates:
        reporter.note(f"the mirror does not serve all of {recipe.suite}-updates/-security; "
                      f"building with {sources.describe()}")
    if ca is None:
        reporter.note("no --ca-cert: building without a deployment CA (chromium will not trust the egress proxy)")

    with _build_lock(cache.root):
        stale = cache.remove_stale()
        if stale:
            reporter.note(f"removed leftovers of an interrupted build: {', '.join(stale)}")
        cached = frozenset(s for s, k in keys.items() if options.use_cache and cache.has(s, k))
        plan = plan_stages(cached)
        now = env.now().strftime("%Y-%m-%dT%H:%M:%SZ")
        logs = cache.root / "logs"
        shutil.rmtree(logs, ignore_errors=True)
        index = 1
        with temp_dir(cache.root, "work-") as work:
            ctx = StageContext(recipe=recipe, sources=sources, ca=ca, keys=keys, cache=cache, tree=work / "rootfs",
                               work=work, runner=CommandRunner(logs / "build.log", redact=[mirror]), now=now)
            for stage in STAGES[1:-1]:
                index += 1
                if stage not in plan.run:
                    reporter.stage_started(stage, index, total, "reuse")
                    if stage in keys and cache.has(stage, keys[stage]):
                        cache.touch(stage, keys[stage])
                    reporter.stage_finished(stage, "reused", 0.0, f"cache key {keys[stage]}")
                    continue
                reporter.stage_started(stage, index, total, "run")
                started = clock()
                ctx.runner = CommandRunner(logs / f"{stage.value}.log", redact=[mirror], on_line=reporter.stage_line)
                if stage is plan.run[0] and plan.start_from is not None:
                    reporter.stage_line(f"unpacking the cached {plan.start_from.value} tree")
                    unpack_cached_tree(ctx, plan.start_from)
                detail = run_stage(ctx, stage)
                if stage is Stage.FILESYSTEM:
                    remove_tree(ctx.tree)  # the raw image holds it now; free the space before the qcow2
                reporter.stage_finished(stage, "ran", clock() - started, detail)

        started = clock()
        reporter.stage_started(Stage.MANIFEST, total, total, "write")
        packages_meta = cache.meta(Stage.PACKAGES, keys[Stage.PACKAGES]) if cache.has(
            Stage.PACKAGES, keys[Stage.PACKAGES]) else None
        kernel_meta = cache.meta(Stage.KERNEL, keys[Stage.KERNEL])
        qcow2_meta = cache.meta(Stage.QCOW2, keys[Stage.QCOW2])
        if packages_meta is None:
            raise ImageError("cache", "the packages stage's record is missing from the cache; rebuild with --no-cache")
        manifest = make_manifest(
            name=options.name, recipe_hash=recipe.recipe_hash, suite=recipe.suite, mirror=mirror,
            sources=str(packages_meta["sources"]), ca=ca, kernel=str(kernel_meta["kernel"]),
            cmdline=recipe.kernel_cmdline, files={**qcow2_meta["files"], **kernel_meta["files"]},
            packages=packages_meta["packages"], keys=keys, built_at=str(qcow2_meta["built_at"]))
        changed = _install_output(images, options.name, manifest, {
            "base.qcow2": cache.entry(Stage.QCOW2, keys[Stage.QCOW2]) / "base.qcow2",
            **{n: cache.entry(Stage.KERNEL, keys[Stage.KERNEL]) / n for n in ("vmlinuz", "vmlinux", "initrd.img")}})
        removed = cache.prune(keys)
        detail = f"{images / options.name} {'written' if changed else 'unchanged'}"
        if removed:
            detail += f"; pruned {len(removed)} old cache entries"
        reporter.stage_finished(Stage.MANIFEST, "ok", clock() - started, detail)
    return BuildResult(image_dir=images / options.name, checksum=manifest["checksum"], manifest=manifest,
                       ran=plan.run, reused=plan.reused())


def _install_output(images: Path, name: str, manifest: dict[str, Any], files: dict[str, Path]) -> bool:
    """Put the image in `<images>/<name>/`, replacing the previous one only when it differs. Returns whether
    it was replaced. Files are hard links to the cache entries (copies across filesystems)."""
    target = images / name
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    current = target / "manifest.json"
    if current.is_file() and current.read_text() == text and all((target / n).is_file() for n in files):
        return False
    tmp = images / f".{name}.tmp-{os.getpid()}-{os.urandom(3).hex()}"
    old = images / f".{name}.old-{os.getpid()}-{os.urandom(3).hex()}"
    tmp.mkdir(parents=True)
    try:
        for out_name, source in files.items():
            try:
                os.link(source, tmp / out_name)
            except OSError:
                shutil.copyfile(source, tmp / out_name)
            (tmp / out_name).chmod(OUTPUT_FILES[out_name])
        (tmp / "manifest.json").write_text(text)
        (tmp / "manifest.json").chmod(0o644)
        if target.exists():
            target.rename(old)
        tmp.rename(target)
    finally:
        for leftover in (tmp, old):
            if leftover.exists():
                shutil.rmtree(leftover)
    return True
