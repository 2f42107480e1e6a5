"""The CLI in kubectl's habits: targets as kubectl names them, the namespace from the context,
one-line errors with documented exit codes, MIG rows under their GPU."""

from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path

import pytest
from kubernetes import client
from urllib3.exceptions import MaxRetryError, NewConnectionError

from flexgpu.controller import cli
from flexgpu.controller.cli_capacity import MIG_NOTE, capacity_table, ordered
from flexgpu.controller.cli_explain import Target, parse_target
from flexgpu.controller.cli_options import CliError, ExitCode, api_error, connect
from flexgpu.driver.allocation import CapacityRow

KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: x}}]
contexts:
  - {name: team, context: {cluster: c, user: u, namespace: team-a}}
  - {name: bare, context: {cluster: c, user: u}}
current-context: team
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trainer", Target("", "ctx-ns", "trainer")),
        ("pod/trainer", Target("pod", "ctx-ns", "trainer")),
        ("po/trainer", Target("pod", "ctx-ns", "trainer")),
        ("resourceclaim/gpu", Target("claim", "ctx-ns", "gpu")),
        ("resourceclaims/gpu", Target("claim", "ctx-ns", "gpu")),
        ("team-b/trainer", Target("", "team-b", "trainer")),  # the older NAMESPACE/NAME
    ],
)
def test_targets_are_named_as_kubectl_names_them(text: str, expected: Target) -> None:
    assert parse_target(text, "ctx-ns") == expected


@pytest.mark.parametrize("text", ["pod/", "/x", "a/b/c"])
def test_a_malformed_target_is_a_usage_error(text: str) -> None:
    with pytest.raises(CliError) as caught:
        parse_target(text, "ns")
    assert caught.value.code == ExitCode.USAGE


def _args(kubeconfig: Path, **extra: object) -> argparse.Namespace:
    fields: dict[str, object] = {"kubeconfig": str(kubeconfig), "context": None, "namespace": None}
    return argparse.Namespace(**(fields | extra))


def test_namespace_comes_from_the_flag_then_the_context_then_default(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text(KUBECONFIG)
    assert connect(_args(path)).namespace == "team-a"
    assert connect(_args(path, namespace="mine")).namespace == "mine"
    assert connect(_args(path, context="bare")).namespace == "default"
    assert connect(_args(path)).server == "https://127.0.0.1:1"


def test_api_failures_are_one_line_with_their_cause() -> None:
    forbidden = client.ApiException(status=403, reason="Forbidden")
    forbidden.body = '{"message": "resourceslices is forbidden: User \\"bob\\" cannot list"}'
    err = api_error(forbidden, "list ResourceSlices")
    assert err.forbidden and err.code == ExitCode.FAILED
    assert err.message == (
        'cannot list ResourceSlices: forbidden (resourceslices is forbidden: User "bob" cannot '
        "list)"
    )
    refused = MaxRetryError(
        None,  # type: ignore[arg-type]
        "/api",
        NewConnectionError(None, "Failed to establish a new connection: [Errno 111] refused"),  # type: ignore[arg-type]
    )
    text = api_error(refused, "list", "https://10.0.0.1:6443").message
    assert text.startswith("cannot reach the API server at https://10.0.0.1:6443: ")
    assert "\n" not in text


def test_an_unreachable_server_is_one_line_on_stderr_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config"
    path.write_text(KUBECONFIG)
    assert cli.main(["capacity", "--kubeconfig", str(path)]) == ExitCode.FAILED
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("flexgpu: cannot reach the API server at https://127.0.0.1:1: ")


def test_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.startswith("flexgpu ")


def _row(type_: str, product: str, profile: str = "", free: int = 1, total: int = 2) -> CapacityRow:
    return CapacityRow(type_, product, profile, total, free)


def test_mig_rows_sit_under_their_gpu_and_say_they_overlap() -> None:
    rows = ordered(
        [
            _row("mig", "NVIDIA H100 80GB HBM3", "1g.10gb", 14, 14),
            _row("gpu", "NVIDIA L4"),
            _row("gpu", "NVIDIA H100 80GB HBM3", free=2, total=2),
            _row("mig", "NVIDIA H100 80GB HBM3", "7g.80gb", 2, 2),
        ]
    )
    shared = _row("shared", "NVIDIA L4")
    shared.shareable = {"memory": (Fraction(8 * 2**30), Fraction(24 * 2**30))}
    lines = capacity_table([("", r) for r in [*rows, shared]]).splitlines()
    assert [line.split()[0] for line in lines] == ["TYPE", "gpu", "└", "└", "gpu", "shared"]
    assert lines[2].startswith("  └ mig") and "1g.10gb" in lines[2]
    assert lines[3].startswith("  └ mig") and "7g.80gb" in lines[3]
    assert "overlaps its GPU" in MIG_NOTE and "do not add up" in MIG_NOTE


def test_every_subcommand_registers_itself() -> None:
    names = set(cli.build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {"inventory", "explain", "capacity", "usage"} <= names


def test_without_any_kubeconfig_the_error_says_what_to_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(CliError) as caught:
        connect(argparse.Namespace(kubeconfig=None, context=None, namespace=None))
    assert caught.value.message == (
        f"no kubeconfig at {tmp_path / 'absent'} and not in a pod; pass --kubeconfig"
    )
