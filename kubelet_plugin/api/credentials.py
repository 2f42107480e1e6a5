"""Who the plugin is to the API server: the server, how its certificate is checked and the
bearer token. kube_config.py finds them in a kubeconfig, kube_api.py in the pod's service
account; kept apart from both so that neither imports the other."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

# Bound service-account tokens are refreshed by the kubelet well before they expire.
TOKEN_REREAD_S: Final = 60.0


class KubeConfigError(ValueError):
    """Credentials cannot be built from the kubeconfig or the pod's service account."""


class TokenFile:
    """A bearer token read from a file, re-read periodically so rotation is followed."""

    def __init__(self, path: Path, reread_s: float = TOKEN_REREAD_S) -> None:
        self._path = path
        self._reread_s = reread_s
        self._token = ""
        self._read_at = -reread_s
        self._lock = threading.Lock()

    def __call__(self) -> str:
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= self._reread_s:
                self._token = self._path.read_text().strip()
                self._read_at = now
            return self._token


@dataclass(frozen=True)
class Credentials:
    """What a KubeApi is built from (kube_api.KubeApi's first three arguments)."""

    server: str
    ssl_context: ssl.SSLContext | None = None
    token: Callable[[], str] | None = None
