"""The training tokenizer as a Hugging Face tokenizer (``AutoTokenizer.from_pretrained``).

A SentencePiece model is converted by transformers (``LlamaTokenizer`` reads ``tokenizer.model``;
the conversion needs ``protobuf``) into a ``tokenizer.json``. transformers' Metaspace
pre-tokenizer does not add SentencePiece's dummy prefix before text that starts with a space
(" Hello" loses one "▁"), so the normaliser is set to exactly SentencePiece's: prepend "▁" (only
when the model adds that dummy prefix: ``train_tokenizer.py --kind code`` does not), then every
space becomes "▁"; the decoder drops the prefix's space only where it was added. No BOS/EOS is added: the training data are the plain
SentencePiece ids with EOS only as the end-of-document token (``tools/preprocess_data.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["hf_tokenizer", "check_same_ids"]

_SPIECE = "▁"


def _adds_dummy_prefix(model_file: str) -> bool:
    """Whether the SentencePiece model prepends "▁" to the text it encodes."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    return proto.normalizer_spec.add_dummy_prefix


def _spiece_normalizer_and_decoder(dummy_prefix: bool):
    """SentencePiece's own normaliser and decoder as ``tokenizers`` components."""
    from tokenizers import decoders, normalizers

    to_spiece = normalizers.Replace(" ", _SPIECE)
    from_spiece = [decoders.Replace(_SPIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if not dummy_prefix:
        return to_spiece, decoders.Sequence(from_spiece)
    return (normalizers.Sequence([normalizers.Prepend(_SPIECE), to_spiece]),
            decoders.Sequence([*from_spiece, decoders.Strip(" ", 1, 0)]))


def _from_sentencepiece(model_file: str):
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_file, Path(tmp) / "tokenizer.model")
        converted = LlamaTokenizer.from_pretrained(tmp)
    backend = converted.backend_tokenizer
    backend.normalizer, backend.decoder = _spiece_normalizer_and_decoder(
        _adds_dummy_prefix(model_file))
    backend.pre_tokenizer = None
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_file)
    specials = {name: sp.id_to_piece(i) for name, i in (
        ("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id()),
        ("pad_token", sp.pad_id())) if i >= 0}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials)


def hf_tokenizer(data_cfg, name: str = "data.tokenizer_model"):
    """The HF tokenizer of a run's ``data`` section (SentencePiece file or HF directory),
    checked first as the trainer checks it (exists, of its kind; ``name`` is the setting
    errors name)."""
    from transformers import AutoTokenizer

    from megatron_boost.data.datasets import check_tokenizer_files

    path = data_cfg.tokenizer_model
    if not os.path.exists(path):
        raise ValueError(f"{name} '{path}' does not exist (moved since training?); pass the "
                         f"run's tokenizer file")
    check_tokenizer_files(path, data_cfg.tokenizer_type, name)

    if data_cfg.tokenizer_type == "huggingface":
        return AutoTokenizer.from_pretrained(data_cfg.tokenizer_model)
    return _from_sentencepiece(data_cfg.tokenizer_model)


def check_same_ids(hf_tok, megatron_tok, text: str) -> None:
    """Raise unless the HF tokenizer gives the training tokenizer's ids on ``text``."""
    ours, theirs = list(megatron_tok.tokenize(text)), hf_tok(text)["input_ids"]
    if ours != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                     min(len(ours), len(theirs)))
        raise ValueError(f"the exported tokenizer gives other ids than the training tokenizer "
                         f"(first difference at token {first} of {len(ours)}); export with "
                         f"--tokenizer naming the run's tokenizer file")
