"""What a GPU node must offer before flexgpu's plugin can serve it, checked from files on the
node (the host root as the plugin sees it) and NVML: the driver root and the driver's version,
the container runtime's CDI settings, whether the CDI hook can run on this host, NVIDIA's
device plugin already serving the node, GPUs already in MIG mode. Read-only: nothing here
changes the node. ``flexgpu doctor node`` prints these; the chart runs it before the plugin.
"""

from __future__ import annotations

import os
import re
import struct
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

from flexgpu.driver.inventory import NodeInventory

NVML_LIBRARY: Final = "libnvidia-ml.so.1"
# Where distributions and the driver installer put the driver's libraries.
LIBRARY_DIRS: Final = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib64",
)
# NVML's placement-based MIG calls came with R470, MPS device-memory limits with R495.
MIN_DRIVER_BRANCH: Final = 495
# The image's nvidia-cdi-hook is a cgo build against Debian 12's glibc.
HOOK_GLIBC: Final = (2, 36)
_GLIBC_VERSION = re.compile(rb"GLIBC_(\d+)\.(\d+)")
_DEVICE_PLUGIN_SOCKETS = re.compile(r"^nvidia.*\.sock$")


class Status(StrEnum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


@dataclass(frozen=True)
class NodeFacts:
    """Where to look. ``host_root`` is the host's / as this process sees it (the plugin's pod
    mounts the driver root, which is the host's / unless a driver container installed it)."""

    driver_root: Path | None
    host_root: Path | None
    kubelet_dir: str = "/var/lib/kubelet"
    cdi_dir: str = "/var/run/cdi"
    # The hook the chart names (a host path), or None: the image's copy, ``image_hook``, and
    # ``image_combined_hook`` (flexgpu-cdi-hooks), which runs the hooks of a spec in one call.
    hook_path: str | None = None
    image_hook: Path | None = None
    image_combined_hook: Path | None = None


def find_nvml(driver_root: Path) -> Path | None:
    for folder in LIBRARY_DIRS:
        path = driver_root / folder / NVML_LIBRARY
        if path.exists():
            return path
    return None


def host_glibc(host_root: Path) -> tuple[int, int] | None:
    """The newest GLIBC_x.y symbol version the host's libc defines, or None without one."""
    for folder in LIBRARY_DIRS:
        libc = host_root / folder / "libc.so.6"
        if libc.is_file():
            versions = {(int(a), int(b)) for a, b in _GLIBC_VERSION.findall(libc.read_bytes())}
            return max(versions) if versions else None
    return None


def is_static_elf(path: Path) -> bool:
    """True for a 64-bit ELF program without a PT_INTERP header (no dynamic loader, so no
    glibc of the host's is needed)."""
    try:
        with path.open("rb") as elf:
            header = elf.read(64)
            if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:
                return False
            order = "<" if header[5] == 1 else ">"
            phoff = struct.unpack_from(order + "Q", header, 32)[0]
            phentsize, phnum = struct.unpack_from(order + "HH", header, 54)
            elf.seek(phoff)
            table = elf.read(phentsize * phnum)
    except OSError:
        return False
    types = [struct.unpack_from(order + "I", table, i * phentsize)[0] for i in range(phnum)]
    return 3 not in types  # PT_INTERP


def driver_root_check(facts: NodeFacts) -> Check:
    if facts.driver_root is None:
        return Check("driver-root", Status.SKIP, "no driver root (simulated GPUs)")
    if not facts.driver_root.is_dir():
        return Check("driver-root", Status.FAIL, f"{facts.driver_root} is not a folder")
    nvml = find_nvml(facts.driver_root)
    if nvml is None:
        return Check(
            "driver-root",
            Status.FAIL,
            f"no {NVML_LIBRARY} under {facts.driver_root} ({', '.join(LIBRARY_DIRS)}): set "
            "kubeletPlugin.nvidiaDriverRoot to where the driver is (/ on the host, "
            "/run/nvidia/driver with the GPU Operator)",
        )
    smi = facts.driver_root / "usr" / "bin" / "nvidia-smi"
    extra = "" if smi.exists() else "; no usr/bin/nvidia-smi there (containers get none)"
    return Check("driver-root", Status.WARN if extra else Status.OK, f"NVML at {nvml}{extra}")


def driver_version_check(inventory: NodeInventory | None, error: str | None) -> Check:
    if inventory is None:
        return Check("driver-version", Status.FAIL, f"NVML did not answer: {error}")
    if not inventory.gpus:
        return Check("driver-version", Status.FAIL, "NVML answers but lists no GPU")
    version = inventory.gpus[0].gpu.driver_version
    branch = int(version.split(".")[0]) if version.split(".")[0].isdigit() else 0
    if branch < MIN_DRIVER_BRANCH:
        return Check(
            "driver-version",
            Status.FAIL,
            f"driver {version} is older than R{MIN_DRIVER_BRANCH} (MIG placements and MPS "
            "memory limits need it)",
        )
    return Check("driver-version", Status.OK, f"driver {version}, {len(inventory.gpus)} GPUs")


def mig_mode_check(inventory: NodeInventory | None) -> Check:
    if inventory is None:
        return Check("mig-mode", Status.SKIP, "no GPU inventory")
    in_mig = [g for g in inventory.gpus if g.gpu.mig_mode is not None and g.gpu.mig_mode.current]
    if not in_mig:
        return Check("mig-mode", Status.OK, "no GPU is in MIG mode")
    listed = ", ".join(f"{g.gpu.index} ({len(g.mig_devices)} MIG devices)" for g in in_mig)
    return Check(
        "mig-mode",
        Status.WARN,
        f"GPUs in MIG mode: {listed}; a GpuNodePolicy decides what they publish, and without "
        "one they are never handed out as whole GPUs",
    )


def _toml(path: Path) -> dict[str, Any] | None:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None


def _dig(table: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if not isinstance(table, dict):
            return None
        table = table.get(key)  # type: ignore[assignment]
    return table


def runtime_cdi_check(facts: NodeFacts) -> Check:
    """containerd (config version 2: containerd 1.7 or 2.x; version 3: 2.x) or CRI-O, as far
    as their config files say."""
    if facts.host_root is None:
        return Check("runtime-cdi", Status.SKIP, "host root not visible")
    containerd = facts.host_root / "etc" / "containerd" / "config.toml"
    crio = facts.host_root / "etc" / "crio" / "crio.conf"
    if containerd.is_file():
        config = _toml(containerd)
        if config is None:
            return Check("runtime-cdi", Status.WARN, f"{containerd} is not valid TOML")
        if config.get("version", 1) >= 3:
            cri = _dig(config, "plugins", "io.containerd.cri.v1.runtime") or {}
            default_on = True
        else:
            cri = _dig(config, "plugins", "io.containerd.grpc.v1.cri") or {}
            default_on = False  # containerd 1.7's default; 2.x migrates it to on
        enabled = cri.get("enable_cdi", default_on)
        dirs = cri.get("cdi_spec_dirs", ["/etc/cdi", "/var/run/cdi"])
        if enabled is False and "enable_cdi" in cri:
            return Check(
                "runtime-cdi", Status.FAIL, f"{containerd}: enable_cdi = false (CDI is off)"
            )
        if facts.cdi_dir.rstrip("/") not in [str(d).rstrip("/") for d in dirs]:
            return Check(
                "runtime-cdi",
                Status.FAIL,
                f"{containerd}: cdi_spec_dirs {dirs} lacks {facts.cdi_dir} (kubeletPlugin.cdiDir)",
            )
        if not enabled:
            return Check(
                "runtime-cdi",
                Status.WARN,
                f"{containerd}: version 2 config without enable_cdi: containerd 1.7 leaves CDI "
                "off (set enable_cdi = true); containerd 2.x turns it on",
            )
        return Check("runtime-cdi", Status.OK, f"containerd reads CDI specs from {dirs}")
    if crio.is_file():
        config = _toml(crio)
        dirs = _dig(config or {}, "crio", "runtime", "cdi_spec_dirs") or [
            "/etc/cdi",
            "/var/run/cdi",
        ]
        if facts.cdi_dir.rstrip("/") not in [str(d).rstrip("/") for d in dirs]:
            return Check(
                "runtime-cdi", Status.FAIL, f"{crio}: cdi_spec_dirs {dirs} lacks {facts.cdi_dir}"
            )
        return Check("runtime-cdi", Status.OK, f"CRI-O reads CDI specs from {dirs}")
    return Check(
        "runtime-cdi", Status.SKIP, f"no containerd or CRI-O config under {facts.host_root}/etc"
    )


def hook_check(facts: NodeFacts) -> Check:
    if facts.host_root is None:
        return Check("cdi-hook", Status.SKIP, "host root not visible")
    if facts.hook_path:
        hook = facts.host_root / facts.hook_path.lstrip("/")
        if not os.access(hook, os.X_OK):
            return Check(
                "cdi-hook",
                Status.FAIL,
                f"kubeletPlugin.nvidiaCdiHookPath {facts.hook_path} is not an executable on "
                "the host",
            )
        return Check("cdi-hook", Status.OK, f"the host's {facts.hook_path}")
    # Containers run both programs on the host: each must run there.
    programs = [p for p in (facts.image_hook, facts.image_combined_hook) if p is not None]
    if programs and all(is_static_elf(p) for p in programs):
        what = "hook is" if len(programs) == 1 else "hooks are"
        them = "it" if len(programs) == 1 else "them"
        return Check(
            "cdi-hook", Status.OK, f"the image's {what} statically linked: any host runs {them}"
        )
    glibc = host_glibc(facts.host_root)
    if glibc is None:
        return Check("cdi-hook", Status.SKIP, "the host's libc.so.6 is not visible")
    if glibc < HOOK_GLIBC:
        dynamic = [p.name for p in programs if not is_static_elf(p)] or ["nvidia-cdi-hook"]
        names = " and ".join(dynamic) + (" needs" if len(dynamic) == 1 else " need")
        toolkit = facts.host_root / "usr" / "bin" / "nvidia-cdi-hook"
        hint = (
            "set kubeletPlugin.nvidiaCdiHookPath=/usr/bin/nvidia-cdi-hook (found on the host)"
            if toolkit.exists()
            else "install NVIDIA Container Toolkit 1.17+ and set kubeletPlugin.nvidiaCdiHookPath "
            "to its /usr/bin/nvidia-cdi-hook"
        )
        return Check(
            "cdi-hook",
            Status.FAIL,
            f"the host's glibc is {glibc[0]}.{glibc[1]}; the image's {names} "
            f"glibc {HOOK_GLIBC[0]}.{HOOK_GLIBC[1]}: {hint}",
        )
    return Check("cdi-hook", Status.OK, f"the image's hook runs on glibc {glibc[0]}.{glibc[1]}")


def device_plugin_check(facts: NodeFacts) -> Check:
    if facts.host_root is None:
        return Check("device-plugin", Status.SKIP, "host root not visible")
    folder = facts.host_root / facts.kubelet_dir.lstrip("/") / "device-plugins"
    if not folder.is_dir():
        return Check("device-plugin", Status.OK, f"no {facts.kubelet_dir}/device-plugins")
    sockets = sorted(p.name for p in folder.iterdir() if _DEVICE_PLUGIN_SOCKETS.match(p.name))
    if sockets:
        return Check(
            "device-plugin",
            Status.FAIL,
            f"NVIDIA's device plugin serves this node ({', '.join(sockets)}): two drivers would "
            "hand out the same GPUs; remove it here or keep flexgpu off this node",
        )
    return Check("device-plugin", Status.OK, "no NVIDIA device plugin socket")


def node_checks(
    facts: NodeFacts, read_inventory: Callable[[], NodeInventory] | None
) -> list[Check]:
    """Every node check, in order; ``read_inventory`` reads the GPUs through NVML (None: no
    NVML here)."""
    inventory: NodeInventory | None = None
    error: str | None = "no NVML on this node"
    root = driver_root_check(facts)
    if read_inventory is not None and root.status is not Status.FAIL:
        try:
            inventory = read_inventory()
        except Exception as err:  # any NVML failure is this check's verdict
            error = str(err) or type(err).__name__
    checks = [root]
    if facts.driver_root is not None or read_inventory is not None:
        checks.append(driver_version_check(inventory, error))
    checks += [
        mig_mode_check(inventory),
        runtime_cdi_check(facts),
        hook_check(facts),
        device_plugin_check(facts),
    ]
    return checks


def worst(checks: Sequence[Check]) -> Status:
    for status in (Status.FAIL, Status.WARN):
        if any(c.status is status for c in checks):
            return status
    return Status.OK
