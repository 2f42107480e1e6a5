"""`flexgpu usage` from the plugins' endpoints: GPU-hours per namespace and per claim by
class, product, profile and share; idle claims only when idle on every node for the window;
table, JSON and YAML; and the idle-claim Events the controller records from the same data."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from flexgpu.controller import cli_usage
from flexgpu.controller.cli import main as cli_main
from flexgpu.controller.cli_options import ExitCode
from flexgpu.controller.cli_usage import (
    UsageReport,
    by_namespace,
    from_plugins,
    render_table,
    report_document,
)
from flexgpu.controller.events import EventTarget
from flexgpu.controller.idle_events import IdleClaimNotifier
from flexgpu.controller.plugin_endpoints import Scrape, endpoint_urls, parse
from tests.conftest import wait_for

LABELS = (
    'node="n1",namespace="{ns}",claim="{c}",device="{d}",class="{k}",product="{p}",'
    'profile="{pr}",share="{s}",pods="{pods}"'
)


def series(
    name: str,
    value: float,
    ns: str,
    c: str,
    d: str,
    k: str,
    pr: str = "",
    s: str = "",
    p: str = "NVIDIA H100 80GB HBM3",
) -> str:
    labels = LABELS.format(ns=ns, c=c, d=d, k=k, p=p, pr=pr, s=s, pods="w-1")
    return f"{name}{{{labels}}} {value}\n"


EXPOSITION = (
    "# TYPE flexgpu_claim_allocated_gpu_seconds counter\n"
    + series(
        "flexgpu_claim_allocated_gpu_seconds_total", 7200, "ml", "train", "gpu-0", "gpu.flexgpu.dev"
    )
    + series(
        "flexgpu_claim_allocated_gpu_seconds_total", 3600, "ml", "train", "gpu-1", "gpu.flexgpu.dev"
    )
    + series(
        "flexgpu_claim_allocated_gpu_seconds_total",
        1800,
        "ml",
        "nb",
        "gpu-2-mig-1g10gb-0",
        "mig.flexgpu.dev",
        pr="1g.10gb",
    )
    + series(
        "flexgpu_claim_allocated_gpu_seconds_total",
        900,
        "web",
        "infer",
        "gpu-3",
        "shared-gpu.flexgpu.dev",
        s="share-a",
    )
    + "# TYPE flexgpu_claim_used_gpu_seconds counter\n"
    + series(
        "flexgpu_claim_used_gpu_seconds_total", 5400, "ml", "train", "gpu-0", "gpu.flexgpu.dev"
    )
    + series("flexgpu_claim_used_gpu_seconds_total", 0, "ml", "train", "gpu-1", "gpu.flexgpu.dev")
    + series(
        "flexgpu_claim_used_gpu_seconds_total",
        0,
        "ml",
        "nb",
        "gpu-2-mig-1g10gb-0",
        "mig.flexgpu.dev",
        pr="1g.10gb",
    )
    + series(
        "flexgpu_claim_used_gpu_seconds_total",
        90,
        "web",
        "infer",
        "gpu-3",
        "shared-gpu.flexgpu.dev",
        s="share-a",
    )
    + "# TYPE flexgpu_claim_idle_seconds gauge\n"
    + 'flexgpu_claim_idle_seconds{node="n1",namespace="ml",claim="nb",pods="w-1"} 9000\n'
    + 'flexgpu_claim_idle_seconds{node="n1",namespace="ml",claim="train",pods="w-1"} 0\n'
    + 'flexgpu_claim_idle_seconds{node="n1",namespace="web",claim="infer",pods="w-1"} 8000\n'
    # The claim spans two nodes and is busy on n2: not idle.
    + 'flexgpu_claim_idle_seconds{node="n2",namespace="web",claim="infer",pods="w-1"} 0\n'
)


def report() -> UsageReport:
    return from_plugins(Scrape(parse(EXPOSITION)), window_s=7200)


def test_gpu_hours_per_claim_and_per_namespace() -> None:
    rows = {(r.claim, r.device_class): r for r in report().rows}
    train = rows[("train", "gpu.flexgpu.dev")]
    assert (train.allocated_gpu_hours, train.used_gpu_hours) == (3.0, 1.5)
    assert train.used_percent == 50
    assert rows[("nb", "mig.flexgpu.dev")].profile == "1g.10gb"
    assert rows[("infer", "shared-gpu.flexgpu.dev")].share == "share-a"
    namespaces = {(r.namespace, r.device_class): r for r in by_namespace(report().rows)}
    assert namespaces[("ml", "gpu.flexgpu.dev")].allocated_gpu_hours == 3.0
    assert namespaces[("ml", "mig.flexgpu.dev")].allocated_gpu_hours == 0.5


def test_idle_claims_are_idle_on_every_node_for_the_window() -> None:
    assert [(i.namespace, i.claim, i.idle_seconds) for i in report().idle] == [("ml", "nb", 9000)]


def test_table_json_and_yaml() -> None:
    table = render_table(report(), wide=False)
    assert "ml         gpu.flexgpu.dev" in table and "Idle claims:" in table
    assert "2h30m" in table  # nb, idle for 9000 s
    wide = render_table(report(), wide=True)
    assert "share-a" in wide and "train" in wide
    document = report_document(report(), wide=True)
    assert json.loads(json.dumps(document)) == yaml.safe_load(yaml.safe_dump(document))
    assert document["idleClaims"][0]["claim"] == "nb"
    assert {c["claim"] for c in document["claims"]} == {"train", "nb", "infer"}


def test_endpoint_names_and_refusals() -> None:
    assert endpoint_urls(["127.0.0.1:9400", "http://127.0.0.1:9401/metrics"]) == [
        "http://127.0.0.1:9400/metrics",
        "http://127.0.0.1:9401/metrics",
    ]
    with pytest.raises(ValueError, match="has no port"):
        endpoint_urls(["plugins.flexgpu-system.svc"])


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[EventTarget, str, str]] = []

    def emit(self, target: EventTarget, reason: str, message: str, *, repeat: bool) -> None:
        self.events.append((target, reason, message))


def test_idle_claim_and_its_pods_get_one_event_per_idle_stretch() -> None:
    claims = {
        ("ml", "nb"): {
            "metadata": {"uid": "uid-nb"},
            "status": {"reservedFor": [{"resource": "pods", "name": "notebook", "uid": "uid-pod"}]},
        }
    }
    text = [EXPOSITION]

    def read(endpoints: Sequence[str]) -> Scrape:
        return Scrape(parse(text[0]))

    sink = Sink()
    notifier = IdleClaimNotifier(
        ["n1:1"],
        sink,
        read_claim=lambda ns, name: claims.get((ns, name)),
        is_leader=lambda: True,
        window_s=7200,
        read=read,
    )
    assert notifier.check_once() == ["ml/nb"]
    assert [(t.kind, t.name, t.uid) for t, _, _ in sink.events] == [
        ("ResourceClaim", "nb", "uid-nb"),
        ("Pod", "notebook", "uid-pod"),
    ]
    assert all(reason == "IdleGpuClaim" for _, reason, _ in sink.events)
    assert "2h30m" in sink.events[0][2]
    assert notifier.check_once() == []  # still the same idle stretch
    text[0] = EXPOSITION.replace("9000", "10")  # busy again
    assert notifier.check_once() == []
    text[0] = EXPOSITION  # idle again: a new stretch is told
    assert notifier.check_once() == ["ml/nb"]
    del claims[("ml", "nb")]  # a claim deleted meanwhile gets nothing
    text[0] = EXPOSITION.replace("9000", "10")
    notifier.check_once()
    text[0] = EXPOSITION
    assert notifier.check_once() == []


def test_an_idle_podgroup_claim_tells_the_podgroup_not_a_pod() -> None:
    """A gang's claim is reserved for its PodGroup and names no pods: the Event goes to the
    PodGroup (not to a pod of the group's name), and a consumer kind nobody knows gets none."""
    group = {"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "train"}
    claims = {
        ("ml", "nb"): {
            "metadata": {"uid": "uid-nb"},
            "status": {
                "reservedFor": [
                    {**group, "uid": "uid-pg"},
                    {"apiGroup": "example.com", "resource": "things", "name": "t", "uid": "u"},
                ]
            },
        }
    }
    sink = Sink()
    notifier = IdleClaimNotifier(
        ["n1:1"],
        sink,
        read_claim=lambda ns, name: claims.get((ns, name)),
        is_leader=lambda: True,
        window_s=7200,
        read=lambda endpoints: Scrape(parse(EXPOSITION)),
    )
    assert notifier.check_once() == ["ml/nb"]
    assert [(t.kind, t.api_version, t.name, t.uid) for t, _, _ in sink.events] == [
        ("ResourceClaim", "resource.k8s.io/v1", "nb", "uid-nb"),
        ("PodGroup", "scheduling.k8s.io/v1beta1", "train", "uid-pg"),
    ]


def test_the_idle_check_thread_survives_a_failing_scrape_and_stops_cleanly() -> None:
    """Started, the notifier checks every interval; a scrape that raises is retried (the thread
    lives on) and the next good one tells the idle claim; stop() leaves no thread behind."""
    calls: list[int] = []

    def read(endpoints: Sequence[str]) -> Scrape:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionRefusedError("plugin away")
        return Scrape(parse(EXPOSITION))

    sink = Sink()
    notifier = IdleClaimNotifier(
        ["n1:1"],
        sink,
        read_claim=lambda ns, name: {"metadata": {"uid": "uid-nb"}, "status": {}},
        is_leader=lambda: True,
        window_s=7200,
        interval_s=0.01,
        read=read,
    )
    notifier.start()
    try:
        wait_for(
            lambda: bool(sink.events) and notifier.last_error is None,
            what="an Event after the failed scrape",
        )
        assert notifier.running and len(calls) >= 2
    finally:
        notifier.stop()
    assert not notifier.running


def _run_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> int:
    """``flexgpu usage --plugin n1:1 ARGS`` reading EXPOSITION, with a kubeconfig whose
    context's namespace is ``ml``."""
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "namespace": "ml"}}],
                "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [],
            }
        )
    )
    monkeypatch.setattr(cli_usage, "scrape", lambda endpoints: Scrape(parse(EXPOSITION)))
    return cli_main(["usage", "--plugin", "n1:1", "--kubeconfig", str(kubeconfig), *args])


def test_cli_namespaces_outputs_and_idle_durations(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The context's namespace by default, -n another, -A all; idle time humane in tables and
    in seconds in JSON."""
    assert _run_cli(monkeypatch, tmp_path) == 0
    table = capsys.readouterr().out
    assert "ml " in table and "web" not in table and "2h30m" in table
    assert _run_cli(monkeypatch, tmp_path, "-n", "web", "-o", "json") == 0
    document = json.loads(capsys.readouterr().out)
    assert {r["namespace"] for r in document["namespaces"]} == {"web"}
    assert _run_cli(monkeypatch, tmp_path, "-A", "-o", "json") == 0
    document = json.loads(capsys.readouterr().out)
    assert {r["namespace"] for r in document["namespaces"]} == {"ml", "web"}
    assert [(i["claim"], i["idleSeconds"]) for i in document["idleClaims"]] == [("nb", 9000)]
    assert _run_cli(monkeypatch, tmp_path, "-A", "-o", "wide") == 0
    assert "share-a" in capsys.readouterr().out


def test_cli_bad_window_is_one_line_and_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run_cli(monkeypatch, tmp_path, "--idle-window", "two hours") == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'two hours' is not a duration" in err
