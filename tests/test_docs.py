"""The documentation's figures come from committed result files (scripts/render_docs.py)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.fast


def _render_docs():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "scripts/render_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_blocks_match_their_files():
    assert _render_docs().stale_blocks(ROOT) == {}


def test_a_changed_figure_is_reported(tmp_path):
    """Negative control: a block whose body no longer equals its file is found."""
    rd = _render_docs()
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "x.txt").write_text("ratio 1.84x\n")
    block = "<!-- generated: include docs/results/x.txt -->\n{}<!-- end generated -->\n"
    (tmp_path / "README.md").write_text(block.format(rd.render_block(tmp_path,
                                                                     "include docs/results/x.txt")))
    assert rd.stale_blocks(tmp_path) == {}
    (tmp_path / "README.md").write_text(block.format("```text\nratio 1.90x\n```\n"))
    assert rd.stale_blocks(tmp_path) == {"README.md": ["include docs/results/x.txt"]}
    assert rd.main(["--root", str(tmp_path)]) == 0  # rewriting restores the file's figure
    assert "1.84x" in (tmp_path / "README.md").read_text()


def test_every_result_file_has_a_command():
    """Each file under docs/results/ is written by scripts/regenerate_results.sh."""
    script = (ROOT / "scripts/regenerate_results.sh").read_text()
    missing = [p.name for p in (ROOT / "docs/results").iterdir() if p.name not in script]
    assert missing == []


def _compare_optimizers():
    spec = importlib.util.spec_from_file_location("compare_optimizers",
                                                  ROOT / "scripts/compare_optimizers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_appended_run_replaces_its_repeat(tmp_path):
    """compare_optimizers --append: a repeated (mode, optimizer, lr, iters) replaces the old run,
    rows come out by mode, optimizer and lr, and earlier sittings' command lines are kept."""
    co = _compare_optimizers()

    def run(mode, lr, ppl):
        return {"mode": mode, "optimizer": "muon", "lr": lr, "iters": 150, "exit": 0,
                "val_ppl": {"150": ppl}, "tokens": 1}

    results = {"modes": ["boost", "full"], "runs": [run("full", 3e-3, 120.0)], "timing": {},
               "commands": ["python scripts/compare_optimizers.py --modes full"]}
    for r in (run("full", 1e-3, 130.0), run("boost", 1e-2, 110.0), run("full", 3e-3, 100.0)):
        co.record(results, r)
    co.write(results, tmp_path / "optimizers")
    text = (tmp_path / "optimizers.txt").read_text()
    rows = [line.split()[:3] for line in text.splitlines() if line.startswith(("boost ", "full "))
            and "@150" in line]
    assert rows == [["boost", "muon", "0.01"], ["full", "muon", "0.001"],
                    ["full", "muon", "0.003"]]
    assert "@150:   100.00" in text and "120.00" not in text
    assert text.startswith("$ python scripts/compare_optimizers.py --modes full\n")


def test_timing_only_retimes_every_pair_and_keeps_the_runs(tmp_path, monkeypatch):
    """compare_optimizers --timing-only --append: every (mode, optimizer) of --modes is timed
    again in this sitting, an earlier sitting's timing is replaced, the runs stay."""
    co = _compare_optimizers()
    run = {"mode": "boost", "optimizer": "muon", "lr": 1e-2, "iters": 300, "exit": 0,
           "val_ppl": {"300": 90.0}, "tokens": 1}
    out = tmp_path / "optimizers"
    out.with_suffix(".json").write_text(json.dumps(
        {"modes": ["boost"], "runs": [run], "commands": [],
         "timing": {"boost-muon": {"step_s": 9.0, "optimizer_s": 8.0}}}))
    timed = []
    monkeypatch.setattr(co, "time_steps", lambda mode, optimizer, steps: timed.append(
        (mode, optimizer)) or {"step_s": 0.5, "optimizer_s": 0.1})
    assert co.main(["--timing-only", "--append", "--modes", "boost,full",
                    "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    assert timed == [("boost", "adamw"), ("boost", "muon"), ("full", "adamw"), ("full", "muon")]
    assert all(t == {"step_s": 0.5, "optimizer_s": 0.1} for t in results["timing"].values())
    assert results["runs"] == [run] and len(results["timing"]) == 4


def test_bench_table_reads_the_json(tmp_path):
    """The benchmark table shows the JSON's own numbers (median step, ratios, overhead)."""
    rd = _render_docs()
    row = {"step_time_median_s": 2.0, "tokens_per_s": 1024.0,
           "tp_comm_bytes_per_step": 64 * 2**20, "saved_activation_bytes_per_microbatch": 2**20}
    base = {"recompute": "none", "steps": 3, "modes": {"boost TP=2": row},
            "ratios": {"boost/naive speed": 1.5}}
    lowrank = {"recompute": "lowrank", "steps": 3,
               "modes": {"boost TP=2": {**row, "step_time_median_s": 2.5,
                                        "saved_activation_bytes_per_microbatch": 2**19}},
               "ratios": {}}
    (tmp_path / "a.json").write_text(json.dumps(base))
    (tmp_path / "b.json").write_text(json.dumps(lowrank))
    text = rd.render_block(tmp_path, "bench a.json b.json")
    assert "| boost TP=2 | none | 2.000 | 1,024 | 64.0 | 1.0 |" in text
    assert "boost/naive speed 1.50x" in text
    assert "step time 1.25x (+25%), saved activations 0.50x" in text
