"""Stage keys change exactly when their inputs change, and the plan reruns only what a change touches."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from wakeful.vm.image import DEFAULT_RECIPE
from wakeful.vm.image.recipe import (
    Plan,
    Recipe,
    Sources,
    Stage,
    load_recipe,
    plan_stages,
    probe_sources,
    sources_text,
    stage_keys,
)

MIRROR = "http://mirror.invalid/debian"
ALL = frozenset(Stage)
# Which keys each kind of change must move; every other key must stay.
DOWNSTREAM_OF_PACKAGES = {Stage.PACKAGES, Stage.CONFIGURE, Stage.CA, Stage.KERNEL, Stage.FILESYSTEM, Stage.QCOW2}
DOWNSTREAM_OF_CONFIGURE = {Stage.CONFIGURE, Stage.CA, Stage.FILESYSTEM, Stage.QCOW2}
DOWNSTREAM_OF_CA = {Stage.CA, Stage.FILESYSTEM, Stage.QCOW2}


@pytest.fixture
def recipe_dir(tmp_path: Path) -> Path:
    target = tmp_path / "guest"
    shutil.copytree(DEFAULT_RECIPE, target)
    return target


def sources(mirror: str = MIRROR, updates: bool = True, security: bool = True) -> Sources:
    return Sources(mirror=mirror, suite="bookworm", updates=updates,
                   security_uri=f"{mirror}-security" if security else None)


def changed(before: dict[Stage, str], after: dict[Stage, str]) -> set[Stage]:
    return {stage for stage in before if before[stage] != after[stage]}


def keys_after(recipe_dir: Path, edit: str, content: str, append: bool = True) -> dict[Stage, str]:
    path = recipe_dir / edit
    path.write_text((path.read_text() if append else "") + content)
    return stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)


def test_keys_are_stable_for_the_same_inputs(recipe_dir: Path) -> None:
    assert stage_keys(load_recipe(recipe_dir), sources(), None) == stage_keys(load_recipe(recipe_dir), sources(), None)


def test_a_new_ca_changes_only_the_ca_stage_and_what_follows(recipe_dir: Path) -> None:
    recipe = load_recipe(recipe_dir)
    before = stage_keys(recipe, sources(), None)
    assert changed(before, stage_keys(recipe, sources(), "ab" * 32)) == DOWNSTREAM_OF_CA
    one, other = stage_keys(recipe, sources(), "ab" * 32), stage_keys(recipe, sources(), "cd" * 32)
    assert changed(one, other) == DOWNSTREAM_OF_CA


def test_a_package_list_change_redoes_packages_but_not_debootstrap(recipe_dir: Path) -> None:
    before = stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)
    assert changed(before, keys_after(recipe_dir, "packages.list", "htop\n")) == DOWNSTREAM_OF_PACKAGES


def test_package_list_comments_and_order_do_not_matter(recipe_dir: Path) -> None:
    before = stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)
    path = recipe_dir / "packages.list"
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    path.write_text("# reordered\n" + "\n".join(reversed(lines)) + "\n")
    assert changed(before, stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)) == set()


def test_an_initramfs_setting_redoes_packages_and_the_kernel(recipe_dir: Path) -> None:
    before = stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)
    after = keys_after(recipe_dir, "pre-install/etc/initramfs-tools/modules", "virtio_net\n")
    assert changed(before, after) == DOWNSTREAM_OF_PACKAGES


def test_a_unit_file_change_redoes_configure_not_packages_or_kernel(recipe_dir: Path) -> None:
    before = stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)
    after = keys_after(recipe_dir, "overlay/etc/systemd/system/wakeful-chromium.service", "# changed\n")
    assert changed(before, after) == DOWNSTREAM_OF_CONFIGURE


def test_making_a_recipe_file_executable_is_a_change(recipe_dir: Path) -> None:
    before = stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)
    (recipe_dir / "overlay/etc/fstab").chmod(0o755)
    assert changed(before, stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)) == DOWNSTREAM_OF_CONFIGURE


def test_the_ca_script_changes_only_the_ca_stage_and_what_follows(recipe_dir: Path) -> None:
    before = stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)
    assert changed(before, keys_after(recipe_dir, "ca.sh", "# changed\n")) == DOWNSTREAM_OF_CA


def test_the_disk_size_changes_only_the_filesystem_and_qcow2(recipe_dir: Path) -> None:
    before = stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)
    path = recipe_dir / "recipe.toml"
    path.write_text(path.read_text().replace("disk_size_mib = 4096", "disk_size_mib = 6144"))
    assert changed(before, stage_keys(load_recipe(recipe_dir), sources(), "ab" * 32)) == {
        Stage.FILESYSTEM, Stage.QCOW2}


def test_another_mirror_or_suite_changes_every_key(recipe_dir: Path) -> None:
    recipe = load_recipe(recipe_dir)
    before = stage_keys(recipe, sources(), None)
    assert changed(before, stage_keys(recipe, sources("http://other.invalid/debian"), None)) == set(before)
    path = recipe_dir / "recipe.toml"
    path.write_text(path.read_text().replace('suite = "bookworm"', 'suite = "trixie"'))
    assert changed(before, stage_keys(load_recipe(recipe_dir), sources(), None)) == set(before)


def test_a_mirror_without_security_updates_gives_other_packages(recipe_dir: Path) -> None:
    recipe: Recipe = load_recipe(recipe_dir)
    before = stage_keys(recipe, sources(), None)
    assert changed(before, stage_keys(recipe, sources(security=False), None)) == DOWNSTREAM_OF_PACKAGES
    assert changed(before, stage_keys(recipe, sources(updates=False), None)) == DOWNSTREAM_OF_PACKAGES


def test_probe_finds_security_on_the_sibling_path_of_a_debian_mirror() -> None:
    served = {f"{MIRROR}/dists/bookworm-updates/InRelease", f"{MIRROR}-security/dists/bookworm-security/InRelease"}
    probed = probe_sources(MIRROR + "/", "bookworm", lambda url: url in served)
    assert (probed.updates, probed.security_uri) == (True, f"{MIRROR}-security")
    text = sources_text(probed)
    assert "Suites: bookworm bookworm-updates\n" in text and f"URIs: {MIRROR}-security\n" in text


def test_probe_falls_back_to_the_main_suite_alone_when_the_mirror_lacks_the_others() -> None:
    probed = probe_sources(MIRROR, "bookworm", lambda url: False)
    assert (probed.updates, probed.security_uri) == (False, None)
    assert sources_text(probed).count("Types: deb") == 1 and "Suites: bookworm\n" in sources_text(probed)
    assert probed.describe() == "bookworm, no bookworm-updates, no bookworm-security"


def test_nothing_cached_runs_every_stage_from_debootstrap() -> None:
    assert plan_stages(frozenset()) == Plan(start_from=None, run=(
        Stage.DEBOOTSTRAP, Stage.PACKAGES, Stage.CONFIGURE, Stage.CA, Stage.KERNEL, Stage.FILESYSTEM, Stage.QCOW2))


def test_everything_cached_runs_nothing_and_reuses_every_stage() -> None:
    plan = plan_stages(ALL)
    assert plan.run == () and plan.reused() == (
        Stage.DEBOOTSTRAP, Stage.PACKAGES, Stage.CONFIGURE, Stage.CA, Stage.KERNEL, Stage.FILESYSTEM, Stage.QCOW2)


def test_a_ca_change_continues_from_the_cached_configure_tree() -> None:
    # The CA key moved, so the image (qcow2) is not cached; the kernel and the trees before it are.
    plan = plan_stages(ALL - {Stage.CA, Stage.FILESYSTEM, Stage.QCOW2})
    assert plan == Plan(start_from=Stage.CONFIGURE, run=(Stage.CA, Stage.FILESYSTEM, Stage.QCOW2))


def test_a_unit_change_continues_from_the_cached_packages_tree() -> None:
    plan = plan_stages(frozenset({Stage.DEBOOTSTRAP, Stage.PACKAGES, Stage.KERNEL}))
    assert plan == Plan(start_from=Stage.PACKAGES, run=(Stage.CONFIGURE, Stage.CA, Stage.FILESYSTEM, Stage.QCOW2))


def test_a_package_change_continues_from_debootstrap_and_remakes_the_kernel() -> None:
    plan = plan_stages(frozenset({Stage.DEBOOTSTRAP}))
    assert plan.start_from is Stage.DEBOOTSTRAP
    assert plan.run == (Stage.PACKAGES, Stage.CONFIGURE, Stage.CA, Stage.KERNEL, Stage.FILESYSTEM, Stage.QCOW2)


def test_a_missing_kernel_alone_needs_the_tree_only_up_to_packages() -> None:
    plan = plan_stages(ALL - {Stage.KERNEL})
    assert plan == Plan(start_from=Stage.PACKAGES, run=(Stage.KERNEL,))
