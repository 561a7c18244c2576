"""serve's exit code when a child dies at an armed crash point while serve is stopping it (found by the crash
harness on PostgreSQL: the worker reached `after_dispatch` during SIGTERM, serve exited as if clean, and the
harness counted one re-delivery more than the crashes it was told of)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from wakeful.server.core.faults import EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]

# A serve with one child that, once it runs, dies at the crash point as soon as it is asked to stop; serve asks
# itself to stop (SIGTERM to its own PID) once the child is ready.
SCRIPT = """
import os, signal, sys
from pathlib import Path
from tests.support.polling import wait_until
from wakeful.server.faces.supervise import Supervisor
from wakeful.server.settings import Settings

data = Path(sys.argv[1])
crash_at = sys.argv[2]


def child(argv):
    signal.signal(signal.SIGTERM, lambda *_: os._exit(77))  # what an armed point reached while stopping does
    (data / "ready").write_text("")
    while True:
        signal.pause()


def stop():
    wait_until(lambda: (data / "ready").exists(), 30, "the child to be ready")
    os.kill(os.getpid(), signal.SIGTERM)


import threading
threading.Thread(target=stop, daemon=True).start()
sys.exit(Supervisor(Settings(data_dir=data, crash_at=crash_at), child, names=("worker",)).run())
"""


def run_serve(tmp_path: Path, crash_at: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), crash_at], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode


def test_a_child_that_dies_at_a_crash_point_while_serve_stops_it_takes_serve_down_with_its_code(
        tmp_path: Path) -> None:
    assert run_serve(tmp_path, "after_dispatch") == EXIT_CODE


def test_without_crash_points_armed_a_stop_is_clean_whatever_the_child_exited_with(tmp_path: Path) -> None:
    assert run_serve(tmp_path, "") == 0
