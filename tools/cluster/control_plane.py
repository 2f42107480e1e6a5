"""Starts and stops a real etcd + kube-apiserver + kube-scheduler + kube-controller-manager
on free loopback ports, with client-certificate auth, RBAC and ServiceAccount tokens."""

from __future__ import annotations

import os
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from tools.cluster import binaries
from tools.cluster.feature_gates import (
    WANTED,
    WORKLOAD_GATES,
    WORKLOAD_REQUIRED,
    feature_gates_arg,
    runtime_config_arg,
)
from tools.cluster.pki import CertPair, LocalPKI
from tools.cluster.process import Component

# Controllers that make sense without kubelets. Node lifecycle is deliberately absent: it
# would taint and evict simulated nodes whose kubelet never posts a heartbeat.
WANTED_CONTROLLERS = (
    "resourceclaim-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "pod-garbage-collector-controller",
    "device-taint-eviction-controller",
    # Folds ClusterRoles labelled aggregate-to-view/edit/admin into the built-in roles.
    "clusterrole-aggregation-controller",
    # Deployments in manifests users bring (NVIDIA's quickstart ones, say) get their pods.
    "deployment-controller",
    "replicaset-controller",
    # Jobs get their pods, and PodDisruptionBudgets their status (which the Eviction API
    # reads): GPU clearing's eviction is tested against both.
    "job-controller",
    "disruption-controller",
    # Lifts the finalizer admission puts on every PodGroup once no pod references it; without
    # it a deleted PodGroup (and the claims it owns) stays for ever. Idle without the gates.
    "podgroup-protection-controller",
)
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


class ControlPlaneError(RuntimeError):
    """A component failed; the message names it and carries its log tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def known_controllers(kcm: Path) -> set[str]:
    out = subprocess.run(
        [str(kcm), "--help"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    match = re.search(r"All controllers:\s*(.*?)\n\s*Disabled-by-default", out, re.S)
    if not match:
        return set(WANTED_CONTROLLERS)
    return {c.strip() for c in match.group(1).replace("\n", " ").split(",") if c.strip()}


class ControlPlane:
    """A local control plane. Use as a context manager or call start()/stop().

    ``workloads``: gang scheduling and claims for PodGroups on as well (Workload and PodGroup
    served), for the tests of them; every component gets the same gates."""

    def __init__(
        self, workdir: Path | None = None, keep_workdir: bool = False, workloads: bool = False
    ) -> None:
        self.workloads = workloads
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="flexgpu-cluster-"))
        self.keep_workdir = keep_workdir or not self._own_workdir
        self.log_dir = self.workdir / "logs"
        self.components: list[Component] = []
        self.kubeconfig = self.workdir / "kubeconfig"
        self.api_port = 0
        self.feature_gates = ""
        self.version = ""
        self._admin_ssl: ssl.SSLContext | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout_s: float = 120.0) -> None:
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> None:
        bin_dir = binaries.control_plane_dir()
        self.version = subprocess.run(
            [str(bin_dir / "kube-apiserver"), "--version"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        pki = LocalPKI(self.workdir / "pki")
        wanted = (*WANTED, *WORKLOAD_GATES) if self.workloads else WANTED
        self.feature_gates = feature_gates_arg(
            [bin_dir / "kube-apiserver", bin_dir / "kube-scheduler"], wanted
        )
        missing = [g for g in WORKLOAD_REQUIRED if self.workloads and g not in self.gate_names]
        if missing:
            raise ControlPlaneError(
                f"workloads=True needs the feature gates {', '.join(missing)}, which "
                f"{self.version or 'this release'} does not list as settable; PodGroup "
                "claims need Kubernetes 1.36 or newer"
            )
        gates = [f"--feature-gates={self.feature_gates}"] if self.feature_gates else []
        minor = re.search(r"v1\.(\d+)\.", self.version)
        apis = runtime_config_arg(self.feature_gates, int(minor.group(1)) if minor else 0)
        runtime_config = [f"--runtime-config={apis}"] if apis else []

        etcd_port, peer_port = free_port(), free_port()
        etcd = self._add(
            "etcd",
            [
                str(bin_dir / "etcd"),
                "--name=flexgpu",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=flexgpu=http://127.0.0.1:{peer_port}",
                # Test data is disposable; skipping fsync keeps a 2-core machine responsive.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._wait_http(etcd, f"http://127.0.0.1:{etcd_port}/health", None, timeout_s)

        self.api_port = free_port()
        serving = pki.issue(
            "apiserver",
            common_name="kube-apiserver",
            dns_names=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"),
            ips=("127.0.0.1", "10.0.0.1"),
            server=True,
        )
        apiserver = self._add(
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # The endpoint reconciler refuses loopback addresses; nothing here needs the
                # `kubernetes` Service's endpoints.
                "--endpoint-reconciler-type=none",
                f"--secure-port={self.api_port}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={pki.ca.cert}",
                # Published for the scheduler's and controller manager's delegated authentication.
                f"--requestheader-client-ca-file={pki.ca.cert}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki.sa_public}",
                f"--service-account-signing-key-file={pki.sa_private}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--allow-privileged=true",
                *gates,
                *runtime_config,
            ],
        )
        admin = pki.issue("admin", common_name="flexgpu-admin", organizations=("system:masters",))
        self._write_kubeconfig(self.kubeconfig, pki, admin)
        self._admin_ssl = self._ssl(pki, admin)
        self._wait_http(
            apiserver, f"https://127.0.0.1:{self.api_port}/readyz", self._admin_ssl, timeout_s
        )

        sched_cfg = self.workdir / "scheduler.kubeconfig"
        self._write_kubeconfig(
            sched_cfg, pki, pki.issue("scheduler", common_name="system:kube-scheduler")
        )
        sched_port = free_port()
        scheduler = self._add(
            "kube-scheduler",
            [
                str(bin_dir / "kube-scheduler"),
                f"--kubeconfig={sched_cfg}",
                f"--authentication-kubeconfig={sched_cfg}",
                f"--authorization-kubeconfig={sched_cfg}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                *gates,
                # To read the scheduler's decisions while a test runs (5: the DRA plugin's).
                *_verbosity("FLEXGPU_SCHEDULER_VERBOSITY"),
            ],
        )

        kcm_cfg = self.workdir / "controller-manager.kubeconfig"
        self._write_kubeconfig(
            kcm_cfg,
            pki,
            pki.issue("controller-manager", common_name="system:kube-controller-manager"),
        )
        known = known_controllers(bin_dir / "kube-controller-manager")
        controllers = [c for c in WANTED_CONTROLLERS if c in known]
        kcm_port = free_port()
        kcm = self._add(
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kcm_cfg}",
                f"--authentication-kubeconfig={kcm_cfg}",
                f"--authorization-kubeconfig={kcm_cfg}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--controllers={','.join(controllers)}",
                f"--service-account-private-key-file={pki.sa_private}",
                f"--root-ca-file={pki.ca.cert}",
                # Each controller acts as its own ServiceAccount, with the bootstrap RBAC roles.
                "--use-service-account-credentials=true",
                *gates,
            ],
        )
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        self._wait_http(scheduler, f"https://127.0.0.1:{sched_port}/healthz", insecure, timeout_s)
        self._wait_http(kcm, f"https://127.0.0.1:{kcm_port}/healthz", insecure, timeout_s)

    def stop(self) -> None:
        for component in reversed(self.components):
            component.stop()
        if self._own_workdir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def restart_apiserver(self, down_s: float = 0.0, timeout_s: float = 120.0) -> float:
        """Stop kube-apiserver, keep it down for ``down_s`` seconds, start it again with the
        same flags and port (etcd keeps the data) and wait until it is ready. Returns the
        ``time.monotonic()`` at which /readyz first answered 200."""
        apiserver = self.component("kube-apiserver")
        apiserver.stop()
        time.sleep(down_s)  # the outage itself, as long as the caller wants it
        apiserver.start()
        self._wait_http(
            apiserver, f"https://127.0.0.1:{self.api_port}/readyz", self._admin_ssl, timeout_s
        )
        return time.monotonic()

    # -- helpers -----------------------------------------------------------------------
    @property
    def gate_names(self) -> set[str]:
        """The gates this control plane turned on (what its --feature-gates names)."""
        return {g.partition("=")[0] for g in self.feature_gates.split(",") if g.endswith("=true")}

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    def component(self, name: str) -> Component:
        return next(c for c in self.components if c.name == name)

    def check_running(self) -> None:
        for component in self.components:
            if not component.running():
                raise self._failure(component, f"exited with code {component.exit_code()}")

    def api_client(self) -> Any:
        """A `kubernetes` ApiClient authenticated as cluster admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def _add(self, name: str, argv: list[str]) -> Component:
        component = Component(name, argv, self.log_dir / f"{name}.log")
        component.start()
        self.components.append(component)
        return component

    def _failure(self, component: Component, what: str) -> ControlPlaneError:
        return ControlPlaneError(
            f"{component.name} {what}; log {component.log_path}, last lines:\n"
            f"{component.log_tail()}"
        )

    def _wait_http(
        self, component: Component, url: str, ctx: ssl.SSLContext | None, timeout_s: float
    ) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if not component.running():
                raise self._failure(component, f"exited with code {component.exit_code()}")
            try:
                with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as err:
                last = str(err)
            time.sleep(0.2)
        raise self._failure(component, f"not ready at {url} after {timeout_s:.0f}s ({last})")

    @staticmethod
    def _ssl(pki: LocalPKI, client: CertPair) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
        ctx.load_cert_chain(str(client.cert), str(client.key))
        return ctx

    def _write_kubeconfig(self, path: Path, pki: LocalPKI, client: CertPair) -> None:
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "flexgpu",
                    "cluster": {
                        "server": f"https://127.0.0.1:{self.api_port}",
                        "certificate-authority": str(pki.ca.cert),
                    },
                }
            ],
            "users": [
                {
                    "name": "user",
                    "user": {"client-certificate": str(client.cert), "client-key": str(client.key)},
                }
            ],
            "contexts": [{"name": "flexgpu", "context": {"cluster": "flexgpu", "user": "user"}}],
            "current-context": "flexgpu",
        }
        path.write_text(yaml.safe_dump(doc))
        path.chmod(0o600)


def _verbosity(variable: str) -> list[str]:
    """``--v=N`` from the environment variable, if set (a number)."""
    value = os.environ.get(variable, "")
    return [f"--v={int(value)}"] if value.strip() else []
