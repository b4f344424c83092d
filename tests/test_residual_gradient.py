"""The residual's gradient added in the A side's dgrad GEMM, and the residual in the B GEMM of
the block's output (``parallel/residual.py``, docs/design.md §3), change no value and remove
autograd's add of the residual gradient and the bda's add of the residual.

One spawn of two gloo ranks (TP=2, CPU mode, fp32). Each rank builds one boost decoder layer the
way the model builds its decoder and runs it twice in a row, y = L(L(x)) (so the first call's
output gradient is the second call's input gradient, as between two layers of a model: the
in-place path; the second call's comes from outside: the copied path), forward and backward
with the same output gradient, once as built and once with megatron's plain slots put back
(``IdentityOp`` norms, ``get_bias_dropout_add``): today's path. For c = 1, c = 2
(``bottleneck_overlap_chunks``, ``parallel/pipeline.py``), low-rank recompute and hidden
dropout on, it compares the output, dx and every weight-gradient shard, and counts the adds
and copies of an [s, b, d/t] tensor that the forward and the backward run (a
``TorchDispatchMode``).

Tolerance (fp32): 1e-5 of the plain path's largest magnitude, the layer tests' bound
(docs/design.md §11). The fusion changes the order of one sum per A side, (dP·W + 2·x·dΣx²) +
d_res to (d_res + dP·W) + 2·x·dΣx²: a rounding of ~2^-24 relative at that dx, carried into the
attention half's gradients through a few GEMMs and the norms (~1e-6); the forward's
residual + z·Bᵀ in one GEMM rounds once where the bda rounded twice (~2^-24 relative); a
dropped or doubled residual, or its gradient, is of order 1.
"""

from __future__ import annotations

import pytest

from tests.rank_pool import distributed

TOL = 1e-5
MODEL = dict(num_layers=1, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, attn_rank=16, mlp_rank=24, seq_length=8,
             bottleneck_activation="silu", mlp_gate_activation=True)
S, B, SEED = 8, 2, 1234
#: {"section.key": value} of each variant.
VARIANTS = {"c=1": {}, "c=2": {"parallel.bottleneck_overlap_chunks": 2},
            "lowrank": {"training.recompute": "lowrank"},
            # megatron's hidden dropout on (set on the layer's config: the run config refuses it
            # at tp > 1, where the ranks' masks differ; each rank compares against itself here)
            "dropout": {"transformer.hidden_dropout": 0.25}}


def _transformer_config(settings: dict):
    from megatron_boost.config.resolved import resolve_run, to_transformer_config
    from megatron_boost.config.run import RunConfig

    cfg = RunConfig()
    for key, value in MODEL.items():
        setattr(cfg.model, key, value)
    cfg.parallel.mode, cfg.parallel.tp = "boost", 2
    on_layer = {}
    for dotted, value in settings.items():
        section, key = dotted.split(".")
        if section == "transformer":
            on_layer[key] = value
        else:
            setattr(getattr(cfg, section), key, value)
    config = to_transformer_config(resolve_run(cfg.validate(), vocab_size=cfg.model.vocab_size))
    for key, value in on_layer.items():
        setattr(config, key, value)
    return config


def _stream_ops(shape):
    """A dispatch mode counting the adds (out of place or in place) and the copies of a
    ``shape`` tensor."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    kinds = {torch.ops.aten.add.Tensor: "adds", torch.ops.aten.add_.Tensor: "adds",
             torch.ops.aten.clone.default: "copies", torch.ops.aten.copy_.default: "copies"}

    class Count(TorchDispatchMode):
        counts = {"adds": 0, "copies": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in kinds and tuple(out.shape) == tuple(shape):
                Count.counts[kinds[func]] += 1
            return out

    return Count()


def _run(layer, x, grad):
    """(output, dx, {name: weight gradient}, {"adds", "copies": of a stream-shaped tensor in
    backward}) of y = L(L(x)), with the RNG reset (the same dropout masks in both runs)."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    forward = _stream_ops(x.shape)
    with forward:
        out = layer(layer(x)[0])[0]
    forward_counts = dict(forward.counts)
    counter = _stream_ops(x.shape)
    with counter:
        out.backward(grad)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads, dict(counter.counts), forward_counts


def _plain_slots(layer) -> None:
    """Today's path: megatron's identity norms and bias-dropout-add in boost's slots."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.identity_op import IdentityOp

    layer.input_layernorm, layer.pre_mlp_layernorm = IdentityOp(), IdentityOp()
    layer.self_attn_bda = layer.mlp_bda = get_bias_dropout_add


def _rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _variant(name: str, rank: int, world: int) -> dict:
    import torch

    from megatron_boost.measure.layer_comm import build_decoder_layer

    layer = build_decoder_layer(_transformer_config(VARIANTS[name]))
    torch.manual_seed(SEED + rank)
    with torch.no_grad():
        for p in layer.parameters():  # γ away from 1: its gradient is tested too
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2)
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(S, B, MODEL["hidden_size"], generator=g).chunk(world, dim=-1)[rank]
    grad = torch.randn(S, B, MODEL["hidden_size"] // world, generator=g)
    handed_in = grad.clone()
    fused = _run(layer, x.contiguous(), grad)
    untouched = torch.equal(grad, handed_in)  # a gradient from outside is copied, not written
    _plain_slots(layer)
    plain = _run(layer, x.contiguous(), grad)
    errs = {"out": _rel_err(fused[0], plain[0]), "dx": _rel_err(fused[1], plain[1])}
    errs.update({f"d{n}": _rel_err(fused[2][n], plain[2][n]) for n in plain[2]})
    return {"errors": errs, "ops": (fused[3], plain[3]), "forward_ops": (fused[4], plain[4]),
            "grad_untouched": untouched}


def _worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    return {name: _variant(name, rank, world) for name in VARIANTS}


@pytest.fixture(scope="module")
def results():
    return distributed(_worker, 2)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_residual_gradient_equals_autograds_add(results, variant):
    """Output, input gradient and every weight-gradient shard as on today's path."""
    for rank, res in enumerate(results):
        errs = res[variant]["errors"]
        assert len(errs) == 2 + 2 * 4 + 2, errs  # out, dx, A and B ×4, 2 γ
        bad = {n: e for n, e in errs.items() if e > TOL}
        assert not bad, f"rank {rank}, {variant}: {bad}"


#: Stream-shaped adds that run in backward on the plain path: low-rank recompute re-runs the
#: forward, whose bias-dropout-adds (the residual added back, two per call) run then.
RECOMPUTED_FORWARD_ADDS = {"lowrank": 2 * 2}
#: Forward adds of the residual left to the bda on the fused path, two per call: with dropout
#: on the tap does not offer it (dropout applies to the branch's output alone).
BDA_ADDS = {"dropout": 2 * 2}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_no_residual_gradient_add_runs(results, variant):
    """Today's path adds the residual's gradient twice per call (attention's and the MLP's:
    four adds in two calls); the fused path none: the dgrad GEMMs add it (and a recomputed
    forward adds the residual in its B GEMMs)."""
    forward = RECOMPUTED_FORWARD_ADDS.get(variant, 0)
    for res in results:
        fused, plain = res[variant]["ops"]
        assert plain["adds"] == forward + 4, res[variant]["ops"]
        assert fused["adds"] == (forward and BDA_ADDS.get(variant, 0)), res[variant]["ops"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_block_outputs_b_gemm_adds_the_residual(results, variant):
    """Today's path adds the residual back after the attention and the MLP (two adds per
    call); the fused path in proj's and fc2's B GEMM (beta = 1), block by block with the
    chunks: no add, except with dropout on, where the bda adds it."""
    for res in results:
        fused, plain = res[variant]["forward_ops"]
        assert plain["adds"] == 2 * 2, res[variant]["forward_ops"]
        assert fused["adds"] == BDA_ADDS.get(variant, 0), res[variant]["forward_ops"]


#: Calls whose output gradient comes from outside the layers: L(L(x))'s second (the test's
#: gradient); with low-rank recompute both (the checkpoint hands each its gradient).
FROM_OUTSIDE = {"c=1": 1, "c=2": 1, "lowrank": 2, "dropout": 1}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_only_a_gradient_from_outside_is_copied(results, variant):
    """The MLP's residual gradient is copied once where it comes from outside; the first
    call's, which the second call's input tap returned, and every attention half's are
    accumulated into in place: one copy more than today's path per such call."""
    for res in results:
        fused, plain = res[variant]["ops"]
        assert fused["copies"] - plain["copies"] == FROM_OUTSIDE[variant], res[variant]["ops"]


def test_a_gradient_from_outside_is_not_written(results):
    """The output gradient the caller hands in is read, never accumulated into (only one the
    next tap returned is: ``parallel/residual.py``)."""
    for res in results:
        assert all(res[v]["grad_untouched"] for v in VARIANTS), res
