"""The container files of infra/container/: the compose file's shape, the entrypoint run in a plain directory, and,
where podman and a local Debian 12 base image are at hand, the image built and serving.

The build test needs a base image already in local storage (no registry is reached): set WAKEFUL_CONTAINER_BASE to
its name, e.g. one imported from a debootstrap tree (docs/deploy.md, "A container")."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.support.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
CONTAINER = ROOT / "infra" / "container"
ENTRYPOINT = CONTAINER / "entrypoint"
VENV_BIN = str(Path(sys.executable).parent)
# This machine's kernel has hybrid cgroups (crun refuses them) and no CAP_SYS_RESOURCE (podman's default ulimits
# cannot be set): runc with lowered limits works. A host of your own needs none of these flags.
yaml = pytest.importorskip("yaml")  # PyYAML, which the dev tools bring
PODMAN = ["podman", "--runtime", "runc"]
LIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def _entrypoint(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "WAKEFUL_DATA_DIR": str(data_dir)}
    return subprocess.run([str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=120, env=env)


def test_the_compose_file_runs_wakeful_on_the_postgres_service_and_publishes_on_loopback_only() -> None:
    compose = yaml.safe_load((CONTAINER / "compose.yaml").read_text())
    db, app = compose["services"]["db"], compose["services"]["wakeful"]
    assert db["image"].startswith("docker.io/library/postgres:")
    assert db["environment"]["POSTGRES_USER"] == db["environment"]["POSTGRES_DB"] == "wakeful"
    assert app["command"][0] == "serve"
    assert app["depends_on"] == {"db": {"condition": "service_healthy"}}
    assert app["environment"]["WAKEFUL_DATABASE_URL"].startswith("postgresql+psycopg://wakeful:")
    assert app["environment"]["WAKEFUL_DATABASE_URL"].endswith("@db/wakeful")
    assert app["volumes"] == ["data:/var/lib/wakeful"]
    assert all(port.startswith("127.0.0.1:") for port in app["ports"])
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


BASE = os.environ.get("WAKEFUL_CONTAINER_BASE", "")


def _has_image(name: str) -> bool:
    return bool(name) and shutil.which("podman") is not None and subprocess.run(
        [*PODMAN, "image", "exists", name], capture_output=True, timeout=60).returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(not _has_image(BASE), reason="needs podman and a local Debian 12 base image named by "
                                                  "WAKEFUL_CONTAINER_BASE (no registry is reached here)")
def test_the_image_builds_from_local_wheels_and_serves_as_wakeful_on_a_private_volume(tmp_path: Path) -> None:
    wheels = ROOT / "build" / "wheels"
    made = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheels), str(ROOT),
                           "psycopg[binary]>=3.1"], capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stderr
    tag = f"localhost/wakeful-test:{uuid.uuid4().hex[:12]}"
    name = f"wakeful-test-{uuid.uuid4().hex[:12]}"
    built = subprocess.run([*PODMAN, "build", *LIMITS, "--network", "none", "--build-arg", f"BASE={BASE}", "-f",
                            str(CONTAINER / "Containerfile"), "-t", tag, str(ROOT)],
                           capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    port = _free_port()
    try:
        started = subprocess.run([*PODMAN, "run", "-d", "--name", name, *LIMITS, "-p", f"127.0.0.1:{port}:8787",
                                  tag], capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 120, "the container answering /healthz", interval=0.5)
        probe = subprocess.run([*PODMAN, "exec", name, "sh", "-c",
                                "id -un; stat -c '%a %U' /var/lib/wakeful /var/lib/wakeful/wakeful.db"],
                               capture_output=True, text=True, timeout=60)
        assert probe.stdout.split("\n")[:3] == ["wakeful", "700 wakeful", "600 wakeful"], probe.stdout
    finally:
        subprocess.run([*PODMAN, "rm", "--force", "--volumes", name], capture_output=True, timeout=120)
        subprocess.run([*PODMAN, "rmi", "--force", tag], capture_output=True, timeout=120)
