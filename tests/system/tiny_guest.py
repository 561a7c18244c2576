"""A tiny guest for the VM system tests: Debian's real kernel and a busybox initramfs, built once into `.cache/`.

/init loads the virtio and ext4 modules, mounts the WKSEED seed disk read-only, brings up user-mode networking,
serves HTTP on guest ports 22, 9222, 5900 and 9444 (so host forwards can be proven without sshd), asks the egress
proxy at 10.0.2.100:3128 and the host gateway 10.0.2.2 (which restrict=on must block), then starts a counter process
that prints `WK-COUNTER n=<n> pid=<pid> boot=<boot_id>` to the serial console every second (and serves its latest line
at `/counter`) and writes `WK<n>` to the first bytes of the overlay disk. `/cgi-bin/proxy?<path>` asks the egress
proxy for `/<path>` when called (for `<path>` itself when it is an `http:` URL), and answers with the proxy's
response. When the seed disk names a proxy other than 10.0.2.100 (an isolated network) the guest takes its address
by DHCP (its reservation), asks that proxy, and skips the boot-time requests; `/cgi-bin/lease` then asks the
network's DHCP server again and answers `WK-LEASE <address>` with the address offered (nothing when none is), leaving
the guest's own as it is. A restore in place continues the counter; a cold boot starts it again at 1.
Requests use busybox nc: the static busybox's wget segfaults on name lookup.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import lzma
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TinyGuest", "build_tiny_guest"]

MODULES = [  # load order (dependencies first), from the modules' own `depends=` fields
    "drivers/virtio/virtio_ring", "drivers/virtio/virtio", "drivers/virtio/virtio_pci_modern_dev",
    "drivers/virtio/virtio_pci_legacy_dev", "drivers/virtio/virtio_pci", "drivers/block/virtio_blk",
    "drivers/virtio/virtio_balloon", "net/core/failover", "drivers/net/net_failover", "drivers/net/virtio_net",
    "lib/crc16", "fs/mbcache", "fs/jbd2/jbd2", "crypto/crc32c_generic", "fs/ext4/ext4",
]

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /lib/modules/order); do insmod /lib/modules/$m.ko; done
boot=$(cat /proc/sys/kernel/random/boot_id)
i=0; seed=""
while [ $i -lt 100 ] && [ -z "$seed" ]; do
  seed=$(findfs LABEL=WKSEED 2>/dev/null); [ -n "$seed" ] || sleep 0.1; i=$((i+1))
done
disk=""
for d in /dev/vd?; do [ "$d" != "$seed" ] && disk=$d; done
mkdir -p /seed
if [ -n "$seed" ] && mount -t ext4 -o ro "$seed" /seed; then
  echo "WK-SEED hostname=$(cat /seed/hostname) files=$(ls /seed | tr '\n' ' ')"
else
  echo "WK-SEED missing"
fi
wanted='pni|ssse3|sse4_1|sse4_2|popcnt|cx16|aes|avx'
echo "WK-CPU $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -x -E "$wanted" | tr '\n' ' ')"
echo "WK-DISK-AT-BOOT $(dd if=$disk bs=16 count=1 2>/dev/null | tr -cd 'A-Z0-9')"
ip link set lo up; ip link set eth0 up
proxy=$(cat /seed/proxy 2>/dev/null); proxy=${proxy#http://}
if [ -z "$proxy" ] || [ "${proxy%:*}" = 10.0.2.100 ]; then
  echo "10.0.2.100 3128" > /wk-proxy
  ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2
else  # an isolated network: the address is the VM's DHCP reservation, the proxy the seed's
  echo "${proxy%:*} ${proxy##*:}" > /wk-proxy
  printf '#!/bin/sh\n[ "$1" = bound ] && ip addr add "$ip/${mask:-24}" dev "$interface"\nexit 0\n' > /bin/wk-dhcp
  chmod 755 /bin/wk-dhcp
  udhcpc -i eth0 -n -q -t 30 -T 1 -s /bin/wk-dhcp >/dev/null 2>&1
  printf '#!/bin/sh\n[ "$1" = bound ] && echo "WK-LEASE $ip"\nexit 0\n' > /bin/wk-lease
  chmod 755 /bin/wk-lease
  echo "WK-NET $(ip -4 -o addr show eth0)"
fi
mkdir -p /www/cgi-bin; echo WK-GUEST-HTTP > /www/index.html
cat > /www/cgi-bin/proxy <<'CGI'
#!/bin/sh
printf 'Content-Type: text/plain\r\n\r\n'
read host port < /wk-proxy
case "$QUERY_STRING" in http:*) target=$QUERY_STRING ;; *) target=/${QUERY_STRING:-cgi} ;; esac
printf 'GET %s HTTP/1.0\r\n\r\n' "$target" | nc -w 5 $host $port 2>&1 | tr -s '\r\n' '  '
CGI
chmod 755 /www/cgi-bin/proxy
cat > /www/cgi-bin/lease <<'CGI'
#!/bin/sh
printf 'Content-Type: text/plain\r\n\r\n'
udhcpc -i eth0 -n -q -t 5 -T 1 -s /bin/wk-lease 2>/dev/null
CGI
chmod 755 /www/cgi-bin/lease
httpd -p 22 -h /www; httpd -p 9222 -h /www; httpd -p 5900 -h /www; httpd -p 9444 -h /www
egress=$(sed -n 's/.*wkegress=\([0-9]*\).*/\1/p' /proc/cmdline)
get() { printf 'GET /%s HTTP/1.0\r\n\r\n' "$3" | nc -w 5 "$1" "$2" 2>&1 | tr -s '\r\n' '  '; }
[ -f /bin/wk-dhcp ] || (
  # Two requests: the proxy forward must serve one connection per request, not a single one-shot stream.
  for try in 1 2; do echo "WK-PROXY $try $(get 10.0.2.100 3128 probe$try)"; done
  [ -n "$egress" ] && echo "WK-EGRESS $(get 10.0.2.2 $egress escape)"
  echo "WK-NET-DONE"
) &
setsid sh -c 'n=0; while :; do
  n=$((n+1)); echo "WK-COUNTER n=$n pid=$$ boot=$0"; echo "WK-COUNTER n=$n pid=$$ boot=$0" > /www/counter.new
  mv /www/counter.new /www/counter
  printf "WK%08d" $n | dd of=$1 bs=16 count=1 conv=notrunc,fsync 2>/dev/null; sleep 1
done' "$boot" "$disk" &
echo "WK-MARKER up pid=$! boot=$boot"
while :; do sleep 3600; done
"""


@dataclass(frozen=True, kw_only=True)
class TinyGuest:
    kernel: Path
    """Uncompressed PVH vmlinux (no xz decompression under TCG)."""
    initrd: Path
    base: Path
    """A 16 MiB empty qcow2: the shared read-only base."""


def _run(*args: str | Path, cwd: Path | None = None) -> None:
    subprocess.run([str(a) for a in args], check=True, cwd=cwd, capture_output=True)


def _kernel_deb(cache: Path) -> Path:
    debs = sorted(cache.glob("linux-image-*-amd64_*.deb"))
    if debs:
        return debs[-1]
    out = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], check=True, capture_output=True, text=True)
    pkg = next(line.split()[-1] for line in out.stdout.splitlines() if "Depends: linux-image-" in line)
    _run("apt-get", "download", pkg, cwd=cache)
    return sorted(cache.glob("linux-image-*-amd64_*.deb"))[-1]


def _deb_members(deb: Path, wanted: list[str]) -> dict[str, bytes]:
    """Read members of a .deb's data tarball by path suffix, without unpacking the rest."""
    tar_bytes = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], check=True, capture_output=True).stdout
    found: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for member in tar:
            for want in wanted:
                if member.isfile() and member.name.endswith(want):
                    data = tar.extractfile(member)
                    assert data is not None
                    found[want] = data.read()
    missing = [w for w in wanted if w not in found]
    assert not missing, f"{deb.name} lacks {missing}"
    return found


def _newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio 'newc' archive (what the kernel unpacks as initramfs); entries are (path, mode, data)."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        encoded = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
        out += b"070701" + b"".join(f"{f:08x}".encode() for f in fields) + encoded
        out += b"\0" * (-(110 + len(encoded)) % 4) + data + b"\0" * (-len(data) % 4)
    return bytes(out)


def build_tiny_guest(cache: Path) -> TinyGuest:
    """Build (or reuse) the tiny guest in `cache`. Only what changed is rebuilt."""
    cache.mkdir(parents=True, exist_ok=True)
    deb = _kernel_deb(cache)
    kernel_version = deb.name.split("_")[0].removeprefix("linux-image-")
    kernel = cache / f"vmlinux-{kernel_version}"
    recipe = hashlib.sha256((deb.name + INIT + " ".join(MODULES)).encode()).hexdigest()[:12]
    initrd = cache / f"initrd-{recipe}.cpio.gz"
    base = cache / "base-16m.qcow2"
    if not kernel.exists() or not initrd.exists():
        members = _deb_members(deb, [f"/boot/vmlinuz-{kernel_version}", *(f"/{m}.ko" for m in MODULES)])
        if not kernel.exists():
            bz = members[f"/boot/vmlinuz-{kernel_version}"]
            # Debian kernels are xz-compressed bzImages with CONFIG_PVH: the payload is a vmlinux QEMU boots directly.
            vmlinux = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bz[bz.find(b"\xfd7zXZ\x00"):])
            tmp = kernel.with_suffix(".tmp")
            tmp.write_bytes(vmlinux)
            tmp.replace(kernel)
        if not initrd.exists():
            busybox = Path("/bin/busybox").read_bytes()
            entries: list[tuple[str, int, bytes]] = [
                (d, 0o040755, b"") for d in ("bin", "proc", "sys", "dev", "lib", "lib/modules", "seed")
            ]
            entries += [("bin/busybox", 0o100755, busybox), ("init", 0o100755, INIT.encode())]
            entries += [(f"lib/modules/{Path(m).name}.ko", 0o100644, members[f"/{m}.ko"]) for m in MODULES]
            entries.append(("lib/modules/order", 0o100644, " ".join(Path(m).name for m in MODULES).encode()))
            tmp = initrd.with_suffix(".tmp")
            tmp.write_bytes(gzip.compress(_newc(entries), compresslevel=1))
            tmp.replace(initrd)
    if not base.exists():
        assert shutil.which("qemu-img"), "qemu-img is missing: apt-get install qemu-utils"
        _run("qemu-img", "create", "-q", "-f", "qcow2", base.with_suffix(".tmp"), "16M")
        base.with_suffix(".tmp").replace(base)
    return TinyGuest(kernel=kernel, initrd=initrd, base=base)
