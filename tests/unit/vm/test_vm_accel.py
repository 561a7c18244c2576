"""Choosing KVM or TCG: forced by a setting, TCG without a usable /dev/kvm, else a boot probe cached per host."""

from __future__ import annotations

from pathlib import Path

import pytest

from wakeful.vm import accel as accel_module
from wakeful.vm.accel import choose_accel
from wakeful.vm.hypervisor import Accel


@pytest.fixture
def kernel(tmp_path: Path) -> Path:
    path = tmp_path / "vmlinux"
    path.write_bytes(b"kernel-1")
    return path


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []

    def fake_boot(kernel: Path, *, timeout: float = 10.0, qemu: str = "") -> bool:
        calls.append(kernel)
        return kernel.read_bytes() == b"boots-under-kvm"

    monkeypatch.setattr(accel_module, "kvm_boots", fake_boot)
    monkeypatch.setattr(accel_module, "kvm_device_usable", lambda device=Path("/dev/kvm"): True)
    return calls


def test_a_setting_forces_the_mode_without_probing(kernel: Path, tmp_path: Path, probes: list[Path]) -> None:
    assert choose_accel(kernel, data_dir=tmp_path, force="kvm").accel is Accel.KVM
    assert choose_accel(kernel, data_dir=tmp_path, force=Accel.TCG).accel is Accel.TCG
    assert probes == []


def test_no_usable_kvm_device_means_tcg(kernel: Path, tmp_path: Path) -> None:
    choice = choose_accel(kernel, data_dir=tmp_path, device=tmp_path / "no-kvm")
    assert choice.accel is Accel.TCG and "cannot be opened" in choice.reason


def test_a_kernel_that_does_not_boot_under_kvm_means_tcg_and_is_cached(kernel: Path, tmp_path: Path,
                                                                        probes: list[Path]) -> None:
    first = choose_accel(kernel, data_dir=tmp_path / "data")
    second = choose_accel(kernel, data_dir=tmp_path / "data")
    assert first.accel is second.accel is Accel.TCG
    assert not first.cached and second.cached
    assert probes == [kernel]


def test_the_cache_is_per_kernel(kernel: Path, tmp_path: Path, probes: list[Path]) -> None:
    assert choose_accel(kernel, data_dir=tmp_path).accel is Accel.TCG
    kernel.write_bytes(b"boots-under-kvm")
    choice = choose_accel(kernel, data_dir=tmp_path)
    assert choice.accel is Accel.KVM and not choice.cached
    assert len(probes) == 2


def test_the_command_line_prints_the_cached_answer(kernel: Path, tmp_path: Path, probes: list[Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    choose_accel(kernel, data_dir=tmp_path)
    accel_module.main(["--cached-only", "--data-dir", str(tmp_path)])
    assert capsys.readouterr().out.startswith("tcg (")
