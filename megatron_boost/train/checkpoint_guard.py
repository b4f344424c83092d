"""Crash-consistent checkpoint directories and the checks made before a checkpoint is read.

Commit protocol (:func:`commit_checkpoint`): every rank writes its shards into
``<save>/iter_XXXXXXX.tmp/``, then fsyncs and CRCs its own shard files (:func:`shard_entries`,
all ranks at once, not rank 0 for all while the others wait); rank 0 gathers those entries,
adds the small common files and writes ``manifest.json`` (the size and CRC-32 of every file),
fsyncs the directory, renames the directory to
``iter_XXXXXXX`` (atomic on one file system), fsyncs ``<save>`` and only then replaces
``latest_checkpointed_iteration.txt`` (temp file, fsync, ``os.replace``, fsync). A crash at
any point leaves the tracker naming the previous complete checkpoint; a leftover ``.tmp``
directory is never read and is removed by the next save (:func:`prune_checkpoints`).

Checks before any tensor is read (each a ``ValueError`` naming the file, value and rule):
:func:`read_tracker` (a number naming an existing checkpoint), :func:`verify_manifest` (no
missing, truncated or corrupted shard; with several ranks each checks only its own share,
:func:`in_share`), :func:`read_common_state` (loaded with
``torch.load(weights_only=True)``), :func:`check_tensor_shapes` (every tensor the model
expects exists with the same global shape; the first mismatch is named with both shapes),
:func:`check_sharded_objects` (every object too, except a module's extra state the checkpoint
has none of, which :func:`without_unsaved_extra_state` leaves out of the load); then the run
config against the checkpoint's (the resume contract, :mod:`megatron_boost.config.
resume_contract`).

Safe loading: megatron-core 0.16 reads the common state (``common.pt``) and the sharded objects
(RNG state) with ``torch.load`` without a ``weights_only`` argument, i.e. torch's default,
which is ``weights_only=True`` since torch 2.6 unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is
set; :func:`read_common_state` refuses that override. (0.17+ keep the common state inside the
torch_dist shards and read it with ``weights_only=True``; megatron's
``load_common_state_dict`` reads either format.) The shards' ``.metadata`` is a pickle read by
torch.distributed.checkpoint: a checkpoint is trusted input, and the manifest checksum only
detects corruption, not tampering.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Dict, Iterable, List, Optional

__all__ = [
    "TRACKER_FILE", "MANIFEST_FILE", "iter_dir_name",
    "temp_dir_for", "read_tracker", "write_manifest", "verify_manifest", "commit_checkpoint",
    "in_share", "shard_entries",
    "prune_checkpoints", "newest_intact_before", "damaged_checkpoint_hint",
    "read_common_state", "check_tensor_shapes",
    "EXTRA_STATE_SUFFIX", "check_sharded_objects", "without_unsaved_extra_state",
]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "manifest.json"
_TEMP_SUFFIX = ".tmp"
_CRC_CHUNK = 1 << 22
# Run-config keys that set tensor shapes (named when a checkpoint's shapes differ).
_SHAPE_KEYS = ("model.num_layers", "model.hidden_size", "model.ffn_hidden_size",
               "model.num_attention_heads", "model.num_query_groups", "model.kv_channels",
               "model.attn_rank", "model.mlp_rank", "model.rank_ratio")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def temp_dir_for(final: Path) -> Path:
    return final.with_name(final.name + _TEMP_SUFFIX)


# ---------------------------------------------------------------------------------------------
# tracker
# ---------------------------------------------------------------------------------------------


def read_tracker(save_dir: Path) -> Optional[int]:
    """The iteration named by ``<save_dir>/latest_checkpointed_iteration.txt``; None without a
    tracker. ``ValueError`` when it holds no number or names a missing checkpoint."""
    tracker = Path(save_dir) / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text(errors="replace").strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint tracker {tracker} holds {text[:40]!r}, not an iteration "
                         f"number; fix or delete it (the iter_* directories are kept)")
    iteration = int(text)
    ckpt = Path(save_dir) / iter_dir_name(iteration)
    if not (ckpt / "metadata.json").is_file():
        raise ValueError(f"checkpoint tracker {tracker} names iteration {iteration} but {ckpt} "
                         f"is missing or incomplete; point it at a complete iter_* directory")
    return iteration


def _fsync_path(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tracker(save_dir: Path, iteration: int) -> None:
    tracker = save_dir / TRACKER_FILE
    tmp = tracker.with_name(TRACKER_FILE + _TEMP_SUFFIX)
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker)
    _fsync_path(save_dir)


# ---------------------------------------------------------------------------------------------
# manifest (size + CRC-32 of every file)
# ---------------------------------------------------------------------------------------------


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(ckpt_dir: Path) -> List[Path]:
    return sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


#: torch_dist's shard files: ``__<writer rank>_<index>.distcp``.
_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def in_share(name: str, rank: int, world: int) -> bool:
    """Whether rank ``rank`` of ``world`` handles checkpoint file ``name`` (relative path):
    the shard files its own rank wrote (the writer's rank modulo ``world`` when the world
    changed), and on rank 0 the rest (metadata and common state, small)."""
    match = _SHARD_FILE.match(Path(name).name)
    return (int(match.group(1)) % world if match else 0) == rank


def shard_entries(ckpt_dir: Path, rank: int = 0, world: int = 1) -> Dict[str, dict]:
    """Size and CRC-32 of this rank's share of ``ckpt_dir``'s files (:func:`in_share`), each
    fsynced first: every rank's part of the manifest, computed in parallel."""
    entries = {}
    for path in _files(ckpt_dir):
        name = str(path.relative_to(ckpt_dir))
        if in_share(name, rank, world):
            _fsync_path(path)
            entries[name] = {"bytes": path.stat().st_size, "crc32": _crc32(path)}
    return entries


def write_manifest(ckpt_dir: Path, entries: Optional[Dict[str, dict]] = None) -> None:
    """Record every file's size and CRC-32 in ``manifest.json``: ``entries`` (the ranks'
    :func:`shard_entries`) and, computed here, every file they do not cover."""
    entries = dict(entries or {})
    for path in _files(ckpt_dir):
        name = str(path.relative_to(ckpt_dir))
        if name not in entries:
            _fsync_path(path)
            entries[name] = {"bytes": path.stat().st_size, "crc32": _crc32(path)}
    with open(ckpt_dir / MANIFEST_FILE, "w") as f:
        json.dump({"files": dict(sorted(entries.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_manifest(ckpt_dir: Path, rank: int = 0, world: int = 1) -> None:
    """``ValueError`` naming the first missing, truncated or corrupted file of a checkpoint,
    among the files of this rank's share (:func:`in_share`; all of them with one rank)."""
    path = Path(ckpt_dir) / MANIFEST_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint {ckpt_dir} has no {MANIFEST_FILE}: it was not committed "
                         f"by megatron-boost (or is from an older version); cannot verify it")
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"checkpoint manifest {path} is corrupt (not the JSON it wrote)") \
            from None
    for name, want in files.items():
        if not in_share(name, rank, world):
            continue
        f = Path(ckpt_dir) / name
        if not f.is_file():
            raise ValueError(f"checkpoint file {f} is missing (listed in {MANIFEST_FILE})")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise ValueError(f"checkpoint file {f} is {size} bytes, {want['bytes']} were "
                             f"written: it is truncated or was replaced")
        if _crc32(f) != want["crc32"]:
            raise ValueError(f"checkpoint file {f} fails its CRC-32 check: it is corrupted")


# ---------------------------------------------------------------------------------------------
# commit and pruning
# ---------------------------------------------------------------------------------------------


def commit_checkpoint(temp: Path, final: Path, iteration: int,
                      entries: Optional[Dict[str, dict]] = None) -> None:
    """Rank 0, after every rank's shards are in ``temp`` (and their ``entries``, when the
    ranks computed them): manifest, fsync, rename, tracker."""
    write_manifest(temp, entries)
    _fsync_path(temp)
    if final.exists():  # the same iteration saved again (e.g. a rerun): replace it whole
        shutil.rmtree(final)
    os.rename(temp, final)
    _fsync_path(final.parent)
    _write_tracker(final.parent, iteration)


def _complete_iterations(save_dir: Path) -> List[int]:
    its = []
    for p in save_dir.glob("iter_*"):
        suffix = p.name[len("iter_"):]
        if p.is_dir() and suffix.isdigit() and (p / MANIFEST_FILE).is_file():
            its.append(int(suffix))
    return sorted(its)


def newest_intact_before(ckpt_dir: Path) -> Optional[int]:
    """The newest complete checkpoint of ``ckpt_dir``'s save directory older than it whose
    every file passes its manifest (:func:`verify_manifest`); None if there is none."""
    ckpt_dir = Path(ckpt_dir)
    suffix = ckpt_dir.name[len("iter_"):]
    if not (ckpt_dir.name.startswith("iter_") and suffix.isdigit()):
        return None
    for iteration in reversed(_complete_iterations(ckpt_dir.parent)):
        if iteration >= int(suffix):
            continue
        try:
            verify_manifest(ckpt_dir.parent / iter_dir_name(iteration))
        except (ValueError, OSError):
            continue
        return iteration
    return None


def damaged_checkpoint_hint(ckpt_dir: Path, intact: Optional[int]) -> str:
    """What a user whose checkpoint ``ckpt_dir`` is damaged can resume from: the newest
    intact one (``intact``, :func:`newest_intact_before`) and how, or that there is none."""
    save_dir = Path(ckpt_dir).parent
    if intact is None:
        return (f"no earlier intact checkpoint in {save_dir}: start a new run directory "
                f"(checkpoint.init_from can start it from other weights)")
    older = save_dir / iter_dir_name(intact)
    return (f"the newest intact checkpoint is iteration {intact}: to resume from it, write "
            f"{intact} into {save_dir / TRACKER_FILE} (then {Path(ckpt_dir).name} can be "
            f"removed), or set checkpoint.load={older} for this launch")


def prune_checkpoints(save_dir: Path, keep_last: Optional[int]) -> List[Path]:
    """Remove leftover temp directories and all but the newest ``keep_last`` complete
    checkpoints (None keeps all). The one the tracker names is never removed. Rank 0 only."""
    removed = [p for p in save_dir.glob(f"iter_*{_TEMP_SUFFIX}") if p.is_dir()]
    if keep_last is not None:
        tracked = read_tracker(save_dir)
        its = _complete_iterations(save_dir)
        keep = set(its[-keep_last:]) | {tracked}
        removed += [save_dir / iter_dir_name(i) for i in its if i not in keep]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


# ---------------------------------------------------------------------------------------------
# content checks
# ---------------------------------------------------------------------------------------------


def read_common_state(ckpt_dir: Path) -> dict:
    """The ``boost_state`` of a checkpoint: megatron's ``load_common_state_dict``, which reads
    it with ``torch.load(weights_only=True)`` (``common.pt`` up to megatron-core 0.16, the
    ``common_state`` object of the shards from 0.17 on)."""
    from megatron.core import dist_checkpointing

    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0") not in ("", "0"):
        raise ValueError("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: megatron would unpickle "
                         "checkpoint objects without restriction; unset it to resume")
    if not (Path(ckpt_dir) / "metadata.json").is_file():
        raise ValueError(f"checkpoint {ckpt_dir} has no metadata.json; not a dist checkpoint")
    try:
        common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    except FileNotFoundError as err:
        missing = Path(err.filename).name if err.filename else str(err)
        raise ValueError(f"checkpoint {ckpt_dir} has no common state ({missing} missing); not a "
                         f"complete dist checkpoint") from None
    except Exception as err:  # unpickling, a truncated file, torch.distributed.checkpoint
        raise ValueError(f"the common state of checkpoint {ckpt_dir} cannot be read safely "
                         f"({' '.join(str(err).split())[:160]})") from None
    boost = common.get("boost_state") if isinstance(common, dict) else None
    if boost is None:
        raise ValueError(f"{ckpt_dir} is not a megatron-boost checkpoint (no boost_state)")
    return boost


def _expected_tensors(sharded_sd: dict) -> Iterable:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for v in nested_values(sharded_sd):
        # a factory (a grouped A, megatron's gated fc1) saves the tensors it builds
        pieces = nested_values(v.build()) if isinstance(v, ShardedTensorFactory) else [v]
        yield from (p for p in pieces if isinstance(p, ShardedTensor))


def _shape_settings(saved_cfg: Optional[Dict], current_cfg: Optional[Dict]) -> str:
    """The shape-setting config keys on which a checkpoint's run and this one differ, as
    'model.hidden_size is 64 in the checkpoint, 128 here', or a pointer to where to look."""
    if saved_cfg is None or current_cfg is None:
        return "check model.* and the tokenizer against the checkpoint's config"
    diffs = [f"{k} is {_lookup(saved_cfg, k)!r} in the checkpoint, {_lookup(current_cfg, k)!r} "
             f"here" for k in _SHAPE_KEYS if _lookup(saved_cfg, k) != _lookup(current_cfg, k)]
    return ("; ".join(diffs) if diffs else "no model.* key differs from the checkpoint's "
            "config: check the tokenizer (the vocabulary sets the embedding rows)")


#: The suffix of the module state megatron saves as a ShardedObject: torch's *extra state*
#: (``get_extra_state``), e.g. Transformer Engine's FP8 recipe state. A module has it or not
#: depending on the backend (TE or not), so a checkpoint and a model may disagree on it.
EXTRA_STATE_SUFFIX = "_extra_state"


def _expected_objects(sharded_sd: dict) -> Iterable:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return (v for v in nested_values(sharded_sd) if isinstance(v, ShardedObject))


def _saved_object_keys(ckpt_dir: Path):
    """(unique keys, keys) of the ShardedObjects a checkpoint holds (megatron's
    ``load_sharded_metadata``: tensors, and objects under their unique keys)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    saved = load_sharded_metadata(str(ckpt_dir))
    objects = [v for v in saved.values() if isinstance(v, ShardedObject)]
    return {o.unique_key for o in objects}, {o.key for o in objects}


def _unsaved_extra_state(sh, saved_keys) -> bool:
    """A module's extra state of which the checkpoint holds no shard at all: the module had
    none when it was saved (saved without TE). Partly saved is not this case."""
    return sh.key.endswith(EXTRA_STATE_SUFFIX) and sh.key not in saved_keys


def check_sharded_objects(ckpt_dir: Path, sharded_sd: dict) -> None:
    """Every ShardedObject of ``sharded_sd`` must exist in the checkpoint, but for a module's
    extra state the checkpoint has none of (:func:`without_unsaved_extra_state` leaves those
    out of the load); ``ValueError`` names the first missing one."""
    unique, keys = _saved_object_keys(ckpt_dir)
    for sh in _expected_objects(sharded_sd):
        if sh.unique_key not in unique and not _unsaved_extra_state(sh, keys):
            raise ValueError(f"checkpoint {ckpt_dir} has no object '{sh.unique_key}' that "
                             f"this model saves: another architecture or mode; check model.* "
                             f"and parallel.mode")


def without_unsaved_extra_state(sharded_sd: dict, ckpt_dir: Path) -> dict:
    """``sharded_sd`` for loading ``ckpt_dir``, less the modules' extra state the checkpoint
    has none of (a checkpoint saved without Transformer Engine, loaded with it): megatron's
    torch_dist load would fail on each ("Missing key in checkpoint state_dict"). Those
    modules keep their fresh extra state (``load_model_state`` accepts the missing keys).
    Extra state the checkpoint has and the model lacks is never asked for, so it is not
    read."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    _, keys = _saved_object_keys(ckpt_dir)
    _, kept = extract_matching_values(
        sharded_sd, lambda v: isinstance(v, ShardedObject) and _unsaved_extra_state(v, keys))
    return kept


def check_tensor_shapes(ckpt_dir: Path, sharded_sd: dict, saved_cfg: Optional[Dict] = None,
                        current_cfg: Optional[Dict] = None) -> None:
    """Every ShardedTensor of ``sharded_sd`` must exist in the checkpoint with the same global
    shape; ``ValueError`` names the checkpoint, the first tensor that does not, both shapes
    and (given both run configs) the config keys that differ."""
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    for sh in _expected_tensors(sharded_sd):
        if sh.key not in saved:
            raise ValueError(f"checkpoint {ckpt_dir} has no tensor '{sh.key}' (this model "
                             f"needs shape {tuple(sh.global_shape)}): another architecture "
                             f"or mode; check model.* and parallel.mode")
        have = tuple(saved[sh.key].global_shape)
        if have != tuple(sh.global_shape):
            raise ValueError(f"checkpoint {ckpt_dir}: tensor '{sh.key}' has shape {have}, this "
                             f"model's is {tuple(sh.global_shape)}: "
                             f"{_shape_settings(saved_cfg, current_cfg)}")


def _lookup(cfg: Dict, dotted: str):
    section, key = dotted.split(".")
    return cfg.get(section, {}).get(key)
