"""The paper's table: its configs pass ``--check`` at every row's layout in every mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_boost.config.shape import MODES
from megatron_boost.cli.pretrain import main as pretrain_main
from megatron_boost.perf.published import PAPER_ROWS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.fast
@pytest.mark.parametrize("row", sorted(PAPER_ROWS))
def test_paper_config_passes_check_at_its_layout_in_every_mode(row, capsys):
    config, tp, pp, _ = PAPER_ROWS[row]
    for mode in MODES:
        code = pretrain_main(["--check", "--world-size", str(tp * pp), "--config", config,
                              f"parallel.mode={mode}", f"parallel.tp={tp}", f"parallel.pp={pp}"])
        assert code == 0, f"{row} {mode}: {capsys.readouterr()}"


def test_dry_run_prints_the_full_table(tmp_path):
    """scripts/slurm/paper_table.sh --dry-run: the GPU run's script and code path on the CPU
    (two gloo processes, tiny shapes) prints every row in every mode, labelled as CPU figures,
    the ratios, and writes the JSON that scripts/render_docs.py renders to the same table."""
    import json
    import subprocess

    from megatron_boost.cli.paper_table import markdown_table
    out = tmp_path / "table.json"
    proc = subprocess.run(["scripts/slurm/paper_table.sh", "--dry-run", "--warmup", "0",
                           "--iters", "1", "--json", str(out)], cwd=ROOT, text=True,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU dry run" in proc.stdout
    for row in PAPER_ROWS:
        for mode in MODES:
            assert f"| {row} | {mode} |" in proc.stdout, (row, mode, proc.stdout)
        assert f"| {row} | " in proc.stdout.split("boost/vanilla")[-1], row
    report = json.loads(out.read_text())
    assert report["cpu_dry_run"] and not report["skipped"]
    assert markdown_table(report) in proc.stdout


@pytest.mark.fast
def test_sizing_doc_has_every_paper_layout_and_flags_the_shapes_that_do_not_divide(capsys):
    """docs/sizing.md's paper-layouts table is the tool's output; it predicts every row in
    every mode and names the rule the CoLA 1B shape (ffn 5461) breaks at TP = 4 in the modes
    that shard the MLP (full, boost), not in naive's."""
    from megatron_boost.cli.perf_model import main
    from megatron_boost.perf.sizing import PAPER_BEGIN, PAPER_END, replace_table

    assert main(["--paper-layouts"]) == 0
    table = capsys.readouterr().out
    doc = (ROOT / "docs" / "sizing.md").read_text()
    assert replace_table(doc, table, PAPER_BEGIN, PAPER_END) == doc, (
        "docs/sizing.md is stale: python tools/perf_model.py --paper-layouts --write "
        "docs/sizing.md")
    lines = table.splitlines()
    for row, (config, tp, pp, _) in PAPER_ROWS.items():
        for mode in MODES:
            line = next(x for x in lines if x.startswith(f"| {row} | `{config}` | {tp}×{pp} | "
                                                         f"{mode} |"))
            assert "does not divide" not in line, line
    flagged = [x for x in lines if "does not divide" in x]
    assert len(flagged) == 2 and all("1B-tp4" in x and "ffn_hidden_size (5461)" in x
                                     for x in flagged), flagged


@pytest.mark.compat
def test_tied_checkpoint_reshards_from_tp2_to_pp2_with_its_optimizer_state(tmp_path):
    """A tied boost run saved at TP=2 (one vocab-parallel table) resumes at TP=1 × PP=2, where
    the last stage holds megatron's copy of the table: the weights and the distributed
    optimizer's state reshard, so the resumed iterations give the uninterrupted run's losses."""
    from tests.test_training import losses, run_training

    tied = ["model.share_embeddings_and_output_weights=true", "model.vocab_size=256",
            "parallel.use_distributed_optimizer=true", "training.train_iters=4",
            "optimizer.lr_decay_iters=4", "training.eval_interval=100",
            "logging.log_interval=1", "checkpoint.save_interval=2"]
    first, second = tmp_path / "tp2", tmp_path / "pp2"
    run_training(2, tied + ["parallel.tp=2", f"logging.run_dir={first}"])
    proc = run_training(2, tied + ["parallel.tp=1", "parallel.pp=2", f"logging.run_dir={second}",
                                   f"checkpoint.load={first / 'checkpoints' / 'iter_0000002'}"])
    assert "saved layout tp=2 pp=1" in proc.stdout
    ref, got = losses(first), losses(second)
    assert sorted(got) == [3, 4]
    for it in (3, 4):  # fp32 CPU, sums in another order: agreement to rounding
        assert got[it] == pytest.approx(ref[it], rel=1e-5), (it, got[it], ref[it])


@pytest.mark.fast
def test_gpu_report_has_mfu_and_the_perf_model_prediction_of_the_run_shape():
    """The GPU branch of the table without a GPU: a measured report of the 3B row on an H200
    gets MFU from the device's peak and the prediction of the shape that ran (28 layers, not
    the 26 of the authors' timed runs)."""
    from megatron_boost.config.shape import ModelShape
    from megatron_boost.cli.paper_table import markdown_table, summarise
    from megatron_boost.config.run import load_run_config
    from megatron_boost.perf.hardware import hardware
    from megatron_boost.perf.model import Layout, predict

    modes = {m: {"times_s": [2.0, 1.0, 3.0], "vocab": 32000, "peak_memory_bytes": 2 ** 34}
             for m in MODES}
    raw = {"device": "NVIDIA H200", "skipped": {}, "rows": {"3B": {
        "tp": 2, "pp": 1, "dp": 1, "seq_length": 4096, "micro_batch_size": 4, "modes": modes}}}
    report = summarise(raw, dry_run=False, warmup=1, iters=3)
    shape = ModelShape.from_config(load_run_config(ROOT / "configs/paper-3b.yaml").model)
    assert shape.num_layers == 28
    for row in report["rows"]:
        lay = Layout(mode=row["mode"], tp=2, pp=1, dp=1, micro_batch=4, recompute="none")
        assert row["predicted_s"] == round(predict(shape, lay, hardware("h200")).iteration_s, 4)
        assert row["iteration_s"] == 2.0 and 0 < row["mfu"] < 1
        assert row["published_a100_s"] is not None
    assert "predicted s (h200)" in markdown_table(report)
