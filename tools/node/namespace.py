"""The real node's own mount and network namespaces, held open by a sleeping process.

Inside, /dev is an overlay of the simulated driver's device nodes on this machine's /dev, so
containerd, runc and the kubelet find /dev/nvidia0 where a GPU node has it; pods get
addresses on a bridge that exists only there; and the `kubernetes` Service address lives on
the namespace's loopback device. The simulated driver is also at /run/nvidia/driver (on a
tmpfs of the node's own), where NVIDIA's GPU Operator's driver container leaves it, with the
Operator validator's ready files under /run/nvidia/validations. This machine's own /dev,
interfaces and routes are never changed, and several nodes can run side by side."""

from __future__ import annotations

import shlex
from pathlib import Path

from tools.node.configs import API_SERVICE_IP

READY = "flexgpu-node-namespace-ready"


def holder_script(driver_dev: Path, work: Path) -> str:
    """The shell script run under `unshare --mount --net`: lays out the namespace, says
    READY, then sleeps for as long as the node lives."""
    stage = work / "dev"
    upper = work / "dev-upper"
    overlay_work = work / "dev-work"
    q = shlex.quote
    return f"""set -eu
mkdir -p {q(str(stage))} {q(str(upper))} {q(str(overlay_work))}
mount -t overlay flexgpu-dev \\
  -o lowerdir={q(str(driver_dev))}:/dev,upperdir={q(str(upper))},workdir={q(str(overlay_work))} \\
  {q(str(stage))}
# The overlay shows /dev's own files only: bring its submounts (pts, shm, mqueue...) along.
for sub in $(awk '$5 ~ "^/dev/[^/]+$" {{print $5}}' /proc/self/mountinfo | sort -u); do
  mkdir -p "{stage}${{sub#/dev}}"
  mount --rbind "$sub" "{stage}${{sub#/dev}}"
done
mount --move {q(str(stage))} /dev
# Shims put their sockets under /run/containerd/s whatever containerd's state folder is:
# keep them in the node's own tmpfs, gone with it.
mkdir -p /run/containerd
mount -t tmpfs -o mode=0711 flexgpu-node-run /run/containerd
# The driver where the GPU Operator's driver container leaves it (its host path
# /run/nvidia/driver), and the validator's files saying driver and toolkit are ready.
mkdir -p /run/nvidia
mount -t tmpfs -o mode=0755 flexgpu-node-nvidia /run/nvidia
mkdir -p /run/nvidia/driver /run/nvidia/validations
mount --rbind {q(str(driver_dev.parent))} /run/nvidia/driver
touch /run/nvidia/validations/driver-ready /run/nvidia/validations/toolkit-ready
# Mounts made by the node (pod volumes, Bidirectional propagation) stay inside it.
mount --make-rshared /
ip link set lo up
ip addr add {API_SERVICE_IP}/32 dev lo
echo {READY}
exec sleep 2147483647
"""


def holder_argv(driver_dev: Path, work: Path) -> list[str]:
    return [
        "unshare",
        "--mount",
        "--net",
        "--propagation",
        "private",
        "sh",
        "-c",
        holder_script(driver_dev, work),
    ]


def enter_argv(holder_pid: int, argv: list[str]) -> list[str]:
    """``argv`` run inside the holder's namespaces (nsenter execs it: same pid)."""
    return ["nsenter", "-t", str(holder_pid), "-m", "-n", "--", *argv]


def namespace_id(pid: int, kind: str = "mnt") -> str | None:
    try:
        return str(Path(f"/proc/{pid}/ns/{kind}").readlink())
    except OSError:
        return None


def pids_in_namespace(holder_pid: int, kind: str = "mnt") -> list[int]:
    """Every process sharing the holder's namespace (containerd, shims, kubelet...)."""
    wanted = namespace_id(holder_pid, kind)
    if wanted is None:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and namespace_id(int(entry.name), kind) == wanted:
            found.append(int(entry.name))
    return found
