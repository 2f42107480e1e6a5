"""Socket paths of a served driver: per-pod names for rolling updates, within the unix limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexgpu.kubelet_plugin.kubeletplugin import MAX_SOCKET_PATH_BYTES, ServerError
from flexgpu.kubelet_plugin.kubeletplugin.sockets import (
    registration_socket_path,
    remove_stale_socket,
    rolling_update_socket_name,
)

DRIVER = "gpu.example.com"
UID = "0b7f2c4e-94b5-4b8e-9a0e-5d2f7c1a3e6b"


def test_without_a_pod_uid_the_registration_socket_is_named_after_the_driver() -> None:
    assert registration_socket_path(Path("/reg"), DRIVER, None) == Path(
        "/reg/gpu.example.com-reg.sock"
    )
    assert registration_socket_path(Path("/reg"), DRIVER, UID).name == f"{DRIVER}-{UID}-reg.sock"


def test_long_registry_dir_falls_back_to_hashed_socket_names() -> None:
    medium = Path("/" + "r" * 50)
    name = rolling_update_socket_name(medium, DRIVER, UID)
    assert name.startswith("gpu.example.com-") and UID not in name
    long = Path("/" + "r" * 70)
    name = rolling_update_socket_name(long, DRIVER, UID)
    assert name.startswith("dra-") and len(str(long / name)) <= MAX_SOCKET_PATH_BYTES
    # Stable across restarts of the same pod, distinct for another pod.
    assert name == rolling_update_socket_name(long, DRIVER, UID)
    assert name != rolling_update_socket_name(long, DRIVER, UID.replace("0", "1"))


def test_stale_socket_removal_removes_files_and_refuses_directories(tmp_path: Path) -> None:
    stale = tmp_path / "dra.sock"
    stale.write_text("")
    remove_stale_socket(stale)
    assert not stale.exists()
    remove_stale_socket(stale)  # nothing there: nothing to do
    (tmp_path / "dir.sock").mkdir()
    with pytest.raises(ServerError, match="is a directory"):
        remove_stale_socket(tmp_path / "dir.sock")
