"""The prerequisite checker names what is missing (command and Debian package, space, root, mirror), and a build
refuses before it writes anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from wakeful.vm.image import BuildEnv, BuildOptions, PrerequisitesMissing, build_image
from wakeful.vm.image.prereq import GIB, REQUIRED_COMMANDS, check_prerequisites
from wakeful.vm.image.recipe import Stage


def fake_bin(tmp_path: Path, commands: list[str]) -> str:
    """A PATH holding only these commands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in commands:
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def plenty(_: Path) -> int:
    return 100 * GIB


@pytest.fixture
def keyring(tmp_path: Path) -> Path:
    path = tmp_path / "debian-archive-keyring.gpg"
    path.write_bytes(b"keys")
    return path


def test_a_complete_machine_has_no_problems(tmp_path: Path, keyring: Path) -> None:
    assert check_prerequisites(euid=0, path=fake_bin(tmp_path, list(REQUIRED_COMMANDS)), cache_dir=tmp_path,
                               free=plenty, mirror="http://m.invalid/debian", keyring=keyring) == []


def test_a_missing_command_names_the_debian_package_to_install(tmp_path: Path, keyring: Path) -> None:
    commands = [c for c in REQUIRED_COMMANDS if c not in ("qemu-img", "mkfs.ext4")]
    problems = check_prerequisites(euid=0, path=fake_bin(tmp_path, commands), cache_dir=tmp_path, free=plenty,
                                   mirror="http://m.invalid/debian", keyring=keyring)
    assert [p.code for p in problems] == ["missing_command", "missing_command"]
    assert "`mkfs.ext4`" in problems[0].message and "`e2fsprogs`" in problems[0].message
    assert "`qemu-img`" in problems[1].message and "`qemu-utils`" in problems[1].message


def test_too_little_space_says_how_much_there_is_and_how_much_is_needed(tmp_path: Path, keyring: Path) -> None:
    seen: list[Path] = []

    def three_gib(path: Path) -> int:
        seen.append(path)
        return 3 * GIB

    problems = check_prerequisites(euid=0, path=fake_bin(tmp_path, list(REQUIRED_COMMANDS)),
                                   cache_dir=tmp_path / "cache", free=three_gib, mirror="http://m.invalid/debian",
                                   keyring=keyring)
    assert [p.code for p in problems] == ["low_disk_space"]
    assert "3.0 GiB free" in problems[0].message and "needs 5 GiB" in problems[0].message
    assert seen == [tmp_path / "cache"]


def test_not_root_no_mirror_and_no_keyring_are_each_named(tmp_path: Path) -> None:
    problems = check_prerequisites(euid=1000, path=fake_bin(tmp_path, list(REQUIRED_COMMANDS)), cache_dir=tmp_path,
                                   free=plenty, mirror=None, keyring=tmp_path / "absent.gpg")
    assert [p.code for p in problems] == ["not_root", "missing_keyring", "no_mirror"]
    assert "debian-archive-keyring" in problems[1].message and "--mirror" in problems[2].message


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def stage_started(self, stage: Stage, index: int, total: int, action: str) -> None:
        self.events.append(f"start {stage.value}")

    def stage_line(self, line: str) -> None:
        pass

    def stage_finished(self, stage: Stage, status: str, seconds: float, detail: str) -> None:
        self.events.append(f"{status} {stage.value}")

    def note(self, message: str) -> None:
        self.events.append(f"note {message}")


def test_a_build_that_cannot_start_writes_nothing_and_asks_the_mirror_nothing(tmp_path: Path) -> None:
    asked: list[str] = []

    def url_exists(url: str) -> bool:
        asked.append(url)
        return True

    env = BuildEnv(euid=1000, path=fake_bin(tmp_path, ["tar"]), free=lambda _: 1 * GIB,
                   sources_file=tmp_path / "absent.sources", url_exists=url_exists)
    data_dir = tmp_path / "data"
    recorder = Recorder()
    with pytest.raises(PrerequisitesMissing) as caught:
        build_image(BuildOptions(data_dir=data_dir), recorder, env)
    codes = [p.code for p in caught.value.problems]
    assert codes[0] == "not_root" and "missing_command" in codes and codes[-2:] == ["no_mirror", "low_disk_space"]
    assert caught.value.code == "not_root"
    assert not data_dir.exists() and asked == []
    assert recorder.events == ["start prerequisites"]


def test_the_mirror_comes_from_the_hosts_sources_file_and_is_never_shown(tmp_path: Path) -> None:
    sources = tmp_path / "debian.sources"
    sources.write_text("Types: deb\nURIs: http://secret-mirror.invalid/debian/\nSuites: bookworm\n")
    env = BuildEnv(euid=0, path=fake_bin(tmp_path, list(REQUIRED_COMMANDS)), free=plenty, sources_file=sources,
                   url_exists=lambda url: False)
    with pytest.raises(Exception) as caught:
        build_image(BuildOptions(data_dir=tmp_path / "data"), Recorder(), env)
    assert getattr(caught.value, "code", None) == "mirror_unreachable"
    assert "secret-mirror" not in str(caught.value) and "sha256:" in str(caught.value)
