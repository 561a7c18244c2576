"""The tool computers of one process, used from another over `<data_dir>/run/computers.sock`: the same answers as
in the owner (observations with their screenshots, acts, refusals, handoffs), errors with the same codes, an
activity held while its block lasts, and nothing done for a peer of another uid or a malformed message."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from tests.support.computers import FakeComputers
from tests.support.polling import wait_until
from wakeful.proxy.clock import FakeClock
from wakeful.server.computers.remote import ActionLocks, ComputerServer, RemoteComputers, computers_socket
from wakeful.server.errors import WakefulError
from wakeful.vm.errors import VmNotFound
from wakeful.vm.observe import Accepted, Fill, Refused, Surface
from wakeful.vm.toolcomputer import ActResult, ToolComputer


class Recording(FakeComputers):
    """FakeComputers that also says whether an activity is in flight, and can fail."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.in_flight = 0
        self.fail: Exception | None = None

    def computer(self, user_id: str) -> ToolComputer:
        if self.fail is not None:
            raise self.fail
        return super().computer(user_id)

    @contextlib.contextmanager
    def activity(self, user_id: str, kind: str) -> Iterator[None]:
        self.activities.append(kind)
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def owned(clock: FakeClock) -> Recording:
    return Recording(clock)


@pytest.fixture
def handoffs() -> list[tuple[str, str]]:
    return []


@pytest.fixture
def server(tmp_path: Path, owned: Recording, handoffs: list[tuple[str, str]]) -> Iterator[ComputerServer]:
    served = ComputerServer(owned, computers_socket(tmp_path), on_handoff=lambda u, t: handoffs.append((u, t)))
    served.start()
    yield served
    served.stop()


@pytest.fixture
def remote(tmp_path: Path, server: ComputerServer) -> RemoteComputers:
    return RemoteComputers(computers_socket(tmp_path), timeout=30)


def _raw(path: Path, payload: bytes) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    (length,) = struct.unpack(">I", data[:4])
    answer: dict[str, object] = json.loads(data[4:4 + length])
    return answer


def _frame(message: object) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">I", len(data)) + data


def test_an_observation_through_the_socket_is_the_owners_own(remote: RemoteComputers, owned: Recording) -> None:
    seen = remote.computer("u1").observe(Surface.BROWSER)
    assert seen.title == "Checkout" and [e.name for e in seen.elements][:2] == ["Checkout", "Name"]
    assert seen.screenshot.startswith(b"\x89PNG") and seen.observation.number == owned.tc.state.last_number
    assert seen.observation == owned.tc.state.latest


def test_an_act_on_a_ref_runs_in_the_owner_and_a_stale_one_is_refused_there(remote: RemoteComputers,
                                                                          owned: Recording) -> None:
    tc = remote.computer("u1")
    seen = tc.observe(Surface.BROWSER)
    fill = Fill(ref=seen.ref_for("textbox", "Name"), text="Ada")
    checked = tc.check(fill)
    assert isinstance(checked, Accepted) and checked.locator is not None and checked.locator.name == "Name"
    done = tc.act(fill)
    assert isinstance(done, ActResult) and done.outcome == "done"
    assert owned.browser.acts == [("fill", 2, "Ada")]
    again = tc.act(fill)  # the observation was consumed
    assert isinstance(again, Refused) and again.code == "observation_required"
    assert owned.browser.acts == [("fill", 2, "Ada")]


def test_a_handoff_is_offered_where_it_is_minted_and_refuses_acts_until_control_returns(
        remote: RemoteComputers, owned: Recording, handoffs: list[tuple[str, str]]) -> None:
    tc = remote.computer("u1")
    seen = tc.observe(Surface.BROWSER)
    grant = tc.request_handoff("log in", timedelta(minutes=5))
    assert handoffs == [("u1", grant.token)]
    assert tc.lease == owned.tc.lease and tc.lease is not None and tc.lease.lease_id == grant.lease.lease_id
    refused = tc.act(Fill(ref=seen.ref_for("textbox", "Name"), text="x"))
    assert isinstance(refused, Refused) and refused.code == "human_in_control"
    assert isinstance(tc.redeem_handoff(grant.token), Accepted)
    assert isinstance(tc.redeem_handoff(grant.token), Refused)  # one time only
    epoch = tc.return_control(grant.lease.lease_id)
    assert epoch == owned.tc.state.epoch and tc.lease is None
    assert tc.vnc_port(5901) == owned.tc.vnc_port(5901)


def test_an_activity_lasts_as_long_as_its_block(remote: RemoteComputers, owned: Recording) -> None:
    with remote.activity("u1", "observe"):
        assert owned.in_flight == 1
    wait_until(lambda: owned.in_flight == 0, 10, "the owner to end the activity")
    assert owned.activities == ["observe"]


def test_reap_runs_in_the_owner(remote: RemoteComputers, owned: Recording) -> None:
    assert remote.reap() == [] and owned.reaped == 1


def test_errors_cross_with_their_codes(remote: RemoteComputers, owned: Recording) -> None:
    owned.fail = VmNotFound("u1 has no tool computer; provision one first")
    with pytest.raises(WakefulError) as caught:
        remote.computer("u1").observe(Surface.BROWSER)
    assert caught.value.code == "vm_not_found" and "provision" in caught.value.message
    owned.fail = WakefulError("tool_computer_unavailable", "no guest image")
    with pytest.raises(WakefulError, match="no guest image") as caught:
        remote.computer("u1").check(Fill(ref="r1", text="x"))
    assert caught.value.code == "tool_computer_unavailable"


def test_no_owner_is_unreachable_and_reap_just_waits(tmp_path: Path) -> None:
    nobody = RemoteComputers(tmp_path / "run" / "computers.sock", timeout=5)
    with pytest.raises(WakefulError) as caught:
        nobody.computer("u1").observe(Surface.BROWSER)
    assert caught.value.code == "computers_unreachable"
    assert nobody.reap() == []


def test_an_act_whose_answer_is_lost_is_unknown_never_nothing(tmp_path: Path) -> None:
    path = tmp_path / "lost.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def swallow() -> None:  # reads the request, then dies before answering
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)

    thread = threading.Thread(target=swallow, daemon=True)
    thread.start()
    try:
        result = RemoteComputers(path, timeout=10).computer("u1").act(Fill(ref="r1", text="x"))
    finally:
        thread.join(timeout=10)
        listener.close()
    assert isinstance(result, ActResult) and result.outcome == "unknown" and result.code == "computers_unreachable"


def test_the_socket_is_the_owners_alone(tmp_path: Path, server: ComputerServer) -> None:
    path = computers_socket(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_second_owner_is_refused(tmp_path: Path, server: ComputerServer, owned: Recording) -> None:
    with pytest.raises(WakefulError) as caught:
        ComputerServer(owned, computers_socket(tmp_path)).start()
    assert caught.value.code == "computers_running"


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another uid needs root")
def test_a_peer_of_another_uid_is_refused_and_nothing_runs(owned: Recording,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    open_dir = Path(tempfile.mkdtemp(prefix="wakeful-peer-", dir="/tmp"))  # pytest's tmp_path is not traversable
    served = ComputerServer(owned, computers_socket(open_dir))
    served.start()
    path = computers_socket(open_dir)
    os.chmod(open_dir, 0o755)  # open the way on purpose: the peer check must hold on its own
    os.chmod(path.parent, 0o755)
    os.chmod(path, 0o666)
    script = (  # the refusal comes at once; the request sent after it must not run
        "import contextlib, json, os, socket, struct, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sys.argv[1])\n"
        "(n,) = struct.unpack('>I', s.recv(4, socket.MSG_WAITALL)); answer = s.recv(n, socket.MSG_WAITALL)\n"
        "d = json.dumps({'op': 'reap'}).encode()\n"
        "with contextlib.suppress(OSError): s.sendall(struct.pack('>I', len(d)) + d)\n"
        "print(answer.decode())\n")
    try:
        with caplog.at_level(logging.WARNING):
            done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, timeout=60,
                                  text=True)
    finally:
        served.stop()
        shutil.rmtree(open_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["error"]["code"] == "peer_refused"
    assert owned.reaped == 0
    assert any("uid 65534" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("payload", "code"), [
    (b"\xff\xff\xff\xff", "bad_message"),  # 4 GiB announced
    (struct.pack(">I", 5) + b"nope!", "bad_message"),
    (_frame([1, 2]), "bad_message"),
    (_frame({"op": "format_disk", "user": "u1"}), "bad_message"),
    (_frame({"op": ["observe"], "user": "u1"}), "bad_message"),
    (_frame({"op": "observe", "user": {"$gt": ""}, "surface": "browser"}), "bad_message"),
    (_frame({"op": "act", "user": "u1", "act": {"kind": "fill", "ref": "r1", "text": "x" * 20_000}}), "invalid_act"),
    (_frame({"op": "observe"}), "bad_message"),
    (_frame({"op": "observe", "user": "u1", "surface": "mainframe"}), "bad_message"),
    (_frame({"op": "act", "user": "u1", "act": {"kind": "click"}}), "invalid_act"),
    (_frame({"op": "request_handoff", "user": "u1", "reason": "x", "seconds": -1}), "bad_message"),
    (_frame({"op": "activity", "user": "u1", "kind": "nap"}), "bad_message"),
    (struct.pack(">I", 100) + b"{", "bad_message"),  # ends early
])
def test_a_malformed_message_is_refused_without_a_traceback(tmp_path: Path, server: ComputerServer, owned: Recording,
                                                            caplog: pytest.LogCaptureFixture, payload: bytes,
                                                            code: str) -> None:
    with caplog.at_level(logging.INFO):
        answer = _raw(computers_socket(tmp_path), payload)
    assert answer["error"]["code"] == code  # type: ignore[index]
    assert owned.browser.acts == [] and owned.activities == [] and owned.reaped == 0
    assert not [r for r in caplog.records if r.exc_info]


def test_one_action_is_dispatched_by_one_process_at_a_time(tmp_path: Path) -> None:
    locks = ActionLocks(tmp_path / "run")
    script = ("import sys\n"
              "from pathlib import Path\n"
              "from wakeful.server.computers.remote import ActionLocks\n"
              "with ActionLocks(Path(sys.argv[1])).held(sys.argv[2]):\n"
              "    print('held', flush=True)\n"
              "    sys.stdin.read()\n")
    with subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "run"), "act_1"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as other:
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline() == "held\n"
        entered = threading.Event()

        def take() -> None:
            with locks.held("act_1"):
                entered.set()

        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        assert not entered.wait(0.5)  # the other process holds this action
        with locks.held("act_2"):  # another action is not held up
            pass
        other.stdin.close()
        thread.join(timeout=30)
        assert entered.is_set()
