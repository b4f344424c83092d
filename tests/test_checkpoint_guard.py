"""The checkpoint commit protocol, pruning and file checks, in-process on fake checkpoint
directories (no training; the end-to-end behaviour is in test_fault_tolerance.py and
test_bad_input.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_boost.train.checkpoint_guard import (
    MANIFEST_FILE,
    TRACKER_FILE,
    commit_checkpoint,
    iter_dir_name,
    prune_checkpoints,
    read_tracker,
    shard_entries,
    temp_dir_for,
    verify_manifest,
    write_manifest,
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


def _two_rank_checkpoint(save_dir: Path) -> Path:
    """A fake checkpoint of two writer ranks, committed the way the ranks commit it: each
    rank's shard entries (computed by that rank) handed to rank 0's manifest."""
    final = save_dir / iter_dir_name(5)
    temp = temp_dir_for(final)
    temp.mkdir(parents=True)
    (temp / "metadata.json").write_text("{}")
    (temp / ".metadata").write_bytes(b"plan")
    for rank in (0, 1):
        (temp / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 4096)
    entries = {**shard_entries(temp, 0, 2), **shard_entries(temp, 1, 2)}
    commit_checkpoint(temp, final, 5, entries)
    return final


def test_each_rank_fsyncs_and_crcs_its_own_shards_for_the_manifest(tmp_path):
    ckpt = _two_rank_checkpoint(tmp_path / "ranks")
    assert sorted(shard_entries(ckpt, 1, 2)) == ["__1_0.distcp"]  # rank 1: its own shard only
    assert sorted(shard_entries(ckpt, 0, 2)) == [".metadata", "__0_0.distcp", "metadata.json"]
    # the same manifest as one process computing every entry itself
    single = tmp_path / "single" / iter_dir_name(5)
    single.parent.mkdir()
    shutil.copytree(ckpt, single)
    (single / MANIFEST_FILE).unlink()
    write_manifest(single)
    assert (single / MANIFEST_FILE).read_text() == (ckpt / MANIFEST_FILE).read_text()


def _verify_on_two_ranks(rank, world, ckpt):
    from megatron_boost.train import checkpoint_guard
    from megatron_boost.train.checkpointing import verify_manifest_shared

    crc, read = checkpoint_guard._crc32, []
    checkpoint_guard._crc32 = lambda path: read.append(Path(path).name) or crc(path)
    try:
        verify_manifest_shared(Path(ckpt))
        error = None
    except ValueError as err:
        error = str(err)
    finally:
        checkpoint_guard._crc32 = crc
    return sorted(read), error


def test_each_rank_verifies_only_its_own_shards_and_all_agree(tmp_path):
    """At resume every rank CRCs only its share (its own shard files; rank 0 the small common
    files), and a damaged shard stops every rank with the same error, not only its checker."""
    from tests.rank_pool import distributed

    ckpt = _two_rank_checkpoint(tmp_path)
    assert distributed(_verify_on_two_ranks, 2, str(ckpt)) == [
        ([".metadata", "__0_0.distcp", "metadata.json"], None), (["__1_0.distcp"], None)]
    (ckpt / "__1_0.distcp").write_bytes(b"\0" * 4096)
    results = distributed(_verify_on_two_ranks, 2, str(ckpt))
    assert [read for read, _ in results] == [[".metadata", "__0_0.distcp", "metadata.json"],
                                             ["__1_0.distcp"]]
    for _, error in results:
        assert "__1_0.distcp fails its CRC-32 check" in error


def test_checkpoint_cost_tool_prints_each_configs_row(tmp_path, capsys):
    """tools/checkpoint_cost.py: one row per configuration with the save and resume times, their
    integrity parts and the pre-emption window verdict; a bad --scale is one error line."""
    from megatron_boost.cli.checkpoint_cost import main, shard_bytes_per_rank

    debug = shard_bytes_per_rank("configs/debug.yaml")
    assert debug["bytes"] == 14 * debug["params"] and debug["tp"] == 1
    assert main(["--configs", "configs/debug.yaml", "--file-mib", "1", "--dir",
                 str(tmp_path)]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("debug") and "integrity" in row and "pre-emption window" in row
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    assert main(["--scale", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --scale (0.0) must be in (0, 1]")
