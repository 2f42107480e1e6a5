"""Where the plugin's two unix sockets live, and clearing what a previous instance left there.

During a rolling update two instances of a plugin run on one node for a while. They must not
share a socket (the kubelet refuses a second registration for the same endpoint, and the new
instance would unlink the old one's), so with a pod UID each instance gets sockets of its own.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

# gRPC's unix listener needs the path plus a terminating NUL in sun_path (108 bytes on Linux).
MAX_SOCKET_PATH_BYTES: Final = 107


class ServerError(RuntimeError):
    """A gRPC server of the plugin could not be started."""


def dra_socket_path(plugin_data_dir: Path, pod_uid: str | None) -> Path:
    """The DRA service's socket in the driver's directory under the kubelet's plugins dir."""
    suffix = f"-{pod_uid}" if pod_uid else ""
    return plugin_data_dir / f"dra{suffix}.sock"


def registration_socket_path(registrar_dir: Path, driver_name: str, pod_uid: str | None) -> Path:
    """The registration socket in the kubelet's plugin registry directory."""
    if pod_uid is None:
        return registrar_dir / f"{driver_name}-reg.sock"
    return registrar_dir / rolling_update_socket_name(registrar_dir, driver_name, pod_uid)


def rolling_update_socket_name(registry_dir: Path, driver_name: str, pod_uid: str) -> str:
    """Registration socket name of one instance in a rolling update.

    Prefers "<driver>-<pod UID>-reg.sock"; falls back to shorter hashed names (the same
    scheme the kubelet plugin helper library uses) when the full path would be too long.
    """
    uid_hash = hashlib.sha256(pod_uid.encode()).digest()
    pair_hash = hashlib.sha256(f"{driver_name}\x00{pod_uid}".encode()).digest()
    candidates = [
        f"{driver_name}-{pod_uid}-reg.sock",
        f"{driver_name}-{_b64(uid_hash[:8])}-reg.sock",
        f"dra-{_b64(pair_hash[:16])}-reg.sock",
    ]
    for name in candidates:
        if path_bytes(registry_dir / name) <= MAX_SOCKET_PATH_BYTES:
            return name
    return candidates[-1]


def path_bytes(path: Path) -> int:
    return len(os.fsencode(path))


def remove_stale_socket(path: Path) -> None:
    """Remove what a previous instance left at path; refuse to delete a directory."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise ServerError(f"socket path {path} is a directory")
    log.info("removing stale socket %s", path)
    path.unlink()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
