"""The manifest's format, the CA the CA stage installs, and a cache that never holds half-written entries."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from wakeful.vm.image import MANIFEST_FORMAT, image_checksum, make_manifest
from wakeful.vm.image.recipe import ImageError, Stage, load_ca
from wakeful.vm.image.stages import Cache

FILES = {
    "base.qcow2": {"sha256": "a" * 64, "size": 1_500_000_000},
    "vmlinuz": {"sha256": "b" * 64, "size": 8_000_000},
    "vmlinux": {"sha256": "c" * 64, "size": 65_000_000},
    "initrd.img": {"sha256": "d" * 64, "size": 6_000_000},
}


def certificate(path: Path, *, ca: bool = True, count: int = 1) -> Path:
    pems = []
    for i in range(count):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"test CA {i}")])
        now = dt.datetime.now(dt.UTC)
        builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(1 + i).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1)))
        if ca:
            builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        pems.append(builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    path.write_bytes(b"".join(pems))
    return path


def test_the_manifest_records_checksums_packages_keys_and_the_mirror_only_by_hash(tmp_path: Path) -> None:
    ca = load_ca(certificate(tmp_path / "ca.pem"))
    manifest = make_manifest(
        name="guest", recipe_hash="r" * 64, suite="bookworm", mirror="http://mirror.invalid/debian",
        sources="bookworm, bookworm-updates, bookworm-security", ca=ca, kernel="6.1.0-57-amd64",
        cmdline="root=/dev/vda rw console=ttyS0", files=FILES, packages={"chromium": "150.0"},
        keys={Stage.DEBOOTSTRAP: "k1", Stage.QCOW2: "k2"}, built_at="2026-11-29T22:00:00Z")
    assert json.loads(json.dumps(manifest)) == manifest
    assert manifest["format"] == MANIFEST_FORMAT == 1
    assert set(manifest) == {"format", "name", "checksum", "built_at", "recipe_hash", "suite", "mirror", "sources",
                             "ca", "kernel", "files", "packages", "stage_keys"}
    assert manifest["files"] == FILES and manifest["packages"] == {"chromium": "150.0"}
    assert manifest["ca"] == {"sha256": ca.fingerprint, "subject": "CN=test CA 0"}
    assert manifest["kernel"] == {"version": "6.1.0-57-amd64", "cmdline": "root=/dev/vda rw console=ttyS0"}
    assert manifest["stage_keys"] == {"debootstrap": "k1", "qcow2": "k2"}
    assert manifest["mirror"].startswith("sha256:") and "mirror.invalid" not in json.dumps(manifest)


def test_the_image_checksum_covers_every_file_and_ignores_order() -> None:
    checksum = image_checksum(FILES)
    assert checksum.startswith("sha256:") and checksum == image_checksum(dict(reversed(list(FILES.items()))))
    changed = {**FILES, "initrd.img": {"sha256": "e" * 64, "size": 6_000_000}}
    assert image_checksum(changed) != checksum


def test_a_ca_certificate_is_loaded_with_its_fingerprint(tmp_path: Path) -> None:
    path = certificate(tmp_path / "ca.pem")
    ca = load_ca(path)
    der = x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(serialization.Encoding.DER)
    assert ca.fingerprint == hashlib.sha256(der).hexdigest() and ca.pem.startswith(b"-----BEGIN")


@pytest.mark.parametrize(("kind", "message"), [
    ("not_ca", "not a CA certificate"), ("two", "holds 2 certificates"), ("garbage", "holds no PEM certificate"),
    ("missing", "cannot read --ca-cert")])
def test_a_bad_ca_is_refused_with_a_reason(tmp_path: Path, kind: str, message: str) -> None:
    path = tmp_path / "ca.pem"
    if kind == "not_ca":
        certificate(path, ca=False)
    elif kind == "two":
        certificate(path, count=2)
    elif kind == "garbage":
        path.write_text("not a certificate")
    with pytest.raises(ImageError) as caught:
        load_ca(path)
    assert caught.value.code == "bad_ca_cert" and message in caught.value.message


def test_a_failed_stage_leaves_no_cache_entry(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    with pytest.raises(RuntimeError), cache.store(Stage.PACKAGES, "k1", {"built_at": "now"}) as out:
        (out / "rootfs.tar.zst").write_bytes(b"half")
        raise RuntimeError("apt failed")
    assert not cache.has(Stage.PACKAGES, "k1") and list(tmp_path.iterdir()) == []


def test_a_finished_stage_is_found_by_key_and_old_entries_are_pruned(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    for key in ("aaa1", "bbb2", "ccc3"):
        with cache.store(Stage.QCOW2, key, {"built_at": key}) as out:
            (out / "base.qcow2").write_bytes(key.encode())
    assert cache.has(Stage.QCOW2, "bbb2") and cache.meta(Stage.QCOW2, "bbb2") == {"built_at": "bbb2"}
    removed = cache.prune({Stage.QCOW2: "aaa1"}, keep=2)
    assert cache.has(Stage.QCOW2, "aaa1") and len(removed) == 1
    assert sum(cache.has(Stage.QCOW2, k) for k in ("bbb2", "ccc3")) == 1
