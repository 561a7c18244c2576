"""`wakeful image build` makes a guest image that boots: files and modes, checksums, a rebuild that reuses every
stage, what is (and is not) inside, and a boot under QEMU TCG to sshd, the desktop units and chromium's CDP."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from tests.support.polling import wait_until
from vm.image_system import sha256_file

if TYPE_CHECKING:
    from tests.system.conftest import GuestImageBuild

pytestmark = pytest.mark.vm

UNITS = ("wakeful-seed", "wakeful-xvfb", "wakeful-wm", "wakeful-x11vnc", "wakeful-x11vnc-view", "wakeful-chromium",
         "bootmarker")
MARKER_TIMEOUT = 120.0  # boot to sshd is ~25 s under TCG on an idle core; the cores here are shared
CDP_TIMEOUT = 180.0  # chromium takes ~30 s more to answer under TCG


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


def debugfs(raw: Path, request: str) -> str:
    return subprocess.run(["debugfs", "-R", request, str(raw)], check=True, capture_output=True, text=True,
                          timeout=60).stdout


def listing(raw: Path, directory: str) -> set[str]:
    return {line.split("/")[5] for line in debugfs(raw, f"ls -p {directory}").splitlines() if line.count("/") >= 6}


def test_the_image_has_the_units_enabled(root_fs: Path) -> None:
    units = listing(root_fs, "/etc/systemd/system")
    assert {f"{u}.service" for u in UNITS} <= units
    wanted = listing(root_fs, "/etc/systemd/system/multi-user.target.wants")
    assert {f"{u}.service" for u in UNITS} <= wanted and "systemd-networkd.service" in wanted
    chromium = debugfs(root_fs, "cat /etc/systemd/system/wakeful-chromium.service")
    assert "--proxy-server=http://10.0.2.100:3128" in chromium and "--remote-debugging-address=127.0.0.1" in chromium


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


# --- a boot under TCG ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BootedGuest:
    ssh: list[str]
    serial: Path
    started: float
    marker_at: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_seed(folder: Path) -> tuple[Path, Path, Path]:
    """A WKSEED disk with a fresh host key and client key; returns (seed image, client key, host public key)."""
    seed = folder / "seed"
    seed.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "test-host", "-f",
                    str(seed / "ssh_host_ed25519_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "test-client", "-f",
                    str(folder / "client")], check=True)
    (seed / "authorized_keys").write_text((folder / "client.pub").read_text())
    (seed / "hostname").write_text("wk-image-test\n")
    image = folder / "seed.img"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "WKSEED", "-d", str(seed), str(image), "8M"], check=True)
    return image, folder / "client", seed / "ssh_host_ed25519_key.pub"


@pytest.fixture(scope="module")
def booted(guest_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootedGuest]:
    folder = tmp_path_factory.mktemp("boot")
    overlay = folder / "overlay.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(guest_image / "base.qcow2"), "-F", "qcow2",
                    str(overlay)], check=True)
    seed, client_key, host_pub = make_seed(folder)
    port = free_port()
    known_hosts = folder / "known_hosts"
    key_type, key_b64 = host_pub.read_text().split()[:2]
    known_hosts.write_text(f"[127.0.0.1]:{port} {key_type} {key_b64}\n")
    cmdline = json.loads((guest_image / "manifest.json").read_text())["kernel"]["cmdline"]
    serial = folder / "serial.log"
    qemu = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg,tb-size=64", "-cpu", "max", "-m", "1024",
            "-smp", "1", "-nodefaults", "-no-reboot", "-display", "none", "-monitor", "none",
            "-kernel", str(guest_image / "vmlinux"), "-initrd", str(guest_image / "initrd.img"),
            "-append", f"{cmdline} panic=-1",
            "-drive", f"file={overlay},if=virtio,format=qcow2",
            "-drive", f"file={seed},if=virtio,format=raw,readonly=on",
            "-netdev", f"user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:{port}-:22",
            "-device", "virtio-net-pci,netdev=n0", "-serial", f"file:{serial}"]
    started = time.monotonic()
    proc = subprocess.Popen(qemu, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def marker() -> bool:
            assert proc.poll() is None, f"qemu exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}"
            return serial.exists() and "WAKEFUL-BOOTED" in serial.read_text(errors="replace")

        try:
            wait_until(marker, MARKER_TIMEOUT, "WAKEFUL-BOOTED on the serial console", interval=0.5)
        except AssertionError:
            print(serial.read_text(errors="replace")[-5000:] if serial.exists() else "(no serial output)")
            raise
        marker_at = time.monotonic() - started
        ssh = ["ssh", "-q", "-p", str(port), "-i", str(client_key), "-o", "IdentitiesOnly=yes",
               "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}",
               "-o", "GlobalKnownHostsFile=/dev/null", "-o", "ConnectTimeout=20", "root@127.0.0.1"]
        yield BootedGuest(ssh=ssh, serial=serial, started=started, marker_at=marker_at)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def guest(booted: BootedGuest, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*booted.ssh, command], capture_output=True, text=True, timeout=timeout, check=False)


def test_the_image_boots_to_the_marker_and_ssh_pins_the_seeded_host_key(booted: BootedGuest) -> None:
    print(f"\nboot to WAKEFUL-BOOTED: {booted.marker_at:.1f} s")
    result = guest(booted, "hostname; ls /etc/ssh/ | grep ssh_host_; stat -c %a /etc/ssh/ssh_host_ed25519_key")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["wk-image-test", "ssh_host_ed25519_key", "ssh_host_ed25519_key.pub", "600"]


def test_the_ca_is_trusted_for_tls_servers_in_chromiums_nss_db(booted: BootedGuest) -> None:
    result = guest(booted, "certutil -d sql:/root/.pki/nssdb -L")
    assert re.search(r"wakeful-deployment-ca\s+C,,", result.stdout), result.stdout + result.stderr


def test_the_desktop_units_run_and_chromium_answers_cdp_on_the_guest_loopback(booted: BootedGuest) -> None:
    # chromium starts with the other units at boot and keeps the guest's one vCPU busy for a while under TCG
    active = guest(booted, "systemctl is-active wakeful-xvfb wakeful-wm wakeful-x11vnc wakeful-chromium")
    assert active.stdout.split() == ["active"] * 4, active.stdout + active.stderr

    def cdp() -> str | None:
        # python3 is in the image; curl is not (nothing in the guest fetches anything but chromium).
        probe = guest(booted, "python3 -c \"import urllib.request as u; "
                              "print(u.urlopen('http://127.0.0.1:9222/json/version', timeout=5).read().decode())\"")
        return probe.stdout if probe.returncode == 0 and "webSocketDebuggerUrl" in probe.stdout else None

    version = wait_until(cdp, CDP_TIMEOUT, "chromium's /json/version on guest 127.0.0.1:9222", interval=2)
    print(f"boot to CDP answering: {time.monotonic() - booted.started:.1f} s")
    assert "Chrome/" in json.loads(version)["Browser"] or "Chromium" in json.loads(version)["Browser"]
    listening = guest(booted, "ss -ltnH").stdout
    assert "127.0.0.1:9222" in listening and "127.0.0.1:5900" in listening
    assert "0.0.0.0:9222" not in listening and "*:9222" not in listening


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # ssh and the build talk to loopback and the Debian mirror only.
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        if name in os.environ:
            monkeypatch.delenv(name)
