"""The plugin's credentials from a kubeconfig: the server, its CA and one user's credentials
(token, token file or client certificate). Anything else is refused by name."""

from __future__ import annotations

import base64
import ssl
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flexgpu.kubelet_plugin.api.credentials import Credentials, KubeConfigError, TokenFile


def from_kubeconfig_doc(doc: Mapping[str, Any], base: Path) -> Credentials:
    """The credentials of the kubeconfig's current context (KubeApi.from_kubeconfig)."""
    context_name = doc.get("current-context")
    if not context_name:
        raise KubeConfigError("kubeconfig: current-context is not set")
    context = _named(doc, "contexts", str(context_name))
    cluster = _named(doc, "clusters", str(context.get("cluster", "")))
    user = _named(doc, "users", str(context.get("user", ""))) if context.get("user") else {}
    for unsupported in ("exec", "auth-provider", "username", "password"):
        if unsupported in user:
            raise KubeConfigError(
                f"kubeconfig user {context.get('user')!r}: {unsupported!r} is not supported; "
                "allowed: token, tokenFile, client-certificate(-data) with client-key(-data)"
            )
    if "tls-server-name" in cluster or "proxy-url" in cluster:
        raise KubeConfigError(
            f"kubeconfig cluster {context.get('cluster')!r}: tls-server-name and proxy-url are "
            "not supported; allowed: server, certificate-authority(-data), "
            "insecure-skip-tls-verify"
        )
    server = str(cluster.get("server", ""))
    context_ssl = None
    if server.startswith("https"):
        context_ssl = _tls(cluster, user, base)
    token: Callable[[], str] | None = None
    if user.get("token"):
        value = str(user["token"])
        token = lambda: value  # noqa: E731
    elif user.get("tokenFile"):
        token = TokenFile(_resolve(base, str(user["tokenFile"])))
    return Credentials(server, ssl_context=context_ssl, token=token)


def _resolve(base: Path, name: str) -> Path:
    path = Path(name)
    return path if path.is_absolute() else base / path


def _tls(cluster: Mapping[str, Any], user: Mapping[str, Any], base: Path) -> ssl.SSLContext:
    if cluster.get("insecure-skip-tls-verify"):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif cluster.get("certificate-authority-data"):
        pem = base64.b64decode(str(cluster["certificate-authority-data"])).decode()
        context = ssl.create_default_context(cadata=pem)
    elif cluster.get("certificate-authority"):
        ca = _resolve(base, str(cluster["certificate-authority"]))
        context = ssl.create_default_context(cafile=str(ca))
    else:
        context = ssl.create_default_context()
    cert, key = user.get("client-certificate-data"), user.get("client-key-data")
    if cert and key:
        # The ssl module loads certificates only from files: write them privately, then drop.
        with tempfile.TemporaryDirectory(prefix="flexgpu-tls-") as tmp:
            cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            for path, data in ((cert_path, cert), (key_path, key)):
                path.write_bytes(base64.b64decode(str(data)))
                path.chmod(0o600)
            context.load_cert_chain(str(cert_path), str(key_path))
    elif user.get("client-certificate") and user.get("client-key"):
        context.load_cert_chain(
            str(_resolve(base, str(user["client-certificate"]))),
            str(_resolve(base, str(user["client-key"]))),
        )
    return context


def _named(doc: Mapping[str, Any], kind: str, name: str) -> dict[str, Any]:
    for entry in doc.get(kind) or []:
        if entry.get("name") == name:
            return dict(entry.get(kind[:-1]) or {})
    raise KubeConfigError(f"kubeconfig: {kind[:-1]} {name!r} is not defined under {kind}")
