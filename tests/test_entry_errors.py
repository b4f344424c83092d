"""Which errors of ``pretrain_lowrank.py`` are usage errors, and who prints them.

* A ``ValueError`` raised by the training loop (after set-up checked every input) is not a
  configuration error: it is not reported as ``error: ...`` with status 2 but ends in its
  traceback (``TrainingError``, chained to the ValueError). Run in this process through
  ``main(argv)`` on configs/debug.yaml with a training step that raises.
* Rank printing (``_print_error``): configuration errors (before the processes start) and a
  divergence are printed by rank 0 alone; an error raised after start is printed by every rank
  that raised it, a rank other than 0 naming itself.

(The usage errors before training, status 2 and one line, are the table of test_bad_input.py.)
"""

from __future__ import annotations

import pytest

from megatron_boost.cli import pretrain
from megatron_boost.train.resilience import RankTimeout, TrainingDiverged
from tests.test_training import DEBUG


def test_value_error_during_training_is_not_a_usage_error(tmp_path, monkeypatch, capsys):
    from megatron_boost.train.trainer import Trainer, TrainingError

    calls = []

    def step_that_fails(self):
        calls.append(self.state.iteration)
        raise ValueError("a value megatron did not expect")

    monkeypatch.delenv("MBOOST_TRACEBACK", raising=False)
    monkeypatch.setattr(Trainer, "train_step", step_that_fails)
    with pytest.raises(TrainingError, match="iteration 1: a value megatron did not expect") \
            as raised:
        pretrain.main(["--config", DEBUG, "training.train_iters=2", "optimizer.warmup_iters=0",
                       f"logging.run_dir={tmp_path / 'run'}"])
    assert calls == [0]  # set-up passed; the loop's first step raised
    assert isinstance(raised.value.__cause__, ValueError)  # the traceback shows the origin
    assert "error:" not in capsys.readouterr().err


def _printed(monkeypatch, capsys, rank: int, err: Exception, started: bool) -> list:
    monkeypatch.setenv("RANK", str(rank))
    pretrain._print_error(err, started)
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("started", [False, True])
def test_rank_zero_prints_every_error(monkeypatch, capsys, started):
    for err in (ValueError("bad"), TrainingDiverged("nan"), RankTimeout("rank 1 hangs")):
        assert _printed(monkeypatch, capsys, 0, err, started) == [f"error: {err}"]


def test_other_ranks_print_their_own_errors_after_start(monkeypatch, capsys):
    assert _printed(monkeypatch, capsys, 1, ValueError("shard 3 is truncated"), True) == \
        ["error: rank 1: shard 3 is truncated"]
    assert _printed(monkeypatch, capsys, 3, RankTimeout("rank 2 hangs"), True) == \
        ["error: rank 3: rank 2 hangs"]
    # the same on every rank: rank 0's line is enough
    assert _printed(monkeypatch, capsys, 1, TrainingDiverged("nan at 4"), True) == []
    assert _printed(monkeypatch, capsys, 1, ValueError("unknown key"), False) == []
