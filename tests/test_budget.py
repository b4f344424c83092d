"""A run's length: exactly one of training.train_iters / training.train_tokens.

Both set would let one silently win (configs/cola-350m.yaml sets train_tokens, and an
override train_iters=50 used to be ignored: 781,250 iterations instead of 50). Both set is an
error naming both; a command-line override of one drops the other from the YAML file; the run
prints the budget it uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_boost.config.run import load_run_config
from megatron_boost.config.validation import budget_line, train_iterations

ROOT = Path(__file__).resolve().parents[1]
COLA_350M = str(ROOT / "configs" / "cola-350m.yaml")  # sets train_tokens: 6.4e9
DEBUG = str(ROOT / "configs" / "debug.yaml")  # sets train_iters: 6


def test_both_budgets_in_the_file_is_an_error_naming_both(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("training:\n  train_iters: 50\n  train_tokens: 1000000\n")
    with pytest.raises(ValueError) as err:
        load_run_config(str(path))
    assert "training.train_iters (50)" in str(err.value)
    assert "training.train_tokens (1000000)" in str(err.value)


def test_both_budgets_on_the_command_line_is_an_error():
    with pytest.raises(ValueError, match="train_iters .*train_tokens .*both set"):
        load_run_config(DEBUG, ["training.train_iters=5", "training.train_tokens=4096"])


def test_no_budget_is_an_error_at_launch(tmp_path):
    with pytest.raises(ValueError, match="set training.train_iters .* or training.train_tokens"):
        load_run_config(None, ["data.mock=true", f"logging.run_dir={tmp_path}"],
                        world_size=1)


def test_train_iters_defaults_to_null():
    assert load_run_config(None).training.train_iters is None


@pytest.mark.parametrize("path,override,kept,dropped,iters", [
    # the file's token budget is dropped: 50 iterations, not 6.4e9 / (512 · 2048) = 6104
    (COLA_350M, "training.train_iters=50", "train_iters", "train_tokens", 50),
    # the file's 6 iterations are dropped: 4096 tokens / (4 · 32) = 32 iterations
    (DEBUG, "training.train_tokens=4096", "train_tokens", "train_iters", 32),
])
def test_a_budget_override_drops_the_other_from_the_file(path, override, kept, dropped, iters):
    cfg = load_run_config(path, [override])
    assert getattr(cfg.training, kept) is not None
    assert getattr(cfg.training, dropped) is None
    assert train_iterations(cfg) == iters


def test_other_overrides_keep_the_files_budget():
    cfg = load_run_config(COLA_350M, ["training.global_batch_size=1024"])
    assert cfg.training.train_tokens == 6_400_000_000 and cfg.training.train_iters is None
    assert train_iterations(cfg) == 3052  # ceil(6.4e9 / (1024 · 2048))


def test_budget_line_names_the_key_iterations_and_tokens():
    line = budget_line(load_run_config(COLA_350M, ["training.train_iters=50"]))
    assert line == ("budget: training.train_iters=50 -> 50 iterations x 1,048,576 tokens "
                    "(global batch 512 x seq 2048) = 52,428,800 tokens")
    line = budget_line(load_run_config(COLA_350M))
    assert line.startswith("budget: training.train_tokens=6,400,000,000 -> 6,104 iterations")


def test_the_run_prints_its_budget_first(monkeypatch, capsys):
    """pretrain's main prints the budget line before it selects a device and trains (device
    selection is made to fail here, so nothing runs)."""
    from megatron_boost.cli import pretrain

    def no_device(requested):
        raise ValueError("no device in this test")

    monkeypatch.setattr(pretrain, "select_device", no_device)
    monkeypatch.delenv("RANK", raising=False)
    rc = pretrain.main(["--config", DEBUG, "training.train_iters=3",
                        "optimizer.warmup_iters=1"])
    out, err = capsys.readouterr()
    assert rc == pretrain.CONFIG_ERROR_EXIT_CODE and "no device in this test" in err
    assert out.splitlines()[0] == ("budget: training.train_iters=3 -> 3 iterations x 128 tokens "
                                   "(global batch 4 x seq 32) = 384 tokens")
