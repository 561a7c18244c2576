"""The seed disk: a small read-only ext4 image labelled WKSEED that gives the guest its identity at boot.

Files (the guest's `wakeful-seed` unit installs them before sshd starts; the names are a contract with it):
`ssh_host_ed25519_key`, `ssh_host_ed25519_key.pub`, `authorized_keys`, `hostname`, and `proxy`: the egress
proxy's URL as the guest reaches it (`http://10.0.2.100:3128` on user-mode networking, the network's host address
on an isolated network), which Chromium's unit reads.
Built without mounting anything: `mkfs.ext4 -d` copies a directory into the new filesystem.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from wakeful.vm.errors import HypervisorUnavailable
from wakeful.vm.keys import VmKeys

__all__ = ["SEED_FILES", "SEED_LABEL", "build_seed"]

SEED_LABEL = "WKSEED"
SEED_FILES = ("ssh_host_ed25519_key", "ssh_host_ed25519_key.pub", "authorized_keys", "hostname", "proxy")


def build_seed(path: Path, *, keys: VmKeys, hostname: str, proxy: str, size: str = "4M") -> Path:
    mkfs = shutil.which("mkfs.ext4") or "/usr/sbin/mkfs.ext4"
    if not Path(mkfs).exists():
        raise HypervisorUnavailable("mkfs.ext4 is missing: apt-get install e2fsprogs")
    with tempfile.TemporaryDirectory(prefix="wkseed-") as tmp:
        root = Path(tmp)
        root.chmod(0o700)
        shutil.copyfile(keys.host_key, root / "ssh_host_ed25519_key")
        (root / "ssh_host_ed25519_key").chmod(0o600)
        (root / "ssh_host_ed25519_key.pub").write_text(keys.host_public + "\n")
        (root / "authorized_keys").write_text(keys.client_public + "\n")
        (root / "hostname").write_text(hostname + "\n")
        (root / "proxy").write_text(proxy + "\n")
        tmp_img = path.with_suffix(".tmp")
        tmp_img.unlink(missing_ok=True)
        done = subprocess.run([mkfs, "-q", "-F", "-L", SEED_LABEL, "-d", str(root), str(tmp_img), size],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise HypervisorUnavailable(f"mkfs.ext4 could not build the seed disk: {done.stderr.strip()}")
    tmp_img.chmod(0o600)
    tmp_img.replace(path)
    return path
