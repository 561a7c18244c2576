"""Fixtures of the VM unit tests: fake image files (the manager and fleet tests), and two fake hosts (the fleet's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wakeful.vm.fake import FakeHypervisor


@pytest.fixture
def images(tmp_path: Path) -> Path:
    images = tmp_path / "images"
    images.mkdir()
    for name in ("vmlinux", "initrd.img"):
        (images / name).write_bytes(b"\x7fELF")
    (images / "base.qcow2").write_text("fake qcow2 size=1073741824\n")
    return images


@pytest.fixture
def a() -> FakeHypervisor:
    return FakeHypervisor()


@pytest.fixture
def b() -> FakeHypervisor:
    return FakeHypervisor()
