"""Per-VM keys (Ed25519, OpenSSH formats, 0600) and the WKSEED seed disk the guest installs them from."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tests.support.debugfs import debugfs
from wakeful.vm.keys import generate_keys, load_keys
from wakeful.vm.seed import SEED_FILES, SEED_LABEL, build_seed


def test_keys_are_ed25519_openssh_pairs_readable_only_by_the_owner(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys", name="wk-alice")
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    for private, public in ((keys.host_key, keys.host_public), (keys.client_key, keys.client_public)):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600
        assert private.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
        key = serialization.load_ssh_private_key(private.read_bytes(), password=None)
        assert isinstance(key, Ed25519PrivateKey)
        pub = serialization.load_ssh_public_key(public.encode())
        assert isinstance(pub, Ed25519PublicKey)
        assert pub.public_bytes_raw() == key.public_key().public_bytes_raw()
    assert keys.host_public != keys.client_public
    assert load_keys(tmp_path / "keys") == keys


def test_existing_keys_are_never_overwritten(tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys", name="wk-alice")
    with pytest.raises(FileExistsError):
        generate_keys(tmp_path / "keys", name="wk-alice")


def test_the_seed_disk_is_an_ext4_labelled_wkseed_with_exactly_the_agreed_files(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys", name="wk-alice")
    seed = build_seed(tmp_path / "seed.img", keys=keys, hostname="wk-alice", proxy="http://10.77.0.1:3128")
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    label = subprocess.run(["blkid", "-o", "value", "-s", "LABEL", str(seed)], capture_output=True, text=True)
    assert label.stdout.strip() == SEED_LABEL
    listing = {line.split()[-1] for line in debugfs(seed, "ls -l /").splitlines() if line.strip()}
    assert listing - {".", "..", "lost+found"} == set(SEED_FILES)
    assert debugfs(seed, "cat /hostname") == "wk-alice\n"
    assert debugfs(seed, "cat /proxy") == "http://10.77.0.1:3128\n"
    assert debugfs(seed, "cat /authorized_keys").strip() == keys.client_public
    assert debugfs(seed, "cat /ssh_host_ed25519_key.pub").strip() == keys.host_public
    assert debugfs(seed, "cat /ssh_host_ed25519_key") == keys.host_key.read_text()
    assert "0600" in debugfs(seed, "stat /ssh_host_ed25519_key").split("Mode:")[1][:12]
