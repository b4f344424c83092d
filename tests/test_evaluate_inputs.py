"""tools/evaluate.py: an input with nothing to score is refused in one line before any model is
loaded, and a checkpoint is evaluated where it lies even when its run's directories cannot be
written here (a read-only copy, another machine's paths): evaluation writes nothing there, so
the trainer's output-directory rules do not apply. In this process through the tool's ``main``
on a checkpoint trained here (configs/debug.yaml, one frozen iteration, a tokenizer)."""

import shutil
import zlib
from pathlib import Path

import pytest

from megatron_boost.cli import evaluate
from tests.convert_fixtures import FROZEN_TRAINING, sample_text
from tests.test_training import DEBUG


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): zlib.crc32(p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_error_line(capsys, needles) -> None:
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if "error:" in line]
    assert len(lines) == 1, out.err
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    assert "Traceback" not in out.err


@pytest.mark.parametrize("name,content", [("empty.txt", ""), ("blank.txt", " \n\n"),
                                          ("empty.jsonl", "\n")])
def test_an_input_with_no_text_is_one_line_before_loading(name, content, tmp_path, capsys):
    (tmp_path / name).write_text(content)
    assert evaluate.main([str(tmp_path / "no_model"), "--input", str(tmp_path / name)]) == 2
    _one_error_line(capsys, (f"--input '{tmp_path / name}'", "no text to score"))


def _one_token_text(tokenizer_model: str) -> str:
    """A word the test tokenizer (trained on the README, so its pieces follow the README's
    text) encodes as one token."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
    for piece in range(sp.get_piece_size()):
        text = sp.decode([piece]).strip()
        if text.isalpha() and len(sp.encode(text)) == 1:
            return text
    raise AssertionError("the test tokenizer has no one-token word")


def test_an_input_of_one_token_is_one_line(tmp_path, capsys, trained, tokenizer_model):
    (tmp_path / "one.txt").write_text(_one_token_text(tokenizer_model))
    assert evaluate.main([str(trained), "--input", str(tmp_path / "one.txt")]) == 2
    _one_error_line(capsys, ("one.txt", "1 token", "at least 2"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer_model) -> Path:
    """The checkpoints folder of a one-iteration run whose run directory is then replaced by a
    file: its saved logging.run_dir and checkpoint.save can no longer be created, as on a
    read-only copy or another machine."""
    from megatron_boost.cli import pretrain

    root = tmp_path_factory.mktemp("evaluate_inputs")
    run = root / "run"
    assert pretrain.main(["--config", DEBUG, *FROZEN_TRAINING,
                          f"data.tokenizer_model={tokenizer_model}",
                          f"logging.run_dir={run}"]) == 0
    copy = root / "copy" / "checkpoints"
    shutil.copytree(run / "checkpoints", copy)
    shutil.rmtree(run)
    run.write_text("not a directory any more\n")
    return copy


def test_a_checkpoint_whose_run_directories_cannot_be_written_is_evaluated(trained, tmp_path,
                                                                           capsys):
    (tmp_path / "t.txt").write_text(sample_text()[:600])
    before = _snapshot(trained.parent)
    assert evaluate.main([str(trained), "--input", str(tmp_path / "t.txt")]) == 0, \
        capsys.readouterr().err
    assert "perplexity" in capsys.readouterr().out
    assert _snapshot(trained.parent) == before  # nothing written beside the checkpoint


def test_json_is_checked_before_loading(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("to be or not to be\n")
    with pytest.raises(SystemExit) as exit_:
        evaluate.main([str(tmp_path / "no_model"), "--input", str(tmp_path / "t.txt"),
                       "--json", "/proc/scores.json"])
    assert exit_.value.code == 2
    _one_error_line(capsys, ("--json", "/proc/scores.json", "cannot create"))
