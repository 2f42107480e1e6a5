"""A folder that looks like an installed NVIDIA driver: character-device nodes with the
driver's numbers (opening them fails, as nothing serves those numbers here; their presence and
the container's device-cgroup access are what tests check), the user-space libraries and
programs at the paths the driver installs them, and MPS control/server programs.

The real node sees ``<root>/dev`` laid over its /dev (tools/node/namespace.py), so its
containerd and kubelet find /dev/nvidia0 where a GPU node has it, while this machine's /dev
stays untouched."""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

# The driver's fixed major for GPUs and nvidiactl; nvidia-uvm and nvidia-caps get dynamic
# majors on a real machine, picked here from the top of the dynamic range.
NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
UVM_MAJOR = 510
CAPS_MAJOR = 511
LIB_DIR = "usr/lib/x86_64-linux-gnu"
BIN_DIR = "usr/bin"
DRIVER_VERSION = "580.95.05"
LIBRARIES = (
    "libnvidia-ml.so",
    "libcuda.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-cfg.so",
)
# nvidia-smi is NVIDIA_SMI below.
PROGRAMS = ("nvidia-debugdump", "nvidia-persistenced")
# MIG capability files: config and monitor, as /proc/driver/nvidia-caps/mig-minors lists them.
CAPS = {"nvidia-cap1": 1, "nvidia-cap2": 2}

MPS_CONTROL = """#!/bin/sh
# MPS control daemon of the simulated driver: `-d` detaches (`-f` stays in the foreground, as
# in a pod), writes its pid where the plugin looks, serves commands from the control pipe
# ("quit" stops it) and logs them.
pipe=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
logs=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
mkdir -p "$pipe" "$logs"
if [ "$1" = "-d" ]; then
  "$0" serve >/dev/null 2>&1 </dev/null &
  exit 0
fi
if [ "$1" = "serve" ] || [ "$1" = "-f" ]; then
  echo $$ > "$pipe/nvidia-cuda-mps-control.pid"
  rm -f "$pipe/control"
  mkfifo "$pipe/control"
  echo "started for ${CUDA_VISIBLE_DEVICES:-all GPUs}" >> "$logs/control.log"
  while :; do
    while read -r cmd; do
      echo "command $cmd" >> "$logs/control.log"
      if [ "$cmd" = quit ]; then
        rm -f "$pipe/control" "$pipe/nvidia-cuda-mps-control.pid"
        exit 0
      fi
    done < "$pipe/control"
  done
fi
# A client call: forward stdin to the running daemon.
[ -p "$pipe/control" ] || { echo "no MPS control daemon in $pipe" >&2; exit 1; }
cat > "$pipe/control"
"""

MPS_SERVER = """#!/bin/sh
# MPS server of the simulated driver: started by the control daemon on a real node; here it
# only records that it ran and waits until stopped.
logs=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
mkdir -p "$logs"
echo "server $$ for ${CUDA_VISIBLE_DEVICES:-all GPUs}" >> "$logs/server.log"
exec sleep 2147483647
"""

PLACEHOLDER = (
    "#!/bin/sh\necho '{name}: simulated NVIDIA driver {version}; no GPU here' >&2\nexit 9\n"
)
# nvidia-smi of the simulated driver takes the two settings a DRA plugin makes before sharing a
# GPU by time-slicing (compute mode, `compute-policy --set-timeslice`; NVIDIA's plugin fails
# prepare when they fail) and says what it took: there is no GPU to apply them to. Anything
# else fails as the other programs do.
NVIDIA_SMI = """#!/bin/sh
case " $* " in
  *" -c "*|*" compute-policy "*--set-timeslice*)
    echo "nvidia-smi $*: taken (simulated NVIDIA driver {version}; no GPU to apply it to)"
    exit 0 ;;
esac
echo 'nvidia-smi: simulated NVIDIA driver {version}; no GPU here' >&2
exit 9
"""


class DriverRootError(RuntimeError):
    pass


@dataclass(frozen=True)
class DriverRoot:
    root: Path
    gpus: int

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    def device_paths(self) -> list[str]:
        """The /dev paths a container of this node may be given."""
        paths = [f"/dev/nvidia{i}" for i in range(self.gpus)]
        paths += ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        return paths + [f"/dev/nvidia-caps/{name}" for name in CAPS]


def registered_char_majors(proc_devices: Path = Path("/proc/devices")) -> dict[int, str]:
    majors: dict[int, str] = {}
    in_char = False
    for line in proc_devices.read_text().splitlines():
        if line.startswith("Character devices"):
            in_char = True
        elif line.startswith("Block devices"):
            in_char = False
        elif in_char and line.strip():
            number, _, name = line.strip().partition(" ")
            majors[int(number)] = name
    return majors


def _mknod(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        st = path.stat()
        if (
            stat.S_ISCHR(st.st_mode)
            and os.major(st.st_rdev) == major
            and os.minor(st.st_rdev) == minor
        ):
            return
        path.unlink()
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    path.chmod(0o666)  # mknod applies the umask


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def create(root: Path, gpus: int, nvml_library: Path | None = None) -> DriverRoot:
    """Creates (or completes) the driver root for ``gpus`` GPUs. ``nvml_library`` is a
    working libnvidia-ml.so.1 to install; without it the library is a placeholder file."""
    if not 1 <= gpus <= 64:
        raise DriverRootError(f"gpus={gpus}: a driver root holds 1 to 64 GPUs")
    taken = registered_char_majors()
    for major in (NVIDIA_MAJOR, UVM_MAJOR, CAPS_MAJOR):
        # A registered major would make the fake nodes open a real device of this machine.
        if major in taken:
            raise DriverRootError(
                f"character major {major} is registered here ({taken[major]}); the simulated "
                f"driver needs {NVIDIA_MAJOR}, {UVM_MAJOR} and {CAPS_MAJOR} unused"
            )
    driver = DriverRoot(root, gpus)
    for i in range(gpus):
        _mknod(driver.dev / f"nvidia{i}", NVIDIA_MAJOR, i)
    _mknod(driver.dev / "nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR)
    _mknod(driver.dev / "nvidia-uvm", UVM_MAJOR, 0)
    _mknod(driver.dev / "nvidia-uvm-tools", UVM_MAJOR, 1)
    for name, minor in CAPS.items():
        _mknod(driver.dev / "nvidia-caps" / name, CAPS_MAJOR, minor)

    libs = root / LIB_DIR
    libs.mkdir(parents=True, exist_ok=True)
    for lib in LIBRARIES:
        versioned = libs / f"{lib}.{DRIVER_VERSION}"
        if lib == "libnvidia-ml.so" and nvml_library is not None:
            shutil.copy2(nvml_library, versioned)
        elif not versioned.exists():
            versioned.write_bytes(b"")  # placeholder: present, not loadable
        for link in (libs / f"{lib}.1", libs / lib):
            if not link.is_symlink():
                link.unlink(missing_ok=True)
                link.symlink_to(versioned.name)
    bins = root / BIN_DIR
    for program in PROGRAMS:
        _write(bins / program, PLACEHOLDER.format(name=program, version=DRIVER_VERSION), 0o755)
    _write(bins / "nvidia-smi", NVIDIA_SMI.format(version=DRIVER_VERSION), 0o755)
    _write(bins / "nvidia-cuda-mps-control", MPS_CONTROL, 0o755)
    _write(bins / "nvidia-cuda-mps-server", MPS_SERVER, 0o755)
    (root / "proc" / "driver" / "nvidia").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "driver" / "nvidia" / "version").write_text(
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {DRIVER_VERSION}  (simulated)\n"
    )
    return driver


def installed_version(driver: DriverRoot) -> str:
    """The version the driver root's ``libnvidia-ml.so.1`` points at now."""
    target = os.readlink(driver.root / LIB_DIR / "libnvidia-ml.so.1")
    return target.removeprefix("libnvidia-ml.so.")


def install_version(driver: DriverRoot, version: str) -> None:
    """Replaces the driver's user-space files with ``version``'s, as an in-place driver
    upgrade does (NVIDIA's GPU Operator reloading its driver container): the new versioned
    libraries beside the old, each link moved over by a rename (never absent), then the old
    versions removed and the programs and the version file naming the new one. A running
    container keeps the files it was given (its bind mounts hold them); only what is handed
    out afterwards changes."""
    if not re.fullmatch(r"\d+(\.\d+)+", version):
        raise DriverRootError(f"version {version!r}: expected a driver version such as 590.44.01")
    old = installed_version(driver)
    if old == version:
        return
    libs = driver.root / LIB_DIR
    for lib in LIBRARIES:
        shutil.copy2(libs / f"{lib}.{old}", libs / f"{lib}.{version}")
        for link in (libs / f"{lib}.1", libs / lib):
            moving = link.with_name(f".{link.name}.new")
            moving.unlink(missing_ok=True)
            moving.symlink_to(f"{lib}.{version}")
            os.replace(moving, link)
    for lib in LIBRARIES:
        (libs / f"{lib}.{old}").unlink()
    bins = driver.root / BIN_DIR
    for program in PROGRAMS:
        _write(bins / program, PLACEHOLDER.format(name=program, version=version), 0o755)
    _write(bins / "nvidia-smi", NVIDIA_SMI.format(version=version), 0o755)
    (driver.root / "proc" / "driver" / "nvidia" / "version").write_text(
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  (simulated)\n"
    )


def mig_minor(gpu: int, gi: int, ci: int | None = None) -> int:
    """The nvidia-caps minor of a GPU instance's (or compute instance's) access file."""
    return 3 + gpu * 32 + gi * 2 + (0 if ci is None else 1)


def add_mig_capabilities(driver: DriverRoot) -> None:
    """What the driver lists for MIG capabilities (proc/driver/nvidia-caps/mig-minors and the
    caps major in proc/devices) with a device node per listed minor, so CDI specs of MIG
    devices name nodes that exist. Separate from create(): a driver root without MIG lists
    nothing."""
    lines = [f"config {CAPS['nvidia-cap1']}", f"monitor {CAPS['nvidia-cap2']}"]
    for gpu in range(driver.gpus):
        for gi in range(15):
            lines.append(f"gpu{gpu}/gi{gi}/access {mig_minor(gpu, gi)}")
            lines.append(f"gpu{gpu}/gi{gi}/ci0/access {mig_minor(gpu, gi, 0)}")
    caps = driver.root / "proc" / "driver" / "nvidia-caps"
    caps.mkdir(parents=True, exist_ok=True)
    (caps / "mig-minors").write_text("\n".join(lines) + "\n")
    (driver.root / "proc" / "devices").write_text(
        f"Character devices:\n{NVIDIA_MAJOR} nvidia\n{UVM_MAJOR} nvidia-uvm\n"
        f"{CAPS_MAJOR} nvidia-caps\n"
    )
    for line in lines:
        minor = int(line.rsplit(" ", 1)[1])
        _mknod(driver.dev / "nvidia-caps" / f"nvidia-cap{minor}", CAPS_MAJOR, minor)
