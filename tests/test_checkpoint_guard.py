"""The checkpoint commit protocol, pruning and file checks, in-process on fake checkpoint
directories (no training; the end-to-end behaviour is in test_fault_tolerance.py and
test_bad_input.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_boost.train.checkpoint_guard import (
    TRACKER_FILE,
    commit_checkpoint,
    iter_dir_name,
    prune_checkpoints,
    read_tracker,
    temp_dir_for,
    verify_manifest,
)

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md


def _save(save_dir: Path, iteration: int) -> Path:
    """A fake checkpoint written into its temp directory and committed."""
    final = save_dir / iter_dir_name(iteration)
    temp = temp_dir_for(final)
    temp.mkdir(parents=True)
    (temp / "metadata.json").write_text("{}")
    (temp / "__0_0.distcp").write_bytes(bytes(range(256)) * iteration)
    commit_checkpoint(temp, final, iteration)
    return final


def test_commit_renames_and_moves_the_tracker_last(tmp_path):
    _save(tmp_path, 2)
    assert read_tracker(tmp_path) == 2
    assert not list(tmp_path.glob("*.tmp"))
    verify_manifest(tmp_path / iter_dir_name(2))


def test_uncommitted_save_leaves_the_tracker_on_the_previous_one(tmp_path):
    _save(tmp_path, 2)
    temp = temp_dir_for(tmp_path / iter_dir_name(4))
    temp.mkdir()
    (temp / "__0_0.distcp").write_bytes(b"partial")
    assert read_tracker(tmp_path) == 2
    assert prune_checkpoints(tmp_path, None) == [temp] and not temp.exists()


def test_prune_keeps_the_newest_and_the_tracked_checkpoint(tmp_path):
    for it in (2, 4, 6, 8):
        _save(tmp_path, it)
    (tmp_path / TRACKER_FILE).write_text("4\n")  # e.g. the user pointed it back
    prune_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [iter_dir_name(4),
                                                               iter_dir_name(8)]


@pytest.mark.parametrize("damage,needle", [
    (lambda f: f.write_bytes(f.read_bytes()[:10]), "truncated"),
    (lambda f: f.write_bytes(bytes(reversed(f.read_bytes()))), "CRC-32"),
    (lambda f: f.unlink(), "missing"),
])
def test_manifest_detects_damaged_shards(tmp_path, damage, needle):
    ckpt = _save(tmp_path, 3)
    damage(ckpt / "__0_0.distcp")
    with pytest.raises(ValueError, match=needle):
        verify_manifest(ckpt)


@pytest.mark.parametrize("text,needle", [("two", "not an iteration number"),
                                         ("9", "names iteration 9")])
def test_tracker_garbage_or_missing_iteration(tmp_path, text, needle):
    _save(tmp_path, 2)
    (tmp_path / TRACKER_FILE).write_text(text)
    with pytest.raises(ValueError, match=needle):
        read_tracker(tmp_path)
