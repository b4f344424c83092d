"""Peak dense bf16 tensor-core TFLOP/s per GPU model, the denominator of MFU.

Keys are the exact strings ``torch.cuda.get_device_name()`` returns; the lookup normalises case
and whitespace and otherwise matches exactly, so "NVIDIA H100 PCIe" can never pick up the SXM
figure through a substring, and an unknown device gives ``None`` (MFU n/a) instead of a guess.
Figures are NVIDIA's datasheet values without structured sparsity (the datasheets print the
sparse figure, twice these).
"""

from __future__ import annotations

from typing import Dict, Optional

__all__ = ["PEAK_DENSE_BF16_TFLOPS", "normalise_device_name", "peak_dense_bf16_tflops",
           "peak_tflops"]

PEAK_DENSE_BF16_TFLOPS: Dict[str, float] = {
    # Ampere
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM-80GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A40": 149.7,
    "NVIDIA A10": 125.0,
    # Ada
    "NVIDIA L40S": 362.0,
    "NVIDIA L4": 121.0,
    # Hopper (H100 SXM5 reports its memory, "80GB HBM3")
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA GH200 480GB": 989.0,
    "NVIDIA GH200 144G HBM3e": 989.0,
}


def normalise_device_name(name: str) -> str:
    """Case-folded, with runs of whitespace collapsed to one space and the ends stripped."""
    return " ".join(name.split()).casefold()


_BY_NORMALISED = {normalise_device_name(k): v for k, v in PEAK_DENSE_BF16_TFLOPS.items()}


def peak_dense_bf16_tflops(device_name: str) -> Optional[float]:
    """The table's figure for this exact device name, or None for a device not in it."""
    return _BY_NORMALISED.get(normalise_device_name(device_name))


def peak_tflops(configured: Optional[float] = None, device_kind: str = "cpu") -> Optional[float]:
    """Peak TFLOP/s of one device: ``configured`` (logging.peak_tflops) if given, else the
    dense bf16 figure of this exact CUDA device (the table above), else None (CPU, a
    device not in the table: MFU is then reported as n/a)."""
    if configured:
        return float(configured)
    if device_kind != "cuda":
        return None
    import torch  # the device name; the table itself is read without torch

    return peak_dense_bf16_tflops(torch.cuda.get_device_name())
