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

    from megatron_boost.analysis import ledger
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
