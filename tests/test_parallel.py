"""3D parallelism (TP × PP × DP) of the whole model equals one process, in every mode.

For each layout: the same global weights (layout-independent init from one seed), the same
global batch split over DP ranks and micro-batches, megatron-core's schedule, DDP and Adam with
clipping. Checked against the one-process model (bottleneck modes against the one-process naive
model, full against the one-process full-rank model): the loss, every gradient shard against
the matching slice of the one-process gradient (except with the distributed optimizer, where
each DP rank holds only its shard of the reduced buffer), the global gradient norm, and every
parameter after one optimizer step. Full rank at TP > 1 runs megatron's sequence parallelism
(its default here; ``full-tp2-nosp`` is plain TP). Tolerances: megatron_boost.testing.verification.TOLERANCES.

Checks are grouped by world size so that one set of processes runs all of them: one process
for the references (and boost at TP=1 against naive at TP=1), two for every world-2 layout and
the TP=2 collectives of the whole model, four for every world-4 layout (each process start costs
seconds of imports). Only the checks of the selected tests are run (the fast tier selects the
TP=2 layout of each mode and one negative control).
"""

from __future__ import annotations

import pytest

from megatron_boost.config.layout import Layout
from megatron_boost.testing.verification import (
    TOLERANCES,
    LayoutSpec,
    model_collectives,
    reference_spec,
    run_layout,
    run_many,
)
from tests.rank_pool import distributed

pytestmark = pytest.mark.compat

#: The fast tier's smoke: TP=2 in each mode, and a negative control that must be caught.
FAST = {"boost-tp2", "naive-tp2", "full-tp2", "NEG-boost-tp2"}

MODEL = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=8,
             num_query_groups=4, vocab_size=100, attn_rank=8, mlp_rank=8)
MODEL4 = dict(MODEL, num_layers=4)  # interleaved pipelines need layers per virtual stage
TIED = dict(MODEL, share_embeddings_and_output_weights=True)  # one [V, d] table, both ends


def L(mode, tp=1, pp=1, vpp=None, model=MODEL, sequence_parallel=None, **kw):
    layout = Layout(mode=mode, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sequence_parallel)
    return LayoutSpec(layout=layout, model=dict(model), **kw)


# (id, world size, spec)
LAYOUTS = [
    ("boost-tp2", 2, L("boost", tp=2)),
    ("naive-tp2", 2, L("naive", tp=2)),
    ("full-tp2", 2, L("full", tp=2)),  # full rank at TP > 1: sequence parallel by default
    ("full-tp2-nosp", 2, L("full", tp=2, sequence_parallel=False)),  # the paper's baseline
    ("boost-pp2", 2, L("boost", pp=2)),
    ("boost-dp2", 2, L("boost")),
    ("boost-pp2-vpp2", 2, L("boost", pp=2, vpp=2, model=MODEL4)),
    ("naive-pp2-vpp2", 2, L("naive", pp=2, vpp=2, model=MODEL4)),
    ("full-pp2-vpp2", 2, L("full", pp=2, vpp=2, model=MODEL4)),
    ("boost-tp4", 4, L("boost", tp=4)),
    ("naive-tp4", 4, L("naive", tp=4)),
    ("full-tp4", 4, L("full", tp=4)),
    ("boost-tp2-pp2", 4, L("boost", tp=2, pp=2)),
    ("naive-tp2-pp2", 4, L("naive", tp=2, pp=2)),
    ("full-tp2-pp2", 4, L("full", tp=2, pp=2)),
    ("boost-tp2-dp2", 4, L("boost", tp=2)),
    ("naive-tp2-dp2", 4, L("naive", tp=2)),
    ("full-tp2-dp2", 4, L("full", tp=2)),
    ("boost-pp2-dp2", 4, L("boost", pp=2)),
    ("boost-tp2-pp2-vpp2", 4, L("boost", tp=2, pp=2, vpp=2, model=MODEL4)),
    # Distributed optimizer and overlapped gradient reduction (updates compared).
    ("boost-tp2-dp2-distopt-overlap", 4,
     L("boost", tp=2, use_distributed_optimizer=True, overlap_grad_reduce=True)),
    ("naive-tp2-dp2-distopt", 4, L("naive", tp=2, use_distributed_optimizer=True)),
    ("full-tp2-dp2-distopt", 4, L("full", tp=2, use_distributed_optimizer=True)),
    ("boost-dp2-distopt", 2, L("boost", use_distributed_optimizer=True)),
    # Two interleaved halves of each micro-batch (parallel.interleave_halves), alone and with
    # a pipeline, data parallelism, the distributed optimizer and the overlapped reduction.
    ("boost-tp2-halves", 2, L("boost", tp=2, interleave_halves=True)),
    ("boost-tp2-pp2-halves", 4, L("boost", tp=2, pp=2, interleave_halves=True)),
    ("boost-tp2-dp2-halves-distopt-overlap", 4,
     L("boost", tp=2, interleave_halves=True, use_distributed_optimizer=True,
       overlap_grad_reduce=True)),
    # Tied embeddings: TP (boost's reduce-scatter lookup), PP (megatron's embedding-group
    # gradient all-reduce between the first and the last stage) and both, against the
    # one-process tied model.
    ("boost-tp2-tied", 2, L("boost", tp=2, model=TIED)),
    ("naive-tp2-tied", 2, L("naive", tp=2, model=TIED)),
    ("full-tp2-tied", 2, L("full", tp=2, model=TIED)),
    ("boost-pp2-tied", 2, L("boost", pp=2, model=TIED)),
    ("naive-pp2-tied", 2, L("naive", pp=2, model=TIED)),
    ("full-pp2-tied", 2, L("full", pp=2, model=TIED)),
    ("boost-tp2-pp2-tied", 4, L("boost", tp=2, pp=2, model=TIED)),
    ("naive-tp2-pp2-tied", 4, L("naive", tp=2, pp=2, model=TIED)),
    ("full-tp2-pp2-tied", 4, L("full", tp=2, pp=2, model=TIED)),
    # Negative controls: one parameter shard corrupted on every rank.
    ("NEG-boost-tp2", 2, L("boost", tp=2, corrupt=True)),
    ("NEG-naive-tp2-pp2", 4, L("naive", tp=2, pp=2, corrupt=True)),
    ("NEG-boost-tp2-pp2-tied", 4, L("boost", tp=2, pp=2, model=TIED, corrupt=True)),
]


def _ref_key(spec: LayoutSpec):
    r = reference_spec(spec)
    return (r.layout.mode, tuple(sorted(r.model.items())))


def _selected(request) -> tuple:
    """(layout names, test function names) of this module's selected tests."""
    items = [item for item in request.session.items if item.module is request.module]
    layouts = {item.callspec.params["name"] for item in items
               if hasattr(item, "callspec") and "name" in item.callspec.params}
    return layouts, {item.originalname for item in items}


COLLECTIVE_MODES = ("full", "naive", "boost", "boost-tied")


def _collective_spec(name: str) -> LayoutSpec:
    """The TP=2 model whose collectives ``test_<name>_model_collectives`` checks."""
    mode, _, tied = name.partition("-")
    return L(mode, tp=2, model=TIED if tied else MODEL)


def _references(rank, world, ref_specs, boost1):
    """The one-process references; then, in the same process, boost at TP=1 against the
    naive reference (``boost1``, when selected): one process start instead of two."""
    refs = run_many(rank, world, [(s, None) for s in ref_specs])
    if boost1 is None:
        return refs, None
    naive1 = refs[[_ref_key(s) for s in ref_specs].index(_ref_key(boost1))]
    return refs, run_layout(rank, world, boost1, naive1)


def _world_jobs(rank, world, jobs, collective_specs):
    """The layouts of one world size, then (world 2) the model's collectives at TP=2 of each
    mode: one set of processes for everything that needs that many, each layout's process
    groups ended before the next (about fifty threads per layout at world 4 otherwise)."""
    from megatron_boost.train.distributed import groups_released

    layouts, collectives = [], []
    for job in jobs:
        with groups_released():
            layouts.extend(run_many(rank, world, [job]))
    for spec in collective_specs:
        with groups_released():
            collectives.append(model_collectives(rank, world, spec))
    return layouts, collectives


@pytest.fixture(scope="module")
def results(request):
    """Every selected check's per-rank results, from at most three sets of processes: the
    one-process references (with boost at TP=1), all world-2 checks, all world-4 checks.
    The collectives of each mode appear as ``collectives-<mode>``."""
    selected, tests = _selected(request)
    boost1 = L("boost") if "boost-tp1-vs-naive-tp1" in selected else None
    wanted = [(n, w, spec) for n, w, spec in LAYOUTS if n in selected]
    collective_modes = [m for m in COLLECTIVE_MODES
                        if f"test_{m.replace('-', '_')}_model_collectives" in tests]
    if "boost-tied" in collective_modes and "boost" not in collective_modes:
        collective_modes.insert(0, "boost")  # the tied model is checked against it
    refs_needed = {}
    for _, _, spec in wanted + ([("", 1, boost1)] if boost1 else []):
        refs_needed.setdefault(_ref_key(spec), reference_spec(spec))
    out, refs = {}, {}
    if refs_needed:
        ref_specs = list(refs_needed.values())
        ref_out, tp1 = distributed(_references, 1, ref_specs, boost1)[0]
        refs = dict(zip(refs_needed.keys(), ref_out))
        if boost1:
            out["boost-tp1-vs-naive-tp1"] = [tp1]
    for world in (2, 4):
        layouts = [(name, spec) for name, w, spec in wanted if w == world]
        collective_specs = ([_collective_spec(m) for m in collective_modes] if world == 2
                            else [])
        if not layouts and not collective_specs:
            continue
        jobs = [(spec, refs[_ref_key(spec)]) for _, spec in layouts]
        per_rank = distributed(_world_jobs, world, jobs, collective_specs, timeout=600)
        for i, (name, _) in enumerate(layouts):
            out[name] = [rank_layouts[i] for rank_layouts, _ in per_rank]
        for i, name in enumerate(collective_modes if world == 2 else []):
            out[f"collectives-{name}"] = per_rank[0][1][i]  # rank 0's record, as before
    return out


def _params(names):
    return [pytest.param(n, marks=pytest.mark.fast) if n in FAST else n for n in names]


def _worst(per_rank, field):
    values = [r[field] for r in per_rank if r[field] is not None]
    return max(values) if values else None


@pytest.mark.parametrize("name", _params([n for n, _, _ in LAYOUTS if not n.startswith("NEG")]
                                         + ["boost-tp1-vs-naive-tp1"]))
def test_layout_equals_one_process(results, name):
    per_rank = results[name]
    loss = _worst(per_rank, "loss")
    assert loss is not None, "no rank reported a loss"
    assert loss <= TOLERANCES["loss"], f"loss rel diff {loss}"
    grad = _worst(per_rank, "grad")
    worst_key = max(per_rank, key=lambda r: r["grad"])["worst_grad_key"]
    assert grad <= TOLERANCES["grad"], f"grad rel diff {grad} at {worst_key}"
    assert _worst(per_rank, "grad_norm") <= TOLERANCES["grad_norm"]
    assert _worst(per_rank, "update") <= TOLERANCES["update"]
    assert all(r["n_tensors"] > 0 for r in per_rank)


@pytest.mark.parametrize("name", _params([n for n, _, _ in LAYOUTS if n.startswith("NEG")]))
def test_negative_control_is_caught(results, name):
    per_rank = results[name]
    worst = max(max(r["grad"], r["update"]) for r in per_rank)
    assert worst > 100 * TOLERANCES["grad"]


# ---------------------------------------------------------------------------------------------
# collectives of the whole model at TP=2
# ---------------------------------------------------------------------------------------------

S, MB = 16, 2
D, F, R = MODEL["hidden_size"], MODEL["ffn_hidden_size"], MODEL["attn_rank"]
HN = D // MODEL["num_attention_heads"]
QKV = D + 2 * MODEL["num_query_groups"] * HN


@pytest.fixture(scope="module")
def collectives(results):
    """Recorded in the world-2 processes of ``results`` (only the selected modes)."""
    return {mode: results[f"collectives-{mode}"] for mode in COLLECTIVE_MODES
            if f"collectives-{mode}" in results}


def _split(records):
    """Per-token activation collectives (numel = tokens · width) vs the loss's small ones."""
    tokens = S * MB
    act = [(d, k, w) for d, k, w, n in records if n == tokens * w and w > MB]
    other = [(d, k, w, n) for d, k, w, n in records if not (n == tokens * w and w > MB)]
    return act, other


def test_boost_model_collectives(collectives):
    act, other = _split(collectives["boost"])
    layers = MODEL["num_layers"]
    fwd = [w for d, k, w in act if d == "fwd" and k == "all_reduce"]
    bwd = [w for d, k, w in act if d == "bwd" and k == "all_reduce"]
    # Per layer: qkv (3 A's + the fused sum of squares), o, gate+up (+1), down. No embedding
    # all-reduce: the table is sharded along d.
    assert fwd == [3 * R + 1, R, 2 * R + 1, R] * layers
    gathers = [w for d, k, w in act if k == "all_gather"]
    assert gathers == [D], "exactly one d-wide all-gather, at the head"
    # Backward: the same bottlenecks in reverse order, r-wide, and the output layer's
    # input-gradient all-reduce (megatron's vocab-parallel head).
    assert sorted(bwd) == sorted([3 * R, R, 2 * R, R] * layers + [D])
    assert max(fwd + bwd) <= D
    assert all(k == "all_reduce" for _, k, _, _ in other)  # vocab-parallel cross entropy


def test_boost_tied_model_collectives(collectives):
    """Tying adds exactly the embedding's reduce-scatter of the [s, b, d] partial rows
    (forward; recorded as its [t·n, d/t] input) and the all-gather of its gradient
    (backward) to the untied boost model's collectives: the head's volume, nothing per layer
    (docs/design.md §2)."""
    extra = list(collectives["boost-tied"])
    for record in collectives["boost"]:
        extra.remove(record)
    tokens, t = S * MB, 2
    assert extra == [("fwd", "reduce_scatter", D // t, tokens * D),
                     ("bwd", "all_gather", D, tokens * D)]


def test_naive_model_collectives(collectives):
    act, _ = _split(collectives["naive"])
    layers = MODEL["num_layers"]
    fwd = [w for d, k, w in act if d == "fwd"]
    bwd = [w for d, k, w in act if d == "bwd"]
    # The embedding's vocab-parallel all-reduce, then per layer qkv, o, gate+up, down.
    assert fwd == [D] + [QKV, D, 2 * F, D] * layers
    assert sorted(bwd) == sorted([D, D, D, F] * layers + [D])


def test_full_model_collectives(collectives):
    """Full rank at TP=2 runs megatron's sequence parallelism (on by default there): the
    embedding's reduce-scatter, then around each block an all-gather of the sequence shards
    before it and a reduce-scatter after it (in place of its all-reduce), and the head's
    all-gather; in backward the conjugates, plus the all-gather of each column-parallel
    linear's input for its weight gradient. Every one moves the whole [s, b, d] activation."""
    layers = MODEL["num_layers"]
    whole = S * MB * D
    acts = [(d, k) for d, k, w, n in collectives["full"] if n == whole]
    fwd = [k for d, k in acts if d == "fwd"]
    assert fwd == (["reduce_scatter"] + ["all_gather", "reduce_scatter"] * 2 * layers
                   + ["all_gather"])
    bwd = sorted(k for d, k in acts if d == "bwd")
    # conjugates: 2·layers + 1 reduce-scatters and 2·layers + 1 all-gathers; the weight
    # gradients of the 2·layers column-parallel linears and the head re-gather their inputs
    assert bwd == sorted(["reduce_scatter"] * (2 * layers + 1)
                         + ["all_gather"] * (2 * layers + 1) + ["all_gather"] * (2 * layers + 1))
