"""The real node's binaries (kubelet, containerd, shim, ctr, runc, CNI plugins), built by
tools/node/build.sh into the tool cache on first use."""

from __future__ import annotations

import functools
from pathlib import Path

from tools import buildcache

BUILD_SCRIPT = buildcache.SCRIPTS["node"]
BINARIES = ("kubelet", "containerd", "containerd-shim-runc-v2", "ctr", "runc")


class NodeBinariesError(RuntimeError):
    pass


@functools.cache
def node_binaries() -> Path:
    """The folder holding the node's binaries (its ``cni/`` subfolder the CNI plugins)."""
    try:
        folder = buildcache.path("node", stream=True)
    except buildcache.BuildError as e:
        raise NodeBinariesError(f"building the real node's binaries failed: {e}") from e
    missing = [b for b in BINARIES if not (folder / b).is_file()]
    if missing:
        raise NodeBinariesError(f"{folder} lacks {', '.join(missing)}; see {BUILD_SCRIPT}")
    return folder
