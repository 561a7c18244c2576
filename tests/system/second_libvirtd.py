"""A second libvirtd on this machine, standing in for a second KVM host in the multi-host tests.

It runs as root in its own mount namespace, where libvirt's state, run, cache and log directories, its domain and
network definitions (`/etc/libvirt/qemu`: a network defined under one name on both daemons would otherwise be one
file, which the first undefine removes under the other) and qemu.conf are bind-mounted from a temporary directory,
so it shares nothing with the system daemon but the kernel, the files it is given and the CPU; its socket lives in
that directory too (`qemu+unix:///system?socket=…`), reachable from outside the namespace. With `own_network=True`
it also gets a network namespace of its own: a loopback of its own (brought up, nothing else), where its guests'
forwards listen; `netns` names it for `nsenter --net=`. `shared_network` then makes an isolated libvirt network (no
`<forward>`) from one XML (name, subnet, bridge and its MAC) both there and on the system libvirtd, in this machine's
own namespace, as a deployment defines it on every host.
What this cannot show: a real network between hosts (latency, bandwidth, NFS semantics), a host that loses power
with a guest running, different CPUs or QEMU versions.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.polling import wait_until

__all__ = ["SecondLibvirtd", "running_network", "shared_network", "start_second_libvirtd"]

START = """#!/bin/sh
set -e
if [ -n "$OWN_NETWORK" ]; then ip link set lo up; fi
for d in run lib cache log etc-qemu; do mkdir -p "$ROOT/$d"; done
mount --bind "$ROOT/etc-qemu" /etc/libvirt/qemu
mount --bind "$ROOT/run" /var/run/libvirt
mount --bind "$ROOT/lib" /var/lib/libvirt
mount --bind "$ROOT/cache" /var/cache/libvirt
mount --bind "$ROOT/log" /var/log/libvirt
mount --bind "$ROOT/qemu.conf" /etc/libvirt/qemu.conf
mkdir -p /var/lib/libvirt/qemu /var/log/libvirt/qemu /var/cache/libvirt
exec libvirtd --config "$ROOT/libvirtd.conf" -p "$ROOT/libvirtd.pid"
"""


@dataclass
class SecondLibvirtd:
    root: Path
    process: subprocess.Popen[bytes]
    own_network: bool = False

    @property
    def netns(self) -> str:
        """The daemon's network namespace (its own only with `own_network`), as a path for `nsenter --net=`."""
        return f"/proc/{self.process.pid}/ns/net"

    @property
    def uri(self) -> str:
        return f"qemu+unix:///system?socket={self.root / 'sock' / 'libvirt-sock'}"

    def answers(self) -> bool:
        try:
            return subprocess.run(["virsh", "-c", self.uri, "version"], capture_output=True,
                                  timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> None:
        """SIGTERM to the daemon this test started (its QEMU processes, if any, are the caller's to destroy)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_second_libvirtd(root: Path, *, own_network: bool = False) -> SecondLibvirtd:
    (root / "sock").mkdir(parents=True, exist_ok=True)
    shutil.copy("/etc/libvirt/qemu.conf", root / "qemu.conf")
    (root / "libvirtd.conf").write_text(f'unix_sock_dir = "{root / "sock"}"\nlisten_tls = 0\nlisten_tcp = 0\n')
    script = root / "start.sh"
    script.write_text(START)
    script.chmod(0o755)
    log = (root / "libvirtd.log").open("wb")
    # unshare execs the script, which execs libvirtd: the Popen's PID is the daemon's, and its namespaces ours to name
    namespaces = ["--mount", *(["--net"] if own_network else [])]
    process = subprocess.Popen(["unshare", *namespaces, "--propagation", "private", str(script)], stdout=log,
                               stderr=subprocess.STDOUT,
                               env={**os.environ, "ROOT": str(root), "OWN_NETWORK": "1" if own_network else ""})
    daemon = SecondLibvirtd(root=root, process=process, own_network=own_network)
    try:
        wait_until(lambda: daemon.process.poll() is not None or daemon.answers(), 120, "the second libvirtd",
                   interval=0.5)
    except AssertionError:
        daemon.stop()
        raise
    if process.poll() is not None:
        raise AssertionError(f"the second libvirtd exited: {(root / 'libvirtd.log').read_text()[-2000:]}")
    return daemon


@contextmanager
def shared_network(daemon: SecondLibvirtd, prefix: str, *, uri: str = "qemu:///system") -> Iterator[tuple[str, str]]:
    """An isolated network (infra/README.md's, no DHCP range) defined from the same XML, bridge MAC included, on the
    libvirt at `uri` (this machine's namespace) and on the daemon (its own namespace): yields its name and host
    address (10.79.N.1, N free here; in the daemon's namespace nothing else is on it), then stops and undefines both.
    """
    assert daemon.own_network, "only a daemon with a network namespace of its own"
    tag = uuid.uuid4().hex[:6]
    taken = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    n = next((n for n in random.sample(range(1, 255), 254) if f" 10.79.{n}." not in taken), None)
    assert n is not None, "no free 10.79.N.0/24 on this host"
    name, host = f"{prefix}net-{tag}", f"10.79.{n}.1"
    mac = "52:54:00:" + ":".join(f"{b:02x}" for b in random.randbytes(3))
    xml = (f"<network><name>{name}</name><bridge name='wkb{tag}' stp='off'/><mac address='{mac}'/>"
           f"<ip address='{host}' netmask='255.255.255.0'><dhcp/></ip></network>")

    with running_network(uri, name, xml), running_network(daemon.uri, name, xml):
        yield name, host


@contextmanager
def running_network(uri: str, name: str, xml: str) -> Iterator[None]:
    """The network `xml` defines, named `name`, defined and started on the libvirt at `uri` for the block, then
    stopped and undefined."""
    def virsh(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["virsh", "-c", uri, *args], capture_output=True, text=True, timeout=120)

    with tempfile.NamedTemporaryFile("w", suffix=".xml") as f:
        f.write(xml)
        f.flush()
        defined = virsh("net-define", f.name)
    assert defined.returncode == 0, defined.stderr
    try:
        started = virsh("net-start", name)
        assert started.returncode == 0, started.stderr
        yield
    finally:
        virsh("net-destroy", name)
        undefined = virsh("net-undefine", name)
    assert undefined.returncode == 0, f"the network {name} is left defined on {uri}: {undefined.stderr}"
