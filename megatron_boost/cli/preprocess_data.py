"""Tokenize text into a Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``).

    megatron-boost-preprocess-data --input data/raw/ --tokenizer-model data/spm.model \\
        --output-prefix data/plays --workers 2 --append-eod

(or ``python tools/preprocess_data.py`` with the same arguments)

One document per plain-text file (e.g. one play) and one per line of a ``.jsonl`` file (its
``--json-key`` field). Directories are read recursively in sorted order and globs are expanded,
so the document order is deterministic. Documents are tokenized by ``--tokenizer-model``, a
SentencePiece model or a Hugging Face tokenizer directory (read by the megatron tokenizer that
training builds from ``data.tokenizer_type: huggingface``, so the ids agree), in a
``multiprocessing`` pool of ``--workers`` processes (order is preserved) and written with
megatron-core's ``IndexedDatasetBuilder``; the token dtype is uint16 for vocabularies below
65500 ids, else int32. ``--append-eod`` appends the tokenizer's ``eos`` id to every document,
which Megatron's GPT dataset treats as the end-of-document token.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from typing import Iterator

from megatron_boost.cli.arg_types import positive_int
from megatron_boost.data.textfiles import expand_inputs

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

# Per-worker state, set by _init_worker (each pool process loads its own tokenizer).
_tok = None
_append_eod = False
_split_sentences = False
_json_key = "text"


def iter_work(files: list[str]) -> Iterator[tuple[str, str, str]]:
    """Yield one ``(kind, where, payload)`` item per document.

    Plain files are passed by path so the workers read them; JSONL lines are passed as raw text
    so the JSON parsing also happens in the workers.
    """
    for path in files:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield "json", f"{path}:{lineno}", line
        else:
            yield "file", path, path


class _SentencePiece:
    """A SentencePiece ``.model`` file: ``encode``, ``eod`` (its eos id), ``vocab_size``."""

    def __init__(self, path: str) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=path)
        self.eod, self.vocab_size = self._sp.eos_id(), self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)


class _HuggingFace:
    """A Hugging Face tokenizer directory, through the very tokenizer training builds from
    ``data.tokenizer_type: huggingface`` (megatron's), so the stored ids are the ids training
    expects and its end-of-document id is training's ``eod``."""

    def __init__(self, path: str) -> None:
        from megatron_boost.data.datasets import DataConfig, build_tokenizer

        self._tok = build_tokenizer(DataConfig(tokenizer_model=path,
                                               tokenizer_type="huggingface"))
        self.eod, self.vocab_size = self._tok.eod, int(self._tok.vocab_size)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.tokenize(text))


def open_tokenizer(path: str):
    """A directory is a Hugging Face tokenizer, a file a SentencePiece model."""
    return _HuggingFace(path) if os.path.isdir(path) else _SentencePiece(path)


def _init_worker(model_path: str, append_eod: bool, split_sentences: bool, json_key: str) -> None:
    global _tok, _append_eod, _split_sentences, _json_key
    _tok = open_tokenizer(model_path)
    _append_eod, _split_sentences, _json_key = append_eod, split_sentences, json_key


def _tokenize(item: tuple[str, str, str]) -> tuple[list[list[int]], int, str]:
    """Tokenize one document into its sentences' ids; returns (sentences, n_bytes, error)."""
    kind, where, payload = item
    if kind == "file":
        with open(payload, encoding="utf-8", errors="replace") as f:
            text = f.read()
    else:
        try:
            text = json.loads(payload)[_json_key]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            return [], 0, f"{where} is not a JSON object with key '{_json_key}' ({err})"
        text = str(text)
    pieces = _SENTENCE_END.split(text) if _split_sentences else [text]
    sentences = [ids for ids in (_tok.encode(p) for p in pieces) if ids]
    if sentences and _append_eod:
        sentences[-1].append(_tok.eod)
    return sentences, len(text.encode("utf-8")), ""


class _Progress:
    """tqdm when installed, else a counter on stderr refreshed at most once a second; neither
    where stderr is not a terminal (a log file would fill with carriage returns).

    ``total`` is the number of documents, or ``None`` when unknown (JSONL inputs).
    """

    def __init__(self, total: int | None) -> None:
        self._quiet = not sys.stderr.isatty()
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="doc", file=sys.stderr, disable=None)
        except ImportError:
            self._bar = None
        self.total, self.count, self._last = total, 0, 0.0

    def update(self) -> None:
        self.count += 1
        if self._bar is not None:
            self._bar.update(1)
        elif not self._quiet and time.perf_counter() - self._last >= 1.0:
            self._last = time.perf_counter()
            self._print()

    def _print(self) -> None:
        of_total = f"/{self.total}" if self.total else ""
        print(f"\rtokenized {self.count}{of_total} docs", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.count and not self._quiet:
            self._print()  # the final count, which the once-a-second refresh may have skipped
            print(file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input", nargs="+", required=True, help="text/.jsonl files, dirs or globs"
    )
    parser.add_argument("--json-key", default="text", help="text field of .jsonl records")
    parser.add_argument("--tokenizer-model", required=True,
                        help="SentencePiece .model file, or a Hugging Face tokenizer directory "
                             "(e.g. an HF model's; train with data.tokenizer_type=huggingface)")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin/.idx")
    parser.add_argument("--workers", type=positive_int, default=1, help="tokenizer processes")
    parser.add_argument("--append-eod", action="store_true", help="append eos to every document")
    parser.add_argument(
        "--split-sentences",
        choices=["no", "yes"],
        default="no",
        help="yes: store each sentence (split after . ! ?) as its own sequence of the document",
    )
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[str]:
    """Validate the arguments; returns the input files (a clear error for each bad value)."""
    if args.workers < 1:
        raise SystemExit(f"preprocess_data.py: error: --workers {args.workers} must be >= 1")
    if not os.path.exists(args.tokenizer_model):
        raise SystemExit(
            f"preprocess_data.py: error: --tokenizer-model '{args.tokenizer_model}' does not "
            f"exist; train one with tools/train_tokenizer.py or give a Hugging Face tokenizer "
            f"directory"
        )
    from megatron_boost.data.datasets import check_tokenizer_files

    kind = "huggingface" if os.path.isdir(args.tokenizer_model) else "sentencepiece"
    try:
        check_tokenizer_files(args.tokenizer_model, kind, "--tokenizer-model")
    except ValueError as err:
        raise SystemExit(f"preprocess_data.py: error: {err}") from None
    files = expand_inputs(args.input, "preprocess_data.py")
    if not files:
        raise SystemExit(f"preprocess_data.py: error: no files in --input {' '.join(args.input)}")
    return files


def tokenized_documents(args: argparse.Namespace, work: Iterator, known_total: bool):
    """``(pool or None, iterator of _tokenize results)``, in document order."""
    init_args = (
        args.tokenizer_model,
        args.append_eod,
        args.split_sentences == "yes",
        args.json_key,
    )
    if args.workers == 1:
        _init_worker(*init_args)
        return None, map(_tokenize, work)
    # Whole files are big work items (balance them one by one); JSONL lines are small, so
    # batch them to amortize the inter-process traffic.
    chunksize = 1 if known_total else 64
    pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=init_args)
    return pool, pool.imap(_tokenize, work, chunksize=chunksize)


def write_documents(results: Iterator, builder, progress: _Progress) -> tuple[int, int, int, int]:
    """Add every non-empty document to ``builder``; returns (docs, tokens, bytes, empty)."""
    import numpy

    n_docs = n_tokens = n_bytes = n_empty = 0
    for sentences, size, error in results:
        progress.update()
        if error:
            raise SystemExit(f"preprocess_data.py: error: {error}; fix the file or pass --json-key")
        if not sentences:
            # An empty document would be a zero-length sequence; skip it but report the count.
            n_empty += 1
            continue
        ids = numpy.concatenate([numpy.asarray(s, dtype=numpy.int64) for s in sentences])
        builder.add_document(ids, [len(s) for s in sentences])
        n_docs += 1
        n_tokens += ids.size
        n_bytes += size
    return n_docs, n_tokens, n_bytes, n_empty


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    files = check_args(args)
    # Stream the work items (a JSONL corpus may not fit in memory); the document count is known
    # up front only without JSONL inputs.
    total = None if any(f.endswith(".jsonl") for f in files) else len(files)

    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tokenizer = open_tokenizer(args.tokenizer_model)
    if args.append_eod and (tokenizer.eod is None or tokenizer.eod < 0):
        raise SystemExit(f"preprocess_data.py: error: --append-eod needs an end-of-document "
                         f"token, and the tokenizer '{args.tokenizer_model}' has no eos token; "
                         f"drop --append-eod or use a tokenizer with one")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(args.output_prefix + ".bin", dtype=dtype)

    start = time.perf_counter()
    progress = _Progress(total)
    pool, results = tokenized_documents(args, iter_work(files), total is not None)
    try:
        n_docs, n_tokens, n_bytes, n_empty = write_documents(results, builder, progress)
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
    builder.finalize(args.output_prefix + ".idx")
    elapsed = time.perf_counter() - start

    if n_docs == 0:
        raise SystemExit("preprocess_data.py: error: every input document was empty")
    print(
        f"wrote {args.output_prefix}.bin/.idx: {n_docs} docs ({n_empty} empty skipped), "
        f"{n_tokens} tokens ({numpy.dtype(dtype).name}), {n_bytes / 1e6:.2f} MB text in "
        f"{elapsed:.1f}s: {n_tokens / max(elapsed, 1e-9):,.0f} tokens/s, "
        f"{n_docs / max(elapsed, 1e-9):,.1f} docs/s with {args.workers} workers"
    )
    return 0
