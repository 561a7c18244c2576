"""A tool computer on the real guest image, on an isolated libvirt network of its own (started for this module and
removed after it; nothing on it leaves the host), behind the real egress proxy listening on the network's host address.

Saved and restored, the VM keeps its TCP connections: they live in the host's kernel and in the guest's saved memory,
not in the QEMU process. So the restore keeps the SSH transport and the DevTools connection through it (nothing is
reconnected), still resyncs the clock and still needs a fresh observation before any act. Timings are printed
(run with `-n 0 -s`), never asserted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from computer_lab import ComputerLab, isolated_network, tool_computer
from shop_lab import ShopEgress, shop_egress

from tests.support.polling import wait_until
from wakeful.vm.accel import choose_accel
from wakeful.vm.observe import Fill, Navigate, Refused
from wakeful.vm.toolcomputer import ActResult

if TYPE_CHECKING:
    from tests.system.conftest import GuestImageBuild

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]  # one cold boot under TCG: minutes

USER = "netshopper"


@pytest.fixture(scope="module")
def world(libvirtd: None, guest_image_build: GuestImageBuild, guest_image: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ComputerLab, ShopEgress]]:
    accel = choose_accel(guest_image / "vmlinux", data_dir=guest_image.parent.parent, timeout=10.0)
    with isolated_network("wkt-") as net, \
            shop_egress(tmp_path_factory.mktemp("egress"), user=USER, deployment=guest_image_build.data_dir,
                        network=(net.name, net.host)) as shop, \
            tool_computer(guest_image, tmp_path_factory.mktemp("vms"), user=USER, accel=accel,
                          proxy_port=shop.settings.proxy_port, credential=shop.credential, network=net,
                          address_book=shop.settings.address_book, port_range=(24300, 24499)) as lab:
        lab.boot()
        yield lab, shop


def test_a_restore_on_an_isolated_network_keeps_ssh_and_cdp_and_still_asks_for_a_fresh_observation(
        world: tuple[ComputerLab, ShopEgress]) -> None:
    lab, shop = world
    tc = lab.computer
    first = tc.observe()
    tc.act(Navigate(url=shop.shop.url, observation=first.observation.number))
    deadline = time.monotonic() + 300
    while (before := tc.observe()).title != "Shop" and time.monotonic() < deadline:
        pass
    assert before.title == "Shop", "the guest reached the shop through the proxy on the network's host address"
    assert shop.asked and all(r.user_id == shop.credential.user_id for r in shop.asked), (
        "the proxy knew the VM by its address")
    boot_id = lab.channel.run("cat /proc/sys/kernel/random/boot_id", timeout=60).stdout
    wait_until(lambda: lab.channel.keeping, 300, "the clock keeper an observation started to be ready")

    lab.manager.suspend(USER)
    t = time.perf_counter()
    lab.manager.ensure_running(USER)
    total = time.perf_counter() - t

    report = lab.restores[-1]
    timings = report.timings
    assert timings.kept, "the SSH transport outlived the save and restore"
    assert timings.ssh_reconnect == 0 and timings.cdp_reconnect == 0, "nothing was reconnected"
    assert report.clock_sync.applied, "the guest clock is set again after any restore"
    assert report.clock_sync.kept, "through the clock keeper that outlived the restore with SSH: no shell started"
    assert report.observation is not None and report.observation.title == "Shop"
    assert report.epoch > before.observation.epoch
    assert lab.channel.run("cat /proc/sys/kernel/random/boot_id", timeout=60).stdout == boot_id, "not rebooted"

    stale = tc.act(Fill(ref=before.ref_for("textbox", "Name"), text="Ada"))
    assert isinstance(stale, Refused) and stale.code == "stale_observation"
    filled = tc.act(Fill(ref=report.observation.ref_for("textbox", "Name"), text="Ada"))
    assert isinstance(filled, ActResult) and filled.outcome == "done", filled
    print(f"\nrestore to first observation {total:.2f} s: probe {timings.probe:.2f} s (kept), clock "
          f"{timings.clock:.2f} s, first observation {timings.first_observation or 0:.2f} s")


def test_restored_as_the_server_does_it_the_clock_is_set_beside_the_agents_first_observation(
        world: tuple[ComputerLab, ShopEgress]) -> None:
    # The server's hook only reconnects (here: keeps) and bumps the epoch; the agent's observe comes next, and the
    # clock resync runs beside it: that observe returns with the guest clock set again.
    lab, _ = world
    tc = lab.computer
    before = tc.observe()
    lab.observe_on_restore = False
    try:
        lab.manager.suspend(USER)
        t = time.perf_counter()
        lab.manager.ensure_running(USER)
        hook = time.perf_counter() - t
        report = lab.restores[-1]
        assert report.timings.kept and report.observation is None and report.clock_sync is None
        assert report.epoch > before.observation.epoch
        seen = tc.observe()
        total = time.perf_counter() - t
    finally:
        lab.observe_on_restore = True
    assert seen.observation.epoch == report.epoch and seen.title == "Shop"
    assert tc.clock_sync is not None and tc.clock_sync.applied, "observe waited for the resync beside it"
    assert abs(tc.clock_sync.after.total_seconds()) < 5, "the guest clock is the host's again"
    assert tc.clock_sync.kept, "through the clock keeper"
    filled = tc.act(Fill(ref=seen.ref_for("textbox", "Name"), text="Grace"))
    assert isinstance(filled, ActResult) and filled.outcome == "done", filled
    print(f"\nas the server does it: restore to first observation {total:.2f} s (the hook {hook:.2f} s, probe "
          f"{report.timings.probe:.2f} s; then observe with the clock beside it)")
