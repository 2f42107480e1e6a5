"""The simulated driver root upgraded in place: what the plugin's fingerprint and NVIDIA's
generator read afterwards is the new version, and nothing of the old version is left."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexgpu.driver.driver_version import read_fingerprint
from tools.node import driver_root

NEW = "590.44.01"


@pytest.fixture
def driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> driver_root.DriverRoot:
    # Device nodes are beside the point here (and need CAP_MKNOD).
    monkeypatch.setattr(driver_root, "_mknod", lambda *_: None)
    monkeypatch.setattr(driver_root, "registered_char_majors", dict)
    return driver_root.create(tmp_path / "driver", 2)


def test_an_upgrade_moves_every_library_link_and_removes_the_old_files(
    driver: driver_root.DriverRoot,
) -> None:
    assert driver_root.installed_version(driver) == driver_root.DRIVER_VERSION
    before = read_fingerprint(driver.root)
    driver_root.install_version(driver, NEW)
    libs = driver.root / driver_root.LIB_DIR
    for lib in driver_root.LIBRARIES:
        assert (libs / f"{lib}.1").resolve() == libs / f"{lib}.{NEW}"
        assert (libs / lib).resolve() == libs / f"{lib}.{NEW}"
    assert not list(libs.glob(f"*.{driver_root.DRIVER_VERSION}"))
    after = read_fingerprint(driver.root)
    assert before is not None and after is not None and after.version == NEW
    assert NEW in (driver.root / "proc/driver/nvidia/version").read_text()
    assert NEW in (driver.root / "usr/bin/nvidia-smi").read_text()


def test_an_upgrade_back_restores_the_first_version(driver: driver_root.DriverRoot) -> None:
    driver_root.install_version(driver, NEW)
    driver_root.install_version(driver, driver_root.DRIVER_VERSION)
    assert driver_root.installed_version(driver) == driver_root.DRIVER_VERSION
    assert not list((driver.root / driver_root.LIB_DIR).glob(f"*.{NEW}"))


def test_a_version_that_is_not_one_is_refused_naming_it(driver: driver_root.DriverRoot) -> None:
    with pytest.raises(driver_root.DriverRootError, match=r"'latest'.*such as"):
        driver_root.install_version(driver, "latest")
