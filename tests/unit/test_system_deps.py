"""tools/system-deps.sh, the step of `make demo` and `make test` that installs the machine's own
Debian packages: on a bare machine it asks apt-get for every package the builds and tests use
(golang-go among them, whose go then fetches the toolchain the go.mod files need),
not as root it names the command in one line and installs nothing, and .ci/run leaves that job
to it (so CI meets what a newcomer meets)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "system-deps.sh"
GO_TOOLCHAIN = ROOT / "tools" / "go-toolchain.sh"
NODE_PACKAGES = [
    "python3-venv",
    "gcc",
    "pkg-config",
    "libseccomp-dev",
    "iproute2",
    "util-linux",
    "mount",
    "golang-go",
]
# The test set adds the metrics tests' Prometheus and what builds and starts the release
# image's arm64 half on another machine (a cross compiler, its C library and qemu).
CROSS_HEADER = Path("/usr/aarch64-linux-gnu/include/stdio.h")
TEST_PACKAGES = [
    *NODE_PACKAGES,
    "prometheus",
    *(
        []
        if os.uname().machine == "aarch64"
        else [
            "gcc-aarch64-linux-gnu",
            # Looked for by a file, not on PATH: present once system-deps has run here.
            *([] if CROSS_HEADER.exists() else ["libc6-dev-arm64-cross"]),
            "qemu-user-static",
        ]
    ),
]


def _bare_bin(tmp: Path) -> Path:
    """A PATH holding only what the script itself runs on any machine (bash, id) and an
    apt-cache that knows no package: a machine with none of the node's tools and no lists."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    apt_cache = bin_dir / "apt-cache"
    apt_cache.write_text("#!/bin/bash\nexit 100\n")
    apt_cache.chmod(0o755)
    return bin_dir


def _recorder(tmp: Path) -> tuple[Path, Path]:
    """An apt-get that records its calls; installing golang-go puts a go on the bare PATH that
    is as new as the go.mod files need, so the toolchain step that follows has nothing to do."""
    log = tmp / "apt-calls"
    recorder = tmp / "apt-get"
    need = subprocess.run(
        ["bash", str(GO_TOOLCHAIN), "need"], capture_output=True, text=True, check=True
    ).stdout.strip()
    go = tmp / "bin" / "go"
    chmod = shutil.which("chmod")  # the bare PATH has none
    recorder.write_text(
        f'#!/bin/bash\necho "$*" >> {log}\n'
        f'if [[ " $* " == *" golang-go "* ]]; then\n'
        f"  printf '#!/bin/bash\\necho go version go{need} linux/amd64\\n' > {go}\n"
        f"  {chmod} 755 {go}\n"
        "fi\n"
    )
    recorder.chmod(0o755)
    return recorder, log


def _run(
    args: list[str], bin_dir: Path, apt_get: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bin_dir), "HOME": "/nonexistent"}
    if apt_get is not None:
        env["FLEXGPU_APT_GET"] = str(apt_get)
    return subprocess.run(
        [str(bin_dir / "bash"), str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="installing needs root (as CI runs)")
@pytest.mark.parametrize(
    ("set_name", "expected"),
    [("node", NODE_PACKAGES), ("test", TEST_PACKAGES)],
)
def test_bare_machine_gets_every_package_from_apt(
    tmp_path: Path, set_name: str, expected: list[str]
) -> None:
    bin_dir = _bare_bin(tmp_path)
    recorder, log = _recorder(tmp_path)
    result = _run([set_name], bin_dir, recorder)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "update -qq"
    assert calls[1].split() == ["install", "-y", "-qq", "--no-install-recommends", *expected]
    assert len(calls) == 2
    # The Go step ran after apt-get and found the go it brought new enough.
    assert "missing: go " not in result.stderr and "missing: go (" not in result.stderr


def test_not_root_names_the_command_in_one_line_and_installs_nothing() -> None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run the script as another user")
    # pytest's own temp folder is private to root; the other user must reach these files.
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        _check_not_root(Path(tmp), setpriv)


def _check_not_root(tmp_path: Path, setpriv: str) -> None:
    bin_dir = _bare_bin(tmp_path)
    recorder, log = _recorder(tmp_path)
    (bin_dir / "apt-get").symlink_to(recorder)
    result = subprocess.run(
        [
            setpriv,
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            str(bin_dir / "bash"),
            str(SCRIPT),
            "test",
        ],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: run as root first: apt-get update && apt-get install -y "
        "--no-install-recommends " + " ".join(TEST_PACKAGES)
    ]
    assert not log.exists()


def test_check_lists_without_installing(tmp_path: Path) -> None:
    bin_dir = _bare_bin(tmp_path)
    recorder, log = _recorder(tmp_path)
    result = _run(["node", "--check"], bin_dir, recorder)
    assert result.returncode == 1
    assert "missing: libseccomp-dev" in result.stderr
    assert not log.exists()


def test_unknown_set_is_refused_with_the_allowed_ones(tmp_path: Path) -> None:
    result = _run(["demo"], _bare_bin(tmp_path))
    assert result.returncode == 2
    assert "node|test" in result.stderr and "'demo'" in result.stderr


def test_make_runs_it_before_the_builds_and_ci_installs_nothing_itself() -> None:
    makefile = (ROOT / "Makefile").read_text()
    setup = next(line for line in makefile.splitlines() if line.startswith("setup:"))
    assert setup.split()[1] == "system-deps", setup
    test = next(line for line in makefile.splitlines() if line.startswith("test:"))
    assert "test-deps" in test.split()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "apt-get" not in ci and "pip install" not in ci and "go install" not in ci
