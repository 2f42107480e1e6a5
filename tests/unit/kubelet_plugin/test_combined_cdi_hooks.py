"""The driver's CDI hooks run as one ``flexgpu-cdi-hooks`` call (driver_edits.combine_hooks):
the container's files come out byte for byte as with NVIDIA's separate ``nvidia-cdi-hook``
calls, hooks run in their order and the first failure stops the rest, as the runtime would.

The hooks run as the runtime runs them: with the OCI state on stdin, in a mount namespace of
their own where the container's root is a mount point (update-ldcache pivots into it)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from flexgpu.kubelet_plugin.devices import driver_edits
from tests.nvidia_ctk import tools_dir
from tools.node import driver_root

HOOK = Path("/opt/hooks/nvidia-cdi-hook")
COMBINED = Path("/opt/hooks/flexgpu-cdi-hooks")


def _hook(name: str, *args: str, stage: str = "createContainer", **extra: Any) -> dict[str, Any]:
    return {
        "hookName": stage,
        "path": str(HOOK),
        "args": ["nvidia-cdi-hook", name, *args],
        "env": ["NVIDIA_CTK_DEBUG=false"],
        **extra,
    }


def test_consecutive_hooks_of_one_stage_become_one_call_in_their_order() -> None:
    edits = {"hooks": [_hook("create-symlinks", "--link", "a::b"), _hook("update-ldcache")]}
    combined = driver_edits.combine_hooks(edits, HOOK, COMBINED)
    assert combined["hooks"] == [
        {
            "hookName": "createContainer",
            "path": str(COMBINED),
            "args": [
                "flexgpu-cdi-hooks",
                '["create-symlinks", "--link", "a::b"]',
                '["update-ldcache"]',
            ],
            "env": ["NVIDIA_CTK_DEBUG=false"],
        }
    ]


def test_another_program_a_timeout_a_stage_or_an_env_change_ends_a_run() -> None:
    """Only what one call can stand for is joined; everything keeps its place."""
    other = {"hookName": "createContainer", "path": "/usr/bin/other", "args": ["other"]}
    hooks = [
        _hook("create-symlinks", "--link", "a::b"),
        _hook("update-ldcache"),
        other,
        _hook("enable-cuda-compat", timeout=5),
        _hook("disable-device-node-modification"),
        _hook("update-application-profile", stage="startContainer"),
        _hook("noop", stage="startContainer", env=["NVIDIA_CTK_DEBUG=true"]),
    ]
    combined = driver_edits.combine_hooks({"hooks": hooks}, HOOK, COMBINED)["hooks"]
    assert [h["path"] for h in combined] == [
        str(COMBINED),
        "/usr/bin/other",
        str(HOOK),
        str(HOOK),
        str(HOOK),
        str(HOOK),
    ]
    assert combined[1:] == hooks[2:]


def test_edits_without_hooks_are_left_as_they_are() -> None:
    edits = {"env": ["A=1"], "mounts": [{"hostPath": "/x", "containerPath": "/x"}]}
    assert driver_edits.combine_hooks(edits, HOOK, COMBINED) == edits


# -- running the hooks ------------------------------------------------------------------------


@pytest.fixture
def tools(monkeypatch: pytest.MonkeyPatch) -> Path:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("running CDI hooks needs root and unshare(1) (a mount namespace)")
    folder = tools_dir()
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return folder


@pytest.fixture
def driver(tmp_path: Path) -> Path:
    root = tmp_path / "driver"
    driver_root.create(root, 2)
    return root


def _bundle(folder: Path, driver: Path) -> Path:
    """A container bundle whose root has the driver's libraries, as the CDI mounts put them."""
    lib = "usr/lib/x86_64-linux-gnu"
    for sub in ("etc", lib, "proc", "dev", "tmp", "run"):
        (folder / "rootfs" / sub).mkdir(parents=True, exist_ok=True)
    for library in (driver / lib).iterdir():
        shutil.copy(library, folder / "rootfs" / lib / library.name, follow_symlinks=False)
    (folder / "config.json").write_text(
        json.dumps({"ociVersion": "1.2.0", "root": {"path": "rootfs"}, "process": {"cwd": "/"}})
    )
    return folder


def _run_hooks(bundle: Path, hooks: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    """Runs ``hooks`` one after another as runc does, stopping at the first that fails."""
    state = json.dumps(
        {"ociVersion": "1.2.0", "id": "c", "status": "creating", "pid": 1, "bundle": str(bundle)}
    )
    (bundle / "state.json").write_text(state)
    quoted = [" ".join(f"'{a}'" for a in [h["path"], *h["args"][1:]]) for h in hooks]
    script = f"mount --bind '{bundle}/rootfs' '{bundle}/rootfs'" + "".join(
        f" && {command} < '{bundle}/state.json'" for command in quoted
    )
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "NVIDIA_CTK_DEBUG": "false"}
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def _tree(bundle: Path) -> list[tuple[str, ...]]:
    """Every path under the container's root with its kind and content (link target, bytes'
    hash, mode). The ld.so.conf.d files get random names from the hook: the name is masked."""
    entries: list[tuple[str, ...]] = []
    root = bundle / "rootfs"
    for path in sorted(root.rglob("*")):
        name = re.sub(r"nvcr-\d+", "nvcr-N", str(path.relative_to(root)))
        if path.is_symlink():
            entries.append((name, "link", os.readlink(path)))
        elif path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            entries.append((name, "file", digest, oct(path.stat().st_mode)))
        else:
            entries.append((name, "dir"))
    return sorted(entries)


def test_one_combined_call_leaves_the_container_as_the_separate_hooks_do(
    tmp_path: Path, tools: Path, driver: Path
) -> None:
    """NVIDIA's generator's hooks over a driver root, separate and combined, each on a fresh
    container root: the same symlinks, ld.so.conf.d entries and ld.so.cache, byte for byte."""
    hook = tools / "nvidia-cdi-hook"
    edits = driver_edits.generate(driver_root=driver, host_driver_root=driver, hook_path=hook)
    separate = edits["hooks"]
    assert len(separate) >= 2, separate
    combined = driver_edits.combine_hooks(edits, hook, tools / "flexgpu-cdi-hooks")["hooks"]
    assert len(combined) == 1
    one = _bundle(tmp_path / "separate", driver)
    two = _bundle(tmp_path / "combined", driver)
    for bundle, hooks in ((one, separate), (two, combined)):
        run = _run_hooks(bundle, hooks)
        assert run.returncode == 0, run.stderr
    tree = _tree(one)
    assert any(e[0] == "etc/ld.so.cache" for e in tree), "update-ldcache wrote no cache"
    assert any(e[1] == "link" for e in tree), "create-symlinks made no link"
    assert _tree(two) == tree


def test_the_first_failing_hook_stops_the_ones_after_it(
    tmp_path: Path, tools: Path, driver: Path
) -> None:
    """A hook that fails (here: a flag its subcommand does not have) makes the call fail with
    its message, and the hooks after it do not run, as with separate hooks under runc."""
    bundle = _bundle(tmp_path / "b", driver)
    hooks = [
        _hook("create-symlinks", "--no-such-flag"),
        _hook(
            "create-symlinks", "--link", "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda-test.so"
        ),
    ]
    combined = driver_edits.combine_hooks({"hooks": hooks}, HOOK, tools / "flexgpu-cdi-hooks")
    run = _run_hooks(bundle, combined["hooks"])
    assert run.returncode != 0
    assert "no-such-flag" in run.stderr
    assert not (bundle / "rootfs/usr/lib/x86_64-linux-gnu/libcuda-test.so").exists()


def test_an_argument_that_is_not_a_json_list_is_refused_with_its_value(tools: Path) -> None:
    run = subprocess.run(
        [str(tools / "flexgpu-cdi-hooks"), "create-symlinks"],
        capture_output=True,
        text=True,
        input="{}",
        timeout=30,
        check=False,
    )
    assert run.returncode == 2
    assert '"create-symlinks"' in run.stderr and "JSON list" in run.stderr


# -- the plugin's choice ------------------------------------------------------------------------


def _plugin_edits(tmp_path: Path, driver: Path, **settings: Any) -> dict[str, Any]:
    from types import SimpleNamespace

    from flexgpu.kubelet_plugin import node_parts
    from flexgpu.kubelet_plugin.config import make_config

    config = make_config(
        node_name="node-a",
        registry_dir=tmp_path / "registry",
        plugins_dir=tmp_path / "plugins",
        cdi_dir=tmp_path / "cdi",
        data_dir=tmp_path / "data",
        gpu_backend="simulated",
        topology="l4-2-pcie",
        driver_root=driver,
        **settings,
    )
    edits: dict[str, Any] = node_parts.node_driver_edits(config, SimpleNamespace())  # type: ignore[arg-type]
    return edits


def test_the_plugin_writes_one_combined_hook_from_its_installed_copy(
    tmp_path: Path, tools: Path, driver: Path
) -> None:
    hooks = _plugin_edits(tmp_path, driver)["hooks"]
    installed = tmp_path / "data" / "bin" / "flexgpu-cdi-hooks"
    assert [h["path"] for h in hooks] == [str(installed)]
    assert installed.read_bytes() == (tools / "flexgpu-cdi-hooks").read_bytes()
    ran = [json.loads(arg)[0] for arg in hooks[0]["args"][1:]]
    assert {"create-symlinks", "update-ldcache"} <= set(ran), ran


def test_an_admins_own_hook_keeps_nvidias_separate_hooks(
    tmp_path: Path, tools: Path, driver: Path
) -> None:
    """With --nvidia-cdi-hook (a host path) there is no flexgpu-cdi-hooks beside it."""
    own = Path("/usr/bin/nvidia-cdi-hook")
    hooks = _plugin_edits(tmp_path, driver, nvidia_cdi_hook=own)["hooks"]
    assert len(hooks) > 1 and {h["path"] for h in hooks} == {str(own)}
    assert not (tmp_path / "data" / "bin" / "flexgpu-cdi-hooks").exists()
