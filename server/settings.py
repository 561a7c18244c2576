"""Settings in one place: CLI flags > `WAKEFUL_*` environment > the TOML config file > defaults.

The config file is `$WAKEFUL_CONFIG` (which must exist when set), else `<data_dir>/wakeful.toml` when it exists,
where `<data_dir>` is the one the flags or the environment name (so `wakeful serve --data-dir D` reads
`D/wakeful.toml`). Nested values use `__` in the environment: `WAKEFUL_SOURCES__GITHUB__SECRET=...` sets the
secret of the source named `github`.

A process resolves its settings once. The processes it starts (the egress proxy under `wakeful serve`) get that
resolution whole in their environment (`child_environment`) and use it instead of resolving again, so parent and
child can never disagree on a port or a directory.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import tomllib
from datetime import timedelta
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    SecretStr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

__all__ = ["DB_FILE", "RESOLVED_ENV", "VM_PACKAGES", "ComputerHost", "ConfigFileError", "Settings", "SourceSettings",
           "child_environment", "config_file", "load_settings", "missing_vm_packages", "parse_listen"]

RESOLVED_ENV = "WAKEFUL_RESOLVED_SETTINGS"
"""The parent's resolved settings as JSON, for its children (never set it by hand: use `WAKEFUL_CONFIG`)."""


class ConfigFileError(ValueError):
    """The config file cannot be used at all: missing though named, unreadable, or not TOML."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem

SignatureKind = Literal["github", "stripe", "slack", "generic"]
"""The webhook signature schemes (`server.core.signatures` verifies them); declared here, where sources are set."""


_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_TIMEDELTA: Final = TypeAdapter(timedelta)


def _seconds(value: Any) -> Any:
    """Durations from the environment may be plain seconds (`30`, `0.5`) as well as ISO 8601 (`PT30S`)."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def _float_seconds(value: Any) -> Any:
    """The same two spellings for the settings the code reads as a float of seconds (`Seconds`)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, str) and not _NUMBER.fullmatch(value.strip()):
        try:
            return _TIMEDELTA.validate_python(value.strip()).total_seconds()
        except ValidationError:
            raise ValueError(f"{value[:40]!r} is neither seconds (30, 0.5) nor an ISO 8601 duration (PT30S)") from None
    return value


Duration = Annotated[timedelta, BeforeValidator(_seconds)]
"""A duration as a `timedelta`: seconds (`30`) or ISO 8601 (`PT30S`)."""
Seconds = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_float_seconds)]
"""A duration as a float of seconds, for the code that reads it so: spelled as `Duration` is."""
Port = Annotated[int, Field(ge=1, le=65535)]


_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _is_host(value: str) -> bool:
    """An IP address or a DNS name (ASCII labels; not only digits, which resolvers would read as an address). The
    egress proxy's `normalize_host` says the same; settings import from no other room, so the rule is here too."""
    name = value.removesuffix(".")
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    labels = name.split(".")
    return (0 < len(name) <= 253 and name.isascii() and all(_LABEL.fullmatch(label) for label in labels)
            and not all(label.isdigit() for label in labels))


def _host_name(value: str) -> str:
    if not _is_host(value):
        raise ValueError(f"{value[:80]!r} is not a host name or an IP address, e.g. merchant.test")
    return value


def _listen_host(value: str) -> str:
    if not _is_host(value):
        raise ValueError(f"{value[:80]!r} is not an address to listen on: an IP address such as 127.0.0.1 or ::1, "
                         "or a host name such as localhost")
    return value


def _ip_address(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{value[:80]!r} is not an IP address, e.g. 127.0.0.1") from None
    return value


def _http_url(value: str) -> str:
    """An absolute `http://` or `https://` URL with a host."""
    problem = f"{value[:80]!r} is not an http:// or https:// URL, e.g. https://example.org/path"
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(problem)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
        if parts.scheme not in ("http", "https") or not parts.hostname or not _is_host(parts.hostname):
            raise ValueError(problem)
    except ValueError:
        raise ValueError(problem) from None
    return value


HostName = Annotated[str, AfterValidator(_host_name)]
HttpUrl = Annotated[str, AfterValidator(_http_url)]
Segment = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
"""A name that is one segment of a URL or a path: a webhook source's (`/v1/hooks/<name>`), an image's."""

DATABASE_DRIVERS: Final = ("sqlite", "sqlite+pysqlite", "postgresql+psycopg")
"""The databases wakeful runs on: SQLite files, and PostgreSQL through psycopg 3."""


def _database_url(value: str | None) -> str | None:
    """A URL of a database wakeful runs on; empty is unset. The URL itself is never repeated (it may hold a
    password)."""
    if value is None or not value.strip():
        return None
    supported = "use sqlite:///PATH or postgresql+psycopg://USER@HOST/DATABASE"
    try:
        url = make_url(value)
    except ArgumentError:
        raise ValueError(f"not a database URL: {supported}") from None
    if url.drivername not in DATABASE_DRIVERS:
        hint = " (psycopg 3, not psycopg2)" if url.drivername.startswith("postgres") else ""
        raise ValueError(f"{url.drivername!r} is not a database wakeful runs on{hint}: only SQLite and PostgreSQL "
                         f"through psycopg are supported; {supported}")
    if url.drivername.startswith("sqlite") and url.database in (None, "", ":memory:"):
        raise ValueError(f"SQLite needs a file, which every wakeful process opens: {supported}")
    if url.drivername == "postgresql+psycopg" and _missing("psycopg"):
        raise ValueError("PostgreSQL's driver, psycopg 3, is not installed: install it into wakeful's virtualenv "
                         "(pip install 'psycopg[binary]>=3.1'; docs/deploy.md)")
    return value

# Where each provider puts the delivery ID and a natural session key, unless the source says otherwise. GitHub has
# none it signs (X-GitHub-Delivery is not): its deliveries are told apart by the digest of what the signature covers.
_DEFAULT_DELIVERY_ID: dict[str, str | None] = {
    "github": None,
    "stripe": "body:id",
    "slack": "body:event_id",
    "generic": "header:X-Wakeful-Delivery",
}
_DEFAULT_SESSION_KEY: dict[str, str] = {
    "github": "body:issue.number",
    "stripe": "body:data.object.id",
    "slack": "body:event.thread_ts",
    "generic": "body:session_key",
}


class SourceSettings(BaseModel):
    """One webhook source, bound to one user."""

    model_config = {"extra": "forbid"}

    kind: SignatureKind
    """Which signature scheme the provider uses."""
    secret: SecretStr
    """The shared signing secret. Prefer the environment (`WAKEFUL_SOURCES__<NAME>__SECRET`) to the file."""
    user: str = "owner"
    """The user every event from this source belongs to."""
    trust: Literal["third_party", "verified_service", "user"] = "third_party"
    """How much the content may be trusted; it is data to the model either way, never an instruction."""
    delivery_id: str | None = None
    """Where the provider's delivery ID is: `header:<Name>` or `body:<dotted.path>`; per-kind default. A header the
    signature does not cover is never trusted as one: such deliveries are told apart by what the signature covers."""
    session_key: str | None = None
    """Where a correlation key is (thread, issue, wait ID): `header:<Name>` or `body:<dotted.path>`."""
    tolerance_seconds: int = Field(default=300, ge=0)
    """How far a signed timestamp may be from now, either way, for the schemes that sign one (generic, Stripe,
    Slack); further is `signature_expired`."""

    @field_validator("delivery_id", "session_key")
    @classmethod
    def _locator(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("header:", "body:")):
            raise ValueError("must start with 'header:' or 'body:'")
        return value

    def delivery_locator(self) -> str | None:
        """Where the delivery ID is; None when there is none the signature covers (GitHub's default)."""
        return self.delivery_id or _DEFAULT_DELIVERY_ID[self.kind]

    def session_locator(self) -> str:
        return self.session_key or _DEFAULT_SESSION_KEY[self.kind]


class ComputerHost(BaseModel):
    """One KVM host tool computers may run on (`computer_hosts`); see docs/configuration.md."""

    model_config = {"extra": "forbid"}

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")
    """A short name for logs and errors: lowercase letters, digits, `-` and `_`."""
    uri: str = Field(min_length=1)
    """Its libvirt connection, e.g. `qemu+ssh://root@kvm2/system` (`qemu:///system` for this machine)."""
    memory_mib: int = Field(ge=256)
    """Memory tool computers may take there in all, in MiB (leave the host its own)."""
    max_restores: int = Field(default=2, ge=1, le=64)
    """Restores and cold boots in flight there at once; more wait (`computer_busy_wait`) or go to another host."""
    mark: Literal["up", "full", "gone"] = "up"
    """`full`: takes no computer that is not running there already; `gone`: treated as unreachable."""
    ssh: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]+@([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(:\d{1,5})?$")
    """For a host other than the api's own: `user@host[:port]`, where the api reaches it over SSH for its guests'
    SSH and to bring their egress proxy connections back: from its 127.0.0.1:`proxy_port` on user-mode networking,
    from `proxy_bridge_listen` on `computer_network` (its sshd then needs `GatewayPorts clientspecified`, and the
    proxy knows each connection by the guest address that sshd reports; see infra/README.md). Unset: this
    machine."""
    ssh_host_key: str | None = None
    """With `ssh`: the host's SSH public key as one OpenSSH line (`ssh-ed25519 AAAA…`, from `/etc/ssh/
    ssh_host_ed25519_key.pub` there); no other key is accepted."""
    ssh_key: Path | None = None
    """With `ssh`: the private key the api logs in with."""
    ssh_proxy_command: str | None = None
    """With `ssh`: a command whose stdin/stdout reach the host's sshd (a bastion: `ssh -W %h:%p jump`)."""

    @field_validator("ssh_host_key")
    @classmethod
    def _one_public_key_line(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa) "
                                                  r"[A-Za-z0-9+/]+={0,2}( [^\n]*)?", value.strip()):
            raise ValueError("ssh_host_key is not an OpenSSH public key line such as `ssh-ed25519 AAAA… root@kvm2`")
        return value

    @model_validator(mode="after")
    def _ssh_needs_its_keys(self) -> ComputerHost:
        if self.ssh is None:
            extra = [n for n in ("ssh_host_key", "ssh_key", "ssh_proxy_command") if getattr(self, n) is not None]
            if extra:
                raise ValueError(f"host {self.name}: {', '.join(extra)} without ssh: set ssh = \"user@host\" too")
        elif self.ssh_host_key is None or self.ssh_key is None:
            raise ValueError(f"host {self.name}: ssh needs ssh_host_key (the host's public key, pinned: never "
                             "trusted on first use) and ssh_key (the api's private key)")
        return self


DB_FILE: Final = "wakeful.db"
"""The SQLite database in a data directory, unless `database_url` names another database."""

EXAMPLE_POLICIES: Final = Path(str(files("wakeful.policies")))
"""The example connector declarations and policy, as the package ships them (an installed package is a folder on
disk): what the demo and the evals run with, and what a user copies into `<data_dir>/policies`."""

VM_PACKAGES: Final = ("libvirt", "paramiko", "playwright")
"""What the `computers` extra installs (`./scripts/install --computers`)."""


def _missing(package: str) -> bool:
    """True when `package` is not installed (looked up, not imported)."""
    try:
        return importlib.util.find_spec(package) is None
    except ImportError:  # a finder that refuses the name outright
        return True


def missing_vm_packages() -> list[str]:
    """The VM stack's libraries that are not installed."""
    return [name for name in VM_PACKAGES if _missing(name)]


def _default_data_dir() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "wakeful"


class _Environment(EnvSettingsSource):
    """The `WAKEFUL_*` environment, where a value that should be JSON and is not (`egress_allow_private=a.test`)
    goes on to validation as it is, which refuses it naming the field (pydantic-settings stops with an error that
    names neither the variable nor what is wrong)."""

    def decode_complex_value(self, field_name: str, field: FieldInfo | None, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)  # type: ignore[arg-type]
        except ValueError:
            return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WAKEFUL_", env_nested_delimiter="__", extra="forbid")

    data_dir: Path = Field(default_factory=_default_data_dir)
    """Where the SQLite file and everything else the server keeps lives."""
    database_url: Annotated[str | None, AfterValidator(_database_url)] = None
    """SQLAlchemy URL; default `sqlite:///<data_dir>/wakeful.db`. The schema is PostgreSQL-compatible."""
    host: Annotated[str, AfterValidator(_listen_host)] = "127.0.0.1"
    """HTTP listen address. Loopback unless you mean it."""
    port: Port = 8787
    public_url: str | None = Field(default=None, pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")
    """The address people reach this server at, e.g. `https://agent.example.org` behind a TLS reverse proxy
    (docs/deploy.md): links in messages (approval cards, live views) start with it, and the console's cookie is
    `Secure` when it is https. Unset: `http://<host>:<port>`, which works only on this machine."""
    sources: dict[Segment, SourceSettings] = Field(default_factory=dict)
    """Webhook sources by name: `POST /v1/hooks/<name>`."""
    policies_dir: Path | None = None
    """Connector declarations (`connectors/*.toml`) and the user's `policy.toml`; default `<data_dir>/policies`."""
    connector_urls: dict[str, HttpUrl] = Field(default_factory=dict)
    """Base URL per connector name, overriding the declared one (simulators, staging)."""
    connector_timeout: Seconds = Field(default=10.0, gt=0, le=600)
    """Seconds a connector request may take; past it the outcome of a write is unknown and is reconciled."""
    proxy: bool = True
    """Send every connector call through the egress proxy, which `wakeful serve` starts as a child process; it adds
    the credential only after the policy decided that exact request. Off: connector calls go out directly and no
    credential is ever added (local simulators only)."""
    proxy_port: Port = 8788
    """The egress proxy's port; it listens on 127.0.0.1 only."""
    proxy_decider_timeout: Seconds = Field(default=2.0, gt=0, le=300)
    """Seconds the proxy waits for the policy decision before it refuses the request (`decider_unavailable`)."""
    egress_grant_ttl: Duration = Field(default=timedelta(seconds=60), gt=timedelta(0), le=timedelta(days=1))
    """How long the grant the server issues for one connector request stays usable by the proxy."""
    egress_allow_private: list[HostName] = Field(default_factory=list)
    """Host names the proxy may dial at private, loopback or reserved addresses (a local simulator); any other
    host resolving there is refused (`address_not_allowed`)."""
    egress_resolve: dict[HostName, list[Annotated[str, AfterValidator(_ip_address)]]] = Field(default_factory=dict)
    """Fixed addresses for host names, used instead of DNS, e.g. `{"merchant.test" = ["127.0.0.1"]}`."""
    egress_no_intercept: list[HostName] = Field(default_factory=list)
    """Hosts that pin certificates or need mutual TLS: tunnelled without interception, so never given a
    credential."""
    egress_upstream_ca: Path | None = None
    """A CA bundle the proxy trusts for upstream TLS instead of the system store (a lab's own CA)."""
    vault_key_file: Path | None = None
    """The credential vault's key file; default `<data_dir>/vault.key`, created on first use. The environment
    variable `WAKEFUL_VAULT_KEY` (base64 keys, comma-separated, current first) is used instead when set."""
    computers: bool = Field(default_factory=lambda: not missing_vm_packages())
    """Give each user a tool computer (a VM from `wakeful image build`, started on first use, suspended when idle).
    Default: on when the VM packages are installed (`./scripts/install --computers`), else off."""
    computer_image: Segment = "guest"
    """The image under `<data_dir>/images/` tool computers boot from."""
    computer_idle_after: Duration = Field(default=timedelta(minutes=10), gt=timedelta(0), le=timedelta(days=30))
    """A tool computer with nothing in flight for this long is suspended (memory saved to disk, RAM freed)."""
    computer_boot_timeout: Duration = Field(default=timedelta(minutes=10), gt=timedelta(0), le=timedelta(days=1))
    """How long the first observe of a cold-booted tool computer waits for its SSH and Chromium to answer (seconds
    on KVM; a minute or two under TCG, where the guest's Chromium answered 60 s after the start with 2 vCPUs, 125–140 s
    with 1)."""
    computer_accel: Literal["kvm", "tcg"] | None = None
    """Force the acceleration; by default KVM is probed (a stock kernel must boot under it) and TCG used otherwise."""
    computer_vcpus: int = Field(default=2, ge=1, le=2)
    """Virtual CPUs of each new tool computer (1 GiB of RAM, an 8 GiB disk). Chromium's processes and threads use the
    second one: under TCG a restore reached its first observation in 3.3 s with 2 instead of 4.9 s with 1, and a cold
    boot in 61 s instead of 110 s (`bench/tool_computer.py`, medians of 3). A computer keeps the count it was made
    with."""
    computer_tcg_cache: int = Field(default=512, ge=32, le=65536)
    """MiB of host memory QEMU may hold per running tool computer for the guest code it translated, under TCG only
    (ignored on KVM). Smaller thrashes: at 64 MiB a page took the guest's Chromium 107-164 s to load, not 14-29 s."""
    libvirt_uri: str = Field(default="qemu:///system", min_length=1)
    """Where tool computers run."""
    computer_hosts: list[ComputerHost] = Field(default_factory=list)
    """Several KVM hosts for tool computers (then `libvirt_uri` is unused). A computer starts on the host with most
    free memory, stays there while it runs, and when suspended resumes there again, or on another host when its own
    is full or gone: its saved state and disks are in `computer_shared_dir`, which every host must see."""
    computer_shared_dir: Path | None = None
    """With `computer_hosts`: a directory every host sees at this same path (NFS in production) holding each
    computer's disk overlay, seed disk, keys and saved memory. The image (`<data_dir>/images/`) must be at its path
    on every host too."""
    computer_busy_wait: Duration = Field(default=timedelta(minutes=2), ge=timedelta(0), le=timedelta(days=1))
    """With `computer_hosts`: how long a restore waits when every host with room is at its `max_restores`."""
    computer_network: str | None = Field(default=None, min_length=1)
    """For production hosts: the isolated libvirt network (no `<forward>`, see infra/README.md) tool computers join
    instead of QEMU user-mode networking. Each VM gets a fixed address (a DHCP reservation, held against spoofing by
    libvirt's `clean-traffic` filter) and reaches nothing but the egress proxy on `proxy_bridge_listen`, which knows
    the VM by that address. Unset: user-mode networking, every host forward on 127.0.0.1."""
    proxy_bridge_listen: str | None = None
    """`ADDRESS:PORT` where the egress proxy also listens for tool computers on `computer_network`: the network's
    own host address. A connection there is known by its source address alone. Required with `computer_network`.
    On hosts reached over `ssh` the same address and port (each host has the network under the same name and
    subnet): their sshd listens there for the api's tunnel (see `proxy_relay_socket`)."""
    reconcile_interval: Seconds = Field(default=5.0, gt=0, le=86400)
    """Seconds between the first and the second read of the provider about one action whose outcome is unknown (or
    whose accepted effect is not verified yet); each later gap doubles, up to `reconcile_backoff_max`, less up to a
    quarter of jitter. The first read is at once. How long the reads go on is the policy's `reconcile_window` and
    `verify_window`."""
    reconcile_backoff_max: Duration = Field(default=timedelta(minutes=10), gt=timedelta(0), le=timedelta(days=1))
    """The longest gap between two reads of the provider about one action."""
    resend_after: Duration = Field(default=timedelta(seconds=10), gt=timedelta(0), le=timedelta(days=30))
    """How long after an attempt whose outcome is unknown, and that the provider shows no trace of, the same request
    may go again with the same idempotency key (only for operations that declare one)."""
    notify_url: HttpUrl | None = None
    """Where messages to the user are delivered (POST, JSON, `Idempotency-Key` header). None: the local feed only."""
    max_body_bytes: int = Field(default=1 << 20, ge=1, le=1 << 30)
    """Webhook bodies larger than this are refused with 413."""
    lease: Duration = Field(default=timedelta(seconds=30), ge=timedelta(seconds=1), le=timedelta(days=366))
    """How long a worker's claim on a session lasts without renewal; a dead worker's session is free after it."""
    run_max_steps: int = Field(default=50, ge=1, le=100_000)
    """Steps one run may take before it is ended and the user told."""
    run_max_seconds: Seconds = Field(default=300.0, gt=0, le=86400)
    """Wall-clock seconds one run may take."""
    run_max_events: int = Field(default=32, ge=1, le=100_000)
    """Outside deliveries one run takes at most, the oldest first (the user's messages and control are always all
    taken); the rest are its session's next run, behind other sessions' work already due. It bounds how long a run
    holds the database's write lock when it starts and when it commits, which acknowledgements queue behind."""
    run_max_tokens: int = Field(default=200_000, ge=1)
    """Model tokens (input + output) one run may use."""
    anthropic_api_key: SecretStr | None = None
    """Enables the Anthropic model for `wakeful serve`; without it runs use the echo handler. Never logged. When
    neither `WAKEFUL_ANTHROPIC_API_KEY` nor the config file sets it, the conventional `ANTHROPIC_API_KEY` is used."""
    model: str = Field(default="claude-sonnet-4-5", min_length=1)
    """The Anthropic model to call."""
    instructions_file: Path | None = None
    """The user's standing instructions (the agent reads, never edits them); default `<data_dir>/instructions.md`."""
    daily_max_steps: int = Field(default=5000, ge=1)
    """Steps per user per UTC day across all runs."""
    coalesce_seconds: Seconds = Field(default=2.0, ge=0, le=300)
    """Webhook deliveries for one session (by their correlation key) that arrive within this many seconds of the first
    are handled by one run (a warning and two cancellations: one run, one rebooking): the run starts this long after
    the first arrived. One without a key starts at once (nothing can join it); so do the user's messages and control,
    taking what is pending with them. 0 turns coalescing off."""
    event_max_attempts: int = Field(default=5, ge=1, le=1000)
    """Runs that may pick up one event before it is marked failed and the user told."""
    followup_cap: int = Field(default=20, ge=0)
    """Active follow-ups per user."""
    schedule_min_interval: Duration = Field(default=timedelta(minutes=15), gt=timedelta(0), le=timedelta(days=366))
    """The shortest gap a recurring check may have (for cron, the shortest between its next firings)."""
    timers_per_task: int = Field(default=10, ge=0)
    """Open follow-ups and recurring checks one task may hold (`server.core.agenda`)."""
    waits_per_task: int = Field(default=10, ge=0)
    """Open reply waits one task may hold."""
    check_wakes_per_day: float = Field(default=48.0, ge=0, allow_inf_nan=False)
    """The wake budget of one task's recurring checks together: their expected wakes per day (86400 s over an
    interval; a cron's firings over the next week, over seven). A new check past it is refused."""
    helper_cap: int = Field(default=2, ge=0)
    """Helper tasks (read-only sub-tasks with their own run) open at once per task."""
    helper_max_steps: int = Field(default=10, ge=1, le=100_000)
    """Steps a helper's run may take before it fails and the main task is told."""
    helper_max_time: Duration = Field(default=timedelta(minutes=30), gt=timedelta(0), le=timedelta(days=366))
    """How long after it started a helper may still go on before it fails and the main task is told."""
    workers: int = Field(default=2, ge=1, le=64)
    """Worker threads: different sessions run in parallel, one run per session at a time."""
    ingest_run_share: float = Field(default=0.02, gt=0, le=1)
    """While the inbox is busy (`ingest_busy_rate`), the share of the time the runs of all workers together may take
    (CPU, or the database's write lock), so that acknowledgements stay fast; the backlog drains once the burst ends.
    1: runs never give way. Each acknowledgement that meets a run's transaction waits for it: at 1,000 deliveries/s
    the ack p99 was 8.3–14.0 ms with 0.05 (six runs), 6.2–6.6 ms with 0.02, 4.8–5.5 ms with 0.01, 3.0–6.4 ms with
    the worker stopped (three runs each, quiet machine; `bench/ingest.py --tail` compares the first, second and last).
    """
    ingest_busy_rate: float = Field(default=500.0, ge=0, allow_inf_nan=False)
    """Deliveries per second above which the inbox counts as busy and runs give way. Below it runs go at full
    speed, so a steady stream the workers can keep up with never builds a backlog. Well above a sustained stream
    runs must keep pace with (200/s in `bench/ingest.py`): at that line, the measured rate's noise made runs give
    way half the time."""
    poll_interval: Seconds = Field(default=1.0, ge=0.01, le=86400)
    """Fallback polling for the worker, scheduler and dispatcher; commits wake them at once in-process."""
    idle_poll_max: Seconds = Field(default=30.0, ge=0.01, le=86400)
    """While a loop keeps finding nothing, its polling slows down to this (seconds). Work in this process wakes it
    at once; the CLI and `wakeful mcp` wake it through `POST /v1/wake` after they write."""
    sweep_interval: Seconds = Field(default=15.0, ge=0.01, le=86400)
    """How often the sweeper runs (seconds)."""
    dispatch_max_attempts: int = Field(default=8, ge=1, le=1000)
    """Deliveries of one outbox message before it is marked failed."""
    dispatch_backoff: Duration = Field(default=timedelta(seconds=1), gt=timedelta(0), le=timedelta(days=1))
    """First retry delay for a failed delivery; doubles each time."""
    log_format: Literal["text", "json"] = "text"
    """How the server's log lines are written to stderr: `text` for a terminal, `json` for a log pipeline (one object
    per line: `time`, `level`, `logger`, `message`, `exception`). Secrets are redacted either way (docs/deploy.md)."""
    metrics: bool = True
    """Serve Prometheus metrics at `GET /metrics`, without a credential: aggregate numbers only, no user's ID or name
    (docs/deploy.md). Off: the route answers 404."""
    drain_seconds: Seconds = Field(default=0.0, ge=0, le=600)
    """After the first SIGTERM, how long the server keeps answering, with `GET /readyz` already 503, before it stops
    listening: set it above the load balancer's health-check interval. A second SIGTERM or Ctrl-C stops it at once.
    0: it stops listening at once."""
    crash_at: str = ""
    """Fault injection for tests only: `point[:probability],...` makes the process `os._exit` there."""
    computer_fakes: bool = False
    """For tests only: tool computers on the vm layer's in-memory fakes (`server.computers.fakes`): no image, no
    libvirt, a checkout form on show."""
    echo_without_model: bool = False
    """For tests only: without a model, runs reply naming the events they handled (the crash campaigns count
    those replies) instead of settling them in silence."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        given = init_settings.init_kwargs if isinstance(init_settings, InitSettingsSource) else {}
        resolved = os.environ.get(RESOLVED_ENV)
        if resolved:  # a child of a process that resolved them already: exactly the parent's settings
            return init_settings, InitSettingsSource(settings_cls, init_kwargs=json.loads(resolved))
        path = config_file(given.get("data_dir"))
        try:
            toml = TomlConfigSettingsSource(settings_cls, toml_file=path)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigFileError(path, f"not valid TOML: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigFileError(path, f"not UTF-8 text, which TOML is: byte {exc.object[exc.start]:#04x} at "
                                        f"offset {exc.start}") from None
        except OSError as exc:
            raise ConfigFileError(path, exc.strerror or str(exc)) from None
        if "data_dir" in toml.toml_data and not os.environ.get("WAKEFUL_CONFIG"):
            raise ConfigFileError(path, "data_dir cannot be set in the data directory's own wakeful.toml; use "
                                        "--data-dir, WAKEFUL_DATA_DIR, or a file named by WAKEFUL_CONFIG")
        return (init_settings, _Environment(settings_cls), toml,
                InitSettingsSource(settings_cls, init_kwargs=_conventional_env()))

    @field_validator("proxy_bridge_listen")
    @classmethod
    def _bridge_listen(cls, value: str | None) -> str | None:
        if value is not None:
            parse_listen(value)
        return value

    @model_validator(mode="after")
    def _hosts_need_a_shared_dir(self) -> Settings:
        if self.computer_hosts and self.computer_shared_dir is None:
            raise ValueError("computer_hosts needs computer_shared_dir: a directory every host sees, where a "
                             "suspended computer's memory and disks wait for whichever host resumes it")
        names = [h.name for h in self.computer_hosts]
        for name in dict.fromkeys(n for n in names if names.count(n) > 1):
            raise ValueError(f"computer_hosts names {name} twice: give each host its own name")
        return self

    @model_validator(mode="after")
    def _network_needs_a_bridge_listener(self) -> Settings:
        if self.computer_network is not None and self.proxy_bridge_listen is None:
            raise ValueError("computer_network needs proxy_bridge_listen: the network's host address and the port "
                             "the egress proxy listens on there, e.g. 10.77.0.1:3128")
        return self

    @property
    def bridge_listen(self) -> tuple[str, int] | None:
        """`proxy_bridge_listen` as (IPv4 address, port)."""
        return parse_listen(self.proxy_bridge_listen) if self.proxy_bridge_listen is not None else None

    @property
    def proxy_relay_socket(self) -> Path | None:
        """With `computer_network` and hosts reached over `ssh`: where the egress proxy takes those hosts' tool
        computers, relayed by the api's SSH tunnel to each, every connection headed by a PROXY line naming the
        computer's address on its host's network (a unix socket, owner only). None otherwise."""
        if self.computer_network is None or not any(h.ssh is not None for h in self.computer_hosts):
            return None
        return self.data_dir / "run" / "proxy-relay.sock"

    @property
    def address_book(self) -> Path:
        """Which tool computer holds which address on `computer_network`: written by the VM manager, read by the
        proxy (0600; it holds each VM's proxy credential)."""
        return self.proxy_dir / "address-book.json"

    @property
    def base_url(self) -> str:
        """Where links in messages point: `public_url` without a trailing slash, else this machine's own address."""
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def policies(self) -> Path:
        return self.policies_dir or self.data_dir / "policies"

    @property
    def vault_path(self) -> Path:
        return self.data_dir / "vault.json"

    @property
    def vault_key_path(self) -> Path:
        return self.vault_key_file or self.data_dir / "vault.key"

    @property
    def ledger_key_path(self) -> Path:
        """The Ed25519 key that signs the ledger's checkpoints (`server.audit`), created 0600 on first use."""
        return self.data_dir / "ledger.key"

    @property
    def proxy_dir(self) -> Path:
        """The deployment CA (`ca.pem`, `ca.key.enc`)."""
        return self.data_dir / "proxy"

    @property
    def metrics_dir(self) -> Path:
        """Where the processes `wakeful serve` starts keep their metrics, summed by `GET /metrics`
        (`server.observe.metrics`); emptied when serve starts."""
        return self.data_dir / "run" / "metrics"

    @property
    def decider_socket(self) -> Path:
        """Where `wakeful serve` answers the proxy's policy questions (a unix socket, owner only)."""
        return self.data_dir / "run" / "decider.sock"

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / DB_FILE}"

    @property
    def db_shown(self) -> str:
        """`db_url` as logs and terminals may show it: a password in it is masked."""
        return make_url(self.db_url).render_as_string(hide_password=True)


def parse_listen(value: str) -> tuple[str, int]:
    """`IPV4:PORT` → (address, port); ValueError naming what is wrong."""
    address, colon, port = value.rpartition(":")
    try:
        ip = ipaddress.IPv4Address(address)
        number = int(port)
    except ValueError:
        raise ValueError(f"{value!r} is not IPV4:PORT, e.g. 10.77.0.1:3128") from None
    if not colon or not 0 < number < 65536 or ip.is_unspecified or ip.is_loopback:
        raise ValueError(f"{value!r} must be one specific, non-loopback IPv4 address and a port 1-65535")
    return str(ip), number


def _conventional_env() -> dict[str, str]:
    """Settings other tools' conventions name, below everything of ours: `ANTHROPIC_API_KEY`."""
    key = os.environ.get("ANTHROPIC_API_KEY", "").strip()
    return {"anthropic_api_key": key} if key else {}


def config_file(data_dir: Path | str | None = None) -> Path:
    """The config file these settings are read from: `$WAKEFUL_CONFIG`, else `wakeful.toml` in the data directory
    the flags (`data_dir`), the environment or the default name. Raises ConfigFileError when the named one is
    missing (a missing `<data_dir>/wakeful.toml` is fine: the defaults apply)."""
    explicit = os.environ.get("WAKEFUL_CONFIG")
    if explicit:
        path = Path(explicit)
        if path.is_dir():
            raise ConfigFileError(path, "WAKEFUL_CONFIG names this directory: name the TOML file itself")
        if not path.exists():
            raise ConfigFileError(path, "WAKEFUL_CONFIG names this file, and it does not exist")
        if not path.is_file():
            raise ConfigFileError(path, "WAKEFUL_CONFIG names this, which is not a regular file: name a TOML file")
        return path
    if data_dir is None:
        data_dir = os.environ.get("WAKEFUL_DATA_DIR") or _default_data_dir()
    path = Path(data_dir) / "wakeful.toml"
    if path.exists() and not path.is_file():
        raise ConfigFileError(path, "is not a regular file: the data directory's config file must be one, or absent")
    return path


def load_settings(**overrides: Any) -> Settings:
    """Settings with CLI-style overrides; `None` overrides are ignored so unset flags fall through."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def child_environment(settings: Settings, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child `wakeful` process: ours, plus our resolved settings, which it uses as they are.
    Secrets travel too (the child may need them, and a process's environment is readable only by its user)."""
    env = dict(os.environ if base is None else base)
    env[RESOLVED_ENV] = json.dumps(_plain(settings.model_dump()))
    return env


def _plain(value: Any) -> Any:
    """A model dump as JSON values the settings read back to the same thing: secrets revealed, durations as
    seconds, paths as strings."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Path):
        return str(value)
    return value
