"""What this machine must allow for a real node; each problem is named so that a test run
skips with the precise reason instead of failing somewhere deep in containerd."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from tools.node import driver_root


def problems() -> list[str]:
    found: list[str] = []
    if os.geteuid() != 0:
        found.append(f"not root (euid {os.geteuid()}): containerd, runc and mknod need root")
        return found
    for tool in ("unshare", "nsenter", "ip", "mount"):
        if shutil.which(tool) is None:
            found.append(f"{tool} is not installed (util-linux / iproute2)")
    filesystems = Path("/proc/filesystems").read_text()
    if "overlay" not in filesystems:
        found.append("the kernel has no overlay filesystem (containerd's snapshotter needs it)")
    if not Path("/sys/fs/cgroup").is_dir() or not any(Path("/sys/fs/cgroup").iterdir()):
        found.append("no cgroup filesystem under /sys/fs/cgroup")
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe"
        try:
            os.mknod(probe, 0o600 | stat.S_IFCHR, os.makedev(driver_root.NVIDIA_MAJOR, 0))
        except OSError as err:
            found.append(f"mknod of a character device is refused here ({err.strerror})")
    taken = driver_root.registered_char_majors()
    for major in (driver_root.NVIDIA_MAJOR, driver_root.UVM_MAJOR, driver_root.CAPS_MAJOR):
        if major in taken:
            found.append(
                f"character major {major} belongs to {taken[major]} here; the simulated "
                "driver's device nodes would open it"
            )
    return found
