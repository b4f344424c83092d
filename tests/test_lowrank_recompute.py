"""Low-rank activation checkpointing and backward overlap change nothing but memory.

For naive and boost at TP 1, 2 and 4 (one set of four processes; DP fills the rest), the same
model and micro-batch run three ways: plain, with ``training.recompute=lowrank`` and with the
backward all-reduce overlap switched off. Gradients must be bitwise identical (the same kernels
run on the same values in the same order; only when they run differs), the collectives
identical in count and bytes (the recompute replays recorded reductions instead of
communicating), and what a checkpointed decoder layer keeps for backward must be exactly what
the design keeps (docs/design.md §7): its input and the results of its forward all-reduces.
"""

from __future__ import annotations

import pytest
import torch

from tests.rank_pool import distributed

MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
             num_query_groups=4, vocab_size=100, attn_rank=16, mlp_rank=16)
SEQ, MICRO_BATCH, HEAD_DIM = 32, 2, 8
VARIANTS = ("plain", "lowrank", "no_overlap")


def _saved_bytes_hooks(params, layers):
    """saved_tensors_hooks counting unique saved storages, parameters excluded: in all
    ("all") and while one of ``layers`` runs its forward ("layers")."""
    seen, total, depth = set(), {"all": 0, "layers": 0}, [0]
    param_ptrs = {p.data_ptr() for p in params}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and t.data_ptr() not in param_ptrs:
            seen.add(ptr)
            total["all"] += t.untyped_storage().nbytes()
            total["layers"] += t.untyped_storage().nbytes() if depth[0] else 0
        return t

    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
        layer.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total


def _design_layer_bytes(mode: str, tp: int) -> int:
    """fp32 bytes a low-rank-checkpointed layer keeps (docs/design.md §7): its input
    (boost: the hidden shard [s, b, d/t]; naive: [s, b, d]) and the results of its forward
    all-reduces, none at TP 1 (boost: [s, b, 3r+1] qkv with the norm's sum of squares, [s, b, r]
    o, [s, b, 2r+1] gate|up, [s, b, r] down; naive: the reduced outputs, q|k|v, d, 2f, d)."""
    d, f, r_a, r_m = MODEL["hidden_size"], MODEL["ffn_hidden_size"], MODEL["attn_rank"], \
        MODEL["mlp_rank"]
    qkv = (MODEL["num_attention_heads"] + 2 * MODEL["num_query_groups"]) * HEAD_DIM
    layer_input = d // tp if mode == "boost" else d
    reductions = ([] if tp == 1 else [3 * r_a + 1, r_a, 2 * r_m + 1, r_m] if mode == "boost"
                  else [qkv, d, 2 * f, d])
    return SEQ * MICRO_BATCH * (layer_input + sum(reductions)) * 4


def _built(spec, **settings):
    """The DDP-wrapped model of ``spec`` with ``settings`` ({"section.key": value}) set in its
    run configuration, built on the CPU through the one builder (megatron's groups exist)."""
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.testing.verification import layout_run_config
    from megatron_boost.train.build import build_run

    cfg = layout_run_config(spec)
    for dotted, value in settings.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    return build_run(resolve_run(cfg.validate(), "cpu"))


def _run(rank, world):
    from megatron_boost.train.distributed import groups_released

    out = {}
    for tp in (1, 2, 4):
        for mode in ("naive", "boost"):
            for variant in VARIANTS:
                # each build's process groups end with it: 18 builds in one set of processes
                with groups_released():
                    out[(tp, mode, variant)] = _one_build(tp, mode, variant)
    return out


def _one_build(tp, mode, variant):
    """Gradients, saved bytes and collectives of one forward and backward of ``mode`` at
    ``tp`` in ``variant`` (plain, low-rank recompute, no backward overlap)."""
    from megatron.core import parallel_state

    from megatron_boost.measure.collectives import record_collectives
    from megatron_boost.model.init import sharded_params
    from megatron_boost.config.layout import Layout
    from megatron_boost.testing.verification import LayoutSpec, layout_batches
    from megatron_boost.train.step import initialize_parallel

    spec = LayoutSpec(layout=Layout(mode=mode, tp=tp), model=MODEL, seq_length=SEQ,
                      micro_batch_size=MICRO_BATCH)
    initialize_parallel(tp, 1, None, spec.seed)
    built = _built(spec, **{
        "training.recompute": "lowrank" if variant == "lowrank" else None,
        "parallel.overlap_bottleneck_grad_reduce": variant != "no_overlap"})
    assert built.config.lowrank_recompute == (variant == "lowrank")
    model = built.chunks[0]
    batch = layout_batches(spec, 100, 1, 0)[0]
    hooks, saved = _saved_bytes_hooks(list(model.parameters()), model.module.decoder.layers)
    group = parallel_state.get_tensor_model_parallel_group()
    with record_collectives(group) as log:
        with hooks:  # forward only: what is kept for backward
            loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss.float().mean().backward()
    grads = {k: p.main_grad.clone() for k, _, _, p in sharded_params(model.module)}
    return {"grads": grads, "saved": dict(saved), "comm": log.summary()}


@pytest.fixture(scope="module")
def dropout_grads():
    """:func:`_dropout_grads` in one process, run before the four of ``results``: a rank left
    with many threads by the 18 builds retires after them (tests/rank_pool.py's MAX_THREADS),
    so run after, it would start and import in a fresh process of its own."""
    return distributed(_dropout_grads, 1)[0]


@pytest.fixture(scope="module")
def results(dropout_grads):  # dropout_grads: only its order (first)
    return distributed(_run, 4)


CASES = [(tp, mode) for tp in (1, 2, 4) for mode in ("naive", "boost")]


@pytest.mark.parametrize("tp,mode", CASES)
@pytest.mark.parametrize("variant", ["lowrank", "no_overlap"])
def test_gradients_identical(results, tp, mode, variant):
    for res in results:
        plain, other = res[(tp, mode, "plain")]["grads"], res[(tp, mode, variant)]["grads"]
        assert plain.keys() == other.keys()
        for key in plain:
            assert torch.equal(plain[key], other[key]), key


@pytest.mark.parametrize("tp,mode", CASES)
def test_lowrank_adds_no_collective(results, tp, mode):
    for res in results:
        assert res[(tp, mode, "lowrank")]["comm"] == res[(tp, mode, "plain")]["comm"]


@pytest.mark.parametrize("tp,mode", CASES)
def test_lowrank_keeps_only_layer_input_and_reductions(results, tp, mode):
    # Exact: unique storages are counted, and every kept tensor is a whole fresh tensor (the
    # layer input and the reductions' outputs), so no margin is needed.
    expected = MODEL["num_layers"] * _design_layer_bytes(mode, tp)
    for res in results:
        plain, low = res[(tp, mode, "plain")]["saved"], res[(tp, mode, "lowrank")]["saved"]
        assert low["layers"] == expected
        # Outside the decoder layers (embedding, final norm, head, loss) nothing changes.
        assert low["all"] - low["layers"] == plain["all"] - plain["layers"]
    low, plain = (results[0][(tp, mode, v)]["saved"] for v in ("lowrank", "plain"))
    print(f"saved bytes in layers lowrank/plain tp={tp} {mode}: "
          f"{low['layers'] / plain['layers']:.3f}")


def _dropout_grads(rank, world):
    """Gradients of one forward + backward with hidden and attention dropout 0.1, without and
    with low-rank recompute, from the same RNG states."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_boost.model.init import sharded_params
    from megatron_boost.config.layout import Layout
    from megatron_boost.testing.verification import LayoutSpec, layout_batches
    from megatron_boost.train.step import initialize_parallel

    spec = LayoutSpec(layout=Layout(mode="boost"), model=dict(MODEL, attention_backend="local"),
                      seq_length=SEQ, micro_batch_size=MICRO_BATCH)
    out = {}
    for recompute in (False, True):
        initialize_parallel(1, 1, None, spec.seed)
        # megatron's attention draws its dropout mask from the RNG tracker's stream, the
        # hidden dropout from the default generator: both must be replayed by the recompute.
        built = _built(spec, **{"training.recompute": "lowrank" if recompute else None,
                                "model.hidden_dropout": 0.1, "model.attention_dropout": 0.1})
        config = built.config
        assert (config.lowrank_recompute, config.hidden_dropout,
                config.attention_dropout) == (recompute, 0.1, 0.1)
        (model,) = built.chunks
        batch = layout_batches(spec, 100, 1, 0)[0]
        torch.manual_seed(5)
        model_parallel_cuda_manual_seed(5)
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss.float().mean().backward()
        out[recompute] = {k: p.main_grad.clone() for k, _, _, p in sharded_params(model.module)}
        parallel_state.destroy_model_parallel()
    return out


def test_lowrank_recompute_replays_dropout(dropout_grads):
    """The recompute restores the CPU, CUDA and RNG-tracker states of the forward, as megatron's
    checkpoint function does, so its dropout masks are the forward's: bitwise equal gradients."""
    plain, low = dropout_grads[False], dropout_grads[True]
    assert plain.keys() == low.keys()
    differ = [k for k in plain if not torch.equal(plain[k], low[k])]
    assert not differ, f"gradients differ with recompute under dropout: {differ}"


def test_the_layers_do_not_know_about_recompute():
    """The layers' forward is written once: low-rank checkpointing reaches their collectives
    through the log of parallel/recompute.py (the mappings' context), never through the
    layer modules (no attribute installed on them, no replay path of their own)."""
    from pathlib import Path

    import megatron_boost.parallel.layers as layers

    source = Path(layers.__file__).read_text()
    for name in ("recompute", "replay", "forward_reductions", "ForwardReductions"):
        assert name not in source, name
