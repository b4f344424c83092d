"""Train a SentencePiece tokenizer offline.

    megatron-boost-train-tokenizer --input data/raw/*.txt --vocab-size 8000 --model-prefix data/spm

(or ``python tools/train_tokenizer.py`` with the same arguments)

Writes ``<model-prefix>.model`` and ``<model-prefix>.vocab``. Inputs are text files (every
non-empty line is a training sentence), ``.jsonl`` files (the ``--json-key`` field of every
record, split into lines) and directories (all files below them, sorted); globs are expanded.

Special ids: unk=0, bos=1, eos=2, pad=3. ``eos`` is the end-of-document (EOD) token that
``tools/preprocess_data.py --append-eod`` appends and Megatron's GPT dataset looks for.
``byte_fallback`` is on, so any UTF-8 text (including newlines) encodes without unknown tokens;
it spends 256 ids on byte pieces, so the vocabulary must exceed 260 plus the kept characters.
The vocabulary size is a soft limit: a corpus too small for the requested size yields a smaller
vocabulary instead of an error.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Iterator

from megatron_boost.cli.arg_types import fraction, non_negative_int, positive_int
from megatron_boost.data.textfiles import expand_inputs

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


def iter_lines(files: list[str], json_key: str) -> Iterator[str]:
    """Yield the non-empty lines of all inputs (for ``.jsonl``: lines of the ``json_key`` text)."""
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, raw in enumerate(f, 1):
                if path.endswith(".jsonl"):
                    if not raw.strip():
                        continue
                    try:
                        text = json.loads(raw)[json_key]
                    except (json.JSONDecodeError, KeyError, TypeError) as err:
                        raise SystemExit(
                            f"train_tokenizer.py: error: {path}:{lineno} is not a JSON object "
                            f"with key '{json_key}' ({err}); fix the file or pass --json-key"
                        ) from err
                    yield from (line for line in str(text).splitlines() if line.strip())
                elif raw.strip():
                    yield raw.rstrip("\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input", nargs="+", required=True, help="text/.jsonl files, dirs or globs"
    )
    parser.add_argument("--vocab-size", type=positive_int, required=True,
                        help="target vocabulary size")
    parser.add_argument("--model-prefix", required=True, help="writes <prefix>.model/.vocab")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument(
        "--character-coverage",
        type=fraction,
        default=0.9995,
        help="fraction of characters kept as pieces; the rest fall back to bytes",
    )
    parser.add_argument("--json-key", default="text", help="text field of .jsonl records")
    parser.add_argument(
        "--input-sentence-size",
        type=non_negative_int,
        default=2_000_000,
        help="at most this many (randomly sampled) lines are used; 0 = all",
    )
    parser.add_argument("--num-threads", type=positive_int, default=os.cpu_count() or 1)
    return parser.parse_args(argv)


def train(lines: list[str], args: argparse.Namespace) -> None:
    """Train the SentencePiece model on ``lines`` and write ``<model-prefix>.model/.vocab``."""
    import sentencepiece as spm

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=args.model_prefix,
            model_type=args.model_type,
            vocab_size=args.vocab_size,
            hard_vocab_limit=False,
            character_coverage=args.character_coverage,
            byte_fallback=True,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            # Keep text as written (no NFKC, keep runs of spaces) so decoding round-trips.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            input_sentence_size=args.input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=max(1, args.num_threads),
            minloglevel=2,
        )
    except RuntimeError as err:
        raise SystemExit(
            f"train_tokenizer.py: error: SentencePiece training failed: {err}\n"
            f"(a vocabulary smaller than 260 + the number of distinct characters fails; raise "
            f"--vocab-size or lower --character-coverage)"
        ) from err


def main(argv: list[str] | None = None) -> int:
    import sentencepiece as spm

    args = parse_args(argv)
    min_vocab = 256 + 4 + 1  # byte pieces + unk/bos/eos/pad + at least one character piece
    if args.vocab_size < min_vocab:
        raise SystemExit(
            f"train_tokenizer.py: error: --vocab-size {args.vocab_size} is too small; byte "
            f"fallback needs 256 byte pieces and 4 special ids, so use at least {min_vocab} "
            f"(a few hundred more for a useful tokenizer)"
        )
    files = expand_inputs(args.input, "train_tokenizer.py")
    # Materialize the lines: the trainer needs them anyway, and an empty corpus must be caught
    # here with a clear message instead of a SentencePiece internal error.
    lines = list(iter_lines(files, args.json_key))
    if not lines:
        raise SystemExit(
            f"train_tokenizer.py: error: no text found in --input {' '.join(args.input)} "
            f"({len(files)} files, all empty); point --input at non-empty .txt/.jsonl files"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)

    start = time.perf_counter()
    train(lines, args)
    elapsed = time.perf_counter() - start

    sp = spm.SentencePieceProcessor(model_file=args.model_prefix + ".model")
    print(
        f"trained {args.model_type} tokenizer {args.model_prefix}.model: "
        f"vocab {sp.get_piece_size()} (requested {args.vocab_size}), eod=eos={sp.eos_id()}, "
        f"pad={sp.pad_id()}, {len(lines)} lines / {sum(map(len, lines))} chars from "
        f"{len(files)} files in {elapsed:.1f}s"
    )
    return 0
