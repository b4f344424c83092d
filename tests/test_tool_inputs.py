"""The analysis tools refuse bad input in one line before any work: an output file that cannot
be written (``--json``, checked while the command line is parsed, before measuring or
predicting), a layout the trainer refuses, an option that would do nothing. In this process
through each tool's ``main(argv)``; nothing is measured (a measurement that started fails the
test)."""

import argparse
from pathlib import Path

import pytest

from megatron_boost.cli import layer_ops, perf_model
from megatron_boost.cli.arg_types import output_file
from tests.test_training import DEBUG

pytestmark = pytest.mark.fast


def _unwritable(tmp_path: Path) -> dict:
    """Output paths that cannot be written, even by root."""
    (tmp_path / "f").write_text("x")
    return {"a directory": (str(tmp_path), "is a directory"),
            "below a file": (str(tmp_path / "f" / "out.json"), "does not exist"),
            "missing folder": (str(tmp_path / "none" / "out.json"), "does not exist"),
            "under /proc": ("/proc/mboost_out.json", "cannot create a file in /proc")}


def test_output_file_refuses_paths_that_cannot_be_written(tmp_path):
    for what, (path, needle) in _unwritable(tmp_path).items():
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            output_file(path)
    assert output_file(str(tmp_path / "new.json")) == str(tmp_path / "new.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the probe is gone


def _one_error_line(capsys, needles) -> None:
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if "error:" in line]
    assert len(lines) == 1, out.err
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    assert "Traceback" not in out.err + out.out


def _exit_status(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def _no_measuring(monkeypatch):
    def measured(*args, **kwargs):
        raise AssertionError("the tool started its work before checking its output path")

    from megatron_boost.measure import ledger
    from megatron_boost.perf import model

    monkeypatch.setattr(ledger, "layer_ledger", measured)
    monkeypatch.setattr(model, "predict", measured)
    monkeypatch.setattr(perf_model, "predict", measured)
    monkeypatch.setattr(perf_model, "compare_published", measured)


@pytest.mark.parametrize("tool", ["layer_ops", "perf_model"])
def test_json_path_is_checked_before_any_work(tool, tmp_path, monkeypatch, capsys):
    _no_measuring(monkeypatch)
    main = {"layer_ops": layer_ops.main, "perf_model": perf_model.main}[tool]
    args = {"layer_ops": ["--config", DEBUG], "perf_model": ["--compare-published"]}[tool]
    for path, needle in _unwritable(tmp_path).values():
        assert _exit_status(main, [*args, "--json", path]) == 2
        _one_error_line(capsys, ("--json", path, needle))


def test_perf_model_refuses_a_pipeline_split_the_trainer_refuses(capsys):
    """The built-in 7B shape has 32 layers: --pp 5 is refused with the validation pass's own
    words; --pp 4 is predicted."""
    assert _exit_status(perf_model.main, ["--pp", "5", "--gpus", "5"]) == 2
    _one_error_line(capsys, ("pp=5", "model.num_layers (32) must be divisible by parallel.pp "
                                     "(5)"))
    args = perf_model.build_parser().parse_args(["--pp", "4", "--gpus", "4"])
    perf_model.check_layouts(perf_model._setup(args), args.modes, None)  # accepted


def test_perf_model_refuses_a_config_layout_the_trainer_refuses(tmp_path, capsys):
    """A config's mode the TP split refuses (naive shards the rank: 16 over 3)."""
    assert _exit_status(perf_model.main, ["--config", DEBUG, "--tp", "3", "--gpus", "3",
                                          "--modes", "naive"]) == 2
    _one_error_line(capsys, ("naive at tp=3", "divisible"))


def test_perf_model_write_needs_a_table(tmp_path, capsys):
    target = tmp_path / "sizing.md"
    target.write_text("unchanged\n")
    assert _exit_status(perf_model.main, ["--write", str(target)]) == 2
    _one_error_line(capsys, ("--write", "--sizing-table or --paper-layouts"))
    assert target.read_text() == "unchanged\n"


# -- tools/paper_table.py and scripts/slurm/paper_table.sh ------------------------------------


def _no_launch(monkeypatch):
    from megatron_boost.cli import paper_table

    def launched(*args, **kwargs):
        raise AssertionError("paper_table launched before checking its environment")

    monkeypatch.setattr(paper_table, "_launch", launched)
    monkeypatch.setattr(paper_table, "_gpus_here", lambda: 8)
    return paper_table


@pytest.mark.parametrize("value", ["abc", "-1", "2.5"])
def test_paper_table_names_a_bad_gpu_count(value, monkeypatch, capsys):
    paper_table = _no_launch(monkeypatch)
    monkeypatch.setenv("MBOOST_GPUS", value)
    assert _exit_status(paper_table.main, ["--rows", "1B"]) == 2
    _one_error_line(capsys, (f"MBOOST_GPUS='{value}'", "not a GPU count", "unset it"))


def test_paper_table_names_a_launcher_that_does_not_exist(monkeypatch, capsys, tmp_path):
    paper_table = _no_launch(monkeypatch)
    monkeypatch.setenv("TORCHRUN", f"{tmp_path}/torchrun --nnodes=1")
    assert _exit_status(paper_table.main, ["--rows", "1B"]) == 2
    _one_error_line(capsys, ("TORCHRUN=", f"'{tmp_path}/torchrun' is not a command"))
    monkeypatch.setenv("TORCHRUN", "bash -c")  # a command that exists is used as given
    assert paper_table.launcher_command() == ["bash", "-c"]


def test_paper_table_json_is_checked_before_running(monkeypatch, capsys):
    paper_table = _no_launch(monkeypatch)
    assert _exit_status(paper_table.main, ["--dry-run", "--json", "/proc/t.json"]) == 2
    _one_error_line(capsys, ("--json", "/proc/t.json"))


def _paper_table_sh(script: Path, submit_dir: Path, *args) -> "subprocess.CompletedProcess":
    import os
    import subprocess

    env = dict(os.environ, SLURM_SUBMIT_DIR=str(submit_dir))
    return subprocess.run(["bash", str(script), *args], cwd=submit_dir, env=env,
                          capture_output=True, text=True, timeout=120)


def test_paper_table_sh_submitted_outside_the_repository(tmp_path):
    """sbatch runs a copy of the script from its spool directory with the submit directory as
    SLURM_SUBMIT_DIR: from outside the repository, one error line; run directly from there,
    the script finds its own checkout."""
    import shutil

    from tests.test_training import ROOT

    spool = tmp_path / "spool" / "job1"
    spool.mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "slurm" / "paper_table.sh", spool / "slurm_script")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _paper_table_sh(spool / "slurm_script", elsewhere, "--rows", "1B")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: {elsewhere} is not the megatron-boost repository (no tools/paper_table.py): "
        f"submit from the repository root (cd there, then sbatch scripts/slurm/paper_table.sh)"]
    direct = _paper_table_sh(ROOT / "scripts" / "slurm" / "paper_table.sh", elsewhere, "--help")
    assert direct.returncode == 0 and "--dry-run" in direct.stdout, direct.stderr
