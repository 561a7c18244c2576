"""Tool computers inside the server: the agent's `computer__observe` and `computer__act` tools, and acts as actions.

Observing is a read. Acting is an external effect like any other: the act (kind, ref, the element's role and name
as observed, the observation and epoch it is based on) becomes an immutable action, goes through admission (acting
on an element whose name reads like confirm, pay, buy, delete, submit, cancel… needs the user's approval unless
the policy says otherwise), and is executed by the dispatcher with its attempt persisted first. The tool computer
checks the act against the latest observation again at execution: a stale ref is refused there and nothing runs.

    Computers           where a user's ToolComputer comes from (a VM from vm.VmManager, or fakes in tests)
    ActArgs, act_*      the `act` argument, derived from vm.observe's act kinds; parsing, recording and risk
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import operator
import re
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, Protocol, get_args, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model

from wakeful.proxy.clock import Clock
from wakeful.server.errors import BadRequest, WakefulError
from wakeful.server.observe import metrics
from wakeful.server.settings import ComputerHost, Settings
from wakeful.server.store.tables import Risk
from wakeful.vm.observe import ACT_KINDS, Act, DesktopClick, DesktopKey, DesktopType

if TYPE_CHECKING:
    from wakeful.vm.hosts import HostFleet, HostHypervisor, HostLink
    from wakeful.vm.hypervisor import Hypervisor, ProxyCredential
    from wakeful.vm.lifecycle import VmInfo, VmManager
    from wakeful.vm.observe import Accepted, HandoffLease, LeaseGrant, Refused, Surface
    from wakeful.vm.toolcomputer import ActResult, ObserveResult, ToolComputer

log = logging.getLogger(__name__)

__all__ = ["ACT_TOOL", "COMPUTER_TOOLS", "HANDOFF_TOOL", "OBSERVE_TOOL", "ActArgs", "Computer", "Computers",
           "LazyVmComputers", "VmComputers", "act_from_args", "act_json", "act_of", "act_risk", "default_link",
           "execute", "guest_socket", "host_tunnel", "hypervisor_for", "network_settings", "observe"]

OBSERVE_TOOL: Final = "computer__observe"
ACT_TOOL: Final = "computer__act"
HANDOFF_TOOL: Final = "computer__request_handoff"
COMPUTER_TOOLS: Final = frozenset({OBSERVE_TOOL, ACT_TOOL, HANDOFF_TOOL})
SENSITIVE: Final = re.compile(r"confirm|pay|buy|purchase|order|checkout|delete|remove|submit|cancel|send|transfer|"
                              r"sign|subscribe|unsubscribe|book|place", re.IGNORECASE)
"""Element names that make an act need approval by default (policy `tiers` can override `computer__act`)."""

_ACT_LIMITS: Final[Mapping[str, Any]] = {
    "ref": Field(max_length=64, description="An element ref from the latest observation."),
    "text": Field(max_length=10_000),
    "key": Field(min_length=1, max_length=64, description="A key or chord: Enter, Tab, Control+a …"),
    "keys": Field(min_length=1, max_length=64, description="xdotool key names joined by +, e.g. ctrl+l, Return"),
    "option": Field(max_length=500, description="The option's label or value."),
    "url": Field(max_length=4000),
    "tab_id": Field(max_length=100),
    "x": Field(ge=0, le=100_000), "y": Field(ge=0, le=100_000),
    "dx": Field(ge=-100_000, le=100_000), "dy": Field(ge=-100_000, le=100_000),
    "button": Field(ge=1, le=3, description="1 left, 2 middle, 3 right"),
    "observation": Field(ge=0, description="The observation acted on, for acts without a ref."),
}
"""What the tool boundary accepts in each act field, by field name (the fields themselves are vm.observe's)."""


def _limited(hint: Any, limit: Any) -> Any:
    """`hint` with the boundary's limit, put on the value's own type (`str | None` → `Annotated[str, …] | None`)."""
    if limit is None:
        return hint
    if isinstance(hint, types.UnionType) and type(None) in get_args(hint):
        (inner,) = (a for a in get_args(hint) if a is not type(None))
        return Annotated[inner, limit] | None
    return Annotated[hint, limit]


def _act_model(kind: str, cls: type[Act]) -> type[BaseModel]:
    """The input model of one act kind, derived from its vm.observe dataclass: `kind` plus the dataclass's fields."""
    hints = get_type_hints(cls)
    fields: dict[str, Any] = {"kind": (Literal[kind], ...)}
    for f in dataclasses.fields(cls):
        default = ... if f.default is dataclasses.MISSING else f.default
        fields[f.name] = (_limited(hints[f.name], _ACT_LIMITS.get(f.name)), default)
    config = ConfigDict(extra="forbid", strict=True, frozen=True)
    return create_model(f"{cls.__name__}Act", __config__=config, __doc__=f"A {kind} act.", **fields)


ActArgs: Any = Annotated[functools.reduce(operator.or_, (_act_model(k, c) for k, c in ACT_KINDS.items())),
                         Field(discriminator="kind")]
"""The `act` argument of `computer__act`: one model per act kind of `vm.observe.ACT_KINDS`, told apart by `kind`
(built at import from the vocabulary, so it has no static type)."""
_ACT_ARGS: Final[TypeAdapter[Any]] = TypeAdapter(ActArgs)


def act_of(args: BaseModel) -> Act:
    """The vm act for a validated `ActArgs`."""
    return ACT_KINDS[args.kind](**args.model_dump(exclude={"kind"}))  # type: ignore[attr-defined]


def act_from_args(raw: Any) -> Act:
    """The typed act for a recorded `act` (as `act_json` wrote it); `invalid_act` names what is missing or wrong."""
    try:
        return act_of(_ACT_ARGS.validate_python(raw))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in ("act", *error["loc"]))
        raise BadRequest("invalid_act", f"{where}: {error['msg']}") from None


def act_json(act: Act) -> dict[str, Any]:
    return {"kind": act.kind, **{k: v for k, v in dataclasses.asdict(act).items() if v is not None}}


def act_risk(act: Act, name: str | None) -> Risk:
    """`ask` when the act may commit something (its element's name reads like it, or it types into the desktop
    blind), else `auto`. Risk tiers in the policy override this for `computer__act`."""
    if isinstance(act, DesktopClick | DesktopKey | DesktopType):
        return Risk.ASK  # coordinates name nothing: a blind click could be "Pay"
    return Risk.ASK if name and SENSITIVE.search(name) else Risk.AUTO


class Computer(Protocol):
    """What the server asks of one user's tool computer (`vm.toolcomputer.ToolComputer`, or another process's
    through `server.computers.remote`)."""

    def observe(self, surface: Surface) -> ObserveResult: ...
    def check(self, act: Act) -> Accepted | Refused: ...
    def act(self, act: Act) -> ActResult | Refused: ...
    def request_handoff(self, reason: str, ttl: timedelta) -> LeaseGrant: ...
    def redeem_handoff(self, token: str) -> Accepted | Refused: ...
    def return_control(self, lease_id: str | None = None) -> int: ...
    @property
    def lease(self) -> HandoffLease | None: ...
    def vnc_port(self, guest_port: int = 5900) -> int: ...


class Computers(Protocol):
    """Where a user's tool computer comes from."""

    def computer(self, user_id: str) -> Computer:
        """The user's tool computer, provisioned, running (restored if it was suspended) and connected."""

    def activity(self, user_id: str, kind: str) -> contextlib.AbstractContextManager[None]:
        """Marks the VM busy (observe, act, handoff, live_view) so the idle reaper leaves it alone."""

    def reap(self) -> list[str]:
        """Suspend the tool computers idle past the setting; returns whose."""


class VmComputers:
    """Tool computers on VMs: one per user from `VmManager`, connected by `connect` (SSH, CDP, desktop)."""

    def __init__(self, manager: VmManager, connect: Callable[[VmInfo], ToolComputer], *,
                 credential: Callable[[str], ProxyCredential | None] = lambda user: None,
                 boot_wait: float = 0.0) -> None:
        """`boot_wait`: seconds the first connection to a VM waits for SSH and Chromium (it may be booting)."""
        self._manager = manager
        self._connect = connect
        self._credential = credential
        self._boot_wait = boot_wait
        self._computers: dict[str, ToolComputer] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        """Guards `_locks`; each user's lock then covers provisioning, booting and connecting that user's VM only,
        so one user's cold boot (minutes under TCG) holds nobody else up."""
        manager.add_after_restore_hook(self._after_restore)
        manager.add_before_suspend_hook(self._before_suspend)

    def _after_restore(self, restored: Any) -> None:
        tc = self._computers.get(restored.vm.user)
        if tc is not None:
            tc.after_restore()  # reconnect SSH ‖ CDP, resync the clock, bump the epoch: observe before acting

    def _before_suspend(self, vm: Any) -> None:
        tc = self._computers.get(vm.user)
        if tc is not None:
            tc.before_suspend()  # the guest drops its page cache: a smaller saved state, a faster restore

    def _user_lock(self, user_id: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(user_id, threading.Lock())

    def _provisioned(self, user_id: str) -> None:
        """The user's VM exists from their first use on (the caller holds the user's lock)."""
        from wakeful.vm.errors import VmNotFound

        try:
            self._manager.get(user_id)
        except VmNotFound:
            self._manager.provision(user_id, proxy_credential=self._credential(user_id))

    def computer(self, user_id: str) -> ToolComputer:
        with self._user_lock(user_id):
            self._provisioned(user_id)
            with metrics.restoring(self._manager.get(user_id).state == "suspended"):
                info = self._manager.ensure_running(user_id)
            metrics.computers(vm.state.value for vm in self._manager.vms())
            tc = self._computers.get(user_id)
            if tc is None:
                tc = self._connect(info)
                tc.connect(wait=self._boot_wait)
                self._computers[user_id] = tc
            return tc

    @contextlib.contextmanager
    def activity(self, user_id: str, kind: str) -> Iterator[None]:
        with self._user_lock(user_id):
            self._provisioned(user_id)  # the first observe marks a VM busy before it asks for the computer
        with self._manager.activity(user_id, kind):
            yield

    def reap(self) -> list[str]:
        reaped = self._manager.reap()
        metrics.computers(vm.state.value for vm in self._manager.vms())
        return reaped


def _vm_error(exc: Exception) -> WakefulError:
    code = getattr(exc, "code", "tool_computer_error")
    return WakefulError(code, str(getattr(exc, "message", exc)))


def observe(computers: Computers, user_id: str, surface: str) -> ObserveResult:
    from wakeful.vm.errors import VmError
    from wakeful.vm.observe import Surface

    try:
        with computers.activity(user_id, "observe"):
            return computers.computer(user_id).observe(Surface(surface))
    except VmError as exc:
        raise _vm_error(exc) from None


def execute(computers: Computers, user_id: str, act: Act) -> ActResult | Refused:
    from wakeful.vm.errors import VmError

    try:
        with computers.activity(user_id, "act"):
            return computers.computer(user_id).act(act)
    except VmError as exc:
        raise _vm_error(exc) from None


class LazyVmComputers:
    """`VmComputers` built on first use from the settings, so a server without an image or libvirt starts fine and
    says exactly what is missing when the agent first asks for its tool computer."""

    def __init__(self, settings: Settings, clock: Clock, credential: Callable[[str], ProxyCredential]) -> None:
        self._settings = settings
        self._clock = clock
        self._credential = credential
        self._inner: VmComputers | None = None
        self._lock = threading.Lock()

    def _vms(self) -> VmComputers:
        with self._lock:
            if self._inner is None:
                self._inner = _build_vm_computers(self._settings, self._clock, self._credential)
            return self._inner

    def computer(self, user_id: str) -> Computer:
        return self._vms().computer(user_id)

    def activity(self, user_id: str, kind: str) -> contextlib.AbstractContextManager[None]:
        return self._vms().activity(user_id, kind)

    def reap(self) -> list[str]:
        return self._inner.reap() if self._inner is not None else []


def network_settings(settings: Settings, hypervisor: Hypervisor) -> dict[str, Any]:
    """The `VmSettings` fields for `computer_network`, after checking that the guests will find the egress proxy
    there: the network is usable (`Hypervisor.network`), its host address is the one the proxy listens on, and the
    proxy runs at all. Nothing (user-mode networking) when no network is set."""
    if settings.computer_network is None:
        return {}
    listen = settings.bridge_listen
    assert listen is not None, "Settings requires proxy_bridge_listen with computer_network"
    if not settings.proxy:
        raise WakefulError("network_unusable", "computer_network needs the egress proxy (proxy = true): it is the "
                                               "only thing tool computers on the network can reach")
    network = hypervisor.network(settings.computer_network)
    if str(network.host.ip) != listen[0]:
        raise WakefulError("network_unusable", f"proxy_bridge_listen is {settings.proxy_bridge_listen}, but the host's "
                                               f"address on {network.name} is {network.host.ip}: tool computers would "
                                               "look for the egress proxy where it is not")
    return {"network": network.name, "network_proxy_port": listen[1], "address_book": settings.address_book}


def hypervisor_for(settings: Settings, connect: Callable[[str], HostHypervisor],
                   link: Callable[[ComputerHost], HostLink] | None = None) -> Hypervisor:
    """Where tool computers run: `connect(libvirt_uri)` alone, or a fleet over `computer_hosts` (each connected with
    `connect(uri)`) with saved state in `computer_shared_dir` (`vm.hosts.HostFleet`, placing each computer by the
    rules of `vm.placement`). A host with `ssh` is reached through `link(host)`: by default a
    `vm.host_tunnel.HostTunnel` that also brings its guests' proxy connections back to the egress proxy here."""
    if not settings.computer_hosts:
        return connect(settings.libvirt_uri)
    from wakeful.vm.hosts import Host, HostFleet
    from wakeful.vm.placement import HostMark, HostSpec

    assert settings.computer_shared_dir is not None, "Settings requires computer_shared_dir with computer_hosts"
    make_link = link or default_link(settings)
    hosts = [Host(spec=HostSpec(name=h.name, uri=h.uri, memory_mib=h.memory_mib, max_restores=h.max_restores,
                                mark=HostMark(h.mark)), hypervisor=connect(h.uri),
                  link=make_link(h) if h.ssh is not None else None)
             for h in settings.computer_hosts]
    return HostFleet(hosts, settings.computer_shared_dir, busy_wait=settings.computer_busy_wait.total_seconds())


def default_link(settings: Settings) -> Callable[[ComputerHost], HostLink]:
    """How the api reaches a host with `ssh`: `host_tunnel` with the forward its guests need to find the egress
    proxy. On user-mode networking the host's 127.0.0.1:`proxy_port`, back to the proxy's loopback listener (the
    guest's connector has put its credential in); on `computer_network` the network's host address there, back to
    the proxy's relay socket with the guest's address (`proxy_relay_socket`). Nothing without the proxy."""
    relay, listen = settings.proxy_relay_socket, settings.bridge_listen
    if not settings.proxy:
        return functools.partial(host_tunnel, proxy=None)
    if relay is not None and listen is not None:
        return functools.partial(host_tunnel, proxy=None, network=(listen, relay))
    return functools.partial(host_tunnel, proxy=("127.0.0.1", settings.proxy_port))


def host_tunnel(host: ComputerHost, *, proxy: tuple[str, int] | None,
                network: tuple[tuple[str, int], Path] | None = None) -> HostLink:
    """The SSH tunnel to a host with `ssh` set (not connected yet: the fleet connects it when it asks the host).
    `network`: the address and port its guests find the proxy at on its isolated network, and the proxy's relay
    socket here (`vm.host_tunnel.NetworkForward`)."""
    from wakeful.vm.host_tunnel import HostSsh, HostTunnel, NetworkForward

    assert host.ssh is not None and host.ssh_host_key is not None and host.ssh_key is not None
    ssh = HostSsh.parse(host.ssh, host_key=host.ssh_host_key, client_key=host.ssh_key,
                        proxy_command=host.ssh_proxy_command)
    forward = NetworkForward(listen=network[0], relay_socket=network[1]) if network is not None else None
    return HostTunnel(name=host.name, ssh=ssh, proxy=proxy, network=forward)


def guest_socket(fleet: HostFleet | None, info: VmInfo) -> Callable[[], object | None] | None:
    """What the guest channel speaks SSH over. On a host reached over SSH the guest's SSH is on that host's loopback
    (a forward) or at its address on that host's isolated network: either way only that host reaches it, so each
    (re)connect asks the fleet where the VM runs now and opens a channel there (None from it: here, directly).
    Without a fleet: None, a plain TCP connection."""
    return None if fleet is None else functools.partial(fleet.open_to, info.name, info.ssh_endpoint)


def _build_vm_computers(settings: Settings, clock: Clock, credential: Callable[[str], ProxyCredential]) -> VmComputers:
    try:  # the VM stack is an optional extra: a server without it runs, and says what a tool computer needs
        from wakeful.vm.accel import choose_accel
        from wakeful.vm.cdp_browser import CdpBrowser
        from wakeful.vm.desktop import XDesktop
        from wakeful.vm.errors import VmError
        from wakeful.vm.hosts import HostFleet
        from wakeful.vm.hypervisor import Accel
        from wakeful.vm.libvirt_adapter import LibvirtHypervisor
        from wakeful.vm.lifecycle import VmManager, VmSettings
        from wakeful.vm.lifecycle_rules import VmSize
        from wakeful.vm.ssh_channel import GuestChannel
        from wakeful.vm.toolcomputer import ToolComputer
    except ImportError as exc:
        raise WakefulError("tool_computer_unavailable", f"tool computers need the optional VM packages, and "
                           f"{exc.name or exc} is not installed: run `./scripts/install --computers` (or install "
                           "`wakeful[computers]`), or set computers = false") from None

    image = settings.data_dir / "images" / settings.computer_image
    kernel = image / "vmlinux"
    if not (image / "base.qcow2").exists() or not kernel.exists():
        raise WakefulError("tool_computer_unavailable", f"no guest image in {image}: build it with "
                                                        "`wakeful image build`")
    try:
        accel = choose_accel(kernel, data_dir=settings.data_dir, force=settings.computer_accel)
        log.info("tool computers run under %s", accel.describe())
        hypervisor = hypervisor_for(settings, LibvirtHypervisor)
        manager = VmManager(VmSettings(
            data_dir=settings.computer_shared_dir or settings.data_dir, base_image=image / "base.qcow2", kernel=kernel,
            initrd=image / "initrd.img" if (image / "initrd.img").exists() else None, accel=accel.accel,
            proxy_port=settings.proxy_port if settings.proxy else None, idle_after=settings.computer_idle_after,
            size=VmSize(memory_mib=1024, vcpus=settings.computer_vcpus, disk_gib=8),
            tb_cache_mib=settings.computer_tcg_cache,
            **network_settings(settings, hypervisor)), hypervisor)
    except VmError as exc:
        raise WakefulError(exc.code, exc.message) from None

    # Chromium under TCG is ~30x slower than on the host (a new tab 9-12 s, a first cross-site navigation up to a
    # minute): its calls get minutes, not seconds, and so does SSH coming back after a restore.
    slow = accel.accel is Accel.TCG

    fleet = hypervisor if isinstance(hypervisor, HostFleet) else None

    def connect(info: VmInfo) -> ToolComputer:
        host, port = info.ssh_endpoint
        channel = GuestChannel(host=host, port=port, user="root", client_key_path=info.keys.client_key,
                               pinned_host_key=info.keys.host_public, sock=guest_socket(fleet, info),
                               side_door=info.side_door if fleet is None else None)
        browser = CdpBrowser(timeout=240.0, navigation_timeout=180.0) if slow else CdpBrowser()
        return ToolComputer(vm_id=info.name, channel=channel, clock=clock, browser=browser, desktop=XDesktop(channel),
                            reconnect_timeout=120.0 if slow else 60.0)

    return VmComputers(manager, connect, credential=credential,
                       boot_wait=settings.computer_boot_timeout.total_seconds())
