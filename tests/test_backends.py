"""Attention-backend resolution, the model.attention_backend key, and the device peak table."""

from __future__ import annotations

import pytest

from megatron_boost.runtime.backends import resolve_attention_backend, te_available
from megatron_boost.runtime.devices import PEAK_DENSE_BF16_TFLOPS, peak_dense_bf16_tflops


@pytest.mark.parametrize("requested,device,te,choice,reason", [
    ("auto", "cuda", True, "te", "auto: CUDA device and transformer_engine imports"),
    ("auto", "cuda", False, "sdpa", "auto: CUDA device but transformer_engine does not import"),
    ("auto", "cpu", True, "sdpa", "auto: device cpu (Transformer Engine needs CUDA)"),
    ("auto", "cpu", False, "sdpa", "auto: device cpu (Transformer Engine needs CUDA)"),
    ("sdpa", "cuda", True, "sdpa", "requested"),
    ("local", "cpu", False, "local", "requested"),
    ("te", "cuda", True, "te", "requested"),
])
def test_resolution(requested, device, te, choice, reason):
    assert resolve_attention_backend(requested, device, te) == (choice, reason)


@pytest.mark.parametrize("requested,device,te,needle", [
    ("te", "cpu", True, "model.attention_backend=te needs a CUDA device (this run is on cpu)"),
    ("te", "cuda", False, "transformer_engine does not import"),
    ("flash", "cuda", True, "model.attention_backend ('flash') must be one of auto, sdpa, "
                            "local, te"),
])
def test_resolution_errors(requested, device, te, needle):
    with pytest.raises(ValueError) as err:
        resolve_attention_backend(requested, device, te)
    assert needle in str(err.value)


def test_config_key_is_validated():
    from megatron_boost.config.run import load_run_config

    assert load_run_config(None, ["model.attention_backend=sdpa"]).model.attention_backend \
        == "sdpa"
    with pytest.raises(ValueError, match="model.attention_backend \\('fast'\\) must be one of"):
        load_run_config(None, ["model.attention_backend=fast"])


def test_core_attention_classes():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_boost.model.attention import SDPAttention, core_attention_class

    assert core_attention_class("sdpa") is SDPAttention
    assert core_attention_class("local") is DotProductAttention
    if te_available():
        assert core_attention_class("te").__name__ == "TEDotProductAttention"
    else:  # megatron's TE extension imports with mock classes: refused up front
        with pytest.raises(ValueError, match="transformer_engine does not import"):
            core_attention_class("te")
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        core_attention_class("auto")


# The exact strings torch.cuda.get_device_name() returns, and their dense bf16 peaks.
DEVICE_NAMES = [
    ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-SXM-80GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A40", 149.7), ("NVIDIA A10", 125.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA GH200 480GB", 989.0), ("NVIDIA GH200 144G HBM3e", 989.0),
]


@pytest.mark.parametrize("name,peak", DEVICE_NAMES)
def test_peak_of_each_device_name(name, peak):
    assert peak_dense_bf16_tflops(name) == peak
    assert peak_dense_bf16_tflops(f"  {name.lower()} ") == peak  # case and spaces normalised


def test_every_table_entry_is_tested():
    assert {n for n, _ in DEVICE_NAMES} == set(PEAK_DENSE_BF16_TFLOPS)


@pytest.mark.parametrize("name", ["NVIDIA H100", "NVIDIA A100", "NVIDIA A10G", "H200",
                                  "NVIDIA H100 80GB HBM3 (MIG 1g.10gb)", "cpu"])
def test_no_substring_matches(name):
    # The former substring table gave "NVIDIA A10G" nothing but "NVIDIA H100 PCIe" the SXM 989.
    assert peak_dense_bf16_tflops(name) is None
