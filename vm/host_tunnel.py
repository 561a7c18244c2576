"""SSH to a tool-computer host other than the api's own: `HostTunnel`, one paramiko transport per remote host.

Under user-mode networking everything of a running computer lives on its host's loopback: the guest's SSH forward
(QEMU's hostfwd on 127.0.0.1), and the egress proxy connector slirp runs there per guest connection
(`busybox nc 127.0.0.1 <proxy port>`, see `vm.domain_xml`). On another host the api reaches them through this
tunnel, made once and remade when it dies (by the keeper below, or by the next use):

    tunnel = HostTunnel(name="kvm2", ssh=HostSsh.parse("root@kvm2", host_key=pinned, client_key=key),
                        proxy=("127.0.0.1", 8788))
    tunnel.ensure()                              # connect (or reconnect); `host_unreachable` if it cannot
    sock = tunnel.open(("127.0.0.1", 10122))     # a direct-tcpip channel: paramiko's `sock` for the guest channel

* the guest channel (and through it CDP and the live view's VNC, both tunnelled in the guest's SSH) is a
  `direct-tcpip` channel to the host's 127.0.0.1:<guest ssh port>;
* a remote forward on the host's 127.0.0.1:<proxy port> brings each connection of a guest's proxy connector back
  to the egress proxy on the api's 127.0.0.1:<proxy port>. The connector inserts the VM's proxy credential before
  the bytes leave the host (`vm.domain_xml.RELAY`), so the proxy knows the VM by it exactly as on the api's host.
* on an isolated network (`NetworkForward`) there is no connector: the guest connects to the network's host address
  on its host, where the remote forward listens instead (the host's sshd needs `GatewayPorts clientspecified`; it is
  checked, see `_check_bind`). The host's sshd names each connection's originator, the guest's address (libvirt's
  clean-traffic filter keeps a guest from sending from another), and the tunnel hands the connection to the egress
  proxy's relay socket here headed by a PROXY line naming it (`proxy.proxyline`): the proxy knows the VM by its
  address alone, as it knows one on the api's own host.

The host key is pinned in the settings and nothing else is accepted (`host_key_mismatch`), never trust-on-first-use.
A host that cannot be reached raises `HostUnreachable`, a `HypervisorUnavailable`: the fleet counts it as gone.

From its first connection until `close()` a tunnel has a keeper thread: every `keepalive` seconds it remakes a
transport that died (and with it the remote forward, which the host's guests use without the api asking anything),
and asks a live one for an answer (`keepalive@openssh.com`), closing it as dead when none comes within `timeout`, so
a host whose network went silent is noticed and counts as unreachable. Failed attempts back off; a drop and a
recovery are logged once each.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import paramiko  # noqa: TID251 - the host tunnel is the second module that talks SSH (the guest channel is the first)

from wakeful.proxy.addressbook import normalize_address
from wakeful.proxy.proxyline import ProxyLine, format_proxy_line
from wakeful.vm.errors import HostUnreachable, VmError
from wakeful.vm.guest import AuthFailed, BadKey, GuestUnreachable, HostKeyMismatch
from wakeful.vm.ssh_channel import parse_public_key, pump

__all__ = ["ForwardRefused", "HostSsh", "HostTunnel", "NetworkForward"]

log = logging.getLogger("wakeful.vm")

_TARGET = re.compile(r"^(?P<user>[A-Za-z0-9._-]+)@(?P<host>[A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(:(?P<port>\d{1,5}))?$")
_RSA = ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")
_BACKOFF_CAP = 12


class ForwardRefused(HostUnreachable):
    """The host's sshd would not listen where its guests look for the egress proxy, or listened elsewhere. A host
    without the proxy is no use for tool computers: it counts as unreachable."""

    code = "host_forward_refused"


@dataclass(frozen=True, kw_only=True)
class NetworkForward:
    """On an isolated network: where the host's guests find the egress proxy, and where it takes them here."""

    listen: tuple[str, int]
    """The network's host address and the proxy's port there (`proxy_bridge_listen`: every host has the network
    under the same name and subnet)."""
    relay_socket: Path
    """The egress proxy's relay socket on the api's machine (`ProxyConfig.relay_socket`)."""


@dataclass(frozen=True, kw_only=True)
class HostSsh:
    """How the api reaches one host over SSH."""

    user: str
    host: str
    port: int = 22
    host_key: str
    """The host's public key as an OpenSSH line (`ssh-ed25519 AAAA…`): the only key accepted."""
    client_key: Path
    """The private key the api logs in with."""
    proxy_command: str | None = None
    """Run to reach the host's sshd on its stdin/stdout (a bastion: `ssh -W %h:%p jump`), as OpenSSH's ProxyCommand;
    `%h` and `%p` are the host and port."""

    @classmethod
    def parse(cls, target: str, *, host_key: str, client_key: Path, proxy_command: str | None = None) -> HostSsh:
        """`user@host[:port]` (an IPv6 address in brackets)."""
        found = _TARGET.match(target)
        if found is None:
            raise ValueError(f"{target!r} is not user@host[:port]")
        port = int(found["port"] or 22)
        if not 0 < port < 65536:
            raise ValueError(f"{target!r}: the port must be 1-65535")
        return cls(user=found["user"], host=found["host"].strip("[]"), port=port, host_key=host_key,
                   client_key=client_key, proxy_command=proxy_command)


class HostTunnel:
    """One SSH transport to one host, kept and remade on demand (see the module docstring)."""

    def __init__(self, *, name: str, ssh: HostSsh, proxy: tuple[str, int] | None = None,
                 network: NetworkForward | None = None, timeout: float = 10.0, keepalive: float = 5.0,
                 retry_after: float = 5.0, monotonic: Callable[[], float] = time.monotonic) -> None:
        """`proxy`: where the egress proxy listens here (127.0.0.1:<proxy_port>); the host's 127.0.0.1 at the same
        port is forwarded to it, since that is where guest connectors look (None: no proxy).
        `network`: instead of `proxy`, for guests on an isolated network (see `NetworkForward`).
        `keepalive`: seconds between the keeper's checks (see `_keep`); 0 for no keeper (the tunnel is then only
        remade when something uses it).
        `timeout`: for connecting, and for the host to answer a keeper's keepalive.
        `retry_after`: for this long after a failed attempt the same error is raised at once, without trying again:
        placement asks every host each time it measures, and an unreachable host would cost `timeout` each time."""
        self.name, self.ssh = name, ssh
        self._pinned = parse_public_key(ssh.host_key)
        try:
            self._key = paramiko.PKey.from_path(ssh.client_key)
        except (OSError, paramiko.SSHException, ValueError) as exc:
            raise BadKey(f"cannot read the client key {ssh.client_key} for host {name}: {exc}") from None
        if proxy is not None and network is not None:
            raise ValueError("a host tunnel forwards the loopback proxy port or the network's, not both")
        self._proxy = proxy
        self._network = network
        self._timeout = timeout
        self._keepalive = keepalive
        self._lock = threading.Lock()
        self._retry_after = retry_after
        self._monotonic = monotonic
        self._failed: tuple[float, VmError] | None = None
        self._transport: paramiko.Transport | None = None
        self._closed = False
        self._lost: float | None = None
        """When the transport was lost (monotonic), until it is made again: one log line per drop and recovery."""
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    @property
    def proxy(self) -> tuple[str, int] | None:
        """Where the loopback forward goes (user-mode networking), if it is made."""
        return self._proxy

    @property
    def network(self) -> NetworkForward | None:
        """The isolated network's forward, if it is made instead."""
        return self._network

    @property
    def where(self) -> str:
        return f"host {self.name} ({self.ssh.user}@{self.ssh.host}:{self.ssh.port})"

    # ------------------------------------------------------------------------------------------ connection

    def connected(self) -> bool:
        transport = self._transport
        return transport is not None and transport.is_active()

    def ensure(self) -> None:
        """Connect unless the transport is alive; `host_unreachable`, `host_key_mismatch` or `auth_failed` if not."""
        self._live()

    def _live(self, *, retry: bool = False) -> paramiko.Transport:
        """The transport, connected again if it died. `retry`: try now even within `retry_after` of a failure (the
        keeper, which has its own backoff)."""
        with self._lock:
            if self._closed:
                raise HostUnreachable(f"the tunnel to {self.where} was closed")
            transport = self._transport
            if transport is not None and transport.is_active():
                return transport
            if transport is not None:
                self._drop(transport, "the connection ended")
            if not retry and self._failed is not None and self._monotonic() - self._failed[0] < self._retry_after:
                raise self._failed[1]
            try:
                self._transport = transport = self._connect()
            except VmError as exc:
                self._failed = (self._monotonic(), exc)
                raise
            self._failed = None
            if self._lost is not None:
                log.info("the SSH tunnel to %s is back after %.1f s", self.where, self._monotonic() - self._lost)
                self._lost = None
            if self._keepalive > 0 and self._keeper is None:
                self._keeper = threading.Thread(target=self._keep, name=f"host-{self.name}-keeper", daemon=True)
                self._keeper.start()
            return transport

    def _drop(self, transport: paramiko.Transport, why: str) -> None:
        """Close a transport found dead (with the lock held); logged once per drop, not per reconnect attempt."""
        if self._transport is transport:
            self._transport = None
            if self._lost is None:
                self._lost = self._monotonic()
                log.warning("the SSH tunnel to %s dropped (%s); connecting again", self.where, why)
        transport.close()

    # ------------------------------------------------------------------------------------------ the keeper

    def _keep(self) -> None:
        """From the first connection until `close()`: every `keepalive` seconds, a transport that died is made again
        (and with it the proxy forward, which guests on the host use without the api asking anything), and a live
        one must answer a keepalive within `timeout` or is closed as dead. After failed attempts the wait doubles, up
        to `_BACKOFF_CAP` times `keepalive`; the first attempt after a drop is made at once."""
        failures = 0
        while not self._stop.wait(_backoff(self._keepalive, failures)):
            transport = self._transport
            if transport is not None and transport.is_active():
                if self._answers(transport):
                    continue
                with self._lock:
                    self._drop(transport, f"no answer to a keepalive within {self._timeout:g} s")
            if self._stop.is_set():
                return
            try:
                self._live(retry=True)
            except VmError:
                failures += 1  # `_failed` now holds the error: placement sees it at once, without trying itself
            else:
                failures = 0

    def _answers(self, transport: paramiko.Transport) -> bool:
        """Whether the host answers a keepalive within `timeout`. paramiko's own keepalive wants no reply, so it never
        notices a peer that went silent; and `global_request(wait=True)` waits as long as the transport looks active,
        which a silent peer's does for as long as TCP holds on: it is asked on a thread of its own, waited for with a
        bound, and ends once the caller closes the transport. A request that cannot be sent is no answer either:
        behind a proxy command paramiko never reads the stream's end as the connection's, and a failed write is
        all that shows it."""
        answered: list[bool] = []

        def ask() -> None:
            try:
                transport.global_request("keepalive@openssh.com", wait=True)  # OpenSSH answers "failure": an answer
            except (paramiko.SSHException, OSError, EOFError):
                answered.append(False)
            else:
                answered.append(True)

        asking = threading.Thread(target=ask, name=f"host-{self.name}-keepalive", daemon=True)
        asking.start()
        asking.join(self._timeout)
        return answered == [True] and transport.is_active()

    def _sock(self) -> socket.socket | paramiko.ProxyCommand:
        ssh = self.ssh
        if ssh.proxy_command is not None:
            command = ssh.proxy_command.replace("%h", ssh.host).replace("%p", str(ssh.port))
            try:
                proxy = paramiko.ProxyCommand(command)
            except (OSError, paramiko.SSHException) as exc:
                raise HostUnreachable(f"cannot run the proxy command for {self.where}: {exc}") from None
            proxy.settimeout(self._timeout)
            return proxy
        try:
            return socket.create_connection((ssh.host, ssh.port), timeout=self._timeout)
        except OSError as exc:
            raise HostUnreachable(f"cannot reach {self.where}: {exc.strerror or exc}") from None

    def _connect(self) -> paramiko.Transport:
        sock = self._sock()
        transport = paramiko.Transport(sock)
        name = self._pinned.get_name()
        transport.get_security_options().key_types = _RSA if name == "ssh-rsa" else (name,)
        transport.banner_timeout = transport.handshake_timeout = transport.auth_timeout = self._timeout
        try:
            transport.start_client(timeout=self._timeout)
            offered = transport.get_remote_server_key()
            if offered != self._pinned:
                raise HostKeyMismatch(f"{self.where} presented host key {offered.fingerprint}, not the one pinned "
                                      f"in its settings ({self._pinned.fingerprint})")
            transport.auth_publickey(self.ssh.user, self._key)
        except paramiko.AuthenticationException as exc:
            transport.close()
            raise AuthFailed(f"{self.where} refused the api's key: {exc}") from None
        except HostKeyMismatch:
            transport.close()
            raise
        except (paramiko.SSHException, OSError, EOFError) as exc:
            transport.close()
            raise HostUnreachable(f"no SSH session with {self.where}: {exc}") from None
        if self._proxy is not None:
            try:
                transport.request_port_forward("127.0.0.1", self._proxy[1], handler=self._to_proxy)
            except (paramiko.SSHException, OSError, EOFError) as exc:
                transport.close()
                raise HostUnreachable(f"{self.where} refused to forward its 127.0.0.1:{self._proxy[1]} to the "
                                      f"egress proxy ({exc}): its sshd needs AllowTcpForwarding, and that port must "
                                      "be free there") from None
        if self._network is not None:
            address, port = self._network.listen
            try:
                transport.request_port_forward(address, port, handler=self._to_relay)
                self._check_bind(transport)
            except ForwardRefused:
                transport.close()
                raise
            except (paramiko.SSHException, OSError, EOFError) as exc:
                transport.close()
                raise ForwardRefused(f"{self.where} refused to listen on {address}:{port} for its guests on the "
                                     f"isolated network ({exc}): its sshd needs AllowTcpForwarding and GatewayPorts "
                                     f"clientspecified, the network must be active there with host address "
                                     f"{address}, and that port must be free there") from None
        return transport

    def _check_bind(self, transport: paramiko.Transport) -> None:
        """OpenSSH grants a forward on another address even when it will not bind there: with `GatewayPorts no` it
        binds the loopback instead, with `yes` every address (the host's LAN included). Ask the host to connect to
        the network's address (it must answer) and to its own 127.0.0.1 at that port (it must not: only
        `clientspecified` binds exactly what was asked). These probes carry nothing: the proxy records nothing."""
        assert self._network is not None
        address, port = self._network.listen
        fix = "set GatewayPorts clientspecified in its sshd_config (for the api's user, e.g. in a Match block)"
        if not self._answers_at(transport, (address, port)):
            raise ForwardRefused(f"{self.where} granted a forward on {address}:{port} but does not answer there "
                                 f"(its sshd binds remote forwards to its loopback, GatewayPorts no, or will not let "
                                 f"the server connect there, PermitOpen): {fix}")
        if self._answers_at(transport, ("127.0.0.1", port)):
            raise ForwardRefused(f"{self.where} also answers at 127.0.0.1:{port}: its sshd bound the forward on "
                                 f"every address (GatewayPorts yes), or something else listens there: {fix}, and "
                                 "keep that port free")

    def _answers_at(self, transport: paramiko.Transport, address: tuple[str, int]) -> bool:
        try:
            probe = transport.open_channel("direct-tcpip", address, ("127.0.0.1", 0), timeout=self._timeout)
        except paramiko.ChannelException:
            return False
        probe.close()
        return True

    # ------------------------------------------------------------------------------------------ channels

    def open(self, address: tuple[str, int], *, timeout: float | None = None) -> paramiko.Channel:
        """A channel to `address` as the host sees it, to use as a socket (paramiko's `sock`). `guest_unreachable`
        when nothing answers there (a guest still booting); `host_unreachable` when the host itself does not."""
        wait = self._timeout if timeout is None else timeout
        transport = self._live()
        try:
            return transport.open_channel("direct-tcpip", address, ("127.0.0.1", 0), timeout=wait)
        except paramiko.ChannelException as exc:
            raise GuestUnreachable(f"nothing answers at {address[0]}:{address[1]} on {self.where}: "
                                   f"{exc.text}") from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            with self._lock:
                self._drop(transport, str(exc))
            raise HostUnreachable(f"the SSH connection to {self.where} dropped: {exc}") from None

    def _to_proxy(self, chan: paramiko.Channel, origin: tuple[str, int], server: tuple[str, int]) -> None:
        """A guest connector on the host connected to the forwarded port: relay it to the egress proxy here."""
        threading.Thread(target=self._relay, args=(chan,), name=f"host-{self.name}-proxy", daemon=True).start()

    def _to_relay(self, chan: paramiko.Channel, origin: tuple[str, int], server: tuple[str, int]) -> None:
        """A guest on the host's isolated network connected to the forward: relay it to the proxy's relay socket,
        headed by the address the host's sshd says it came from."""
        threading.Thread(target=self._relay, args=(chan, (origin, server)), name=f"host-{self.name}-proxy",
                         daemon=True).start()

    def _relay(self, chan: paramiko.Channel, ends: tuple[tuple[str, int], tuple[str, int]] | None = None) -> None:
        """`ends`: the origin and the forward's address, on an isolated network (then to the relay socket)."""
        try:
            conn = self._dial(ends)
        except (OSError, ValueError) as exc:
            log.warning("the egress proxy does not take a guest connection from %s: %s", self.where, exc)
            chan.close()
            return
        conn.settimeout(None)
        try:
            pump(conn, chan, half_close=True)
        except (OSError, EOFError, paramiko.SSHException):
            pass  # either side went away: both are closed below, and the guest sees its connection end
        finally:
            chan.close()
            conn.close()

    def _dial(self, ends: tuple[tuple[str, int], tuple[str, int]] | None) -> socket.socket:
        """The connection to the egress proxy for one guest connection: its loopback listener, or (with `ends`) its
        relay socket with the PROXY line written. `ValueError` for an origin that is not an IPv4 address."""
        if ends is None:
            assert self._proxy is not None
            return socket.create_connection(self._proxy, timeout=self._timeout)
        assert self._network is not None
        (origin, origin_port), (_, port) = ends
        source = normalize_address(origin)
        if source is None:
            raise ValueError(f"the guest connection came from {origin}, not an IPv4 address")
        head = format_proxy_line(ProxyLine(source=source, source_port=origin_port,
                                           destination=self._network.listen[0], destination_port=port))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(self._timeout)
            conn.connect(str(self._network.relay_socket))
            conn.sendall(head)
        except OSError:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        """Close the transport and stop the keeper (waiting for it a bounded time)."""
        self._stop.set()
        with self._lock:
            self._closed = True
            transport, self._transport = self._transport, None
            keeper = self._keeper
        if transport is not None:
            transport.close()
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(self._timeout + 1.0)


def _backoff(every: float, failures: int) -> float:
    """How long the keeper waits before its next check: `every`, doubled per failed attempt, at most
    `_BACKOFF_CAP` times `every`."""
    return every * min(1 << min(failures, 16), _BACKOFF_CAP)

