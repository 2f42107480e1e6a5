"""Plugin registration service: tells the kubelet who we are and where the DRA socket is."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import grpc

from flexgpu.kubelet_plugin.kubeletplugin import grpc_handlers as h
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.pluginregistration.v1 import (
    registration_pb2 as reg,
)

log = logging.getLogger(__name__)

PLUGIN_TYPE: Final = "DRAPlugin"

# The strings the kubelet matches in supported_versions ("<package suffix>.<service>"). They
# are the DRAPluginService / DRAResourceHealthService constants of the k8s.io/kubelet API
# packages; the 1.37 kubelet takes the first DRA entry it knows and, separately, the newest
# health service it knows.
DRA_V1: Final = "v1.DRAPlugin"
DRA_V1BETA1: Final = "v1beta1.DRAPlugin"
HEALTH_V1: Final = "v1.DRAResourceHealth"
HEALTH_V1ALPHA1: Final = "v1alpha1.DRAResourceHealth"


def supported_versions(with_health: bool) -> list[str]:
    """Most preferred first, as the kubelet walks this list in order for the DRA service."""
    versions = [DRA_V1, DRA_V1BETA1]
    if with_health:
        versions += [HEALTH_V1, HEALTH_V1ALPHA1]
    return versions


@dataclass(frozen=True)
class RegistrationState:
    """Last verdict of the kubelet. registered is None until the kubelet has answered."""

    registered: bool | None = None
    error: str = ""
    # time.time() of the last NotifyRegistrationStatus.
    updated_at: float | None = None

    @property
    def healthy(self) -> bool:
        return self.registered is not False


class RegistrationService:
    """Implements pluginregistration.Registration."""

    def __init__(self, driver_name: str, endpoint: str, versions: Sequence[str]) -> None:
        self.driver_name = driver_name
        self.endpoint = endpoint
        self.versions = list(versions)
        self._state = RegistrationState()
        self._lock = threading.Lock()

    @property
    def state(self) -> RegistrationState:
        with self._lock:
            return self._state

    def get_info(self, request: reg.InfoRequest) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver_name,
            endpoint=self.endpoint,
            supported_versions=self.versions,
        )

    def notify_registration_status(
        self, request: reg.RegistrationStatus
    ) -> reg.RegistrationStatusResponse:
        state = RegistrationState(request.plugin_registered, request.error, time.time())
        with self._lock:
            self._state = state
        if state.registered:
            log.info("registered with the kubelet as %s at %s", self.driver_name, self.endpoint)
        else:
            log.error("kubelet rejected registration of %s: %s", self.driver_name, state.error)
        # Acknowledge either way: an error reply would only be logged by the kubelet.
        return reg.RegistrationStatusResponse()

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        methods = {
            "GetInfo": h.unary(self.get_info, reg.InfoRequest.FromString),
            "NotifyRegistrationStatus": h.unary(
                self.notify_registration_status, reg.RegistrationStatus.FromString
            ),
        }
        return [h.service(h.service_name(reg.DESCRIPTOR, "Registration"), methods)]
