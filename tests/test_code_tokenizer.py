"""``tools/train_tokenizer.py --kind code`` on source code: indentation and newlines round-trip
exactly, are few tokens, read the same through megatron's tokenizer and the HF export, and a
code corpus trained as prose gets its one warning line.

The corpus is the project's own Python source (a few KB of it), read at test time.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from megatron_boost.cli import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
#: A snippet whose layout must survive: nested indentation, blank lines, a tab, trailing spaces.
SNIPPET = "class A:\n    def f(self):\n\n        if x:\n            return 1  \n\treturn 2\n"


def _code_corpus(folder: Path, max_chars: int = 24_000) -> str:
    """Copy whole source files of the project into ``folder`` up to ``max_chars``; their text."""
    folder.mkdir()
    texts = []
    for source in sorted((ROOT / "megatron_boost" / "train").glob("*.py")):
        text = source.read_text(encoding="utf-8")
        if texts and sum(map(len, texts)) + len(text) > max_chars:
            continue
        (folder / source.name).write_text(text, encoding="utf-8")
        texts.append(text)
    return "".join(texts)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The code corpus, and a tokenizer of each kind trained on it (with their printed lines)."""
    import sentencepiece as spm

    tmp = tmp_path_factory.mktemp("code_tok")
    text = _code_corpus(tmp / "corpus")
    models, outputs = {}, {}
    for kind in ("prose", "code"):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert train_tokenizer.main(["--input", str(tmp / "corpus"), "--vocab-size", "600",
                                         "--model-prefix", str(tmp / kind), "--kind", kind,
                                         "--num-threads", "1"]) == 0
        models[kind] = str(tmp / f"{kind}.model")
        outputs[kind] = (out.getvalue(), err.getvalue())
    return text, models, outputs, {k: spm.SentencePieceProcessor(model_file=m)
                                   for k, m in models.items()}


def _whitespace_share(sp, text: str) -> float:
    ids = sp.encode(text)
    return sum(train_tokenizer._is_whitespace_piece(sp, i) for i in ids) / len(ids)


def _space_tokens(sp, text: str) -> int:
    """The tokens of ``text`` that are spaces only ("▁", "▁▁▁▁", a space byte)."""
    return sum(1 for i in sp.encode(text) if train_tokenizer._is_whitespace_piece(sp, i)
               and sp.id_to_piece(i) not in ("\n", "<0x0A>"))


@pytest.mark.fast
def test_code_kind_round_trips_layout_in_few_whitespace_tokens(trained):
    text, _, _, sps = trained
    code = sps["code"]
    for sample in (text, SNIPPET):
        assert code.decode(code.encode(sample)) == sample
    # The newline is one piece of its own, not a byte-fallback piece.
    assert code.encode("\n", out_type=str) == ["\n"]
    # An indentation of eight spaces is one piece, not eight "▁".
    assert "▁" * 8 in code.encode("x\n        y", out_type=str)
    # The prose kind spends a token on every space of an indentation; code far fewer.
    assert _space_tokens(code, text) < _space_tokens(sps["prose"], text) / 2
    assert _whitespace_share(code, text) < _whitespace_share(sps["prose"], text)


@pytest.mark.fast
def test_report_line_and_the_code_as_prose_warning(trained):
    text, _, outputs, sps = trained
    for kind in ("prose", "code"):
        out, err = outputs[kind]
        report = [line for line in out.splitlines() if line.startswith(f"{kind} tokenizer on")]
        assert len(report) == 1, out
        share = 100 * _whitespace_share(sps[kind], "\n".join(
            line for line in text.splitlines() if line.strip()))
        assert f"{share:.1f} % of the tokens whitespace only" in report[0]
        assert "bytes per token" in report[0]
    prose_err = outputs["prose"][1].splitlines()
    assert len(prose_err) == 1 and "use --kind code" in prose_err[0], prose_err
    assert outputs["code"][1] == ""


def test_code_tokenizer_reads_the_same_in_megatron_and_the_hf_export(trained):
    """Training (megatron's tokenizer) and the export (HF tokenizer) give the very ids, and
    the HF tokenizer decodes them back to the text."""
    from megatron_boost.convert.tokenizer import check_same_ids, hf_tokenizer
    from megatron_boost.data.datasets import DataConfig, build_tokenizer

    text, models, _, sps = trained
    data = DataConfig(tokenizer_model=models["code"], mock=True)
    megatron_tok, hf_tok = build_tokenizer(data), hf_tokenizer(data)
    for sample in (text, SNIPPET):
        assert list(megatron_tok.tokenize(sample)) == sps["code"].encode(sample)
        check_same_ids(hf_tok, megatron_tok, sample)
        assert hf_tok.decode(hf_tok(sample)["input_ids"]) == sample
