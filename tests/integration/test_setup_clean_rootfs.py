"""The set-up's system check (tools/system-deps.sh, the first step of `make demo` and `make
test`) run in a fresh Debian root file system: Debian's required packages and their
dependencies, unpacked from their .deb files, chrooted into with an empty environment.

What it proves: on such a machine the check names every Debian package it then needs (and
the missing package lists); with exactly those packages (and their dependencies) added and
the lists present, the check names only the Go toolchain (Debian's go is older than the
go.mod files need; the run without --check fetches it with that go), and the things the
later steps need from the system work there: a virtualenv with pip, a C program built
against libseccomp through pkg-config, as runc's build does, and Debian's go.

What it cannot: run the builds themselves there (the Go toolchain, the control plane, the
node), run maintainer scripts (update-alternatives links, dpkg's database; only
ca-certificates' bundle is made, by its own update-ca-certificates), or see what an
Ubuntu machine's package set lacks. Alternatives in the dependency closure are all unpacked,
so the root file system holds somewhat more than a minimal install."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from release.layers import cache_root
from tools.images import debian_rootfs

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="chroot and mount namespaces need root"),
    pytest.mark.skipif(shutil.which("apt-cache") is None, reason="needs a Debian machine"),
]

REPO = Path(__file__).resolve().parents[2]
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
# What the release image's arm64 half adds to `make test` on another architecture.
ARM64_BUILD = ("gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user-static")
# What a fresh Debian lacks for `make demo` (set "node"); `make test` adds prometheus.
FRESH_DEBIAN_NEEDS = {
    "python3-venv",
    "ca-certificates",
    "gcc",
    "libc6-dev",
    "pkg-config",
    "libseccomp-dev",
    "iproute2",
    "golang-go",
}
SECCOMP_PROGRAM = """#include <seccomp.h>
int main(void) { scmp_filter_ctx c = seccomp_init(SCMP_ACT_ALLOW); seccomp_release(c); return 0; }
"""


def _run(
    rootfs: Path, script: str, binds: dict[Path, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = debian_rootfs.chroot_argv(
        rootfs, ["bash", "-c", script], {REPO: "/src", **(binds or {})}, ENV
    )
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)


def _missing(stderr: str) -> set[str]:
    return set(re.findall(r"^missing: (\S+) \(", stderr, re.M))


def test_a_fresh_debian_gets_exactly_what_the_setup_needs(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    debs = cache_root() / "debs"
    debian_rootfs.add_packages(rootfs, debian_rootfs.required_packages(), debs)

    node = _run(rootfs, "bash /src/tools/system-deps.sh node --check")
    assert node.returncode == 1, node.stderr
    assert _missing(node.stderr) == FRESH_DEBIAN_NEEDS, node.stderr
    assert "missing: the apt package lists" in node.stderr
    test = _run(rootfs, "bash /src/tools/system-deps.sh test --check")
    arm64 = set() if os.uname().machine == "aarch64" else set(ARM64_BUILD)
    assert _missing(test.stderr) == FRESH_DEBIAN_NEEDS | {"prometheus"} | arm64, test.stderr

    # Add what the check named (as apt-get install would, dependencies included) and the
    # package lists: the check passes, and what it stands for works.
    debian_rootfs.add_packages(rootfs, sorted(FRESH_DEBIAN_NEEDS), debs)
    lists = {Path("/var/lib/apt/lists"): "/var/lib/apt/lists", Path("/etc/apt"): "/etc/apt"}
    # The one maintainer script's work done: ca-certificates' postinst enables every
    # certificate it ships and writes the CA bundle.
    again = _run(
        rootfs,
        "cd /usr/share/ca-certificates && find . -name '*.crt' | sed 's|^./||' | sort"
        " > /etc/ca-certificates.conf && update-ca-certificates >/dev/null"
        " && bash /src/tools/system-deps.sh node --check",
        lists,
    )
    # Only the Go toolchain is left: Debian's go is older than the go.mod files need, and the
    # run without --check fetches the newer one with it (tests/unit/test_go_toolchain.py).
    assert again.returncode == 1, again.stderr
    left = re.findall(r"^missing: .*$", again.stderr, re.M)
    assert len(left) == 1 and left[0].startswith("missing: go "), again.stderr
    assert "go on PATH is 1." in left[0], again.stderr
    (rootfs / "tmp").mkdir(exist_ok=True)
    (rootfs / "tmp" / "seccomp.c").write_text(SECCOMP_PROGRAM)
    works = _run(
        rootfs,
        "set -e; python3 -m venv /tmp/venv && /tmp/venv/bin/pip --version; "
        "gcc -o /tmp/seccomp /tmp/seccomp.c $(pkg-config --cflags --libs libseccomp); "
        "/tmp/seccomp && echo built-and-ran; go version",
    )
    assert works.returncode == 0, works.stderr
    assert "built-and-ran" in works.stdout
    assert "go version go1." in works.stdout  # the go that fetches the toolchain runs
