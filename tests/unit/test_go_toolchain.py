"""tools/go-toolchain.sh, the step of `make demo` and `make test` that brings the Go toolchain:
it works out the version the go.mod files need, compares it with the go on PATH as Go orders
versions (1.26rc1 < 1.26.0 < 1.26.8 < 1.26.10), fetches the toolchain module into the cache only
when that go is missing or older, installs it whole or not at all, and the Makefile puts it first
on PATH. The go here is a recorder that answers as a real one does, fetching a toolchain module
that holds a go of the asked version into the private module cache it is given."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import put_fetched_go_first

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "go-toolchain.sh"

# Answers `go version`, `go env NAME` and `go mod download MODULE` as go does; the module
# fetched holds a go that reports the version in its name unless FAKE_GO_FETCHED_VERSION says
# otherwise, its files read-only as in a real module cache.
FAKE_GO = r"""#!/bin/bash
echo "$*" >> "$FAKE_GO_LOG"
case "$1" in
  version) echo "go version go$FAKE_GO_VERSION linux/amd64" ;;
  env)
    case "$2" in
      GOHOSTOS) echo linux ;;
      GOHOSTARCH) echo amd64 ;;
      GOPROXY) echo https://proxy.example ;;
    esac ;;
  mod)
    [ -n "${FAKE_GO_FETCH_FAILS:-}" ] && { echo "proxy unreachable" >&2; exit 1; }
    mod=$3
    version=${mod#golang.org/toolchain@v0.0.1-go}
    version=${FAKE_GO_FETCHED_VERSION:-${version%.linux-amd64}}
    dir="$GOMODCACHE/$mod"
    mkdir -p "$dir/bin" "$dir/pkg/tool/linux_amd64"
    printf '#!/bin/bash\necho "go version go%s linux/amd64"\n' "$version" > "$dir/bin/go"
    printf '#!/bin/bash\n' > "$dir/pkg/tool/linux_amd64/compile"
    chmod 0444 "$dir/bin/go" "$dir/pkg/tool/linux_amd64/compile"
    chmod 0555 "$dir/bin" "$dir/pkg/tool/linux_amd64" "$dir/pkg/tool" "$dir/pkg" "$dir" ;;
esac
"""


def _need() -> str:
    out = subprocess.run(["bash", str(SCRIPT), "need"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _key(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def _machine(tmp_path: Path, go_version: str | None) -> tuple[dict[str, str], Path]:
    """A PATH of the coreutils the install uses and, unless None, a go of that version."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "mkdir", "mktemp", "chmod", "rm", "mv", "ln", "flock"):
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    log = tmp_path / "go-calls"
    if go_version is not None:
        go = bin_dir / "go"
        go.write_text(FAKE_GO)
        go.chmod(0o755)
    env = {
        "PATH": str(bin_dir),
        "HOME": str(tmp_path / "home"),
        "FLEXGPU_CACHE": str(tmp_path / "cache"),
        "FAKE_GO_LOG": str(log),
        "FAKE_GO_VERSION": go_version or "",
    }
    return env, log


def _run(
    args: list[str], env: dict[str, str], script: Path = SCRIPT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [env["PATH"] + "/bash", str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _older_and_newer(need: str) -> tuple[list[str], list[str]]:
    major, minor, patch = _key(need)
    older = [f"{major}.{minor}rc1", f"{major}.{minor - 1}.99", "1.19.8", "1.9.9"]
    if patch > 0:
        older.append(f"{major}.{minor}.{patch - 1}")
    # 1.26.18 sorts before 1.26.8 as text; 1.100 before 1.26: Go's order is by number.
    newer = [need, f"{major}.{minor}.{patch + 10}", f"{major}.{minor + 1}rc1", f"{major}.100.0"]
    return older, newer


NEED = _need()
OLDER, NEWER = _older_and_newer(NEED)


def test_need_is_the_newest_go_line_of_the_modules_the_builds_use() -> None:
    lines = []
    for mod in sorted((ROOT / "tools").glob("*/go.mod")) + sorted(
        (ROOT / "tools").glob("*/*/go.mod")
    ):
        build = mod.parent / "build.sh"
        if build.exists() and "GOTOOLCHAIN=" in build.read_text():
            continue  # tools/karpenter picks its own toolchain
        for line in mod.read_text().splitlines():
            if line.startswith("go "):
                lines.append(line.split()[1])
    assert lines
    assert _key(NEED) == max(_key(v) for v in lines)


@pytest.mark.parametrize("version", NEWER)
def test_a_go_at_least_the_need_is_kept_and_nothing_fetched(tmp_path: Path, version: str) -> None:
    env, log = _machine(tmp_path, version)
    result = _run([], env)
    assert result.returncode == 0, result.stderr
    assert "mod download" not in (log.read_text() if log.exists() else "")
    assert not (tmp_path / "cache" / "go").exists()


@pytest.mark.parametrize("version", OLDER)
def test_an_older_go_fetches_the_needed_toolchain_into_the_cache(
    tmp_path: Path, version: str
) -> None:
    env, log = _machine(tmp_path, version)
    result = _run([], env)
    assert result.returncode == 0, result.stderr
    assert f"go on PATH is {version}" in result.stderr
    assert f"mod download golang.org/toolchain@v0.0.1-go{NEED}.linux-amd64" in log.read_text()
    go_dir = tmp_path / "cache" / "go"
    go = go_dir / "bin" / "go"
    assert os.access(go, os.X_OK)
    assert subprocess.run([go], capture_output=True, text=True, check=True).stdout.startswith(
        f"go version go{NEED} "
    )
    assert (go_dir / "bin").resolve() == go_dir / f"go{NEED}" / "bin"
    tool = go_dir / f"go{NEED}" / "pkg" / "tool" / "linux_amd64" / "compile"
    assert tool.stat().st_mode & stat.S_IXUSR
    # The private module cache and the half-made copy are gone.
    assert sorted(p.name for p in go_dir.iterdir()) == [".lock", "bin", f"go{NEED}"]


def test_a_second_run_reuses_the_fetched_toolchain(tmp_path: Path) -> None:
    env, log = _machine(tmp_path, OLDER[0])
    assert _run([], env).returncode == 0
    log.unlink()
    result = _run([], env)
    assert result.returncode == 0, result.stderr
    assert "mod download" not in log.read_text()


def test_check_names_what_is_missing_and_fetches_nothing(tmp_path: Path) -> None:
    env, log = _machine(tmp_path, "1.19.8")
    result = _run(["--check"], env)
    assert result.returncode == 1
    assert f"missing: go {NEED} (go on PATH is 1.19.8" in result.stderr
    assert "mod download" not in log.read_text()
    assert not (tmp_path / "cache" / "go").exists()


def test_no_go_at_all_names_the_package_that_brings_one(tmp_path: Path) -> None:
    env, _ = _machine(tmp_path, None)
    check = _run(["--check"], env)
    assert check.returncode == 1
    assert f"missing: go (the builds need {NEED}" in check.stderr
    result = _run([], env)
    assert result.returncode == 2
    assert "apt-get install golang-go" in result.stderr


def test_a_failed_fetch_names_the_module_and_the_proxy_and_installs_nothing(
    tmp_path: Path,
) -> None:
    env, _ = _machine(tmp_path, "1.19.8")
    env["FAKE_GO_FETCH_FAILS"] = "1"
    result = _run([], env)
    assert result.returncode == 2
    assert f"golang.org/toolchain@v0.0.1-go{NEED}.linux-amd64 failed" in result.stderr
    assert "GOPROXY=https://proxy.example" in result.stderr
    assert sorted(p.name for p in (tmp_path / "cache" / "go").iterdir()) == [".lock"]


def test_a_module_holding_another_version_is_refused(tmp_path: Path) -> None:
    env, _ = _machine(tmp_path, "1.19.8")
    env["FAKE_GO_FETCHED_VERSION"] = "1.19.8"
    result = _run([], env)
    assert result.returncode == 2
    assert f"not go{NEED}" in result.stderr
    assert sorted(p.name for p in (tmp_path / "cache" / "go").iterdir()) == [".lock"]


def test_what_a_killed_fetch_left_is_cleared_before_the_next(tmp_path: Path) -> None:
    env, _ = _machine(tmp_path, "1.19.8")
    go_dir = tmp_path / "cache" / "go"
    # A private module cache (read-only, as go leaves it) and a half-moved toolchain.
    stale = go_dir / ".download.abc123" / "mod" / "golang.org"
    stale.mkdir(parents=True)
    stale.chmod(0o555)
    stale.parent.chmod(0o555)
    (go_dir / f"go{NEED}.tmp" / "bin").mkdir(parents=True)
    result = _run([], env)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in go_dir.iterdir()) == [".lock", "bin", f"go{NEED}"]


def _tools_copy(tmp_path: Path, modules: dict[str, str], own_toolchain: str = "") -> Path:
    """The script in a tools/ folder of its own, with these go.mod files (folder: text)."""
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy(SCRIPT, tools / SCRIPT.name)
    for folder, text in modules.items():
        (tools / folder).mkdir(parents=True)
        (tools / folder / "go.mod").write_text(f"module example.com/{folder}\n\n{text}\n")
    if own_toolchain:
        (tools / own_toolchain / "build.sh").write_text("export GOTOOLCHAIN=go1.99.0\n")
    return tools / SCRIPT.name


@pytest.mark.parametrize(
    ("modules", "need"),
    [
        ({"a": "go 1.25.0", "b": "go 1.26.8", "node/c": "go 1.26.9"}, "1.26.9"),
        ({"a": "go 1.26.8\ntoolchain go1.26.10"}, "1.26.10"),
        ({"a": "go 1.27", "b": "go 1.26.9"}, "1.27.0"),
        ({"a": "go 1.26rc2", "b": "go 1.25.7"}, "1.26rc2"),
        ({"a": "go 1.19"}, "1.21.0"),
        ({"a": "go 1.26.0", "own": "go 1.30.0"}, "1.26.0"),
    ],
)
def test_need_follows_go_and_toolchain_lines(
    tmp_path: Path, modules: dict[str, str], need: str
) -> None:
    script = _tools_copy(tmp_path, modules, own_toolchain="own" if "own" in modules else "")
    result = subprocess.run(
        ["bash", str(script), "need"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == need


def test_a_go_line_that_is_no_version_is_named(tmp_path: Path) -> None:
    script = _tools_copy(tmp_path, {"a": "go 1.x"})
    result = subprocess.run(
        ["bash", str(script), "need"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "a/go.mod: 'go 1.x' is not a Go version" in result.stderr


def test_unknown_argument_is_refused_with_the_allowed_ones(tmp_path: Path) -> None:
    env, _ = _machine(tmp_path, NEED)
    result = _run(["install"], env)
    assert result.returncode == 2
    assert "--check|need|bin-dir" in result.stderr and "'install'" in result.stderr


def test_make_puts_the_cached_toolchain_first_on_path(tmp_path: Path) -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    env, _ = _machine(tmp_path, "1.19.8")
    bin_dir = tmp_path / "cache" / "go" / "bin"
    assert _run(["bin-dir"], env).stdout.strip() == str(bin_dir)
    assert _run([], env).returncode == 0
    env["PATH"] = f"{env['PATH']}:/usr/bin:/bin"
    result = subprocess.run(
        [make, "-s", "-C", str(ROOT), "--eval", "go-path: ; @command -v go", "go-path"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(bin_dir / "go")


def test_pytest_run_directly_puts_the_fetched_toolchain_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXGPU_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    put_fetched_go_first()
    assert os.environ["PATH"] == "/usr/bin:/bin"  # nothing fetched: nothing changes
    bin_dir = tmp_path / "go" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "go").write_text("#!/bin/sh\n")
    put_fetched_go_first()
    put_fetched_go_first()
    assert os.environ["PATH"] == f"{bin_dir}:/usr/bin:/bin"
