"""Which pod a process belongs to, from its cgroup path (``/proc/<pid>/cgroup``).

The kubelet puts every container in a cgroup under its pod's, named after the pod UID:
``/kubepods/burstable/pod<uid>/<container>`` with the cgroupfs driver, and
``.../kubepods-burstable-pod<uid with _ for ->.slice/...`` with the systemd driver. The plugin
runs with the host's PID namespace (the chart sets hostPID), so NVML's PIDs are found there.
"""

from __future__ import annotations

import re
from pathlib import Path

_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)


def pod_uid_in(cgroup_text: str) -> str | None:
    """The pod UID named in a ``/proc/<pid>/cgroup`` file's text, or None."""
    for line in cgroup_text.splitlines():
        match = _POD_UID.search(line.rpartition(":")[2])
        if match:
            return match.group(1).replace("_", "-")
    return None


def pod_uid_of(pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The UID of the pod running ``pid``; None for a process outside any pod, or one that
    has exited (its file is gone) or cannot be read."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    return pod_uid_in(text)
