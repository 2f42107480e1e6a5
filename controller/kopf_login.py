"""kopf's credentials taken from the kubernetes client's, for the controller and the webhook.

Both then talk to the same cluster as the same user, whichever way (--kubeconfig or in-cluster)
the client's configuration was loaded. Kept out of controller.kube so that the ``flexgpu`` CLI,
which uses kube, does not import kopf.
"""

from __future__ import annotations

import kopf
from kubernetes import client


def connection_info(configuration: client.Configuration) -> kopf.ConnectionInfo:
    """The token's scheme is what the header says, else Bearer (a bare token)."""
    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )
