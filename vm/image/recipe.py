"""The guest image recipe and the pure parts of a build: inputs, stage keys, which stages must run.

A stage's key is a hash of exactly its inputs plus the key of the stage it builds on, so a changed input
invalidates that stage and everything after it, and nothing before it. Keys are pure functions of data:
the files under the recipe folder, the mirror, what the mirror serves, the CA's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

__all__ = [
    "ARTIFACT_STAGES",
    "STAGES",
    "CaCert",
    "ImageError",
    "Plan",
    "Recipe",
    "Sources",
    "Stage",
    "load_ca",
    "load_recipe",
    "mirror_id",
    "plan_stages",
    "probe_sources",
    "read_configured_mirror",
    "sources_text",
    "stage_keys",
]


class ImageError(Exception):
    """A build refused or failed; `code` is stable, `message` says what to do about it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Stage(StrEnum):
    PREREQUISITES = "prerequisites"
    DEBOOTSTRAP = "debootstrap"
    PACKAGES = "packages"
    CONFIGURE = "configure"
    CA = "ca"
    KERNEL = "kernel"
    FILESYSTEM = "filesystem"
    QCOW2 = "qcow2"
    MANIFEST = "manifest"


STAGES: tuple[Stage, ...] = tuple(Stage)
# Stages whose output is kept in the cache (the others are cheap, or feed the next stage directly).
ARTIFACT_STAGES: frozenset[Stage] = frozenset(
    {Stage.DEBOOTSTRAP, Stage.PACKAGES, Stage.CONFIGURE, Stage.KERNEL, Stage.QCOW2})
# Bump a stage's number when the code that runs it changes what it produces.
_LOGIC_VERSION: dict[Stage, int] = {
    Stage.DEBOOTSTRAP: 1, Stage.PACKAGES: 1, Stage.CONFIGURE: 1, Stage.CA: 1,
    Stage.KERNEL: 1, Stage.FILESYSTEM: 1, Stage.QCOW2: 1,
}
_TREE_STAGES = (Stage.DEBOOTSTRAP, Stage.PACKAGES, Stage.CONFIGURE, Stage.CA)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What `images/<recipe>/` says the image is."""

    path: Path
    suite: str
    variant: str
    disk_size_mib: int
    source_date_epoch: int
    """File times newer than this are clamped to it before the filesystem is made."""
    kernel_cmdline: str
    packages: tuple[str, ...]
    pre_install_hash: str
    """The files copied into the tree before apt runs (initramfs and dpkg settings)."""
    overlay_hash: str
    configure_hash: str
    ca_script_hash: str
    recipe_hash: str
    """Everything under the recipe folder, for the manifest."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_hash(root: Path) -> str:
    """A hash of the files under `root`: relative paths, whether executable, contents, symlink targets."""
    digest = hashlib.sha256()
    if root.is_file():
        digest.update(b"x" if root.stat().st_mode & 0o111 else b"-")
        digest.update(root.read_bytes())
        return digest.hexdigest()
    for path in sorted(p for p in root.rglob("*") if not p.is_dir() or p.is_symlink()):
        rel = path.relative_to(root).as_posix().encode()
        if path.is_symlink():
            digest.update(b"L" + rel + b"\0" + str(path.readlink()).encode() + b"\0")
        else:
            executable = b"x" if path.stat().st_mode & 0o111 else b"-"
            digest.update(b"F" + rel + b"\0" + executable + _sha256(path.read_bytes()).encode() + b"\0")
    return digest.hexdigest()


def _parse_packages(text: str) -> tuple[str, ...]:
    names = []
    for line in text.splitlines():
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", name):
            raise ImageError("bad_recipe", f"packages.list: {name!r} is not a Debian package name")
        names.append(name)
    return tuple(names)


def load_recipe(path: Path) -> Recipe:
    """Read a recipe folder; missing or malformed files are a `bad_recipe` error naming the file."""
    try:
        settings = tomllib.loads((path / "recipe.toml").read_text())
        packages = _parse_packages((path / "packages.list").read_text())
        for needed in ("pre-install", "overlay", "configure.sh", "ca.sh"):
            if not (path / needed).exists():
                raise ImageError("bad_recipe", f"{path / needed} is missing")
        return Recipe(
            path=path,
            suite=str(settings["suite"]),
            variant=str(settings.get("variant", "minbase")),
            disk_size_mib=int(settings["disk_size_mib"]),
            source_date_epoch=int(settings["source_date_epoch"]),
            kernel_cmdline=str(settings["kernel_cmdline"]),
            packages=packages,
            pre_install_hash=tree_hash(path / "pre-install"),
            overlay_hash=tree_hash(path / "overlay"),
            configure_hash=tree_hash(path / "configure.sh"),
            ca_script_hash=tree_hash(path / "ca.sh"),
            recipe_hash=tree_hash(path),
        )
    except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError) as exc:
        raise ImageError("bad_recipe", f"cannot read the recipe in {path}: {exc}") from None


# --- the mirror ---------------------------------------------------------------------------------------------------

def read_configured_mirror(sources_file: Path) -> str | None:
    """The first `URIs:` of the host's deb822 sources file (the mirror this machine installs from)."""
    try:
        text = sources_file.read_text()
    except OSError:
        return None
    match = re.search(r"^URIs:\s*(\S+)", text, re.MULTILINE)
    return match.group(1).rstrip("/") if match else None


def mirror_id(mirror: str) -> str:
    """Names the mirror in manifests and logs without writing its address."""
    return "sha256:" + _sha256(mirror.rstrip("/").encode())[:16]


@dataclass(frozen=True, kw_only=True)
class Sources:
    """Which suites the chroot's apt reads, and from where (all on the build mirror)."""

    mirror: str
    suite: str
    updates: bool
    security_uri: str | None

    def key_material(self) -> dict[str, object]:
        return {"updates": self.updates,
                "security": None if self.security_uri is None else _sha256(self.security_uri.encode())}

    def describe(self) -> str:
        parts = [self.suite, f"{self.suite}-updates" if self.updates else f"no {self.suite}-updates",
                 f"{self.suite}-security" if self.security_uri else f"no {self.suite}-security"]
        return ", ".join(parts)


def probe_sources(mirror: str, suite: str, exists: Callable[[str], bool]) -> Sources:
    """Ask the mirror whether it serves `<suite>-updates` and `<suite>-security`; `exists(url)` does the I/O.

    Security updates live at `<mirror>-security` on Debian's own layout (`.../debian` → `.../debian-security`);
    some mirrors carry them in the main tree instead. Either is fine; neither means the image goes without."""
    mirror = mirror.rstrip("/")
    updates = exists(f"{mirror}/dists/{suite}-updates/InRelease")
    candidates = [f"{mirror}-security", mirror] if mirror.endswith("/debian") else [mirror]
    security = next((uri for uri in candidates if exists(f"{uri}/dists/{suite}-security/InRelease")), None)
    return Sources(mirror=mirror, suite=suite, updates=updates, security_uri=security)


def sources_text(sources: Sources) -> str:
    """The chroot's `/etc/apt/sources.list.d/debian.sources` while packages are installed."""
    suites = sources.suite + (f" {sources.suite}-updates" if sources.updates else "")
    stanzas = [f"Types: deb\nURIs: {sources.mirror}\nSuites: {suites}\nComponents: main\n"
               "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"]
    if sources.security_uri:
        stanzas.append(f"Types: deb\nURIs: {sources.security_uri}\nSuites: {sources.suite}-security\n"
                       "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
    return "\n".join(stanzas)


# --- the deployment CA --------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class CaCert:
    pem: bytes
    fingerprint: str
    """sha256 of the DER certificate, hex."""
    subject: str


def load_ca(path: Path) -> CaCert:
    """One PEM certificate that may sign server certificates (the egress proxy's CA)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ImageError("bad_ca_cert", f"cannot read --ca-cert {path}: {exc.strerror}") from None
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ImageError("bad_ca_cert", f"{path} holds no PEM certificate") from None
    if len(certs) != 1:
        raise ImageError("bad_ca_cert", f"{path} holds {len(certs)} certificates; give exactly one")
    cert = certs[0]
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise ImageError("bad_ca_cert", f"{path} is not a CA certificate (basicConstraints CA:TRUE is missing)")
    return CaCert(pem=cert.public_bytes(serialization.Encoding.PEM),
                  fingerprint=cert.fingerprint(hashes.SHA256()).hex(), subject=cert.subject.rfc4514_string())


# --- stage keys and the plan --------------------------------------------------------------------------------------

def _key(stage: Stage, previous: str | None, inputs: Mapping[str, object]) -> str:
    material = {"stage": stage.value, "logic": _LOGIC_VERSION[stage], "previous": previous, "inputs": inputs}
    return _sha256(json.dumps(material, sort_keys=True).encode())[:20]


def stage_keys(recipe: Recipe, sources: Sources, ca_fingerprint: str | None) -> dict[Stage, str]:
    """The cache key of every cached or cacheable stage, each built on the one whose output it starts from."""
    keys: dict[Stage, str] = {}
    keys[Stage.DEBOOTSTRAP] = _key(Stage.DEBOOTSTRAP, None, {
        "suite": recipe.suite, "variant": recipe.variant, "mirror": mirror_id(sources.mirror)})
    keys[Stage.PACKAGES] = _key(Stage.PACKAGES, keys[Stage.DEBOOTSTRAP], {
        "packages": sorted(set(recipe.packages)), "pre_install": recipe.pre_install_hash,
        "sources": sources.key_material()})
    keys[Stage.CONFIGURE] = _key(Stage.CONFIGURE, keys[Stage.PACKAGES], {
        "overlay": recipe.overlay_hash, "configure": recipe.configure_hash})
    keys[Stage.CA] = _key(Stage.CA, keys[Stage.CONFIGURE], {
        "ca": ca_fingerprint or "none", "script": recipe.ca_script_hash})
    # The kernel and initrd are what the packages stage installed; nothing later touches /boot.
    keys[Stage.KERNEL] = _key(Stage.KERNEL, keys[Stage.PACKAGES], {})
    keys[Stage.FILESYSTEM] = _key(Stage.FILESYSTEM, keys[Stage.CA], {
        "disk_size_mib": recipe.disk_size_mib, "source_date_epoch": recipe.source_date_epoch})
    keys[Stage.QCOW2] = _key(Stage.QCOW2, keys[Stage.FILESYSTEM], {})
    return keys


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a build does, given which stage outputs are already in the cache."""

    start_from: Stage | None
    """The cached tree the build unpacks to continue from; None: start with debootstrap (or need no tree)."""
    run: tuple[Stage, ...]
    """The build stages that run, in order; every other build stage is reused from the cache."""

    def reused(self) -> tuple[Stage, ...]:
        return tuple(s for s in STAGES if s not in self.run and s not in (Stage.PREREQUISITES, Stage.MANIFEST))


def plan_stages(cached: frozenset[Stage]) -> Plan:
    """Run the fewest stages that produce a missing output: the image (qcow2) and the kernel files.

    A tree is needed when either is missing; it is unpacked from the latest cached tree stage it needs
    (the kernel needs the tree only as far as the packages stage)."""
    need_image = Stage.QCOW2 not in cached
    need_kernel = Stage.KERNEL not in cached
    if not need_image and not need_kernel:
        return Plan(start_from=None, run=())
    last_tree_stage = Stage.CA if need_image else Stage.PACKAGES
    wanted = _TREE_STAGES[: _TREE_STAGES.index(last_tree_stage) + 1]
    start_from = next((s for s in reversed(wanted) if s in cached and s in ARTIFACT_STAGES), None)
    first = 0 if start_from is None else wanted.index(start_from) + 1
    run = list(wanted[first:])
    if need_kernel:
        run.append(Stage.KERNEL)
    if need_image:
        run += [Stage.FILESYSTEM, Stage.QCOW2]
    return Plan(start_from=start_from, run=tuple(run))
