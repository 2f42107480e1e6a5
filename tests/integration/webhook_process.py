"""The admission webhook as a process of its own (``python -m flexgpu.controller.admission_server``)
for the integration tests: started against a cluster, ready once it listens and the webhook
configuration points at it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from flexgpu.controller.webhook_config import CONFIGURATION_NAME

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class WebhookProcess:
    """A running ``controller.admission_server`` started by ``run_webhook_for_tests``."""

    process: subprocess.Popen[bytes]
    port: int
    url: str
    log_path: Path

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _configuration_url(admission: Any, name: str) -> str | None:
    from kubernetes.client.exceptions import ApiException

    try:
        current = admission.read_validating_webhook_configuration(name)
    except ApiException:
        return None
    hooks = current.webhooks or []
    return hooks[0].client_config.url if hooks and hooks[0].client_config else None


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def run_webhook_for_tests(
    kubeconfig: Path,
    log_path: Path,
    *,
    port: int | None = None,
    secret_namespace: str = "flexgpu-system",
    secret_name: str = "flexgpu-webhook-tls",
    configuration_name: str = CONFIGURATION_NAME,
    extra_args: Sequence[str] = (),
    timeout_s: float = 60.0,
) -> Iterator[WebhookProcess]:
    """Start the webhook on ``127.0.0.1:port`` against the cluster of ``kubeconfig`` and wait
    until it listens and the configuration points at it. The Secret's namespace must exist.
    Stops the process on exit (the configuration stays; delete it if the test should not
    leave it behind). The apiserver may need a moment more to load a new configuration."""
    from kubernetes import client, config

    port = port or free_port()
    argv = [
        sys.executable,
        "-m",
        "flexgpu.controller.admission_server",
        f"--kubeconfig={kubeconfig}",
        f"--webhook-listen=127.0.0.1:{port}",
        f"--webhook-secret-namespace={secret_namespace}",
        f"--webhook-secret-name={secret_name}",
        f"--webhook-configuration-name={configuration_name}",
        *extra_args,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    log: TextIO = log_path.open("a")
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    handle = WebhookProcess(proc, port, f"https://127.0.0.1:{port}", log_path)
    admission = client.AdmissionregistrationV1Api(
        config.new_client_from_config(config_file=str(kubeconfig))
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"webhook exited with {proc.returncode}:\n{handle.log_tail()}")
            url = _configuration_url(admission, configuration_name)
            if url is not None and url.startswith(handle.url + "/") and _listening(port):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"webhook not ready after {timeout_s:.0f}s:\n{handle.log_tail()}"
                )
            time.sleep(0.2)
        yield handle
    finally:
        handle.stop()
        log.close()
