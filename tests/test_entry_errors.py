"""Which errors of ``pretrain_lowrank.py`` are usage errors, and who prints them.

* A ``ValueError`` raised by the training loop (after set-up checked every input) is not a
  configuration error: it is not reported as ``error: ...`` with status 2 but ends in its
  traceback (``TrainingError``, chained to the ValueError). Run in this process through
  ``main(argv)`` on configs/debug.yaml with a training step that raises.
* Rank printing (``_print_error``): every rank prints the error it raised, a rank other than 0
  naming itself (torchrun ends the other ranks once one exits, so rank 0 may never print).

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


def _printed(monkeypatch, capsys, rank: int, err: Exception) -> list:
    monkeypatch.setenv("RANK", str(rank))
    pretrain._print_error(err)
    return capsys.readouterr().err.splitlines()


ERRORS = (ValueError("unknown key"), ValueError("shard 3 is truncated"),
          TrainingDiverged("nan at 4"), RankTimeout("rank 2 hangs"))


def test_rank_zero_prints_every_error(monkeypatch, capsys):
    for err in ERRORS:
        assert _printed(monkeypatch, capsys, 0, err) == [f"error: {err}"]


def test_other_ranks_print_every_error_naming_themselves(monkeypatch, capsys):
    """Also the errors every rank raises alike (configuration, divergence): the rank that
    exits first may be the only one whose line is written."""
    for rank in (1, 3):
        for err in ERRORS:
            assert _printed(monkeypatch, capsys, rank, err) == [f"error: rank {rank}: {err}"]
