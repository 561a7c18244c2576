"""The container files of infra/container/: the compose file's shape, the entrypoint run in a plain directory, and,
where podman and a local Debian 12 base image are at hand, the image built and serving, under systemd, and the
compose file brought up with podman-compose on the Debian-built PostgreSQL image (infra/container/postgres/).

The build tests need a Debian 12 base image already in local storage (no registry is reached): the one
`scripts/container-base` makes from a debootstrap tree (`scripts/install --all` runs it as root), or another named by
WAKEFUL_CONTAINER_BASE. The PostgreSQL image and the systemd test take Debian packages from the mirror the base's
sources.list names."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.polling import wait_until
from wakeful.server.core.signatures import sign

ROOT = Path(__file__).resolve().parents[2]
CONTAINER = ROOT / "infra" / "container"
ENTRYPOINT = CONTAINER / "entrypoint"
VENV_BIN = str(Path(sys.executable).parent)
# This machine's kernel has hybrid cgroups (crun refuses them) and no CAP_SYS_RESOURCE (podman's default ulimits
# cannot be set): runc with lowered limits works. A host of your own needs none of these flags.
yaml = pytest.importorskip("yaml")  # PyYAML, which the dev tools bring
PODMAN = ["podman", "--runtime", "runc"]
LIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]
# The same under podman-compose (1.0.3, Debian 12's): its global podman arguments go after each podman command,
# where podman takes `--runtime` too; its run arguments go to `podman run` (and `create`) only.
COMPOSE_PODMAN = ["--podman-args=" + " ".join(PODMAN[1:]), "--podman-run-args=" + " ".join(LIMITS)]


def _entrypoint(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "WAKEFUL_DATA_DIR": str(data_dir)}
    return subprocess.run([str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=120, env=env)


def test_the_compose_file_runs_wakeful_on_the_postgres_service_and_publishes_on_loopback_only() -> None:
    compose = yaml.safe_load((CONTAINER / "compose.yaml").read_text())
    db, app = compose["services"]["db"], compose["services"]["wakeful"]
    # The official image unless the .env names another (the Debian-built one of infra/container/postgres/).
    assert db["image"] == "${WAKEFUL_POSTGRES_IMAGE:-docker.io/library/postgres:15}"
    assert app["image"] == "${WAKEFUL_IMAGE:-localhost/wakeful:latest}"
    assert db["environment"]["POSTGRES_USER"] == db["environment"]["POSTGRES_DB"] == "wakeful"
    assert app["command"][0] == "serve"
    assert app["depends_on"] == {"db": {"condition": "service_healthy"}}
    assert app["environment"]["WAKEFUL_DATABASE_URL"].startswith("postgresql+psycopg://wakeful:")
    assert app["environment"]["WAKEFUL_DATABASE_URL"].endswith("@db/wakeful")
    assert app["environment"]["WAKEFUL_COMPUTERS"] == "false"  # no libvirt in a container: /readyz would say 503
    assert app["volumes"] == ["data:/var/lib/wakeful"]
    assert app["ports"] == ["127.0.0.1:${WAKEFUL_PORT:-8787}:8787"]
    assert set(compose["volumes"]) == {"data", "db"}


def test_the_entrypoint_closes_an_open_data_directory_and_runs_wakeful(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    data_dir.chmod(0o755)
    result = _entrypoint(data_dir, "token")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("wk_")
    assert "was open to others (mode 755): made it 0700" in result.stderr
    assert data_dir.stat().st_mode & 0o777 == 0o700
    assert (data_dir / "wakeful.db").stat().st_mode & 0o777 == 0o600


def test_the_entrypoint_refuses_a_missing_data_directory(tmp_path: Path) -> None:
    result = _entrypoint(tmp_path / "absent", "status")
    assert result.returncode == 2 and "does not exist: mount a volume there" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="chowns a directory to another user")
def test_the_entrypoint_refuses_a_data_directory_another_user_owns(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    os.chown(data_dir, 65534, 65534)
    result = _entrypoint(data_dir, "status")
    assert result.returncode == 2 and "belongs to uid 65534" in result.stderr
    assert not (data_dir / "wakeful.db").exists()


BASE = os.environ.get("WAKEFUL_CONTAINER_BASE") or "localhost/wakeful-base:bookworm"  # scripts/container-base's


def _has_image(name: str) -> bool:
    return bool(name) and shutil.which("podman") is not None and subprocess.run(
        [*PODMAN, "image", "exists", name], capture_output=True, timeout=60).returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


needs_base = pytest.mark.skipif(not _has_image(BASE), reason=f"needs podman and the local Debian 12 base image {BASE} "
                                                                "(scripts/container-base; no registry is reached)")


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The image infra/container/Containerfile builds, from wheels made here, under a tag of this run's own."""
    wheels = ROOT / "build" / "wheels"
    made = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheels), str(ROOT),
                           "psycopg[binary]>=3.1"], capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stderr
    with _built("localhost/wakeful-test", CONTAINER / "Containerfile", ROOT, "--network", "none") as tag:
        yield tag


@contextlib.contextmanager
def _built(name: str, containerfile: Path, context: Path, *flags: str) -> Iterator[str]:
    """`containerfile` built on BASE under a tag of this run's own, removed afterwards."""
    tag = f"{name}:{uuid.uuid4().hex[:12]}"
    built = subprocess.run([*PODMAN, "build", *LIMITS, *flags, "--build-arg", f"BASE={BASE}", "-f", str(containerfile),
                            "-t", tag, str(context)], capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    try:
        yield tag
    finally:
        subprocess.run([*PODMAN, "rmi", "--force", tag], capture_output=True, timeout=120)


@contextlib.contextmanager
def _container(*args: str) -> Iterator[str]:
    name = f"wakeful-test-{uuid.uuid4().hex[:12]}"
    try:
        started = subprocess.run([*PODMAN, "run", "-d", "--name", name, *LIMITS, *args], capture_output=True,
                                 text=True, timeout=120)
        assert started.returncode == 0, started.stderr
        yield name
    finally:
        subprocess.run([*PODMAN, "rm", "--force", "--volumes", name], capture_output=True, timeout=120)


def _exec(name: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PODMAN, "exec", name, "sh", "-c", script], capture_output=True, text=True, timeout=120)


@needs_base
def test_the_image_builds_from_local_wheels_and_serves_as_wakeful_on_a_private_volume(image: str) -> None:
    port = _free_port()
    with _container("-p", f"127.0.0.1:{port}:8787", image) as name:

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 120, "the container answering /healthz", interval=0.5)
        probe = _exec(name, "id -un; stat -c '%a %U' /var/lib/wakeful /var/lib/wakeful/wakeful.db")
        assert probe.stdout.split("\n")[:3] == ["wakeful", "700 wakeful", "600 wakeful"], probe.stdout


# The units run their own commands; no libvirtd answers in the container, so tool computers are off (with them on,
# the API holds them and the worker reaches them on the API's socket).
DROP_INS = {
    "wakeful-api.service": "[Service]\nEnvironment=WAKEFUL_COMPUTERS=false\n",
    "wakeful-worker@.service": "[Service]\nEnvironment=WAKEFUL_COMPUTERS=false\n",
    "wakeful-proxy.service": "[Service]\nEnvironment=WAKEFUL_PROXY_PORT=8789\n",
}


@needs_base
def test_under_systemd_each_unit_runs_its_process_sandboxed_as_wakeful(image: str, tmp_path: Path) -> None:
    """systemd as PID 1 in a container (privileged, so it can build each unit's namespaces), the shipped units
    mounted in; Debian's systemd is added from its mirror."""
    (tmp_path / "Containerfile").write_text(
        f"FROM {image}\nUSER root\nRUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
        "--no-install-recommends systemd systemd-sysv && rm -rf /var/lib/apt/lists/* && /usr/sbin/groupadd -r libvirt\n"
        'ENTRYPOINT []\nCMD ["/sbin/init"]\n')
    tag = f"{image}-systemd"
    built = subprocess.run([*PODMAN, "build", *LIMITS, "-t", tag, str(tmp_path)], capture_output=True, text=True,
                           timeout=1800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    mounts = [f"--volume={p}:/etc/systemd/system/{p.name}:ro" for p in sorted((ROOT / "infra" / "systemd").iterdir())]
    for unit, text in DROP_INS.items():
        (tmp_path / f"{unit}.d").mkdir()
        (tmp_path / f"{unit}.d" / "test.conf").write_text(text)
        mounts.append(f"--volume={tmp_path / f'{unit}.d'}:/etc/systemd/system/{unit}.d:ro")
    try:
        with _container("--systemd=always", "--privileged", "--network=none", *mounts, tag) as name:
            wait_until(lambda: _exec(name, "systemctl is-system-running").stdout.strip() in {"running", "degraded"},
                       120, "systemd running in the container", interval=0.5)
            started = _exec(name, "systemctl start wakeful-api.service && systemctl start wakeful-proxy.service "
                                  "wakeful-worker@1.service")
            assert started.returncode == 0, started.stderr
            url = "http://127.0.0.1:8787/healthz"
            wait_until(lambda: _exec(name, f"python3 -c \"import urllib.request as u; "
                                           f"print(u.urlopen('{url}').read())\"").returncode == 0,
                       120, f"{url} answering in the container", interval=0.5)
            worker = "journalctl -u wakeful-worker@1.service -o cat"
            wait_until(lambda: "wakeful worker running" in _exec(name, worker).stdout, 120,
                       "the worker saying it runs", interval=0.5)
            for unit in ("wakeful-api.service", "wakeful-proxy.service", "wakeful-worker@1.service"):
                pid = _exec(name, f"systemctl show -p MainPID --value {unit}").stdout.strip()
                assert pid not in {"", "0"}, f"{unit} is not running"
                restarts = _exec(name, f"systemctl show -p NRestarts --value {unit}").stdout.strip()
                # The proxy started before the api had opened its channel was one such restart (a flaky MainPID 0).
                assert restarts == "0", f"{unit} failed and was restarted {restarts} times"
                status = _exec(name, f"cat /proc/{pid}/status; stat -c %U /proc/{pid}").stdout
                assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status, unit
                assert "CapEff:\t0000000000000000" in status and status.rstrip().endswith("wakeful"), unit
            writes = _exec(name, "nsenter -t $(systemctl show -p MainPID --value wakeful-api.service) -m "
                                 "sh -c 'touch /usr/probe; touch /var/lib/wakeful/probe && echo data-writable'")
            assert "Read-only file system" in writes.stderr and writes.stdout.strip() == "data-writable"
            modes = _exec(name, "stat -c '%a %U' /var/lib/wakeful /var/lib/wakeful/wakeful.db").stdout.split("\n")
            assert modes[:2] == ["700 wakeful", "600 wakeful"]
    finally:
        subprocess.run([*PODMAN, "rmi", "--force", tag], capture_output=True, timeout=120)


def _service_names_resolve() -> bool:
    """Whether podman networks answer DNS for container names, as compose's `@db` needs: CNI with its `dnsname`
    plugin, or netavark with aardvark-dns."""
    info = subprocess.run(["podman", "info", "--format", "{{.Host.NetworkBackend}}"], capture_output=True, text=True,
                          timeout=60)
    plugins = {"cni": ("/usr/lib/cni/dnsname", "/usr/libexec/cni/dnsname", "/opt/cni/bin/dnsname"),
               "netavark": ("/usr/lib/podman/aardvark-dns", "/usr/libexec/podman/aardvark-dns")}
    return any(Path(path).exists() for path in plugins.get(info.stdout.strip(), ()))


needs_compose = pytest.mark.skipif(
    not _has_image(BASE) or shutil.which("podman-compose") is None or not _service_names_resolve(),
    reason="needs podman, podman-compose, DNS on podman networks (Debian: golang-github-containernetworking-plugin-"
           f"dnsname) and the local Debian 12 base image {BASE} (scripts/container-base)")


@pytest.fixture(scope="module")
def postgres_image() -> Iterator[str]:
    """The Debian-built PostgreSQL image of infra/container/postgres/, under a tag of this run's own."""
    with _built("localhost/wakeful-postgres-test", CONTAINER / "postgres" / "Containerfile",
                CONTAINER / "postgres") as tag:
        yield tag


@needs_compose
def test_the_debian_built_postgres_refuses_to_initialise_without_a_password(postgres_image: str) -> None:
    name = f"wakeful-test-{uuid.uuid4().hex[:12]}"
    try:
        ran = subprocess.run([*PODMAN, "run", "--name", name, *LIMITS, "--network=none", postgres_image],
                             capture_output=True, text=True, timeout=120)
        assert ran.returncode != 0 and "set POSTGRES_PASSWORD to make the database" in ran.stderr, ran.stderr
    finally:
        subprocess.run([*PODMAN, "rm", "--force", "--volumes", name], capture_output=True, timeout=120)


# The settings a deployment adds beside compose.yaml: docker compose and podman-compose both read this file.
OVERRIDE = """services:
  wakeful:
    environment:
      WAKEFUL_SOURCES__HOOK__KIND: generic
      WAKEFUL_SOURCES__HOOK__SECRET: ${WAKEFUL_HOOK_SECRET:?put WAKEFUL_HOOK_SECRET in .env}
"""


@needs_compose
def test_the_compose_file_comes_up_on_postgresql_and_keeps_a_delivery_across_down_and_up(
        image: str, postgres_image: str, tmp_path: Path) -> None:
    project = f"wakefultest{uuid.uuid4().hex[:12]}"
    app_name, db_name = f"{project}_wakeful_1", f"{project}_db_1"
    port, secret = _free_port(), uuid.uuid4().hex
    shutil.copy(CONTAINER / "compose.yaml", tmp_path / "compose.yaml")
    (tmp_path / "compose.override.yaml").write_text(OVERRIDE)
    dotenv = tmp_path / ".env"
    dotenv.touch(mode=0o600)
    dotenv.write_text(f"WAKEFUL_DB_PASSWORD={uuid.uuid4().hex}\nWAKEFUL_IMAGE={image}\n"
                      f"WAKEFUL_POSTGRES_IMAGE={postgres_image}\nWAKEFUL_PORT={port}\nWAKEFUL_HOOK_SECRET={secret}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}
    url = f"http://127.0.0.1:{port}"

    def compose(*args: str) -> str:
        done = subprocess.run(["podman-compose", "-p", project, *COMPOSE_PODMAN, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    def answers(path: str) -> bool:
        try:
            return httpx.get(url + path, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def up() -> None:
        compose("up", "-d")
        # podman-compose 1.0.3 starts wakeful without waiting for db's healthcheck (and podman runs healthchecks
        # only with systemd): wakeful exits until the database answers, and `restart: unless-stopped` restarts it.
        wait_until(lambda: answers("/healthz"), 300, "the wakeful service answering /healthz", interval=0.5)
        wait_until(lambda: answers("/readyz"), 300, "the wakeful service ready (its database reached)", interval=0.5)

    def listed(kind: str) -> set[str]:
        done = subprocess.run(["podman", kind, "ls", *(["-a"] if kind == "container" else []), "--filter",
                               f"label=io.podman.compose.project={project}", "--format", "{{.Name}}"],
                              capture_output=True, text=True, timeout=60)
        return set(done.stdout.split())

    try:
        up()
        log = subprocess.run([*PODMAN, "logs", app_name], capture_output=True, text=True, timeout=60)
        said = log.stdout + log.stderr
        assert "wakeful serving on http://0.0.0.0:8787 (database postgresql+psycopg://wakeful" in said, said[-3000:]
        # podman-compose prints the podman command it runs and its exit code around what the command prints.
        said = compose("exec", "-T", "wakeful", "wakeful", "token")
        tokens = [line for line in said.splitlines() if line.startswith("wk_")]
        assert len(tokens) == 1 and "exit code: 0" in said, said
        auth = {"Authorization": f"Bearer {tokens[0]}"}

        body = b'{"text": "a delivery through compose"}'

        def deliver() -> httpx.Response:
            headers = {"Content-Type": "application/json",
                       **sign("generic", secret=secret.encode(), body=body, now=time.time(), delivery_id="compose-1")}
            return httpx.post(f"{url}/v1/hooks/hook", content=body, headers=headers, timeout=30)

        first = deliver()
        assert first.is_success and first.json()["duplicate"] is False, first.text
        event_id = first.json()["event_id"]
        assert httpx.get(f"{url}/v1/events/{event_id}", headers=auth, timeout=30).status_code == 200
        stored = subprocess.run([*PODMAN, "exec", db_name, "psql", "-U", "wakeful", "-d", "wakeful", "-Atc",
                                 f"SELECT source FROM events WHERE id = '{event_id}'"],
                                capture_output=True, text=True, timeout=60)
        assert stored.stdout.strip() == "hook", stored.stderr
        # The password is kept as SCRAM, and a client on the network without it is turned away.
        scram = subprocess.run([*PODMAN, "exec", db_name, "psql", "-U", "wakeful", "-d", "wakeful", "-Atc",
                                "SELECT rolpassword LIKE 'SCRAM-SHA-256$%' FROM pg_authid WHERE rolname = 'wakeful'"],
                               capture_output=True, text=True, timeout=60)
        assert scram.stdout.strip() == "t", scram.stderr
        wrong = subprocess.run([*PODMAN, "exec", db_name, "psql", "postgresql://wakeful:wrong@127.0.0.1/wakeful", "-c",
                                "SELECT 1"], capture_output=True, text=True, timeout=60)
        assert wrong.returncode != 0 and "password authentication failed" in wrong.stderr, wrong.stderr

        compose("down")
        assert listed("container") == set()
        assert listed("volume") == {f"{project}_db", f"{project}_data"}
        up()
        again = httpx.get(f"{url}/v1/events/{event_id}", headers=auth, timeout=30)
        assert again.status_code == 200 and again.json()["source"] == "hook", again.text
        replay = deliver()
        assert replay.is_success and replay.json() == {**replay.json(), "event_id": event_id, "duplicate": True}

        compose("down", "-v")
        assert listed("container") == listed("volume") == set()
        # podman-compose 1.0.3's `down` leaves the network it made.
        removed = subprocess.run(["podman", "network", "rm", f"{project}_default"], capture_output=True, timeout=120)
        assert removed.returncode == 0, removed.stderr
    finally:
        subprocess.run(["podman-compose", "-p", project, *COMPOSE_PODMAN, "down", "-v"], cwd=tmp_path, env=env,
                       capture_output=True, timeout=600)
        for kind, names in (("container", [app_name, db_name]), ("volume", [f"{project}_db", f"{project}_data"])):
            subprocess.run(["podman", kind, "rm", "--force", *names], capture_output=True, timeout=120)
        subprocess.run(["podman", "network", "rm", "--force", f"{project}_default"], capture_output=True, timeout=120)
