"""Checks of megatron indexed datasets (``<prefix>.bin`` + ``<prefix>.idx``) before megatron
opens them.

megatron-core's ``IndexedDataset`` asserts on a bad ``.idx`` header (``AssertionError: bad
header``), maps a too-short file into garbage offsets, and reads token ids beyond the tokenizer's
vocabulary without complaint (the embedding lookup then fails deep in the forward pass, or on
GPU corrupts memory). :func:`validate_indexed_dataset` reads the ``.idx`` header with
megatron's own format constants and checks, in order: both files exist and are non-empty, the
header magic, version 1, a known dtype code, the ``.idx`` size implied by its counts, the
document index, the ``.bin`` size implied by the sequence lengths, and (given a vocabulary size)
that every token id is below it. Each failure is a ``ValueError`` naming the file, the value
and the rule. The format is written by megatron's ``IndexedDatasetBuilder``:

    magic (9 B) | version <Q | dtype code <B | sequence count S <Q | document count D <Q |
    lengths int32[S] | pointers int64[S] | document indices int64[D]
"""

from __future__ import annotations

import os
import struct
from typing import Optional

import numpy as np

__all__ = ["validate_indexed_dataset", "validate_data_files"]

# Fixed part of the header: magic + version + dtype code + sequence count + document count.
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
# Tokens scanned per chunk when looking for ids beyond the vocabulary (bounded memory).
_SCAN_CHUNK = 1 << 24


def _require_nonempty(path: str, what: str) -> int:
    if not os.path.isfile(path):
        raise ValueError(f"dataset {what} file '{path}' does not exist; run "
                         f"tools/preprocess_data.py or fix data.data_path")
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"dataset {what} file '{path}' is empty (0 bytes); re-run "
                         f"tools/preprocess_data.py for this prefix")
    return size


def _read_header(idx_path: str, idx_size: int) -> tuple:
    """``(dtype, S, D)`` from the ``.idx`` header, checked against megatron's constants."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    if idx_size < _HEADER_BYTES:
        raise ValueError(f"dataset index '{idx_path}' is truncated: {idx_size} bytes, shorter "
                         f"than the {_HEADER_BYTES}-byte header")
    with open(idx_path, "rb") as f:
        magic = f.read(len(_INDEX_HEADER))
        version, code, seqs, docs = struct.unpack("<QBQQ", f.read(_HEADER_BYTES - len(magic)))
    if magic != _INDEX_HEADER:
        raise ValueError(f"dataset index '{idx_path}' has header {magic!r}, expected megatron's "
                         f"{_INDEX_HEADER!r}; the file is corrupt or not a megatron .idx")
    if version != 1:
        raise ValueError(f"dataset index '{idx_path}' has format version {version}; only "
                         f"version 1 is readable")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise ValueError(f"dataset index '{idx_path}' has dtype code {code}; known codes are "
                         f"{[d.value for d in DType]}") from None
    return np.dtype(dtype), seqs, docs


def _check_documents(idx_path: str, idx_size: int, seqs: int, docs: int) -> np.ndarray:
    """The sequence lengths, after checking the ``.idx`` size and its document index."""
    expected = _HEADER_BYTES + 4 * seqs + 8 * seqs + 8 * docs
    if idx_size != expected:
        raise ValueError(f"dataset index '{idx_path}' is {idx_size} bytes but its counts "
                         f"({seqs} sequences, {docs} document boundaries) need {expected}; "
                         f"the file is truncated or corrupt")
    if seqs == 0:
        raise ValueError(f"dataset index '{idx_path}' holds no sequences; the dataset is empty")
    mm = np.memmap(idx_path, mode="r")
    lengths = np.frombuffer(mm, dtype=np.int32, count=seqs, offset=_HEADER_BYTES)
    doc_idx = np.frombuffer(mm, dtype=np.int64, count=docs, offset=_HEADER_BYTES + 12 * seqs)
    if lengths.min() < 0 or docs < 2 or doc_idx[0] != 0 or doc_idx[-1] != seqs \
            or np.any(np.diff(doc_idx) < 0):
        raise ValueError(f"dataset index '{idx_path}' has an inconsistent document index (must "
                         f"rise from 0 to the sequence count {seqs}); the file is corrupt")
    return lengths


def _check_token_ids(bin_path: str, dtype: np.dtype, vocab_size: int) -> None:
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start:start + _SCAN_CHUNK]
        if chunk.max() >= vocab_size or chunk.min() < 0:
            bad = int(chunk.max() if chunk.max() >= vocab_size else chunk.min())
            raise ValueError(f"dataset '{bin_path}' holds token id {bad}, outside the "
                             f"tokenizer's vocabulary of {vocab_size} ids; the data was "
                             f"tokenized with another tokenizer than data.tokenizer_model")


def validate_indexed_dataset(prefix: str, vocab_size: Optional[int] = None) -> None:
    """Check ``<prefix>.idx`` / ``<prefix>.bin`` (see the module docstring); ``vocab_size``
    additionally checks every token id. Raises ``ValueError``; returns nothing when valid."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    idx_size = _require_nonempty(idx_path, "index")
    bin_size = _require_nonempty(bin_path, "token")
    dtype, seqs, docs = _read_header(idx_path, idx_size)
    lengths = _check_documents(idx_path, idx_size, seqs, docs)
    expected = int(lengths.sum(dtype=np.int64)) * dtype.itemsize
    if bin_size != expected:
        raise ValueError(f"dataset tokens '{bin_path}' are {bin_size} bytes but its index "
                         f"'{idx_path}' describes {expected}; the .bin and .idx do not belong "
                         f"together or one is truncated")
    if vocab_size is not None:
        _check_token_ids(bin_path, dtype, vocab_size)


def validate_data_files(data_cfg, vocab_size: int) -> None:
    """:func:`validate_indexed_dataset` for every prefix of the ``data:`` section's blends
    (none with ``mock: true``)."""
    from megatron_boost.data.datasets import parse_blend

    if data_cfg.mock:
        return
    for name in ("data_path", "valid_data_path", "test_data_path"):
        paths = getattr(data_cfg, name)
        if paths:
            for prefix in parse_blend(paths, f"data.{name}")[0]:
                validate_indexed_dataset(prefix, vocab_size)
