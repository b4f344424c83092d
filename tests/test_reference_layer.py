"""The plain-torch BOOST reference (``parallel/reference.py``) computes what the optimised
boost layer computes (docs/design.md §14).

One spawn of two gloo ranks (TP=2, CPU mode, fp32). Each rank builds one boost decoder layer
the way the model builds its decoder (``build_decoder_layer``: megatron's TransformerLayer with
the bottleneck slots of ``parallel/layers.py``) and the model's final norm (``GatheredRMSNorm``,
``model/gpt.py``), copies its local weight shards into the reference (the grouped factors split
per projection), feeds both the same hidden shard and the same output gradient, and compares
the gathered, normalised output, the layer's own output shard, the input gradient and every
weight-gradient shard. Negative controls: the reference run again without its forward
all-reduce, and without the backward all-reduce of dz, must both be caught.

Tolerance (fp32): relative 1e-5 of the optimised tensor's largest magnitude, the layer tests'
bound (docs/design.md §11). Both sides compute the same sums in other orders and groupings
(γ ⊙ x here, the folded A ⊙ γ there; one GEMM per projection here, one per group there; fused
regions there): fp32 rounding, ~sqrt(K)·2^-24 ≈ 1e-6 relative through attention and the norms at
these sizes, a tenfold margin below 1e-5; a dropped or misplaced collective is of order 1.
"""

from __future__ import annotations

import pytest

from tests.rank_pool import distributed

pytestmark = [pytest.mark.fast]  # the tiers: docs/testing.md

TOL = 1e-5
MODEL = dict(num_layers=1, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, attn_rank=16, mlp_rank=24, seq_length=8,
             bottleneck_activation="silu", mlp_gate_activation=True)
S, B, SEED = 8, 2, 1234


def _transformer_config():
    from megatron_boost.config.resolved import resolve_run, to_transformer_config
    from megatron_boost.config.run import RunConfig

    cfg = RunConfig()
    for key, value in MODEL.items():
        setattr(cfg.model, key, value)
    cfg.parallel.mode, cfg.parallel.tp = "boost", 2
    return to_transformer_config(resolve_run(cfg.validate(), vocab_size=cfg.model.vocab_size))


def _reference(config, group):
    import torch.nn.functional as F

    from megatron_boost.parallel.reference import ReferenceBoostLayer, ReferenceFinalNorm

    layer = ReferenceBoostLayer(
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups, kv_channels=config.kv_channels,
        ffn_hidden_size=config.ffn_hidden_size, attn_rank=config.attn_rank,
        mlp_rank=config.mlp_rank, tp_group=group, sigma=F.silu,
        silu_gate=config.mlp_gate_activation, eps=config.layernorm_epsilon)
    return layer, ReferenceFinalNorm(config.hidden_size, group, config.layernorm_epsilon)


#: The optimised layer's slot of each reference group.
SLOTS = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
         "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}


def _pairs(layer, norm, ref_layer, ref_norm):
    """(name, optimised parameter, reference parameters in its row order): a grouped factor
    [Σ rows, cols] is the reference's per-projection factors stacked by rows."""
    params = dict(layer.named_parameters())
    out = [("final_norm.weight", norm.weight, [ref_norm.weight])]
    for group, slot in SLOTS.items():
        ref = getattr(ref_layer, group)
        out += [(f"{slot}.A", params[f"{slot}.A"], list(ref.A)),
                (f"{slot}.B", params[f"{slot}.B"], list(ref.B))]
        if ref.gamma is not None:
            out.append((f"{slot}.layer_norm_weight", params[f"{slot}.layer_norm_weight"],
                        [ref.gamma]))
    return out


def _copy_weights(pairs):
    import torch

    with torch.no_grad():
        for _, param, refs in pairs:
            param.normal_(1.0 if param.dim() == 1 else 0.0, 0.2)  # γ away from 1: tested too
            for piece, ref in zip(param.split([r.shape[0] for r in refs]), refs):
                ref.copy_(piece)


def _rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _run(layer, norm, x, grad):
    """(gathered normalised output, the layer's output shard, dx) of one forward/backward."""
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    y = norm(out)
    (y * grad).sum().backward()
    return y, out, x.grad


def _errors(pairs, ours, theirs) -> dict:
    import torch

    errs = {name: _rel_err(a, b) for name, a, b in zip(("y", "out", "dx"), theirs, ours)}
    for name, param, refs in pairs:
        errs[f"d{name}"] = _rel_err(torch.cat([r.grad for r in refs]), param.grad)
    return errs


def _worker(rank, world):
    from unittest import mock

    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_boost.measure.layer_comm import build_decoder_layer
    from megatron_boost.model.gpt import GatheredRMSNorm
    from megatron_boost.parallel import reference

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    config = _transformer_config()
    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)  # the same γ on both ranks: the final norm's is replicated
    layer = build_decoder_layer(config)
    norm = GatheredRMSNorm(config, config.hidden_size, config.layernorm_epsilon, group)
    ref_layer, ref_norm = _reference(config, group)
    pairs = _pairs(layer, norm, ref_layer, ref_norm)
    _copy_weights(pairs)
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(S, B, config.hidden_size, generator=g).chunk(world, dim=-1)[rank].contiguous()
    grad = torch.randn(S, B, config.hidden_size, generator=g)  # of the gathered output
    ours = _run(layer, norm, x, grad)
    result = {"match": _errors(pairs, ours, _run(ref_layer, ref_norm, x, grad))}
    for name in ("AllReduceForward", "AllReduceBackward"):  # the negative controls
        ref_layer.zero_grad(), ref_norm.zero_grad()
        with mock.patch.object(getattr(reference, name), "apply", lambda t, _group: t):
            result[f"without {name}"] = _errors(pairs, ours, _run(ref_layer, ref_norm, x, grad))
    return result


@pytest.fixture(scope="module")
def results():
    return distributed(_worker, 2)


def test_reference_equals_the_optimised_layer_forward_and_every_gradient_shard(results):
    for rank, res in enumerate(results):
        errs = res["match"]
        assert len(errs) == 3 + 1 + 2 * 4 + 2, errs  # y, out, dx, final γ, A and B ×4, 2 γ
        bad = {n: e for n, e in errs.items() if e > TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_a_dropped_forward_all_reduce_is_caught(results):
    """Negative control: without the products' all-reduce every output differs."""
    for res in results:
        errs = res["without AllReduceForward"]
        assert errs["y"] > TOL and errs["out"] > TOL, errs


def test_a_dropped_backward_all_reduce_is_caught(results):
    """Negative control: without the all-reduce of dz the forward still agrees, but the input
    gradient and every A factor's gradient do not; the gradients taken before the first dz
    (the final γ, fc2's B) still do."""
    for res in results:
        errs = res["without AllReduceBackward"]
        assert errs["y"] <= TOL and errs["out"] <= TOL and errs["dx"] > TOL, errs
        wrong = {n for n, e in errs.items() if e > TOL}
        assert {f"d{slot}.A" for slot in SLOTS.values()} <= wrong, errs
        assert not {"dfinal_norm.weight", f"d{SLOTS['fc2']}.B"} & wrong, errs
