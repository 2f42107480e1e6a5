"""The build cache (tools/buildcache.sh and tools/buildcache.py): one key rule in both, keys of
the long Go builds unchanged, one build per entry at a time, no half entry after a crash, and
eviction that keeps what is current, recent or locked."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import holds_for, wait_for
from tools import buildcache

REPO = buildcache.REPO
LIBRARY = REPO / "tools" / "buildcache.sh"
# A build that records each run, says when it started and, with HOLD naming a file, waits for
# that file before it finishes: a stand-in for a long Go build.
FAKE_BUILD = """#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")"
. {library}
key=$(bc_key input.txt)
bc_begin fake "$key"
echo run >> runs.log
touch "$BC_TMP/started"
while [ -n "${{HOLD:-}}" ] && [ ! -e "$HOLD" ]; do sleep 0.05; done
echo built > "$BC_TMP/artefact"
bc_finish
"""
DAY = 86400


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The fake build's folder, with the cache in tmp_path/cache and the artefact registered."""
    folder = tmp_path / "fake"
    folder.mkdir()
    (folder / "build.sh").write_text(FAKE_BUILD.format(library=LIBRARY))
    (folder / "input.txt").write_text("pins v1\n")
    monkeypatch.setenv("FLEXGPU_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FLEXGPU_CACHE_KEEP_DAYS", raising=False)
    monkeypatch.setitem(buildcache.SCRIPTS, "fake", folder / "build.sh")
    yield folder


def start(fake: Path, hold: Path | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "HOLD": str(hold) if hold else ""}
    return subprocess.Popen(
        ["bash", str(fake / "build.sh")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def runs(fake: Path) -> int:
    log = fake / "runs.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def age(path: Path, days: float) -> None:
    then = time.time() - days * DAY
    os.utime(path, (then, then))


def entry(cache: Path, name: str, used_days_ago: float) -> Path:
    """A complete entry last used ``used_days_ago``."""
    folder = cache / name
    folder.mkdir(parents=True)
    (folder / ".complete").touch()
    age(folder / ".complete", used_days_ago)
    return folder


def test_the_shell_and_python_key_rules_agree(tmp_path: Path) -> None:
    files = [tmp_path / n for n in ("go.mod", "go.sum", "main.go")]
    for i, f in enumerate(files):
        f.write_bytes(f"content {i}\n".encode() * (i + 1))
    shell = subprocess.run(
        ["bash", "-c", f'. {LIBRARY}; bc_key "$@"', "bc_key", *map(str, files)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert shell == buildcache.key(files)
    assert shell == hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    assert buildcache.key(reversed(files)) != shell  # order is part of the rule


def test_a_missing_input_is_named_not_hashed_as_nothing(tmp_path: Path) -> None:
    script = f'. {LIBRARY}; key=$(bc_key go.mod absent.sum); echo "key $key"'
    (tmp_path / "go.mod").write_text("module x\n")
    run = subprocess.run(
        ["bash", "-ec", script], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert run.returncode == 2 and "key" not in run.stdout
    assert f"the build input {tmp_path}/absent.sum is missing" in run.stderr
    with pytest.raises(buildcache.BuildError, match=r"absent\.sum is missing"):
        buildcache.key([tmp_path / "go.mod", tmp_path / "absent.sum"])


def _old_key(*parts: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()[:12]


def _module_version(go_mod: Path, module: str) -> str:
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", go_mod.read_text(), re.M)
    assert match, f"{go_mod} pins no {module}"
    return match.group(1)


def test_the_long_go_builds_keep_their_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control planes, NVIDIA's plugin and the reference driver are cached under the
    keys their scripts used before the shared helper (pins and our Go sources only), so a warm
    cache stays warm: computed here from those rules, asked of the scripts."""
    monkeypatch.setenv("FLEXGPU_CACHE", str(tmp_path))
    k8s = REPO / "tools" / "k8s"
    sources = sorted(p for p in k8s.rglob("*.go") if p.relative_to(k8s).parts[0] != "releases")
    sources.sort(key=lambda p: "./" + str(p.relative_to(k8s)))
    version = _module_version(k8s / "go.mod", "k8s.io/kubernetes")
    key = _old_key(k8s / "go.mod", k8s / "go.sum", *sources)
    assert buildcache.entry("k8s") == (tmp_path / f"k8s-{version}-{key}", False)
    release = k8s / "releases" / "1.34"
    patches = sorted(release.glob("*.patch"))
    version = _module_version(release / "go.mod", "k8s.io/kubernetes")
    key = _old_key(release / "go.mod", release / "go.sum", *sources, *patches)
    assert buildcache.entry("k8s", "1.34") == (tmp_path / f"k8s-{version}-{key}", False)
    for name, module in (
        ("nvidia-driver", "sigs.k8s.io/dra-driver-nvidia-gpu"),
        ("example-driver", "sigs.k8s.io/dra-example-driver"),
    ):
        folder = REPO / "tools" / name
        version = _module_version(folder / "go.mod", module)
        key = _old_key(folder / "go.mod", folder / "go.sum")
        assert buildcache.entry(name) == (tmp_path / f"{name}-{version}-{key}", False)


def test_path_builds_once_and_then_serves_the_entry(fake: Path, tmp_path: Path) -> None:
    assert buildcache.lookup("fake") is None
    built = buildcache.path("fake")
    assert (built / "artefact").read_text() == "built\n"
    assert built.parent == tmp_path / "cache" and built.name.startswith("fake-")
    assert buildcache.path("fake") == built and runs(fake) == 1
    assert buildcache.lookup("fake") == built
    (fake / "input.txt").write_text("pins v2\n")  # another input: another key
    assert buildcache.lookup("fake") is None
    assert buildcache.path("fake") != built and runs(fake) == 2


def test_an_unknown_artefact_names_the_allowed_ones() -> None:
    with pytest.raises(buildcache.BuildError, match=r"unknown artefact 'nope'; allowed: .*k8s"):
        buildcache.path("nope")


def test_a_failed_build_says_why(fake: Path) -> None:
    (fake / "build.sh").write_text(
        f". {LIBRARY}\nbc_begin fake 000000000000\necho 'go: module not found' >&2\nexit 2\n"
    )
    with pytest.raises(buildcache.BuildError, match=r"exit 2\):\ngo: module not found"):
        buildcache.path("fake")


def test_a_second_build_of_one_key_waits_for_the_first(fake: Path, tmp_path: Path) -> None:
    release = tmp_path / "release"
    first = start(fake, hold=release)
    wait_for(lambda: list((tmp_path / "cache").glob("fake-*.tmp/started")), what="first build")
    second = start(fake)
    holds_for(
        lambda: second.poll() is None and runs(fake) == 1,
        seconds=1.0,
        why="the second build blocks on the entry's lock for as long as the first holds it",
    )
    release.touch()
    out_first, _ = first.communicate(timeout=30)
    out_second, _ = second.communicate(timeout=30)
    assert first.returncode == second.returncode == 0
    assert out_first.splitlines()[-1] == out_second.splitlines()[-1]
    assert runs(fake) == 1  # the second found the entry complete


def test_a_build_killed_before_its_mark_leaves_no_entry(fake: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    killed = start(fake, hold=tmp_path / "never")
    started = wait_for(lambda: list(cache.glob("fake-*.tmp/started")), what="build start")
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    assert buildcache.lookup("fake") is None
    assert not [p for p in cache.glob("fake-*") if p.suffix not in (".tmp", ".lock")]
    (started[0].parent / "leftover").touch()
    built = buildcache.path("fake")  # the next build clears what the killed one left
    assert (built / "artefact").read_text() == "built\n"
    assert not (built / "leftover").exists() and runs(fake) == 2


def _hold_lock(lock: Path) -> int:
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_eviction_keeps_current_recent_and_locked_entries(fake: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    stale = entry(cache, "fake-000000000001", used_days_ago=30)
    recent = entry(cache, "fake-000000000002", used_days_ago=3)
    locked = entry(cache, "fake-000000000003", used_days_ago=30)
    half = cache / "fake-000000000004"  # no mark: a build that never finished
    half.mkdir()
    dead_tmp = cache / "fake-000000000005.tmp"
    dead_tmp.mkdir()
    other = entry(cache, "other-000000000001", used_days_ago=30)
    fd = _hold_lock(cache / "fake-000000000003.lock")
    try:
        current = buildcache.path("fake")
    finally:
        os.close(fd)
    assert current.is_dir() and recent.is_dir() and locked.is_dir() and other.is_dir()
    assert not stale.exists() and not half.exists() and not dead_tmp.exists()
    assert not (cache / "fake-000000000001.lock").exists()
    # A hit counts as a use: the current entry, unused for a month, survives the next build.
    age(current / ".complete", 30)
    buildcache.path("fake")
    (fake / "input.txt").write_text("pins v2\n")
    buildcache.path("fake")
    assert current.is_dir()


def test_the_keep_period_is_a_setting(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    recent = entry(cache, "fake-000000000002", used_days_ago=3)
    monkeypatch.setenv("FLEXGPU_CACHE_KEEP_DAYS", "2")
    buildcache.path("fake")
    assert not recent.exists()
    monkeypatch.setenv("FLEXGPU_CACHE_KEEP_DAYS", "two")
    with pytest.raises(buildcache.BuildError, match=r"FLEXGPU_CACHE_KEEP_DAYS='two' is not"):
        buildcache.evict(cache, "fake-*", keep=cache / "x")


def test_python_eviction_of_file_entries(tmp_path: Path) -> None:
    """The image archives and layers (files, not folders) follow the same rule."""
    files = {}
    for name, days in (("old", 30), ("recent", 1), ("locked", 30), ("current", 30)):
        files[name] = tmp_path / f"flexgpu-{name}.tar"
        files[name].write_bytes(b"tar")
        age(files[name], days)
    fd = _hold_lock(tmp_path / "flexgpu-locked.tar.lock")
    try:
        removed = buildcache.evict(tmp_path, "flexgpu-*.tar", keep=files["current"])
    finally:
        os.close(fd)
    assert removed == [files["old"]]
    assert all(files[n].exists() for n in ("recent", "locked", "current"))
    buildcache.touch(files["locked"])
    assert buildcache.evict(tmp_path, "flexgpu-*.tar", keep=files["current"]) == []
    # Cheap to make again, short kept: the recent one goes with a half-day period.
    removed = buildcache.evict(tmp_path, "flexgpu-*.tar", keep=files["current"], keep_days=0.5)
    assert removed == [files["recent"]]


def test_every_build_goes_through_the_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each registered script answers a query with an entry of the cache (so it sources the
    helper and computes its key before anything else), and none keeps a lock, mark or eviction
    rule of its own."""
    monkeypatch.setenv("FLEXGPU_CACHE", str(tmp_path))
    for name, script in buildcache.SCRIPTS.items():
        found, complete = buildcache.entry(name)
        assert found.parent == tmp_path and not complete, name
        text = script.read_text()
        assert "buildcache.sh" in text, script
        for own in ("flock", ".complete", "ls -dt", "out.tmp", "cache_root="):
            assert own not in text, f"{script} does its own {own!r}"
    scripts = set(REPO.glob("tools/*/build.sh")) | set(REPO.glob("*/build.sh"))
    assert scripts <= set(buildcache.SCRIPTS.values())


def test_the_hooks_build_refuses_an_architecture_it_does_not_build() -> None:
    """hooks/build.sh builds amd64 and arm64 (the image index's platforms); another name is
    refused before any build, naming the allowed ones."""
    proc = subprocess.run(
        ["bash", str(REPO / "hooks" / "build.sh"), "riscv64"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "architecture 'riscv64' is not built; allowed: amd64, arm64" in proc.stderr
