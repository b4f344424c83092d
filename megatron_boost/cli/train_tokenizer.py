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

``--kind`` fits the pieces to the text. ``prose`` (the default) is SentencePiece's usual BPE: a
word piece carries its leading space ("▁word"), a run of spaces is one "▁" token per space and a
newline is a byte piece. ``code`` keeps the layout of source code in few tokens: runs of spaces
are pieces of their own ("▁▁▁▁", ``allow_whitespace_only_pieces``), the newline is one piece
(a user-defined symbol) and no dummy "▁" is prepended to a line, so an indented line encodes
the same wherever it stands. After training one line reports the share of whitespace-only
tokens and the bytes per token on the training text; a corpus whose lines are mostly indented
trained as ``prose`` gets a one-line warning.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Iterator

from megatron_boost.cli.arg_types import fraction, non_negative_int, positive_int
from megatron_boost.data.textfiles import expand_inputs

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

#: SentencePiece options of each ``--kind`` (on top of those ``train`` always passes).
KIND_OPTIONS = {
    "prose": {},
    "code": {"allow_whitespace_only_pieces": True, "user_defined_symbols": ["\n"],
             "add_dummy_prefix": False},
}
#: A corpus with at least this share of indented lines is taken for code (prose is rarely
#: indented; Python or C source is, on a third to a half of its lines).
CODE_INDENT_SHARE = 0.25
#: The report and the code check read at most this many characters of the training text.
REPORT_CHARS = 2_000_000
_WHITESPACE = frozenset(" \t\n\r▁")


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
        "--kind", choices=sorted(KIND_OPTIONS), default="prose",
        help="prose: SentencePiece's usual pieces; code: runs of spaces and the newline as "
             "pieces, for source code (and text whose indentation matters)")
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
            **KIND_OPTIONS[args.kind],
        )
    except RuntimeError as err:
        raise SystemExit(
            f"train_tokenizer.py: error: SentencePiece training failed: {err}\n"
            f"(a vocabulary smaller than 260 + the number of distinct characters fails; raise "
            f"--vocab-size or lower --character-coverage)"
        ) from err


def indented_share(lines: list[str]) -> float:
    """The share of ``lines`` that start with a space or a tab (code is indented, prose not)."""
    return sum(1 for line in lines if line[:1] in (" ", "\t")) / max(1, len(lines))


def _is_whitespace_piece(sp, token: int) -> bool:
    """True for a piece of whitespace only: "▁", "▁▁▁▁", the newline, or a whitespace byte."""
    piece = sp.id_to_piece(token)
    if sp.is_byte(token):  # "<0x0A>": a byte-fallback piece
        return chr(int(piece[3:5], 16)) in _WHITESPACE
    return not sp.is_control(token) and set(piece) <= _WHITESPACE


def report_line(sp, text: str) -> str:
    """One line on how ``sp`` encodes ``text``: tokens, bytes per token, whitespace-only share."""
    ids = sp.encode(text)
    pieces = [sp.id_to_piece(token) for token in ids]
    blank = sum(1 for token in ids if _is_whitespace_piece(sp, token))
    newline = sum(1 for piece in pieces if piece in ("\n", "<0x0A>"))
    n_bytes, n_ids = len(text.encode("utf-8")), max(1, len(ids))
    return (f"on the training text ({n_bytes:,} bytes): {len(ids):,} tokens, "
            f"{n_bytes / n_ids:.2f} bytes per token, {100 * blank / n_ids:.1f} % of the tokens "
            f"whitespace only ({100 * newline / n_ids:.1f} % newlines)")


def warn_if_code_as_prose(lines: list[str], kind: str) -> None:
    """One warning line when a corpus that looks like code is trained with prose pieces."""
    share = indented_share(lines)
    if kind == "prose" and share >= CODE_INDENT_SHARE:
        print(f"train_tokenizer.py: warning: {100 * share:.0f} % of the lines start with "
              f"indentation (code?); --kind prose makes every space of an indentation a token "
              f"and every newline a byte; use --kind code", file=sys.stderr)


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
    warn_if_code_as_prose(lines, args.kind)

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
    sample = "\n".join(lines)[:REPORT_CHARS]
    print(f"{args.kind} tokenizer {report_line(sp, sample)}")
    return 0
