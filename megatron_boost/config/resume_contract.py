"""The resume contract: which run-config keys may change when a run resumes from its checkpoint.

Every key of :class:`~megatron_boost.config.run.RunConfig` is classified here, once
(tests/test_resume_contract.py walks the dataclass tree and fails on a key this table leaves
out). A key is one of:

* ``may change``: a resumed run takes the new value; the rule's text says what that means
  (another layout reshards the checkpoint, a budget extends the run, logging goes elsewhere).
* ``must match (weights)``: the checkpoint's weights compute another function under another
  value (σ, RoPE's base, full rank vs low rank). Refused on resume and for
  ``checkpoint.init_from`` alike.
* ``must match (model)``: part of the model's definition (its sizes, ranks, ε, tying, vocabulary):
  a resume that changed it would train another model from the old one's state, or drop trained
  weights silently (tying an untied run drops its output layer). Refused on resume; a new run
  may take the weights as its start with ``checkpoint.init_from`` (its own run directory).
* ``must match (optimizer state)``: the saved optimizer state has the old value's format;
  refused on resume unless ``checkpoint.no_load_optim`` (weights only, fresh optimizer state).

Some rules compare a value derived from the config rather than the raw key, so that spellings
of one model agree (``num_query_groups: null`` and the head count; a rank given or derived
from ``rank_ratio``). A key the saved config lacks (written before the key existed) counts as
its default, which is the behaviour the version before it had. :func:`check_resume_contract`
is the one check (train/checkpointing.py calls it after the tensor-shape check, which names
the shape keys with both shapes); its refusal is one line naming the key, both values and the
fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional

from megatron_boost.config.modes import TPMode, default_rank

__all__ = ["MAY_CHANGE", "WEIGHTS", "MODEL", "OPTIMIZER_STATE", "Rule", "RESUME_CONTRACT",
           "config_keys", "check_resume_contract"]

MAY_CHANGE = "may change"
WEIGHTS = "must match (weights)"
MODEL = "must match (model)"
OPTIMIZER_STATE = "must match (optimizer state)"


@dataclass(frozen=True)
class Rule:
    """How one key behaves on resume: its ``kind`` and what a change means (``meaning``);
    ``value`` derives the compared value from the whole config (dict) when the raw key's
    spellings differ for one model."""

    kind: str
    meaning: str
    value: Optional[Callable[[Dict], Any]] = None


def _get(cfg: Dict, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _lowrank(cfg: Dict) -> bool:
    return TPMode.parse(_get(cfg, "parallel.mode", TPMode.BOOST)).is_lowrank


def _resolved_ranks(cfg: Dict):
    """(attn, mlp) ranks of a low-rank model as the model builds them; None for full rank."""
    if not _lowrank(cfg):
        return None
    rank = default_rank(_get(cfg, "model.hidden_size", 64), _get(cfg, "model.rank_ratio", 0.25))
    return (_get(cfg, "model.attn_rank") or rank, _get(cfg, "model.mlp_rank") or rank)


def _query_groups(cfg: Dict) -> int:
    return _get(cfg, "model.num_query_groups") or _get(cfg, "model.num_attention_heads", 4)


def _head_dim(cfg: Dict) -> int:
    heads = _get(cfg, "model.num_attention_heads", 4)
    return _get(cfg, "model.kv_channels") or _get(cfg, "model.hidden_size", 64) // heads


def _vocab(cfg: Dict):
    """model.vocab_size where it is the vocabulary: without a tokenizer (the embedding's shape
    guards a tokenizer's)."""
    return None if _get(cfg, "data.tokenizer_model") else _get(cfg, "model.vocab_size", 256)


def _tokenizer_type(cfg: Dict):
    return _get(cfg, "data.tokenizer_type") if _get(cfg, "data.tokenizer_model") else None


_SHAPE = "a model of another size"
_LAYOUT = "the checkpoint reshards to the new layout (docs/design.md §8)"
_LOG = "logging from the resume point on"
_BUDGET = "the run's length: a larger value extends it (docs/fault-tolerance.md)"
_SCHEDULE = "the learning-rate schedule from the resume point on"
_HYPER = "an optimizer hyperparameter, used from the resume point on"
_DATA = "the data read from the resume point on"
_NEXT = "the checkpoints written from the resume point on"
_SPEED = "speed or memory only: the same function"

#: Every key of the run config, dotted (``logging.wandb.project``), and its rule.
RESUME_CONTRACT: Dict[str, Rule] = {
    "model.num_layers": Rule(MODEL, _SHAPE),
    "model.hidden_size": Rule(MODEL, _SHAPE),
    "model.ffn_hidden_size": Rule(MODEL, _SHAPE),
    "model.num_attention_heads": Rule(MODEL, _SHAPE),
    "model.num_query_groups": Rule(MODEL, _SHAPE, _query_groups),
    "model.kv_channels": Rule(MODEL, _SHAPE, _head_dim),
    "model.vocab_size": Rule(MODEL, "another vocabulary", _vocab),
    "model.seq_length": Rule(MAY_CHANGE, "samples of the new length from the resume point on "
                             "(RoPE positions are relative)"),
    "model.attn_rank": Rule(MODEL, "another bottleneck rank", _resolved_ranks),
    "model.mlp_rank": Rule(MODEL, "another bottleneck rank", _resolved_ranks),
    "model.rank_ratio": Rule(MODEL, "another bottleneck rank", _resolved_ranks),
    "model.bottleneck_activation": Rule(WEIGHTS, "another σ inside every bottleneck"),
    "model.mlp_gate_activation": Rule(WEIGHTS, "another MLP gate"),
    "model.cola_init": Rule(MAY_CHANGE, "the initialisation only: unused on resume"),
    "model.init_method_std": Rule(MAY_CHANGE, "the initialisation only: unused on resume"),
    "model.norm_epsilon": Rule(MODEL, "another ε in every RMSNorm"),
    "model.rotary_base": Rule(WEIGHTS, "another RoPE base"),
    "model.share_embeddings_and_output_weights": Rule(
        MODEL, "tying drops the trained output layer, untying starts a new one"),
    "model.attention_backend": Rule(MAY_CHANGE, _SPEED),
    "model.hidden_dropout": Rule(MAY_CHANGE, "regularisation from the resume point on"),
    "model.attention_dropout": Rule(MAY_CHANGE, "regularisation from the resume point on"),
    "model.bias_activation_fusion": Rule(MAY_CHANGE, _SPEED),
    "parallel.mode": Rule(WEIGHTS, "full rank and low rank are other models (boost and naive "
                          "are one model: that change is a layout)",
                          lambda c: "low-rank" if _lowrank(c) else "full"),
    "parallel.tp": Rule(MAY_CHANGE, _LAYOUT),
    "parallel.pp": Rule(MAY_CHANGE, _LAYOUT),
    "parallel.vpp": Rule(MAY_CHANGE, _LAYOUT),
    "parallel.dp": Rule(MAY_CHANGE, _LAYOUT),
    "parallel.use_distributed_optimizer": Rule(OPTIMIZER_STATE, "another optimizer-state "
                                               "format"),
    "parallel.overlap_grad_reduce": Rule(MAY_CHANGE, _SPEED),
    "parallel.sequence_parallel": Rule(MAY_CHANGE, _LAYOUT),
    "parallel.overlap_bottleneck_grad_reduce": Rule(MAY_CHANGE, _SPEED),
    "parallel.bottleneck_overlap_chunks": Rule(MAY_CHANGE, _SPEED),
    "parallel.interleave_halves": Rule(MAY_CHANGE, _SPEED),
    "parallel.timeout_minutes": Rule(MAY_CHANGE, "how long a collective waits"),
    "training.micro_batch_size": Rule(MAY_CHANGE, _SPEED),
    "training.global_batch_size": Rule(MAY_CHANGE, "the batch from the resume point on"),
    "training.train_iters": Rule(MAY_CHANGE, _BUDGET),
    "training.train_tokens": Rule(MAY_CHANGE, _BUDGET),
    "training.eval_interval": Rule(MAY_CHANGE, _LOG),
    "training.eval_iters": Rule(MAY_CHANGE, _LOG),
    "training.precision": Rule(MAY_CHANGE, "the arithmetic from the resume point on"),
    "training.recompute": Rule(MAY_CHANGE, _SPEED),
    "training.cuda_graph_impl": Rule(MAY_CHANGE, _SPEED),
    "training.cuda_graph_scope": Rule(MAY_CHANGE, _SPEED),
    "training.seed": Rule(MAY_CHANGE, "the data order and dropout from the resume point on"),
    "training.device": Rule(MAY_CHANGE, _SPEED),
    "training.max_skipped_steps": Rule(MAY_CHANGE, "when non-finite steps stop the run"),
    "training.exit_interval": Rule(MAY_CHANGE, "when the run stops"),
    "training.exit_duration_minutes": Rule(MAY_CHANGE, "when the run stops"),
    "data.data_path": Rule(MAY_CHANGE, _DATA),
    "data.split": Rule(MAY_CHANGE, _DATA),
    "data.valid_data_path": Rule(MAY_CHANGE, _DATA),
    "data.test_data_path": Rule(MAY_CHANGE, _DATA),
    "data.tokenizer_model": Rule(MAY_CHANGE, "a tokenizer file at another path (its "
                                 "vocabulary size is checked by the embedding's shape)"),
    "data.tokenizer_type": Rule(MODEL, "another tokenizer library", _tokenizer_type),
    "data.cache_path": Rule(MAY_CHANGE, _DATA),
    "data.num_workers": Rule(MAY_CHANGE, _SPEED),
    "data.mock": Rule(MAY_CHANGE, _DATA),
    "data.mock_vocab_size": Rule(MAY_CHANGE, "not read by training (a mock run's vocabulary is "
                                 "model.vocab_size)"),
    "data.reset_position_ids": Rule(MAY_CHANGE, _DATA),
    "data.eod_mask_loss": Rule(MAY_CHANGE, _DATA),
    "optimizer.name": Rule(OPTIMIZER_STATE, "another optimizer"),
    "optimizer.lr": Rule(MAY_CHANGE, _SCHEDULE),
    "optimizer.min_lr": Rule(MAY_CHANGE, _SCHEDULE),
    "optimizer.warmup_iters": Rule(MAY_CHANGE, _SCHEDULE),
    "optimizer.lr_decay_iters": Rule(MAY_CHANGE, _SCHEDULE),
    "optimizer.lr_decay_style": Rule(MAY_CHANGE, _SCHEDULE),
    "optimizer.lr_wsd_decay_iters": Rule(MAY_CHANGE, _SCHEDULE),
    "optimizer.lr_wsd_decay_style": Rule(MAY_CHANGE, _SCHEDULE),
    "optimizer.weight_decay": Rule(MAY_CHANGE, _HYPER),
    "optimizer.adam_beta1": Rule(MAY_CHANGE, _HYPER),
    "optimizer.adam_beta2": Rule(MAY_CHANGE, _HYPER),
    "optimizer.adam_eps": Rule(MAY_CHANGE, _HYPER),
    "optimizer.clip_grad": Rule(MAY_CHANGE, _HYPER),
    "optimizer.muon_momentum": Rule(MAY_CHANGE, _HYPER),
    "optimizer.muon_nesterov": Rule(MAY_CHANGE, _HYPER),
    "optimizer.muon_ns_steps": Rule(MAY_CHANGE, _HYPER),
    "optimizer.muon_ns_coefficients": Rule(MAY_CHANGE, _HYPER),
    "optimizer.muon_scale": Rule(MAY_CHANGE, _HYPER),
    "optimizer.muon_extra_scale": Rule(MAY_CHANGE, _HYPER),
    "logging.run_dir": Rule(MAY_CHANGE, _LOG),
    "logging.log_interval": Rule(MAY_CHANGE, _LOG),
    "logging.tensorboard": Rule(MAY_CHANGE, _LOG),
    "logging.peak_tflops": Rule(MAY_CHANGE, _LOG),
    "logging.measure_comm": Rule(MAY_CHANGE, _LOG),
    "logging.wandb.project": Rule(MAY_CHANGE, _LOG),
    "logging.wandb.name": Rule(MAY_CHANGE, _LOG),
    "logging.wandb.dir": Rule(MAY_CHANGE, _LOG),
    "logging.wandb.mode": Rule(MAY_CHANGE, _LOG),
    "checkpoint.save": Rule(MAY_CHANGE, _NEXT),
    "checkpoint.save_interval": Rule(MAY_CHANGE, _NEXT),
    "checkpoint.load": Rule(MAY_CHANGE, "where the run resumes from"),
    "checkpoint.init_from": Rule(MAY_CHANGE, "ignored once the run has a checkpoint"),
    "checkpoint.no_load_optim": Rule(MAY_CHANGE, "a fresh optimizer state"),
    "checkpoint.keep_last": Rule(MAY_CHANGE, _NEXT),
    "checkpoint.async_save": Rule(MAY_CHANGE, _NEXT),
}


def config_keys(cls, prefix: str = "") -> Iterator[str]:
    """Every dotted leaf key of config dataclass ``cls`` (nested dataclasses walked)."""
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from config_keys(hints[f.name], dotted + ".")
        else:
            yield dotted


def _defaults() -> Dict:
    from megatron_boost.config.run import RunConfig

    return dataclasses.asdict(RunConfig())


def _with_defaults(cfg: Any, defaults: Any) -> Any:
    """``cfg`` with every key it lacks (a config saved before the key existed) at its
    default."""
    if not isinstance(defaults, dict):
        return cfg
    cfg = cfg if isinstance(cfg, dict) else {}
    return {k: _with_defaults(cfg[k], v) if k in cfg else v for k, v in defaults.items()}


def _compared(cfg: Dict, key: str, rule: Rule) -> Any:
    """The value of ``key`` that must match (``cfg`` filled with the defaults)."""
    return _get(cfg, key) if rule.value is None else rule.value(cfg)


def _fix(kind: str, key: str, saved: Any, ckpt_dir) -> str:
    if kind == WEIGHTS:
        return f"set {key}={saved!r} (these weights cannot serve another value)"
    if kind == OPTIMIZER_STATE:
        return (f"set {key}={saved!r}, or set checkpoint.no_load_optim=true (weights only, "
                f"fresh optimizer state)")
    return (f"set {key}={saved!r} to resume, or start a new run in another logging.run_dir "
            f"with checkpoint.init_from={ckpt_dir} (its weights, a fresh optimizer and schedule)")


def check_resume_contract(ckpt_dir, saved_cfg: Dict, current_cfg: Dict, *,
                          weights_only: bool = False, load_optim: bool = True) -> None:
    """``ValueError`` (one line: key, both values, why, fix) on the first key that must match
    and does not: every must-match key on resume; only the ``weights`` keys for
    ``weights_only`` (checkpoint.init_from); the optimizer-state keys only when the optimizer
    state is loaded (``load_optim``)."""
    defaults = _defaults()
    saved_cfg, current_cfg = (_with_defaults(c, defaults) for c in (saved_cfg, current_cfg))
    for key, rule in RESUME_CONTRACT.items():
        if rule.kind == MAY_CHANGE or (weights_only and rule.kind != WEIGHTS):
            continue
        if rule.kind == OPTIMIZER_STATE and not load_optim:
            continue
        if _compared(saved_cfg, key, rule) != _compared(current_cfg, key, rule):
            saved, current = _get(saved_cfg, key), _get(current_cfg, key)
            keeper = "these weights" if weights_only else "a resume"
            raise ValueError(
                f"checkpoint {ckpt_dir} was trained with {key}={saved!r}, this run sets "
                f"{current!r}: {rule.meaning}, which {keeper} must keep; "
                f"{_fix(rule.kind, key, saved, ckpt_dir)}")
