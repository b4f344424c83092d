"""Data pipeline: the YAML ``data:`` section, the tokenizer and megatron-core GPT datasets.

Everything here is a thin layer over ``megatron.core.datasets`` and ``megatron.core.tokenizers``:

* :class:`DataConfig` holds the ``data:`` section; its ``validate`` (run by the run-level
  validation at launch, before anything is built) makes a missing ``.bin``/``.idx`` or
  tokenizer file fail with a message naming the fix instead of a deep traceback from inside
  Megatron. The builders below expect a validated section.
* :func:`build_tokenizer` loads a SentencePiece (or Hugging Face) tokenizer as a Megatron
  tokenizer; its ``eod`` id is the SentencePiece ``eos`` id written by
  ``tools/train_tokenizer.py`` and appended by ``tools/preprocess_data.py``.
* :func:`build_gpt_datasets` builds the train/valid/test :class:`GPTDataset` splits (or blends)
  with ``BlendedMegatronDatasetBuilder``, with or without ``torch.distributed``.
* :func:`get_batch` turns the next micro-batch of a data iterator into the tensors the training
  step needs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    import torch
# torch is imported where it is used: loading a configuration (DataConfig) must not import it
# (megatron_boost/config/modes.py says why).

__all__ = [
    "DataConfig",
    "parse_blend",
    "build_tokenizer",
    "check_tokenizer_files",
    "build_gpt_datasets",
    "get_batch",
]

_TOKENIZER_TYPES = ("sentencepiece", "huggingface")


def _is_number(value: Any) -> bool:
    """True for ints/floats and for strings that parse as a float (YAML may give either)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def parse_blend(
    paths: list, name: str = "data.data_path"
) -> tuple[list[str], Optional[list[float]]]:
    """Parse a Megatron blend list into ``(prefixes, weights)``.

    Accepted forms (Megatron's ``--data-path`` syntax): ``[prefix]``, ``[prefix1, prefix2, ...]``
    (weights inferred from dataset sizes, returned as ``None``) and
    ``[w1, prefix1, w2, prefix2, ...]``; a string is split on whitespace like the Megatron-LM
    command line. ``name`` is the config key used in error messages.
    """
    if isinstance(paths, str):
        paths = paths.split()
    if not paths:
        raise ValueError(
            f"{name} is empty; give [prefix] or [weight1, prefix1, weight2, prefix2, ...]"
        )
    if not _is_number(paths[0]):
        bad = [p for p in paths if _is_number(p)]
        if bad:
            raise ValueError(
                f"{name}={paths!r} mixes prefixes and weights; use either [prefix1, prefix2, ...] "
                f"or [weight1, prefix1, weight2, prefix2, ...]"
            )
        return [str(p) for p in paths], None
    if len(paths) % 2 != 0:
        raise ValueError(
            f"{name}={paths!r} has {len(paths)} entries; a weighted blend needs pairs "
            f"[weight1, prefix1, weight2, prefix2, ...]"
        )
    weights, prefixes = [], []
    for weight, prefix in zip(paths[0::2], paths[1::2]):
        if not _is_number(weight) or _is_number(prefix):
            raise ValueError(
                f"{name}={paths!r}: expected alternating weight, prefix pairs but got "
                f"({weight!r}, {prefix!r}); fix the order to [weight1, prefix1, ...]"
            )
        if float(weight) <= 0:
            raise ValueError(
                f"{name} weight {weight!r} for prefix {prefix!r} must be > 0; drop the prefix "
                f"instead of giving it weight 0"
            )
        weights.append(float(weight))
        prefixes.append(str(prefix))
    return prefixes, weights


@dataclass
class DataConfig:
    """The ``data:`` section of a run config."""

    data_path: list[str] = field(default_factory=list)
    """Megatron blend of indexed datasets: ``[prefix]``, ``[prefix1, prefix2, ...]`` or
    ``[w1, prefix1, w2, prefix2, ...]``. A prefix names ``<prefix>.bin``/``<prefix>.idx`` as written
    by ``tools/preprocess_data.py``. Ignored when ``mock`` is true."""

    split: str = "969,30,1"
    """Train/valid/test weights (comma separated) used to split every prefix of ``data_path`` by
    document. Ignored when ``valid_data_path`` is set (then ``data_path`` is all training data)."""

    valid_data_path: list[str] = field(default_factory=list)
    """Optional separate blend for validation (same syntax as ``data_path``), e.g. held-out plays.
    When set, validation reads it, training reads all of ``data_path`` and ``split`` is unused."""

    test_data_path: list[str] = field(default_factory=list)
    """Optional separate blend for the test split; only used together with ``valid_data_path``
    (without it the test split comes from ``split``)."""

    tokenizer_model: str = ""
    """Path to the tokenizer: a SentencePiece ``.model`` file (``tools/train_tokenizer.py``), or a
    Hugging Face tokenizer directory when ``tokenizer_type`` is ``huggingface``. May be empty only
    with ``mock: true`` (a null tokenizer of ``mock_vocab_size`` ids is used then)."""

    tokenizer_type: str = "sentencepiece"
    """Tokenizer library: ``sentencepiece`` (default) or ``huggingface`` (a tokenizer directory;
    needs ``transformers``)."""

    cache_path: Optional[str] = None
    """Directory for Megatron's cached sample/shuffle indices. ``None`` keeps Megatron's default,
    ``<prefix dir>/cache/GPTDataset_indices`` (the data directory must then be writable)."""

    num_workers: int = 0
    """DataLoader worker processes; 0 loads samples in the training process (enough for the
    memory-mapped ``.bin`` files at small scale)."""

    mock: bool = False
    """Use Megatron's ``MockGPTDataset`` (synthetic token sequences) instead of files: for tests
    and throughput benchmarks that need no data."""

    mock_vocab_size: int = 32000
    """Vocabulary size of the null tokenizer used when ``mock`` is true and no ``tokenizer_model``
    is given (the last id is the end-of-document token)."""

    reset_position_ids: bool = False
    """Restart position ids after every end-of-document token inside a sample."""

    eod_mask_loss: bool = False
    """Exclude the loss on end-of-document tokens (``loss_mask`` is 0 there)."""

    def validate(self) -> None:
        """Check the section and raise ``ValueError`` naming the value, the rule and the fix."""
        self._validate_tokenizer()
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers} must be >= 0 (0 = no workers)")
        if self.mock:
            return
        _parse_split(self.split)
        self._validate_blend(self.data_path, "data.data_path")
        if self.valid_data_path:
            self._validate_blend(self.valid_data_path, "data.valid_data_path")
        if self.test_data_path:
            if not self.valid_data_path:
                raise ValueError(
                    "data.test_data_path is set but data.valid_data_path is not; separate "
                    "blends are used per split only together: set valid_data_path as well, or "
                    "drop test_data_path and use data.split"
                )
            self._validate_blend(self.test_data_path, "data.test_data_path")

    def _validate_tokenizer(self) -> None:
        """Check ``tokenizer_type`` and that ``tokenizer_model`` exists (unless mock)."""
        if self.tokenizer_type not in _TOKENIZER_TYPES:
            raise ValueError(
                f"data.tokenizer_type={self.tokenizer_type!r} is not supported; use one of "
                f"{list(_TOKENIZER_TYPES)}"
            )
        if not self.tokenizer_model:
            if self.mock:
                if self.mock_vocab_size < 2:
                    raise ValueError(
                        f"data.mock_vocab_size={self.mock_vocab_size} must be >= 2 "
                        f"(at least one token plus end-of-document)"
                    )
                return
            raise ValueError(
                "data.tokenizer_model is empty; set it to a SentencePiece .model file "
                "(train one with tools/train_tokenizer.py) or set data.mock: true"
            )
        if not os.path.exists(self.tokenizer_model):
            raise ValueError(
                f"data.tokenizer_model '{self.tokenizer_model}' does not exist; train it with "
                f"tools/train_tokenizer.py or fix the path"
            )
        check_tokenizer_files(self.tokenizer_model, self.tokenizer_type, "data.tokenizer_model")

    @staticmethod
    def _validate_blend(paths: list, name: str) -> None:
        """Check the blend syntax and that every prefix has its ``.bin`` and ``.idx`` files."""
        prefixes, _ = parse_blend(paths, name)
        for prefix in prefixes:
            missing = [s for s in (".bin", ".idx") if not os.path.isfile(prefix + s)]
            if missing:
                raise ValueError(
                    f"{name} prefix '{prefix}' has no {prefix}.bin/.idx (missing "
                    f"{', '.join(missing)}); run tools/preprocess_data.py --output-prefix "
                    f"{prefix} first, or fix the path (give the prefix without .bin/.idx)"
                )


def _parse_split(split: str) -> list[float]:
    """Parse ``"969,30,1"`` into three non-negative weights, with a helpful error."""
    try:
        weights = [float(part) for part in str(split).split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"data.split={split!r} must be 1 to 3 comma-separated non-negative numbers with a "
            f"positive sum (train,valid,test), e.g. '969,30,1'"
        )
    return weights + [0.0] * (3 - len(weights))


#: Files of which a Hugging Face tokenizer directory needs at least one (tokenizer.json: a fast
#: tokenizer; tokenizer.model: a SentencePiece one; vocab.json: a BPE vocabulary).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_tokenizer_files(path: str, tokenizer_type: str, name: str) -> None:
    """``ValueError`` naming ``name`` when the existing ``path`` is not a tokenizer of that
    kind: a SentencePiece tokenizer is one ``.model`` file that SentencePiece parses, a Hugging
    Face tokenizer a directory holding one of :data:`HF_TOKENIZER_FILES`."""
    if tokenizer_type == "huggingface":
        if not os.path.isdir(path):
            raise ValueError(f"{name} '{path}' is a file; a Hugging Face tokenizer is a directory "
                             f"(with tokenizer.json); a SentencePiece .model file is "
                             f"tokenizer_type sentencepiece")
        if not any(os.path.isfile(os.path.join(path, f)) for f in HF_TOKENIZER_FILES):
            raise ValueError(f"{name} '{path}' is an incomplete Hugging Face tokenizer "
                             f"directory: it holds none of {', '.join(HF_TOKENIZER_FILES)}; "
                             f"save the tokenizer there with save_pretrained()")
        return
    if os.path.isdir(path):
        raise ValueError(f"{name} '{path}' is a directory; a SentencePiece tokenizer is a single "
                         f".model file (a Hugging Face tokenizer directory is tokenizer_type "
                         f"huggingface)")
    import sentencepiece as spm

    try:
        spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as err:
        reason = " ".join(str(err).split())[:120]
        raise ValueError(f"{name} '{path}' is not a SentencePiece model ({reason}); give the "
                         f".model file tools/train_tokenizer.py wrote") from None


def build_tokenizer(data_cfg: DataConfig):
    """Load the tokenizer named by ``data_cfg`` as a Megatron tokenizer.

    Returns a ``megatron.core.tokenizers`` tokenizer (``MegatronTokenizerBase``) with
    ``vocab_size``, ``eod`` (the SentencePiece ``eos`` id), ``tokenize`` and ``detokenize``.
    The metadata is passed as a dict rather than written with ``write_metadata``: Megatron keeps
    one ``tokenizer_metadata.json`` per directory, which would clash between two models in the
    same folder and fails on read-only data directories. ``data_cfg`` must be validated
    (:meth:`DataConfig.validate`).
    """
    from megatron.core.tokenizers import MegatronTokenizer

    from megatron_boost.compat import null_tokenizer

    if not data_cfg.tokenizer_model:
        # Mock data without a tokenizer file: Megatron's null tokenizer uses its last id as EOD.
        return null_tokenizer(data_cfg.mock_vocab_size - 1)
    metadata = {"library": data_cfg.tokenizer_type, "model_type": "gpt", "chat_template": None}
    try:
        return MegatronTokenizer.from_pretrained(data_cfg.tokenizer_model, metadata_path=metadata)
    except Exception as err:  # noqa: BLE001 - each library raises its own kinds
        reason = " ".join(str(err).split())[:200]
        raise ValueError(f"data.tokenizer_model '{data_cfg.tokenizer_model}' cannot be loaded "
                         f"as a {data_cfg.tokenizer_type} tokenizer ({reason})") from None


def _check_split_coverage(prefixes: list[str], split_matrix: list, split: str) -> None:
    """Fail early when ``split`` gives some prefix no documents in a split with weight > 0.

    Megatron splits every prefix by document (sequence) index; a split that rounds to zero
    documents has zero tokens per epoch, and ``GPTDataset._get_num_epochs`` then loops forever.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        # Same count and rounding as BlendedMegatronDatasetBuilder._build_megatron_dataset_splits.
        num_docs = len(IndexedDataset(prefix))
        for name, bounds in zip(("train", "valid", "test"), split_matrix):
            if bounds is None:
                continue
            begin, end = (int(round(b * float(num_docs))) for b in bounds)
            if end <= begin:
                raise ValueError(
                    f"data.split={split!r} leaves the {name} split of prefix '{prefix}' "
                    f"({num_docs} documents) empty; give that split weight 0, a larger weight, "
                    f"more documents, or a separate data.valid_data_path"
                )


def _blends(data_cfg: DataConfig):
    """``(blend, blend_per_split, split)`` for megatron's GPTDatasetConfig: one blend cut by
    ``data.split``, or one blend per split when a separate validation set is given (train then
    reads all of ``data_path``). All None for mock data: GPTDatasetConfig then switches itself
    to mock mode."""
    if data_cfg.mock:
        return None, None, None
    train_blend = parse_blend(data_cfg.data_path, "data.data_path")
    if not data_cfg.valid_data_path:
        return train_blend, None, str(data_cfg.split)
    test_blend = (parse_blend(data_cfg.test_data_path, "data.test_data_path")
                  if data_cfg.test_data_path else None)
    valid_blend = parse_blend(data_cfg.valid_data_path, "data.valid_data_path")
    return None, [train_blend, valid_blend, test_blend], None


def build_gpt_datasets(
    data_cfg: DataConfig,
    tokenizer,
    seq_length: int,
    seed: int,
    train_samples: Optional[int],
    valid_samples: Optional[int],
    test_samples: Optional[int],
):
    """Build the ``(train_ds, valid_ds, test_ds)`` GPT datasets described by ``data_cfg``.

    Each sample is a dict of ``tokens``/``labels``/``loss_mask``/``position_ids``, each of length
    ``seq_length`` (drawn as ``seq_length + 1`` tokens and shifted by one for the labels); no
    attention mask is built because the model applies causal attention itself. A ``*_samples``
    count is the minimum to draw (Megatron rounds the train split up to whole epochs); ``None``
    means one epoch. A split with weight 0 (or no separate blend) is returned as ``None``.

    ``data_cfg`` must be validated (:meth:`DataConfig.validate`). Works without
    ``torch.distributed`` (single process). With a process group every rank must
    call this: rank 0 builds and caches the indices first, the others then load them.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    config = _gpt_dataset_config(data_cfg, tokenizer, seq_length, seed)
    dataset_cls = MockGPTDataset if data_cfg.mock else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        dataset_cls,
        [train_samples, valid_samples, test_samples],
        lambda: True,  # every rank holds the datasets; rank 0 still builds the cache first
        config,
    )
    from megatron_boost.compat import rank_zero_without_process_group  # a version difference

    with rank_zero_without_process_group():
        train_ds, valid_ds, test_ds = builder.build()
    return train_ds, valid_ds, test_ds


def _gpt_dataset_config(data_cfg: DataConfig, tokenizer, seq_length: int, seed: int):
    """megatron's ``GPTDatasetConfig`` for ``data_cfg`` (blends, splits, cache, masks), once
    the blend's files are known to cover the split's non-empty parts."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length} must be >= 1")
    blend, blend_per_split, split = _blends(data_cfg)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache=data_cfg.cache_path,
        tokenizer=tokenizer,
        reset_position_ids=data_cfg.reset_position_ids,
        reset_attention_mask=False,
        eod_mask_loss=data_cfg.eod_mask_loss,
        create_attention_mask=False,
    )
    if blend is not None:
        _check_split_coverage(blend[0], config.split_matrix, data_cfg.split)
    return config


def get_batch(data_iterator: Optional[Iterator]) -> Optional[dict[str, torch.Tensor]]:
    """Take the next micro-batch from ``data_iterator`` as training tensors.

    Returns ``tokens``, ``labels``, ``position_ids`` (int64, ``[b, s]``) and ``loss_mask``
    (float32, ``[b, s]``), plus ``attention_mask`` if the dataset produced one. Returns ``None``
    when ``data_iterator`` is ``None`` (pipeline stages that read no data).
    """
    import torch

    if data_iterator is None:
        return None
    batch = next(data_iterator)
    out = {}
    for key in ("tokens", "labels", "position_ids"):
        out[key] = torch.as_tensor(batch[key]).long()
    out["loss_mask"] = torch.as_tensor(batch["loss_mask"]).float()
    if "attention_mask" in batch:
        out["attention_mask"] = torch.as_tensor(batch["attention_mask"])
    # A dataset indexed directly (no DataLoader) yields unbatched [s] samples: make them [1, s].
    if out["tokens"].dim() == 1:
        out = {key: value.unsqueeze(0) for key, value in out.items()}
    return out
