"""Tests of the analytical cluster performance model (megatron_boost/perf)."""

import dataclasses
import json
import os
import re

import pytest

from megatron_boost.analysis.comm import layer_comm_formula, tp_comm_widths
from megatron_boost.config.shape import MODES, ModelShape
from megatron_boost.cli.perf_model import main
from megatron_boost.perf import model as pm
from megatron_boost.perf.hardware import SUSTAINED_A100, hardware
from megatron_boost.perf.kernels import allgather_time, allreduce_time, gemm_efficiency
from megatron_boost.perf.published import (FIT_MODES, PUBLISHED_SETUP, compare_published,
                                           fit_sustained_ratio)
from megatron_boost.perf.report import format_published
from megatron_boost.perf.search import recommend

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COLA_7B = ModelShape("CoLA-7B", num_layers=32, hidden=4096, ffn=11008, heads=32,
                        vocab=32000, seq_length=4096, attn_rank=1024, mlp_rank=1024)




def _tp_comm(shape, mode):
    """Per-layer TP elements per token of the one formula (analysis.comm)."""
    f = layer_comm_formula(shape, mode)
    return {"forward": f["fwd_elems_per_token"], "backward": f["bwd_elems_per_token"],
            "collectives": f["fwd_count"] + f["bwd_count"]}


# ---------------------------------------------------------------------------------------------
# the published A100 table
# ---------------------------------------------------------------------------------------------


def test_published_table_within_15_percent_every_cell():
    """A FIT check, not a prediction: the A100's sustained-clock ratio (SUSTAINED_A100, the one
    fitted parameter) was chosen on the full-rank and naive cells (FIT_MODES), so this only
    shows that one value fits all of them. boost is predicted from our layer's op ledger: our
    layer is leaner than the authors', so it may predict less time than they measured, but not
    more than the fit's tolerance. The prediction check is the hold-out test below."""
    rows = compare_published()
    assert len(rows) == 12
    table = format_published(rows)
    assert fit_sustained_ratio() == pytest.approx(SUSTAINED_A100, abs=1e-9), table
    for r in rows:
        ok = (0.84 <= r["ratio"] <= 1.16 if r["mode"] in FIT_MODES
              else 0.7 <= r["ratio"] <= 1.16)
        assert ok, f"{r['model']} {r['mode']}: ratio {r['ratio']}\n{table}"
        # the published figure is never an input: the prediction differs from it
        assert r["predicted_s"] != r["published_s"]


@pytest.mark.parametrize("held_out", ["1B", "3B", "7B", "13B"])
def test_published_table_predicted_for_a_model_left_out_of_the_fit(held_out):
    """Leave one model out: refit the one parameter on the other three models' full and naive
    cells and predict the held-out model's within 16 % (boost: not above 16 %). 13B is the
    only layout with a pipeline (TP4 x PP2), 1B the only one without TP. (15 % until the op
    ledger counted flash attention's three backward kernels, TE's norm backward and DDP's
    gradient accumulation, which the authors' runs pay too: 1B naive held out is then 1.152.)"""
    ratio = fit_sustained_ratio(held_out=held_out)
    hw = dataclasses.replace(hardware(PUBLISHED_SETUP["gpu"]), sustained_clock_ratio=ratio)
    rows = [r for r in compare_published(hw) if r["model"] == held_out]
    assert len(rows) == 3
    for r in rows:
        ok = (0.84 <= r["ratio"] <= 1.16 if r["mode"] in FIT_MODES
              else 0.7 <= r["ratio"] <= 1.16)
        assert ok, (held_out, ratio, r["mode"], r["ratio"])


def test_published_speedup_ordering():
    """The published qualitative result: boost beats full everywhere and naive from TP2 on.
    At TP1 naive and boost run the same GEMMs; our boost layer fuses its norm and σ, so it
    is not slower there either."""
    by = {(r["model"], r["mode"]): r["predicted_s"] for r in compare_published()}
    for model in ("1B", "3B", "7B", "13B"):
        assert by[(model, "boost")] < by[(model, "full")]
    for model in ("3B", "7B", "13B"):
        assert by[(model, "boost")] < by[(model, "naive")] / 1.5
    assert by[("1B", "boost")] <= by[("1B", "naive")]


# ---------------------------------------------------------------------------------------------
# communication formulas (docs/design.md §5 table)
# ---------------------------------------------------------------------------------------------


def test_tp_comm_formulas_match_design_table():
    d, f = 4096, 11008
    full = _tp_comm(COLA_7B, "full")
    naive = _tp_comm(COLA_7B, "naive")
    boost = _tp_comm(COLA_7B, "boost")
    assert full == {"forward": 8192, "backward": 8192, "collectives": 4}
    assert naive == {"forward": 42496, "backward": 3 * d + f, "collectives": 8}
    assert naive["forward"] == 5 * d + 2 * f
    assert boost == {"forward": 7170, "backward": 7 * 1024, "collectives": 8}


def test_gqa_shrinks_naive_kv_terms():
    gqa = dataclasses.replace(COLA_7B, query_groups=8)
    e = 128
    naive = _tp_comm(gqa, "naive")
    assert naive["forward"] == (32 + 2 * 8) * e + 4096 + 2 * 11008 + 4096
    # boost and full do not depend on the kv width
    assert _tp_comm(gqa, "boost")["forward"] == 7170
    assert _tp_comm(gqa, "full")["forward"] == 8192


def test_per_layer_bytes_reproduce_authors_anchor():
    """The anchor (authors' README, LLaMA-7B, micro-batch 4, seq 4096, bf16, one
    layer, forward): full ≈ 0.25 GB, vanilla ≈ 1.32 GB, BTP ≈ 0.22 GB (the authors' logs give
    256 / 1328 / 224 MiB). Their full rank is all-reduce TP without sequence parallelism."""
    hw = hardware("a100-80gb")
    got = {}
    for mode in MODES:
        sp = False if mode == "full" else None
        pr = pm.predict(COLA_7B, pm.Layout(mode=mode, tp=4, micro_batch=4,
                                           sequence_parallel=sp), hw)
        got[mode] = pr.comm["tp_bytes_per_layer_fwd"] / 2**30
    assert got["full"] == pytest.approx(0.25, rel=0.02)
    assert got["naive"] == pytest.approx(1.32, rel=0.03)
    assert got["boost"] == pytest.approx(0.22, rel=0.02)


def test_boost_comm_below_full_for_cola_7b():
    hw = hardware("a100-80gb")
    preds = {m: pm.predict(COLA_7B, pm.Layout(mode=m, tp=4, micro_batch=2), hw)
             for m in MODES}
    assert (preds["boost"].comm["tp_bytes_per_iteration"]
            < preds["full"].comm["tp_bytes_per_iteration"]
            < preds["naive"].comm["tp_bytes_per_iteration"])
    assert preds["boost"].breakdown_s["tp_comm"] < preds["full"].breakdown_s["tp_comm"]
    assert preds["boost"].iteration_s < preds["full"].iteration_s < preds["naive"].iteration_s


# ---------------------------------------------------------------------------------------------
# kernel model and sanity
# ---------------------------------------------------------------------------------------------


def test_gemm_efficiency_saturates_and_penalises_rank_slices():
    hw = hardware("a100-80gb")
    n, d, r, t = 16384, 4096, 1024, 4
    naive_a = gemm_efficiency(n, r // t, d, hw)      # A column-parallel: N = r/t
    boost_a = gemm_efficiency(n, 3 * r, d // t, hw)  # A row-sharded: K = d/t, N = 3r
    dense = gemm_efficiency(n, 3 * d // t, d, hw)
    assert naive_a < boost_a < dense < hw.gemm_eff_max
    effs = [gemm_efficiency(n, x, x, hw) for x in (64, 128, 256, 512, 1024, 4096, 16384)]
    assert effs == sorted(effs) and effs[-1] < hw.gemm_eff_max


def test_pipeline_bubble_formula():
    for p, m in ((2, 1), (4, 8), (8, 32)):
        total, bubble = pm.pipeline_time([1.0] * p, m)
        assert total == pytest.approx(m + p - 1)
        assert bubble / total == pytest.approx((p - 1) / (m + p - 1))
    total, bubble = pm.pipeline_time([1.0] * 4, 8, v=3)
    assert bubble == pytest.approx(3 / 3)


def test_more_tp_less_memory_per_gpu():
    hw = hardware("a100-80gb")
    for mode in MODES:
        mems = [pm.predict(COLA_7B, pm.Layout(mode=mode, tp=t, micro_batch=1), hw)
                .memory_gb["total"] for t in (1, 2, 4, 8)]
        assert all(a > b for a, b in zip(mems, mems[1:])), (mode, mems)
    # naive replicates attention and the MLP activation: its activations shrink far less
    act = {m: [pm.predict(COLA_7B, pm.Layout(mode=m, tp=t, micro_batch=1), hw)
               .memory_gb["activations"] for t in (1, 8)] for m in ("naive", "boost")}
    assert act["boost"][1] / act["boost"][0] < 0.5 * act["naive"][1] / act["naive"][0]


def test_full_rank_gpu_predictions_use_sequence_parallelism():
    """Full rank at TP > 1 is predicted as megatron runs it (the trainer's default): with
    sequence parallelism the norm / residual activations it saves are sharded by t (4d/t
    instead of 4d per token per layer) and each d-wide all-reduce is a reduce-scatter plus an
    all-gather of the same bytes (plus the backward re-gather of the qkv / fc1 input). The
    BOOST paper's baseline (no SP) stays available; boost refuses the flag as the trainer
    does."""
    hw, t, b = hardware("h100-80gb"), 4, 1
    sp, no_sp, default = (pm.predict(COLA_7B, pm.Layout(mode="full", tp=t, micro_batch=b,
                                                        sequence_parallel=v), hw)
                          for v in (True, False, None))
    for field in ("iteration_s", "breakdown_s", "memory_gb", "comm"):  # default: megatron's
        assert getattr(default, field) == getattr(sp, field), field
    d, n, L = COLA_7B.hidden, b * COLA_7B.seq_length, COLA_7B.num_layers
    saved_gb = lambda p: p.memory_gb["activations"]  # noqa: E731
    # per layer, per token: 4d of norm / linear inputs become 4d/t; the embedding output d
    # becomes d/t (one micro-batch in flight at pp = 1); rounding of memory_gb: 1e-3 GB
    expected = (4 * d * (1 - 1 / t) * L + d * (1 - 1 / t)) * n * 2 / 1e9
    assert saved_gb(no_sp) - saved_gb(sp) == pytest.approx(expected, abs=2e-3)
    # 4 forward / 6 backward half-collectives of d; the same bytes as the 2 + 2 all-reduces
    # on the wire forward (a ring all-reduce is a reduce-scatter plus an all-gather)
    assert sp.comm["tp_collectives_per_layer"] == 10
    assert sp.comm["tp_elements_per_token_per_layer_fwd"] == 4 * d
    assert no_sp.comm["tp_elements_per_token_per_layer_fwd"] == 2 * d
    assert sp.breakdown_s["elementwise"] < no_sp.breakdown_s["elementwise"]
    with pytest.raises(ValueError, match="does not apply to boost"):
        pm.predict(COLA_7B, pm.Layout(mode="boost", tp=t, sequence_parallel=True), hw)


def test_recompute_policies_trade_time_for_memory():
    hw = hardware("a100-80gb")
    res = {rc: pm.predict(COLA_7B, pm.Layout(mode="boost", tp=4, micro_batch=4,
                                             recompute=rc), hw)
           for rc in pm.RECOMPUTE}
    t = {rc: p.iteration_s for rc, p in res.items()}
    mem = {rc: p.memory_gb["activations"] for rc, p in res.items()}
    assert t["none"] < t["selective"] < t["lowrank"] < t["full"]
    assert mem["none"] > mem["selective"] > mem["lowrank"] > mem["full"]
    assert res["lowrank"].breakdown_s["recompute"] > 0
    # lowrank never re-runs a collective; full recompute re-runs the forward ones
    assert (res["lowrank"].breakdown_s["tp_comm"]
            == pytest.approx(res["none"].breakdown_s["tp_comm"]))
    assert res["full"].breakdown_s["tp_comm"] > res["none"].breakdown_s["tp_comm"]
    with pytest.raises(ValueError):
        pm.predict(COLA_7B, pm.Layout(mode="full", tp=4, recompute="lowrank"), hw)


def test_params_and_dp_pp_accounting():
    # low-rank projections cost r·(d_in + d_out); embedding and head stay full rank
    assert COLA_7B.layer_params(lowrank=True) == 1024 * (4 * 8192 + 3 * (4096 + 11008)) + 8192
    assert COLA_7B.embedding_params() == 2 * 32000 * 4096 + 4096
    hw = hardware("a100-80gb")
    one = pm.predict(COLA_7B, pm.Layout(mode="boost", tp=4, dp=1, micro_batch=2,
                                         global_batch=16), hw)
    dp4 = pm.predict(COLA_7B, pm.Layout(mode="boost", tp=4, dp=4, micro_batch=2,
                                         global_batch=16), hw)
    assert dp4.comm["dp_gradient_bytes"] > 0 and one.comm["dp_gradient_bytes"] == 0
    assert dp4.iteration_s < one.iteration_s
    pp2 = pm.predict(COLA_7B, pm.Layout(mode="boost", tp=4, pp=2, micro_batch=2,
                                         global_batch=16), hw)
    assert pp2.breakdown_s["pp_bubble"] > 0
    assert pp2.comm["pp_p2p_bytes_per_microbatch"] == 2 * 4096 * 4096 // 4 * 2
    assert pp2.memory_gb["weights"] < one.memory_gb["weights"]


def test_tied_boost_adds_the_embeddings_reduce_scatter_and_all_gather():
    """Tied boost looks up the vocab-parallel table and reduce-scatters the partial rows to the
    hidden shards forward, all-gathering their gradient backward (docs/design.md §2, §5): two
    d-wide collectives of all-gather cost per micro-batch on the first stage over the untied
    model's TP time. Tied full and naive keep their collectives; every tied model holds one
    table instead of two (pp = 1)."""
    hw = hardware("a100-80gb")
    tied_shape = dataclasses.replace(COLA_7B, tied_embeddings=True)
    n, d, t = 2 * 4096, 4096, 4  # tokens of a micro-batch, hidden, TP
    for mode in MODES:
        layout = pm.Layout(mode=mode, tp=t, micro_batch=2, global_batch=16)
        untied, tied = pm.predict(COLA_7B, layout, hw), pm.predict(tied_shape, layout, hw)
        m = tied.layout["num_micro_batches"]
        added = 2 * allgather_time(n * d * pm.BYTES_ACT, t, hw, True) if mode == "boost" else 0
        # breakdowns are rounded to the microsecond
        assert tied.breakdown_s["tp_comm"] == pytest.approx(
            untied.breakdown_s["tp_comm"] + m * added, abs=2e-6), mode
        assert untied.memory_gb["weights"] - tied.memory_gb["weights"] == pytest.approx(
            32000 * d / t * pm.BYTES_WEIGHT / 1e9, abs=2e-3), mode


def test_boost_tp_time_is_the_measured_collectives():
    """boost's TP seconds per step are the collectives the op ledger records (the widths of
    tests/test_step_comm.py), each as long as the GEMMs issued beside it cannot hide it: per
    layer the four synchronous forward all-reduces in full, the fp32 statistic's (started
    before the A GEMM) and the backward ones (overlapped with the dB GEMMs) only where they
    outlast that GEMM; at the head the all-gather of the hidden shards forward and the output
    layer's all-reduce of d backward, plus the cross entropy's three fp32 all-reduces. With
    the forward all-reduces pipelined over 2 blocks of the sequence, the first block's hides
    behind the second block's GEMM."""
    hw = hardware("a100-80gb")
    n, d, t = 2 * 4096, 4096, 4
    layout = pm.Layout(mode="boost", tp=t, micro_batch=2, global_batch=16)
    pred = pm.predict(COLA_7B, layout, hw)
    fwd, bwd = tp_comm_widths(COLA_7B, "boost", dtype="bf16")

    def all_reduce(nbytes):
        return allreduce_time(nbytes, t, hw, True)

    products = sum(all_reduce(n * w * pm.BYTES_ACT) for w in fwd if w > 1)  # synchronous
    hidden = sum(all_reduce(n * w * pm.BYTES_ACT) for w in bwd) + 2 * all_reduce(n * 4)
    head = (3 * all_reduce(n * 4) + allgather_time(n * d * pm.BYTES_ACT, t, hw, True)
            + all_reduce(n * d * pm.BYTES_ACT))
    m, layers = pred.layout["num_micro_batches"], COLA_7B.num_layers
    tp = pred.breakdown_s["tp_comm"]
    assert m * (layers * products + head) - 2e-6 <= tp < m * (layers * (products + hidden)
                                                              + head)
    piped = pm.predict(COLA_7B, dataclasses.replace(layout, overlap_chunks=2), hw)
    assert piped.breakdown_s["tp_comm"] < tp


def test_hardware_table_complete():
    for name in ("a100-80gb", "a100-40gb", "h100-80gb", "h200", "b200"):
        hw = hardware(name)
        for f in dataclasses.fields(hw):
            v = getattr(hw, f.name)
            if isinstance(v, (int, float)) and f.name not in ("step_overhead_ms",):
                assert v > 0, (name, f.name)
    assert hardware("h100-80gb").peak_bf16_tflops > hardware("a100-80gb").peak_bf16_tflops
    # a switchless 4-GPU mesh gives a TP2 group only the direct pair links
    mesh = hardware("a100-80gb-perlmutter")
    switch = hardware("a100-80gb")
    assert allreduce_time(1e9, 2, mesh, True) > allreduce_time(1e9, 2, switch, True)
    assert allreduce_time(1e9, 4, mesh, True) == allreduce_time(1e9, 4, switch, True)
    with pytest.raises(ValueError):
        hardware("tpu-v9")


def test_recommend_returns_fitting_sorted_layouts():
    hw = hardware("a100-40gb")
    res = recommend(COLA_7B, 16, hw, top=3)
    assert set(res) == set(MODES)
    for mode, preds in res.items():
        assert preds, mode
        assert all(p.fits for p in preds)
        times = [p.iteration_s for p in preds]
        assert times == sorted(times)
        for p in preds:
            assert p.layout["tp"] * p.layout["pp"] * p.layout["dp"] == 16
            assert p.layout["global_batch"] == 8 * 16


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


# The CLI runs in this process: its layers' op ledgers are the ones the tests above measured
# already (one per process, measure/ledger.py); test_bad_input runs tools/perf_model.py itself.


def test_cli_compare_published_writes_json(tmp_path, capsys):
    out = tmp_path / "pub.json"
    assert main(["--compare-published", "--json", str(out)]) == 0
    assert "8/8 full and naive cells (the fit's) within ±15 %" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data["published_comparison"]) == 12
    assert data["hardware"]["peak_bf16_tflops"] == 312.0


def test_cli_recommend_prints_layouts(tmp_path, capsys):
    out = tmp_path / "rec.json"
    assert main(["--recommend", "--gpus", "16", "--gpu", "h100-80gb", "--modes", "naive,boost",
                 "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "[boost]" in stdout and "[naive]" in stdout and "[full]" not in stdout
    assert stdout.count("tp=") >= 2
    # the figures say they are predicted, and what mb= and m= are
    assert stdout.startswith("Fastest layouts that fit, predicted (not measured): ")
    assert "mb = micro-batch size, m = micro-batches per step" in stdout.splitlines()[0]
    rows = [line for line in stdout.splitlines() if line.startswith("  tp=")]
    assert rows and all(" predicted: iter=" in row for row in rows), rows
    data = json.loads(out.read_text())
    assert set(data["recommend"]) == {"naive", "boost"}


def test_cli_with_config(tmp_path, capsys):
    cfg = tmp_path / "cola7b.yaml"
    cfg.write_text(
        "model:\n  num_layers: 32\n  hidden_size: 4096\n  ffn_hidden_size: 11008\n"
        "  num_attention_heads: 32\n  vocab_size: 32000\n  seq_length: 2048\n"
        "  rank_ratio: 0.25\n"
        "parallel:\n  mode: boost\n  tp: 4\n  pp: 1\n"
        "training:\n  micro_batch_size: 2\n  global_batch_size: 64\n")
    out = tmp_path / "pred.json"
    rc = main(["--config", str(cfg), "--gpus", "8", "--gpu", "a100-80gb",
                  "--recompute", "lowrank", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "[boost]" in text and "tp=4 pp=1 dp=2" in text
    for line in text.splitlines():  # every figure says it is predicted, and what m= is
        if line.startswith("["):
            assert "] predicted (not measured) for " in line and re.search(
                r" mb=\d+ m=\d+ .*\(mb = micro-batch size, m = micro-batches per step\)$",
                line), line
        elif not line.startswith(("  comm (counted):", "wrote ", "note: ")):
            assert line.startswith("  predicted "), line
    preds = json.loads(out.read_text())["predictions"]
    assert [p["mode"] for p in preds] == ["full", "naive", "boost"]
    assert preds[0]["layout"]["recompute"] == "full"  # full-rank: no bottleneck to checkpoint
    assert preds[2]["layout"]["recompute"] == "lowrank"
    assert preds[2]["comm"]["tp_elements_per_token_per_layer_fwd"] == 7170
    assert preds[2]["layout"]["num_micro_batches"] == 64 // (2 * 2)
    assert preds[2]["iteration_s"] < preds[0]["iteration_s"]


def test_docs_sizing_table_is_current(capsys):
    """docs/sizing.md holds exactly what `tools/perf_model.py --sizing-table` prints: every
    shipped GPU config once (the CPU configs, device: cpu, are not sized)."""
    from pathlib import Path

    from megatron_boost.config.run import load_run_config
    from megatron_boost.perf.sizing import replace_table

    assert main(["--sizing-table"]) == 0
    table = capsys.readouterr().out
    doc = (Path(ROOT) / "docs" / "sizing.md").read_text()
    assert replace_table(doc, table) == doc, (
        "docs/sizing.md is stale: python tools/perf_model.py --sizing-table --write "
        "docs/sizing.md")
    gpu_configs = sorted(p.name for p in (Path(ROOT) / "configs").glob("*.yaml")
                         if p.name != "reference.yaml"
                         and load_run_config(str(p)).training.device != "cpu")
    assert len(gpu_configs) >= 10
    rows = [line for line in table.splitlines() if line.startswith("| `configs/")]
    assert sorted(r.split("`")[1].split("/")[1] for r in rows) == gpu_configs


def test_tp_divisibility_is_the_trainers_rule():
    """The perf model accepts exactly the layouts the trainer accepts (config.transformer's
    check_tp_split): boost never shards the rank, so a rank that tp does not divide is a valid
    boost layout and an invalid naive one."""
    from megatron_boost.config.modes import check_tp_split

    shape = ModelShape(name="odd-rank", num_layers=2, hidden=512, ffn=1024, heads=8,
                       vocab=32000, seq_length=256, attn_rank=100, mlp_rank=100)
    hw = hardware("a100-80gb")
    assert pm.predict(shape, pm.Layout(mode="boost", tp=8), hw).mfu > 0
    with pytest.raises(ValueError, match=r"attn_rank \(100\) must be divisible"):
        pm.predict(shape, pm.Layout(mode="naive", tp=8), hw)
    for mode in MODES:
        for tp in (1, 2, 3, 4, 8):
            sizes = dict(hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8,
                         num_query_groups=8, attn_rank=100, mlp_rank=100)
            try:
                check_tp_split(mode, tp, **sizes)
                trainer_ok = True
            except ValueError:
                trainer_ok = False
            try:
                pm.predict(shape, pm.Layout(mode=mode, tp=tp), hw)
                model_ok = True
            except ValueError:
                model_ok = False
            assert model_ok == trainer_ok, (mode, tp)
