"""flexgpu's run-time Python dependencies for another architecture than this machine's:
the distributions and versions this environment holds (release/python_env.py), as that
architecture's wheels from the package index (`pip download --platform ... --only-binary
:all:`), installed into an image folder with `pip install --target`. Nothing is built from
source: a dependency with no such wheel stops the build, named."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from release import debs, python_env

# Debian's architecture -> the machine name in wheel platform tags.
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
# Debian 12's C library is glibc 2.36: manylinux wheels for 2.17 up to it run there.
GLIBC_MINORS = range(17, 37)
PYTHON = ("3.11", "cp", "cp311")


class WheelError(RuntimeError):
    pass


def platform_tags(arch: str) -> list[str]:
    """The wheel platform tags that run on Debian 12 for ``arch``."""
    machine = MACHINES.get(arch)
    if machine is None:
        raise WheelError(f"architecture {arch!r} has no wheels here; allowed: {sorted(MACHINES)}")
    return [f"manylinux2014_{machine}"] + [f"manylinux_2_{m}_{machine}" for m in GLIBC_MINORS]


def _target_options(arch: str) -> list[str]:
    version, implementation, abi = PYTHON
    options = ["--no-deps", "--only-binary=:all:", "--python-version", version]
    options += ["--implementation", implementation, "--abi", abi]
    for tag in platform_tags(arch):
        options += ["--platform", tag]
    return options


def _pip(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def requirements(arch: str) -> list[str]:
    """``name==version`` of every run-time dependency, markers read for ``arch``."""
    platform_tags(arch)  # an architecture without wheels is refused, named
    closure = python_env.dependency_closure(machine=MACHINES[arch])
    return [f"{d.metadata['Name']}=={d.version}" for d in closure]


def download(arch: str, wanted: Sequence[str], folder: Path) -> None:
    """The wheels of ``wanted`` for ``arch`` into ``folder`` (pip keeps what it has)."""
    folder.mkdir(parents=True, exist_ok=True)
    # Builds of other trees share the folder: one download at a time.
    with debs.locked(folder / ".lock"):
        proc = _pip(["download", *_target_options(arch), "--dest", str(folder), *wanted])
    if proc.returncode == 0:
        return
    # pip stops at the first miss: ask for each one to name every dependency that lacks one.
    lacking = [
        req
        for req in wanted
        if _pip(["download", *_target_options(arch), "--dest", str(folder), req]).returncode
    ]
    detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
    raise WheelError(
        f"no linux/{arch} wheel for Python {PYTHON[0]} on the package index for "
        f"{', '.join(lacking) or 'the dependencies'} (platforms {platform_tags(arch)[0]} to "
        f"{platform_tags(arch)[-1]}); pip said: {' '.join(detail)}"
    )


def install(arch: str, site: Path, cache: Path) -> list[str]:
    """Installs the dependencies' ``arch`` wheels into ``site`` (a site-packages folder),
    downloading them into ``cache``; returns their ``name==version`` list."""
    wanted = requirements(arch)
    download(arch, wanted, cache)
    with tempfile.TemporaryDirectory(prefix="flexgpu-wheels-") as tmp:
        target = Path(tmp) / "site"
        args = ["install", *_target_options(arch), "--no-index", "--find-links", str(cache)]
        proc = _pip([*args, "--no-compile", "--target", str(target), *wanted])
        if proc.returncode != 0:
            raise WheelError(
                f"pip install --target of the linux/{arch} wheels failed: "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
            )
        # Console scripts of dependencies are not shipped (nor are they for this machine's).
        shutil.rmtree(target / "bin", ignore_errors=True)
        site.mkdir(parents=True, exist_ok=True)
        for entry in sorted(target.iterdir()):
            shutil.move(str(entry), site / entry.name)
    python_env.records_inside(site)
    return wanted


def wheel_files(arch: str, wanted: Sequence[str], cache: Path) -> list[str]:
    """The file names of the downloaded wheels that ``wanted`` (``name==version``) installs
    for ``arch``: what decides the dependency layer's content there."""
    tags = set(platform_tags(arch)) | {"any"}
    files: list[str] = []
    for req in wanted:
        name, _, version = req.partition("==")
        for wheel in sorted(cache.glob("*.whl")):
            dist, found_version, _, wheel_tags = parse_wheel_filename(wheel.name)
            platforms = {t.platform for t in wheel_tags}
            same = dist == canonicalize_name(name) and str(found_version) == version
            if same and platforms & tags:
                files.append(wheel.name)
    return files
