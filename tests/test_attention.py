"""SDPAttention against megatron-core's DotProductAttention (the ``local`` backend).

One gloo worker (megatron's parallel state and RNG tracker need a process group) builds both
modules from the same config and feeds them the same query, key and value ([s, b, heads, e]);
it returns, per case, the worst relative error of the context and of the query, key and value
gradients (relative to the largest reference magnitude).

Tolerance (fp32): 1e-5. Both compute softmax(q·kᵀ·scale)·v in fp32, summing the e-wide dot
products and the s-long weighted sums in different orders (megatron: baddbmm, softmax, bmm;
SDPA on CPU: a blocked kernel with an online softmax), which costs ~sqrt(s)·2^-24 ≈ 1e-7
relative here; a wrong mask, scale or query-group mapping is O(0.1), as the negative control
(causal reference, no mask) shows.
"""

from __future__ import annotations

import pytest
import torch

from tests.rank_pool import distributed

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

S, B, HEADS, E = 16, 2, 4, 8
TOL = 1e-5


def _config(groups, dropout=0.0):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HEADS * E, num_attention_heads=HEADS,
        num_query_groups=groups, kv_channels=E, use_cpu_initialization=True,
        attention_dropout=dropout, hidden_dropout=0.0, masked_softmax_fusion=False)


def _inputs(groups, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, HEADS, E, generator=gen)  # [s, b, n, e]
    k, v = (torch.randn(S, B, groups, E, generator=gen) for _ in range(2))  # [s, b, g, e]
    grad = torch.randn(S, B, HEADS * E, generator=gen)  # [s, b, n·e]
    return q, k, v, grad


def _run(module, q, k, v, grad, mask=None):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def _rel(got, ref):
    return max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, ref))


def _padding_mask(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, 1, S, S, generator=gen) < 0.3  # True = masked out (megatron)
    mask[..., 0] = False  # every query keeps one key: no fully masked row
    return mask


def _compare_worker(rank, world):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_boost.model.attention import SDPAttention

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)
    out = {}
    for name, groups in (("mha", HEADS), ("gqa", 2)):
        cfg = _config(groups)
        data = _inputs(groups, seed=groups)
        ref = _run(DotProductAttention(cfg, 1, AttnMaskType.causal, "self"), *data)
        out[name] = _rel(_run(SDPAttention(cfg, 1, AttnMaskType.causal, "self"), *data), ref)
        # negative control: attention without the causal mask must be caught
        out[f"{name}_no_mask"] = _rel(
            _run(SDPAttention(cfg, 1, AttnMaskType.no_mask, "self"), *data), ref)
        mask = _padding_mask(groups)
        ref = _run(DotProductAttention(cfg, 1, AttnMaskType.padding, "self"), *data, mask)
        out[f"{name}_padding"] = _rel(
            _run(SDPAttention(cfg, 1, AttnMaskType.padding, "self"), *data, mask), ref)
    out.update(_dropout_checks(SDPAttention, AttnMaskType.causal))
    out["rejections"] = _rejections(SDPAttention(_config(HEADS), 1, AttnMaskType.causal, "self"))
    return out


def _dropout_checks(cls, mask_type):
    """Dropout acts in training mode only, and draws from megatron's TP RNG tracker (so the
    same tracker state reproduces it)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    attn = cls(_config(HEADS, dropout=0.5), 1, mask_type, "self")
    q, k, v, _ = _inputs(HEADS, seed=7)
    model_parallel_cuda_manual_seed(5)
    first = attn(q, k, v, None)
    model_parallel_cuda_manual_seed(5)
    again = attn(q, k, v, None)
    attn.eval()
    plain = attn(q, k, v, None)
    return {"dropout_changes_output": bool((first - plain).abs().max() > 1e-3),
            "dropout_reproducible": bool(torch.equal(first, again))}


@pytest.fixture(scope="module")
def results():
    return distributed(_compare_worker, 1)[0]


@pytest.mark.parametrize("case", ["mha", "gqa", "mha_padding", "gqa_padding"])
def test_sdpa_matches_megatron_local_attention(results, case):
    assert results[case] < TOL, (case, results[case])


@pytest.mark.parametrize("case", ["mha_no_mask", "gqa_no_mask"])
def test_negative_control_missing_causal_mask_is_caught(results, case):
    assert results[case] > 100 * TOL, (case, results[case])


def test_dropout_is_honoured(results):
    assert results["dropout_changes_output"]
    assert results["dropout_reproducible"]


def test_mask_rules():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_boost.model.attention import _sdpa_mask

    with pytest.raises(ValueError, match="needs an attention_mask"):
        _sdpa_mask(AttnMaskType.padding, None, S, S)
    # causal: megatron's (plain causal) mask is ignored, SDPA's is_causal applies it
    assert _sdpa_mask(AttnMaskType.causal, torch.ones(1, 1, S, S, dtype=torch.bool), S, S) \
        == (True, None)


def _rejections(attn):
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v, _ = _inputs(HEADS, seed=1)
    errors = []
    for kwargs in ({"packed_seq_params": PackedSeqParams()},
                   {"attention_bias": torch.zeros(1)}):
        try:
            attn(q, k, v, None, **kwargs)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_packed_sequence_params_and_bias_rejected_clearly(results):
    errors = results["rejections"]
    assert len(errors) == 2
    assert "packed sequences" in errors[0] and "attention_backend=te" in errors[0]
    assert "attention_bias" in errors[1]
