"""What every cluster subcommand of ``flexgpu`` shares, in kubectl's habits.

Options: ``--kubeconfig``, ``--context``, ``-n/--namespace`` (default: the context's
namespace, else ``default``), ``-A/--all-namespaces``, ``-o/--output``. Errors are one line
on stderr, ``flexgpu: <what>``, and the exit status says what happened (``ExitCode``; listed in
docs/cli.md), so scripts and ``kubectl flexgpu`` users can act on it without parsing text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, Final

import yaml
from kubernetes import client, config
from urllib3.exceptions import HTTPError

# Reading the cluster once must not hang a terminal: seconds per API call.
REQUEST_TIMEOUT_S: Final = 30
_SERVICE_ACCOUNT_NAMESPACE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ExitCode(IntEnum):
    OK = 0
    # The command could not do its job: cluster unreachable, forbidden, bad kubeconfig.
    FAILED = 1
    # Bad command line (argparse's own code).
    USAGE = 2
    # explain: a claim of the target cannot be satisfied now (no fit, template refused or
    # missing, prepare failed on the node, pod bound without the scheduler).
    UNSATISFIED = 3
    # explain: no such pod or ResourceClaim.
    NOT_FOUND = 4
    # doctor: a preflight check failed.
    CHECK_FAILED = 5


class CliError(Exception):
    """Ends the command with ``message`` on stderr and ``code`` as the exit status."""

    def __init__(
        self, message: str, code: ExitCode = ExitCode.FAILED, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        # The API server's HTTP status when an API call failed (403: forbidden).
        self.status = status

    @property
    def forbidden(self) -> bool:
        return self.status == 403


@dataclass(frozen=True)
class Connection:
    api: client.ApiClient
    # The namespace the command is about: -n, else the context's, else "default".
    namespace: str
    # -A: every namespace.
    all_namespaces: bool
    server: str


def add_cluster_options(
    parser: argparse.ArgumentParser,
    *,
    outputs: tuple[str, ...],
    namespace: bool = True,
    all_namespaces: bool = True,
) -> None:
    """kubectl's connection and output options on a subcommand's parser."""
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)"
    )
    group.add_argument("--context", help="kubeconfig context to use (default: the current one)")
    if namespace:
        group.add_argument(
            "-n", "--namespace", help="namespace (default: the context's namespace, or default)"
        )
    if all_namespaces:
        group.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    parser.add_argument(
        "-o",
        "--output",
        choices=outputs,
        help=f"output format: {', '.join(outputs)} (default: a table or text)",
    )


def _context_namespace(kubeconfig: str | None, context: str | None) -> str | None:
    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    except (config.ConfigException, OSError, TypeError, ValueError):
        return None
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
    namespace = ((chosen or {}).get("context") or {}).get("namespace")
    return str(namespace) if namespace else None


def namespace_of(args: argparse.Namespace) -> str | None:
    """The namespace a command that reads no namespaced API is about: None for -A, else -n,
    else the context's namespace, else ``default``; without connecting to anything."""
    if getattr(args, "all_namespaces", False):
        return None
    chosen: str | None = getattr(args, "namespace", None)
    if chosen:
        return chosen
    kubeconfig: str | None = getattr(args, "kubeconfig", None)
    if _kubeconfig_exists(kubeconfig):
        chosen = _context_namespace(kubeconfig, getattr(args, "context", None))
    elif _SERVICE_ACCOUNT_NAMESPACE.exists():
        chosen = _SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    return chosen or "default"


def _kubeconfig_exists(kubeconfig: str | None) -> bool:
    if kubeconfig:
        return True
    paths = os.environ.get("KUBECONFIG", "") or "~/.kube/config"
    return any(Path(p).expanduser().exists() for p in paths.split(os.pathsep) if p)


def connect(args: argparse.Namespace) -> Connection:
    """A client for the chosen kubeconfig and context (or the pod's service account when no
    kubeconfig exists), and the namespace the command is about."""
    kubeconfig: str | None = getattr(args, "kubeconfig", None)
    context: str | None = getattr(args, "context", None)
    configuration = client.Configuration()
    namespace: str | None = getattr(args, "namespace", None)
    try:
        if _kubeconfig_exists(kubeconfig):
            config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=configuration
            )
            namespace = namespace or _context_namespace(kubeconfig, context)
        elif not os.environ.get("KUBERNETES_SERVICE_HOST"):
            where = os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise CliError(f"no kubeconfig at {where} and not in a pod; pass --kubeconfig")
        else:
            config.load_incluster_config(client_configuration=configuration)
            if namespace is None and _SERVICE_ACCOUNT_NAMESPACE.exists():
                namespace = _SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except config.ConfigException as err:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise CliError(f"cannot use the kubeconfig ({where}): {_one_line(str(err))}") from None
    except OSError as err:
        raise CliError(f"cannot read the kubeconfig: {err}") from None
    # One try: an unreachable server should answer in seconds, not after urllib3's retries.
    configuration.retries = 1
    return Connection(
        api=client.ApiClient(configuration),
        namespace=namespace or "default",
        all_namespaces=bool(getattr(args, "all_namespaces", False)),
        server=str(configuration.host),
    )


def _one_line(text: str) -> str:
    return " ".join(text.split())


def api_error(err: Exception, what: str, server: str = "") -> CliError:
    """One line for an API call that failed: forbidden, not found, or unreachable."""
    if isinstance(err, client.ApiException):
        reason = ""
        try:
            body = json.loads(err.body or "{}")
            reason = str(body.get("message") or "")
        except (TypeError, ValueError):
            reason = ""
        reason = reason or str(err.reason or "")
        if err.status == 403:
            return CliError(f"cannot {what}: forbidden ({_one_line(reason)})", status=403)
        return CliError(f"cannot {what}: {err.status} {_one_line(reason)}", status=err.status)
    if isinstance(err, HTTPError):
        # MaxRetryError and friends: the cause is the useful part (refused, timed out, DNS).
        cause = _one_line(str(getattr(err, "reason", None) or err))
        # urllib3 prefixes the connection's repr: "HTTPSConnection(host=..., port=...): ".
        cause = re.sub(r"^\w*Connection(Pool)?\([^)]*\): ", "", cause)
        where = f" at {server}" if server else ""
        return CliError(f"cannot reach the API server{where}: {cause}")
    return CliError(f"cannot {what}: {_one_line(str(err))}")


def call(connection: Connection, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
    """The server's JSON for one generated-client call; failures become one-line errors."""
    try:
        response = function(
            *args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S, **kwargs
        )
        return json.loads(response.data)
    except (client.ApiException, HTTPError, OSError, ValueError) as err:
        raise api_error(err, what, connection.server) from None


def emit(document: Any, output: str) -> None:
    """``-o json`` or ``-o yaml``."""
    if output == "yaml":
        sys.stdout.write(yaml.safe_dump(document, sort_keys=False))
    else:
        print(json.dumps(document, indent=2))
