"""The real node's binaries (kubelet, containerd, shim, ctr, runc, CNI plugins), built by
tools/node/build.sh into the tool cache on first use."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().parent / "build.sh"
BINARIES = ("kubelet", "containerd", "containerd-shim-runc-v2", "ctr", "runc")


class NodeBinariesError(RuntimeError):
    pass


@functools.cache
def node_binaries() -> Path:
    """The folder holding the node's binaries (its ``cni/`` subfolder the CNI plugins)."""
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise NodeBinariesError(
            f"building the real node's binaries failed (exit {proc.returncode}); "
            f"run `bash {BUILD_SCRIPT}` to see the full output"
        )
    folder = Path(proc.stdout.strip().splitlines()[-1])
    missing = [b for b in BINARIES if not (folder / b).is_file()]
    if missing:
        raise NodeBinariesError(f"{folder} lacks {', '.join(missing)}; see {BUILD_SCRIPT}")
    return folder
