"""A damaged checkpoint's refusal names what the user can resume from instead
(``newest_intact_before``, ``damaged_checkpoint_hint`` in train/checkpoint_guard.py), in-process
on fake committed checkpoints; through the trainer it is appended to the damage's line
(train/checkpointing.py, the checkpoint cases of tests/test_bad_input.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_boost.train.checkpoint_guard import (TRACKER_FILE, damaged_checkpoint_hint,
                                                   iter_dir_name, newest_intact_before)

from tests.test_checkpoint_guard import _save  # a fake committed checkpoint

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md


def _truncate(ckpt: Path) -> None:
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])


def test_the_newest_intact_older_checkpoint_is_named_with_how_to_resume(tmp_path):
    two, four, six = (_save(tmp_path, it) for it in (2, 4, 6))
    _truncate(six)
    _truncate(four)  # damaged too: not offered
    assert newest_intact_before(six) == 2
    hint = damaged_checkpoint_hint(six, newest_intact_before(six))
    for part in ("iteration 2", f"write 2 into {tmp_path / TRACKER_FILE}", iter_dir_name(6),
                 f"checkpoint.load={two}"):
        assert part in hint, hint


def test_without_an_intact_older_checkpoint_a_new_run_is_the_way(tmp_path):
    two = _save(tmp_path, 2)
    _truncate(two)
    assert newest_intact_before(two) is None
    assert "no earlier intact checkpoint" in damaged_checkpoint_hint(two, None)
