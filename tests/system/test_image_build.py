"""`wakeful image build` makes a guest image that boots: files and modes, checksums, a rebuild that reuses every
stage, and what is (and is not) inside. That the image boots (sshd with the seeded host key, the desktop units,
chromium's CDP on the guest's loopback only) is asserted on the tool computer's own cold boot, in
test_vm_toolcomputer_image.py: one boot under TCG costs minutes, and the tool computer boots this image anyway."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from tests.support.debugfs import debugfs
from wakeful.vm.image.system import sha256_file

if TYPE_CHECKING:
    from tests.system.conftest import GuestImageBuild

# The first test here sets up the session's image build: a cold one takes about three minutes on an idle 2-core host and
# more than pytest's default 300 s on a busy one, so the module's tests get the bound the other image modules have.
pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]

UNITS = ("wakeful-seed", "wakeful-xvfb", "wakeful-wm", "wakeful-x11vnc", "wakeful-x11vnc-view", "wakeful-chromium",
         "bootmarker")


def test_the_build_writes_the_image_files_with_their_modes(guest_image: Path) -> None:
    modes = {p.name: p.stat().st_mode & 0o777 for p in guest_image.iterdir()}
    assert modes == {"base.qcow2": 0o444, "vmlinuz": 0o644, "vmlinux": 0o644, "initrd.img": 0o644,
                     "manifest.json": 0o644}
    assert (guest_image / "vmlinux").read_bytes()[:4] == b"\x7fELF"


def test_the_manifest_checksums_match_the_files(guest_image_build: GuestImageBuild) -> None:
    image = guest_image_build.image_dir
    manifest = json.loads((image / "manifest.json").read_text())
    assert set(manifest["files"]) == {"base.qcow2", "vmlinuz", "vmlinux", "initrd.img"}
    for name, record in manifest["files"].items():
        assert sha256_file(image / name) == record["sha256"], name
        assert (image / name).stat().st_size == record["size"], name
    assert f"checksum: {manifest['checksum']}" in guest_image_build.first_build.stdout
    assert manifest["packages"]["chromium"] and manifest["packages"]["openssh-server"]
    assert manifest["packages"][f"linux-image-{manifest['kernel']['version']}"]
    ca = x509.load_pem_x509_certificate(guest_image_build.ca_cert.read_bytes())
    assert manifest["ca"] == {"subject": ca.subject.rfc4514_string(),
                              "sha256": ca.fingerprint(hashes.SHA256()).hex()}


def documented_build_command() -> list[str]:
    """The build command docs/images.md shows (the only one it shows)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "images.md").read_text()
    commands = [line for line in text.splitlines() if "wakeful image build" in line and line.startswith("WAKEFUL_")]
    assert len(commands) == 1, commands
    return shlex.split(commands[0])


def test_the_documented_rebuild_with_nothing_changed_reuses_every_stage(guest_image_build: GuestImageBuild) -> None:
    image = guest_image_build.image_dir
    before = (image / "manifest.json").read_text()
    inode = (image / "base.qcow2").stat().st_ino
    assignment, wakeful, *args = documented_build_command()
    assert assignment.startswith("WAKEFUL_DATA_DIR=") and wakeful == "wakeful" and args[:3] == [
        "image", "build", "--ca-cert"]
    env = {**os.environ, "WAKEFUL_DATA_DIR": str(guest_image_build.data_dir), "COLUMNS": "200"}
    started = time.monotonic()
    again = subprocess.run([str(Path(sys.executable).parent / "wakeful"), *args[:3], str(guest_image_build.ca_cert)],
                           env=env, capture_output=True, text=True, timeout=600, check=False)
    print(f"\nrebuild with nothing changed: {time.monotonic() - started:.1f} s")
    assert again.returncode == 0, again.stderr
    for stage in ("debootstrap", "packages", "configure", "ca", "kernel", "filesystem", "qcow2"):
        assert re.search(rf"^\s+{stage}\s+reused\b", again.stderr, re.MULTILINE), (stage, again.stderr)
    assert "Nothing changed: reused all 7 stages from the cache." in again.stderr
    assert f"checksum: {json.loads(before)['checksum']}" in again.stdout
    assert (image / "manifest.json").read_text() == before and (image / "base.qcow2").stat().st_ino == inode


# --- what is inside ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def root_fs(guest_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The image's root filesystem as a raw file, read with debugfs (no mount)."""
    raw = tmp_path_factory.mktemp("rootfs") / "root.raw"
    subprocess.run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(guest_image / "base.qcow2"), str(raw)],
                   check=True, timeout=300)
    yield raw
    raw.unlink()


def listing(raw: Path, directory: str) -> set[str]:
    return {line.split("/")[5] for line in debugfs(raw, f"ls -p {directory}").splitlines() if line.count("/") >= 6}


def test_the_image_has_the_units_enabled(root_fs: Path) -> None:
    units = listing(root_fs, "/etc/systemd/system")
    assert {f"{u}.service" for u in UNITS} <= units
    wanted = listing(root_fs, "/etc/systemd/system/multi-user.target.wants")
    assert {f"{u}.service" for u in UNITS} <= wanted and "systemd-networkd.service" in wanted
    chromium = debugfs(root_fs, "cat /etc/systemd/system/wakeful-chromium.service")
    assert "--proxy-server=${WAKEFUL_PROXY}" in chromium and "--remote-debugging-address=127.0.0.1" in chromium
    assert "WAKEFUL_PROXY=http://10.0.2.100:3128" in chromium  # the default; the seed disk's proxy file overrides it
    assert "EnvironmentFile=-/run/wakeful/chromium.env" in chromium


def test_the_image_has_no_host_keys_no_password_and_apt_points_at_the_public_archive(root_fs: Path) -> None:
    assert not {name for name in listing(root_fs, "/etc/ssh") if name.startswith("ssh_host_")}
    shadow = {line.split(":")[0]: line.split(":")[1] for line in debugfs(root_fs, "cat /etc/shadow").splitlines()}
    assert shadow["root"] == "*"
    assert debugfs(root_fs, "cat /etc/machine-id") == ""
    # apt in the guest points at the public archive, whatever mirror the image was built from.
    sources = debugfs(root_fs, "cat /etc/apt/sources.list.d/debian.sources")
    uris = re.findall(r"^URIs: (\S+)$", sources, re.MULTILINE)
    assert uris == ["http://deb.debian.org/debian", "http://security.debian.org/debian-security"]


def test_the_ca_is_in_the_system_trust_store_and_chromiums_nss_db(root_fs: Path,
                                                                   guest_image_build: GuestImageBuild) -> None:
    pem = guest_image_build.ca_cert.read_text().strip()
    assert debugfs(root_fs, "cat /usr/local/share/ca-certificates/wakeful.crt").strip() == pem
    assert pem in debugfs(root_fs, "cat /etc/ssl/certs/ca-certificates.crt")
    assert "cert9.db" in listing(root_fs, "/root/.pki/nssdb")


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # ssh and the build talk to loopback and the Debian mirror only.
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        if name in os.environ:
            monkeypatch.delenv(name)
