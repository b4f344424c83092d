"""The placement table (megatron_boost/config/placement.py) is the one statement of BOOST's
sharding: the layers, the communication formulas, the perf model and the per-rank factor
shapes all read it, so changing one entry changes every one of them."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_boost.analysis.comm import layer_comm_bytes_per_token, tp_comm_widths
from megatron_boost.config.layout import Layout
from megatron_boost.config.shape import ModelShape
from megatron_boost.config.modes import TPMode
from megatron_boost.config import placement as P
from megatron_boost.perf.model import layer_work

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

# d, f, ranks and heads all distinct, so each width names its source
SHAPE = ModelShape("t", num_layers=2, hidden=32, ffn=48, heads=4, query_groups=2,
                   attn_rank=8, mlp_rank=12)
TP = 2


def _fc2_layer(**slot_kwargs):
    """A boost fc2 bottleneck at TP 1 (no process group needed to read its sharding)."""
    import torch

    from megatron_boost.config.transformer import BoostTransformerConfig
    from megatron_boost.parallel.layers import BoostLinearFC2

    config = BoostTransformerConfig(
        num_layers=1, hidden_size=SHAPE.hidden, num_attention_heads=SHAPE.heads,
        ffn_hidden_size=SHAPE.ffn, tp_mode=TPMode.BOOST, attn_rank=SHAPE.attn_rank,
        mlp_rank=SHAPE.mlp_rank, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=torch.float32)
    return BoostLinearFC2(SHAPE.ffn, SHAPE.hidden, config=config, tp_group=None, **slot_kwargs)


def _consumers():
    """What each consumer makes of boost's fc2 (the last group of a layer)."""
    from megatron_boost.testing.layers import axis_of

    fwd, bwd = tp_comm_widths(SHAPE, TPMode.BOOST)
    work = layer_work(SHAPE, TPMode.BOOST, TP)
    gemm = work.gemms[-2]  # A of fc2 (then B_down)
    shapes = dict(P.local_factor_shapes(TPMode.BOOST, SHAPE.projections(TPMode.BOOST), TP))
    layer = _fc2_layer()
    return {"muon_rows": _muon_rows(_fc2_layer()), "comm": (fwd[-1], bwd[-1]), "perf_coll": (work.coll_fwd[-1], work.coll_bwd[-1]),
            "perf_gemm": (gemm.N, gemm.K), "local_A": shapes["A_fc2"],
            "layer_axes": (axis_of(layer, "A_down"), axis_of(layer, "B_down")),
            "layer_norm": hasattr(layer, "layer_norm_weight"), **_sp_consumers()}


def _muon_rows(layer):
    """Muon's global rows of the layer's A and B: the local rows, times the TP size where the
    table splits a factor's rows (the layer is built at TP 1, then told it has TP ranks; its
    factor views stay those of the rows it holds)."""
    from megatron_boost.train.muon import _global_factor_rows

    views = {which: layer.factors(which) for which in ("A", "B")}  # the rows built at TP 1
    layer.factors = views.__getitem__
    layer.tp_size = TP
    rows = _global_factor_rows([layer])
    return rows[id(layer.A)], rows[id(layer.B)]


def _sp_consumers():
    """What each consumer makes of full rank's fc2 (the last group) with sequence
    parallelism: the formula's widths and forward bytes, and the perf model's last forward
    and backward collectives (kind and width: it prices each by its kind)."""
    fwd, bwd = tp_comm_widths(SHAPE, TPMode.FULL, sequence_parallel=True)
    fwd_bytes, _ = layer_comm_bytes_per_token(SHAPE, TPMode.FULL, sequence_parallel=True)
    work = layer_work(SHAPE, TPMode.FULL, TP, sequence_parallel=True)
    perf = [next(c for c in reversed(work.collectives) if c[0] == way) for way in ("fwd", "bwd")]
    return {"sp_comm": (fwd[-1], bwd[-1], fwd_bytes), "sp_perf_coll": perf}


def test_every_consumer_follows_one_entry(monkeypatch):
    """boost's fc2 as the table states it, then with naive's placement for that one entry
    (A split along the rank, B along it too, the output all-reduced forward and the input
    gradient backward) and a fused norm: each consumer changes with the entry. Likewise full
    rank's fc2 under sequence parallelism (a d-wide reduce-scatter forward, an all-gather
    backward), then with an f-wide all-reduce forward in their place."""
    r, f, d = SHAPE.mlp_rank, SHAPE.ffn, SHAPE.hidden
    assert _consumers() == {"muon_rows": ((r,), (TP * d,)), "comm": (r, r), "perf_coll": (r, r), "perf_gemm": (r, f / TP),
                            "local_A": (r, f // TP), "layer_axes": (1, 0),
                            "layer_norm": False, "sp_comm": (d, d, 4 * 4 * d),
                            "sp_perf_coll": [("fwd", "reduce_scatter", d),
                                             ("bwd", "all_gather", d)]}
    changed = dataclasses.replace(P.PLACEMENT[(TPMode.NAIVE, P.Group.FC2)], norm=P.Norm.FUSED)
    monkeypatch.setitem(P.PLACEMENT, (TPMode.BOOST, P.Group.FC2), changed)
    full_fc2 = P.PLACEMENT[(TPMode.FULL, P.Group.FC2)]
    monkeypatch.setitem(P.PLACEMENT, (TPMode.FULL, P.Group.FC2), dataclasses.replace(
        full_fc2, sp_fwd=(P.Collective(P.Dim.D_IN, "all_reduce"),)))
    # fwd: output all-reduce d plus the fused statistic's column; bwd: input gradient f.
    # full + SP: fc2's forward is an f-wide all-reduce (fp32 bytes: 3 d-wide ones and it)
    assert _consumers() == {"muon_rows": ((TP * r,), (d,)), "comm": (d + 1, f), "perf_coll": (d, f),
                            "perf_gemm": (r / TP, f), "local_A": (r // TP, f),
                            "layer_axes": (0, 1), "layer_norm": True,
                            "sp_comm": (f, d, 4 * (3 * d + f)),
                            "sp_perf_coll": [("fwd", "all_reduce", f),
                                             ("bwd", "all_gather", d)]}


def test_table_covers_every_mode_and_group():
    assert set(P.PLACEMENT) == {(m, g) for m in TPMode for g in P.GROUPS}
    for (mode, group), entry in P.PLACEMENT.items():
        assert (entry.b is None) == (mode is TPMode.FULL), (mode, group)
        assert (entry.norm is P.Norm.FUSED) == (mode is TPMode.BOOST and group.is_column)
        # megatron's sequence parallelism is full rank's (config/modes.py refuses it elsewhere)
        assert (entry.sp_fwd is not None) == (entry.sp_bwd is not None) == (mode is TPMode.FULL)


@pytest.mark.parametrize("mode", list(TPMode))
def test_local_factors_hold_a_tp_share_of_the_parameters(mode):
    """Every factor is split in every mode: the local factors hold 1/t of the projections."""
    local = P.local_factor_shapes(mode, SHAPE.projections(mode), TP)
    assert TP * sum(rows * cols for _, (rows, cols) in local) == SHAPE.projection_params(mode)


def test_mode_is_a_tpmode_that_reads_as_its_name():
    """Reports, JSON and dictionaries keyed by the name take a TPMode as they did the str."""
    import json

    assert f"{TPMode.BOOST}" == str(TPMode.BOOST) == "boost"
    assert json.dumps({TPMode.NAIVE: TPMode.FULL}) == '{"naive": "full"}'
    assert {"full": 1}[TPMode.FULL] == 1


def test_a_row_layer_is_its_group_by_type_not_by_its_buffer_name():
    """megatron names the slot's communication buffer; the layer's group, rank and sharding
    do not depend on it (o and down were once told apart by ``tp_comm_buffer_name``)."""
    layer = _fc2_layer(tp_comm_buffer_name="proj")
    assert [(p.name, p.rank) for p in layer.projections] == [("down", SHAPE.mlp_rank)]
    assert layer.group is P.Group.FC2


def test_configs_are_read_by_type_not_by_their_attributes():
    """ModelShape.from_config and the FLOP count's mode tell a RunConfig, a ModelConfig and a
    TransformerConfig apart by type: an object that merely has a config's attributes (a
    ``parallel`` with a mode, a ``model``) is refused, not read."""
    from types import SimpleNamespace

    from megatron_boost.analysis.flops import forward_flops_per_token
    from megatron_boost.config.shape import config_mode
    from megatron_boost.config.run import load_run_config

    cfg = load_run_config("configs/debug.yaml", ["parallel.mode=naive"])
    assert config_mode(cfg) is TPMode.NAIVE and config_mode(cfg.model) is TPMode.BOOST
    assert ModelShape.from_config(cfg) == ModelShape.from_config(cfg.model)
    lookalike = SimpleNamespace(model=cfg.model, parallel=cfg.parallel)
    with pytest.raises(TypeError, match="SimpleNamespace"):
        ModelShape.from_config(lookalike)
    with pytest.raises(TypeError, match="SimpleNamespace"):
        forward_flops_per_token(lookalike)


def test_the_gpu_checks_rank_shapes_follow_the_table(monkeypatch):
    """The GPU check's per-rank layer (analysis/rank_shape.py) shrinks the sizes the table
    splits: boost's fc1 given naive's placement keeps the ffn whole and splits the MLP rank."""
    from megatron_boost.analysis.rank_shape import rank_local_shape

    def sizes():
        local = rank_local_shape(SHAPE, TPMode.BOOST, TP)
        return (local.hidden, local.ffn, local.heads, local.r_attn, local.r_mlp)

    d, f, h = SHAPE.hidden, SHAPE.ffn, SHAPE.heads
    assert sizes() == (d // TP, f // TP, h // TP, SHAPE.attn_rank, SHAPE.mlp_rank)
    monkeypatch.setitem(P.PLACEMENT, (TPMode.BOOST, P.Group.FC1),
                        P.PLACEMENT[(TPMode.NAIVE, P.Group.FC1)])
    assert sizes() == (d // TP, f, h // TP, SHAPE.attn_rank, SHAPE.mlp_rank // TP)


def _split_size_names(mode):
    """The names config/modes.py's TP-divisibility rule checks in ``mode``."""
    from megatron_boost.config.modes import tp_sharded_sizes

    return [name for name, _, _ in tp_sharded_sizes(
        mode, hidden_size=SHAPE.hidden, ffn_hidden_size=SHAPE.ffn,
        num_attention_heads=SHAPE.heads, num_query_groups=SHAPE.query_groups,
        attn_rank=SHAPE.attn_rank, mlp_rank=SHAPE.mlp_rank)]


def test_the_tp_divisibility_rule_follows_the_table(monkeypatch):
    """tp_sharded_sizes lists the sizes the table's split axes fall on: boost's fc2 given
    naive's placement adds the MLP rank; naive's stream split along d adds the hidden size."""
    heads = ["num_attention_heads", "num_query_groups"]  # megatron's own rule, every mode
    assert _split_size_names(TPMode.BOOST) == ["hidden_size", "ffn_hidden_size", *heads]
    assert _split_size_names(TPMode.NAIVE) == ["attn_rank", "mlp_rank", *heads]
    assert _split_size_names(TPMode.FULL) == ["ffn_hidden_size", *heads]
    monkeypatch.setitem(P.PLACEMENT, (TPMode.BOOST, P.Group.FC2),
                        P.PLACEMENT[(TPMode.NAIVE, P.Group.FC2)])
    monkeypatch.setitem(P.TENSORS, (TPMode.NAIVE, P.Tensor.STREAM), P.TensorPlacement(2))
    assert _split_size_names(TPMode.BOOST) == ["hidden_size", "mlp_rank", "ffn_hidden_size",
                                               *heads]
    assert _split_size_names(TPMode.NAIVE) == ["hidden_size", "attn_rank", "mlp_rank", *heads]



def _perf_tensor_consumers(monkeypatch):
    """What the perf model makes of boost's tensors outside the factors on one GPU of TP 2
    and two stages (untied, then tied embeddings), and of full rank's stream with sequence
    parallelism: the layer's parameters beyond its factors (γ), the stream per token, the first
    and last stage's parameters beyond their layers (embedding; head and final norm), the
    head's GEMM time, the last stage's logits and the tied embedding's gradient all-reduce."""
    from megatron_boost.perf import model as perf
    from megatron_boost.perf.hardware import hardware

    class NoLedger:  # the stage memory's ledger terms out of the way: nothing saved
        saved_bytes, saved_by_scope = 0, {}

    monkeypatch.setattr(perf.LayerWork, "ledger", lambda self, recompute=None: NoLedger())
    hw = hardware("h100-80gb")
    st = perf._Setting.of(SHAPE, perf.Layout(mode="boost", tp=TP, pp=2), hw)
    tied = perf._Setting.of(dataclasses.replace(SHAPE, tied_embeddings=True),
                            perf.Layout(mode="boost", tp=TP, pp=2), hw)
    full_sp = perf._Setting.of(SHAPE, perf.Layout(mode="full", tp=TP), hw)
    factors = sum(gemm.N * gemm.K for gemm in st.work.gemms)
    first, last = (params - st.work.params for params in perf._stage_params(st, [1, 1]))
    return {"perf_norms": st.work.params - factors, "perf_stream": st.d_loc,
            "perf_first": first, "perf_last": last,
            "perf_head_gemm": perf._head_times(st)["gemm"],
            "perf_logits": perf._stage_memory(st, 1, 1, 0.0)["activations"],
            "perf_tied": perf._step_tail(tied, 0.0, 0.0)["tied"],
            "perf_sp_stream": full_sp.d_loc}


def _hidden_sharded_embedding(monkeypatch):
    """boost's untied embedding on one of TP ranks: its table's shape and TP split axis (the
    attribute megatron's checkpointing and optimizers read)."""
    import torch

    from megatron_boost.config.transformer import BoostTransformerConfig
    from megatron_boost.model import gpt

    monkeypatch.setattr(gpt, "get_pg_size", lambda group: TP)
    config = BoostTransformerConfig(
        num_layers=1, hidden_size=SHAPE.hidden, num_attention_heads=SHAPE.heads,
        ffn_hidden_size=SHAPE.ffn, tp_mode=TPMode.BOOST, attn_rank=SHAPE.attn_rank,
        mlp_rank=SHAPE.mlp_rank, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=torch.float32)
    weight = gpt.HiddenShardedEmbedding(config, SHAPE.vocab, tp_group=None).word_embeddings.weight
    return {"gpt_embedding_shape": tuple(weight.shape),
            "gpt_embedding_axis": weight.partition_dim}


def _sequence_parallel_seq_rule() -> bool:
    """Whether the run validation refuses full rank with sequence parallelism at TP 2 on a
    sequence TP does not divide (each rank would hold s/t positions)."""
    from megatron_boost.config import validation
    from megatron_boost.config.run import load_run_config

    cfg = load_run_config("configs/debug.yaml", [
        "parallel.mode=full", f"parallel.tp={TP}", "parallel.sequence_parallel=true"])
    cfg.model.seq_length = TP * 8 + 1  # after loading, which validates
    try:
        validation._check_tp_split(cfg)
    except ValueError as err:
        return "sequence parallelism" in str(err)
    return False


def _tensor_consumers(monkeypatch):
    """What every consumer outside parallel/ makes of the tensors of TENSORS: the model's
    stream split between stages, its pipeline seq_length rule and its embedding table; the
    op ledger's and the comm measurement's layer input; the perf model's sizes."""
    from megatron_boost.measure import layer_comm as comm, ledger
    from megatron_boost.config.modes import check_pipeline_seq_length
    from megatron_boost.model.gpt import stream_split

    try:  # an odd sequence cannot be exchanged as [s/t, b, d] where the stream is split
        check_pipeline_seq_length(TPMode.BOOST, TP, 2, TP * 8 + 1)
        refused = False
    except ValueError:
        refused = True
    spec = ledger.LedgerSpec(shape=SHAPE, layout=Layout(mode="boost", tp=TP), seq_length=16)
    return {"sp_seq_rule": _sequence_parallel_seq_rule(),
            "gpt_stream": stream_split(TPMode.BOOST, TP), "pipeline_seq_rule": refused,
            **_hidden_sharded_embedding(monkeypatch),
            "ledger_input": ledger.layer_input_shape(spec),
            "ledger_sp_input": ledger.layer_input_shape(dataclasses.replace(
                spec, layout=Layout(mode="full", tp=TP, sequence_parallel=True))),
            "comm_input": comm.layer_input_shape(
                comm.LayerCommSpec(layout=Layout(mode="boost", tp=TP)), SHAPE.hidden),
            **_perf_tensor_consumers(monkeypatch)}


_STREAM_CONSUMERS = {"gpt_stream", "pipeline_seq_rule", "ledger_input", "comm_input",
                     "perf_stream"}


def _replicated(mode, tensor, consumers):
    return pytest.param((mode, tensor), P.TensorPlacement(None), consumers,
                        id=f"{mode.value}-{tensor.value}")


@pytest.mark.parametrize("entry,changed,consumers", [
    _replicated(TPMode.BOOST, P.Tensor.STREAM, _STREAM_CONSUMERS),
    _replicated(TPMode.BOOST, P.Tensor.NORM_WEIGHT, {"perf_norms"}),
    # boost's final γ is replicated (the norm runs after the gather): split it instead
    pytest.param((TPMode.BOOST, P.Tensor.FINAL_NORM_WEIGHT), P.TensorPlacement(0), {"perf_last"},
                 id="boost-final_norm_weight-split"),
    _replicated(TPMode.BOOST, P.Tensor.EMBEDDING, {"gpt_embedding_shape", "gpt_embedding_axis",
                                                    "perf_first", "perf_tied"}),
    _replicated(TPMode.BOOST, P.Tensor.HEAD, {"perf_last", "perf_head_gemm", "perf_logits"}),
    _replicated(TPMode.FULL, P.Tensor.STREAM, {"ledger_sp_input", "perf_sp_stream",
                                                  "sp_seq_rule"}),
])
def test_every_consumer_follows_one_tensor_entry(monkeypatch, entry, changed, consumers):
    """One TENSORS entry changed (made replicated, or split) changes exactly the consumers that
    read it, each of
    them (and no other): a consumer that wrote its split by hand would stay as it was."""
    before = _tensor_consumers(monkeypatch)
    d, s = SHAPE.hidden, 16
    assert before["ledger_input"] == (s, 1, d // TP)
    assert before["ledger_sp_input"] == (s // TP, 1, d)
    monkeypatch.setitem(P.TENSORS, entry, changed)
    after = _tensor_consumers(monkeypatch)
    assert {key for key in before if after[key] != before[key]} == consumers


def test_the_heads_split_follows_qkv_entry(monkeypatch):
    """Where qkv is split along its output the heads are: naive's qkv given boost's placement
    splits the perf model's attention heads and the attention core of the per-rank FLOP count
    (naive keeps both whole on every rank)."""
    from megatron_boost.analysis.flops import rank_step_flops

    def consumers():
        flops = rank_step_flops(SHAPE, TPMode.NAIVE, 1, SHAPE.vocab, 16, TP)
        return layer_work(SHAPE, TPMode.NAIVE, TP).attn_heads, flops

    heads, flops = consumers()
    assert heads == SHAPE.heads
    monkeypatch.setitem(P.PLACEMENT, (TPMode.NAIVE, P.Group.QKV),
                        P.PLACEMENT[(TPMode.BOOST, P.Group.QKV)])
    split_heads, split_flops = consumers()
    assert split_heads == SHAPE.heads / TP and split_flops < flops
