"""Catalog of GPU models the simulated backend can build nodes from, with the identity and
figures NVML reports for each (product name string, memory in MiB, multiprocessors)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from flexgpu.driver.gpu_model import MigProfile
from flexgpu.driver.mig_catalog import mig_profiles_for


class GpuModelSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str  # what topology files name, e.g. "H100-SXM5-80GB"
    product_name: str  # exactly as nvmlDeviceGetName returns it
    brand: str
    architecture: str
    cuda_compute_capability: str
    memory_mib: int  # total as nvmlDeviceGetMemoryInfo reports it
    multiprocessors: int
    pci_device_id: int  # vendor 0x10DE in the low half, as in nvmlPciInfo_t.pciDeviceId
    mig_profiles: tuple[MigProfile, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)


def _spec(
    key: str,
    *,
    product_name: str,
    architecture: str,
    cc: str,
    memory_mib: int,
    sms: int,
    pci_device_id: int,
    mig_family: str | None = None,
) -> GpuModelSpec:
    return GpuModelSpec(
        key=key,
        product_name=product_name,
        brand="NVIDIA",
        architecture=architecture,
        cuda_compute_capability=cc,
        memory_mib=memory_mib,
        multiprocessors=sms,
        pci_device_id=pci_device_id,
        mig_profiles=mig_profiles_for(mig_family) if mig_family else (),
    )


GPU_CATALOG: dict[str, GpuModelSpec] = {
    spec.key: spec
    for spec in (
        _spec(
            "A100-SXM4-40GB",
            product_name="NVIDIA A100-SXM4-40GB",
            architecture="Ampere",
            cc="8.0",
            memory_mib=40960,
            sms=108,
            pci_device_id=0x20B010DE,
            mig_family="A100-40GB",
        ),
        _spec(
            "A100-SXM4-80GB",
            product_name="NVIDIA A100-SXM4-80GB",
            architecture="Ampere",
            cc="8.0",
            memory_mib=81920,
            sms=108,
            pci_device_id=0x20B210DE,
            mig_family="A100-80GB",
        ),
        _spec(
            "H100-SXM5-80GB",
            product_name="NVIDIA H100 80GB HBM3",
            architecture="Hopper",
            cc="9.0",
            memory_mib=81559,
            sms=132,
            pci_device_id=0x233010DE,
            mig_family="H100-80GB",
        ),
        _spec(
            "H200-SXM5-141GB",
            product_name="NVIDIA H200",
            architecture="Hopper",
            cc="9.0",
            memory_mib=143771,
            sms=132,
            pci_device_id=0x233510DE,
            mig_family="H200-141GB",
        ),
        _spec(
            "B200-SXM6-180GB",
            product_name="NVIDIA B200",
            architecture="Blackwell",
            cc="10.0",
            memory_mib=183359,
            sms=148,
            pci_device_id=0x290110DE,
            mig_family="B200-180GB",
        ),
        _spec(
            "L4",
            product_name="NVIDIA L4",
            architecture="Ada Lovelace",
            cc="8.9",
            memory_mib=23034,
            sms=58,
            pci_device_id=0x27B810DE,
        ),
        _spec(
            "T4",
            product_name="Tesla T4",
            architecture="Turing",
            cc="7.5",
            memory_mib=15360,
            sms=40,
            pci_device_id=0x1EB810DE,
        ),
    )
}


def gpu_model(key: str) -> GpuModelSpec:
    """Look up a catalog entry; the error lists the allowed keys."""
    try:
        return GPU_CATALOG[key]
    except KeyError:
        raise KeyError(f"unknown GPU model {key!r}; allowed: {', '.join(GPU_CATALOG)}") from None


def spec_for_product_name(product_name: str) -> GpuModelSpec | None:
    """Catalog entry whose NVML product name matches, used to fill figures NVML cannot report."""
    for spec in GPU_CATALOG.values():
        if spec.product_name == product_name:
            return spec
    return None
