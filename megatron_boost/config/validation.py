"""Every run-level rule of a :class:`~megatron_boost.config.run.RunConfig`, in one pass.

:func:`validate_run_config` raises ``ValueError`` naming the key, its value and the fix. Without
a world size (a config read by a tool) it checks the layout and the modes; with one (a launch)
also the data files, the world layout, the batch split over data-parallel ranks, the budget,
the learning-rate schedule and the intervals.
The model-shape rules belong to :class:`~megatron_boost.config.transformer.BoostTransformerConfig`
(megatron configs validate themselves in ``__post_init__``) and are not repeated here; the one
tensor-parallel divisibility rule (``config.modes.check_tp_split``) is called here as
well, so that a layout it refuses stops before any rank starts.
"""

from __future__ import annotations

import difflib
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_boost.config.inert_settings import (CUDA_GRAPH_IMPLS, CUDA_GRAPH_SCOPES,
                                                   TE_GRAPHS_FIX,
                                                   check_cuda_graphs, check_finite_numbers,
                                                   check_muon_keys_need_muon,
                                                   check_overlap_chunks_fit)
from megatron_boost.config.modes import (TPMode, check_bottleneck_ranks, check_lowrank_recompute,
                                          check_pipeline_seq_length, check_tp_split,
                                          resolve_sequence_parallel)
from megatron_boost.config.placement import Tensor, tensor_split
from megatron_boost.runtime.backends import check_attention_backend

__all__ = ["ParallelDims", "validate_run_config", "validate_reading_launch", "train_iterations", "lr_decay_iterations",
           "budget_line", "LR_DECAY_STYLES"]

_PRECISIONS = ("auto", "fp32", "bf16")
# Sizes and rates that must be > 0 (checked first, so that each names its own rule rather than
# a later rule it also breaks), and those that may be null.
_POSITIVE = ("model.num_layers", "model.hidden_size", "model.ffn_hidden_size",
             "model.num_attention_heads", "model.vocab_size", "model.seq_length",
             "model.rank_ratio", "parallel.tp", "parallel.pp", "parallel.timeout_minutes",
             "parallel.bottleneck_overlap_chunks",
             "training.micro_batch_size", "training.global_batch_size",
             "training.max_skipped_steps", "model.norm_epsilon", "model.rotary_base",
             "optimizer.adam_eps")
# A learning rate of 0 is allowed (frozen weights: evaluation runs, conversion checks); so is a
# zero clip (no clipping), weight decay, std or evaluation count. A negative one would quietly
# disable the feature or fail deep inside torch, so it is refused.
_NON_NEGATIVE = ("optimizer.lr", "optimizer.min_lr", "optimizer.clip_grad",
                 "optimizer.weight_decay", "model.init_method_std", "training.eval_iters",
                 "training.seed")
_POSITIVE_OR_NULL = ("model.num_query_groups", "model.kv_channels", "model.attn_rank",
                     "model.mlp_rank", "parallel.vpp", "parallel.dp", "checkpoint.keep_last",
                     "training.train_iters", "training.train_tokens", "logging.peak_tflops",
                     "training.exit_interval", "training.exit_duration_minutes")
# Adam's moment decay rates lie in [0, 1).
_UNIT_INTERVAL = ("optimizer.adam_beta1", "optimizer.adam_beta2")
_RECOMPUTE = (None, "selective", "full", "lowrank")


@dataclass(frozen=True)
class ParallelDims:
    """The launch's factors: world size = tp · pp · dp (dp derived from the world)."""

    tp: int
    pp: int
    world_size: int

    def __post_init__(self):
        model_parallel = self.tp * self.pp
        if self.world_size % model_parallel:
            raise ValueError(
                f"world size ({self.world_size}) must be divisible by parallel.tp × parallel.pp "
                f"({self.tp} × {self.pp} = {model_parallel}); launch a multiple of "
                f"{model_parallel} processes (torchrun --nproc_per_node=...)")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


def train_iterations(cfg) -> int:
    """Optimizer steps of a run: ``training.train_iters``, or ``training.train_tokens`` over
    the tokens of one step, rounded up. Exactly one of them is set (:func:`_check_budget`)."""
    t = cfg.training
    if t.train_iters is not None:
        return int(t.train_iters)
    if t.train_tokens is None:
        raise ValueError("set training.train_iters (a positive number of steps) or "
                         "training.train_tokens (a token budget)")
    return max(1, math.ceil(t.train_tokens / (t.global_batch_size * cfg.model.seq_length)))


def budget_line(cfg) -> str:
    """The one line a run prints at start: which key sets its length, and what it means in
    iterations and tokens."""
    t = cfg.training
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    iters = train_iterations(cfg)
    key = (f"training.train_iters={t.train_iters}" if t.train_iters is not None
           else f"training.train_tokens={t.train_tokens:,}")
    return (f"budget: {key} -> {iters:,} iterations x {tokens_per_step:,} tokens "
            f"(global batch {t.global_batch_size} x seq {cfg.model.seq_length}) = "
            f"{iters * tokens_per_step:,} tokens")


#: optimizer.lr_decay_style -> megatron's lr_decay_style.
LR_DECAY_STYLES = {"cosine": "cosine", "linear": "linear", "wsd": "WSD"}
#: megatron's lr_wsd_decay_style values (OptimizerParamScheduler.get_lr).
_WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def lr_decay_iterations(cfg) -> int:
    """The step at which the decay reaches min_lr: ``optimizer.lr_decay_iters``, or the
    training length."""
    decay = cfg.optimizer.lr_decay_iters
    return decay if decay is not None else train_iterations(cfg)


#: logging.wandb.mode values: offline writes the run under its dir (``wandb sync`` uploads
#: it), online streams it to the W&B server (``WANDB_API_KEY`` or ``wandb login``).
WANDB_MODES = ("offline", "online")


def validate_run_config(cfg, world_size: Optional[int] = None) -> None:
    """Check every run-level rule once. ``world_size``: the number of launched processes; None
    (a config read by a tool, whose data need not exist here) skips the launch rules."""
    check_finite_numbers(cfg)  # first: nan passes every comparison below
    _check_positive(cfg)
    _check_one_budget(cfg)
    _check_layout(cfg)
    _check_modes(cfg)
    _check_bottlenecks(cfg)
    _check_dropout(cfg)
    _check_wandb(cfg)
    _check_optimizer(cfg)
    check_muon_keys_need_muon(cfg)
    check_overlap_chunks_fit(cfg)
    if world_size is None:
        _check_tp_split(cfg)
        _check_pipeline_sequence(cfg)
        return
    cfg.data.validate()
    _check_launch(cfg, ParallelDims(cfg.parallel.tp, cfg.parallel.pp, world_size))
    _check_tp_split(cfg)  # after the launch's layout: a tp the world cannot hold comes first
    _check_pipeline_sequence(cfg)
    _check_budget(cfg)
    _check_intervals(cfg)
    _check_paths(cfg)
    _check_wandb_dir(cfg)
    _check_wandb_installed(cfg)


def validate_reading_launch(cfg, world_size: int) -> None:
    """The rules of a launch that reads a checkpoint and writes no run (evaluation): the tool
    rules, the world layout and the batch split over data-parallel ranks; not the output
    directories, the budget or W&B, which such a launch never uses."""
    validate_run_config(cfg)
    _check_launch(cfg, ParallelDims(cfg.parallel.tp, cfg.parallel.pp, world_size))


def _value(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _check_positive(cfg) -> None:
    for dotted in _POSITIVE + _POSITIVE_OR_NULL:
        value = _value(cfg, dotted)
        if value is None and dotted in _POSITIVE_OR_NULL:
            continue
        if value is None or value <= 0:
            raise ValueError(f"{dotted} ({value}) must be positive")
    for dotted in _NON_NEGATIVE:
        if _value(cfg, dotted) < 0:
            raise ValueError(f"{dotted} ({_value(cfg, dotted)}) must be >= 0")
    for dotted in _UNIT_INTERVAL:
        if not 0 <= _value(cfg, dotted) < 1:
            raise ValueError(f"{dotted} ({_value(cfg, dotted)}) must be in [0, 1)")


def _check_wandb(cfg) -> None:
    w = cfg.logging.wandb
    _check_one_of("logging.wandb.mode", w.mode, WANDB_MODES,
                  "to log nothing to W&B, leave logging.wandb.project null")
    if w.project is not None and not str(w.project).strip():
        raise ValueError("logging.wandb.project is empty; name a W&B project, or null to log "
                         "nothing to W&B")


def _check_wandb_dir(cfg) -> None:
    """logging.wandb.dir, where a launch that logs to W&B writes its files, is a writable
    directory (checked before the run directory is made)."""
    w = cfg.logging.wandb
    if w.project is not None and w.dir is not None:
        _check_output_dir("logging.wandb.dir", w.dir)


def _check_wandb_installed(cfg) -> None:
    """A launch that asks for W&B logging needs the optional wandb package (found, not
    imported: a check stays quick)."""
    import importlib.util

    project = cfg.logging.wandb.project
    if project is not None and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"logging.wandb.project is '{project}' but wandb is not installed; "
                         f"install the wandb extra (pip install wandb, or EXTRAS=wandb "
                         f"scripts/setup_env.sh), or set logging.wandb.project=null")


def _check_one_budget(cfg) -> None:
    """At most one budget key: with both set, one would silently win over the other."""
    t = cfg.training
    if t.train_iters is not None and t.train_tokens is not None:
        raise ValueError(
            f"training.train_iters ({t.train_iters}) and training.train_tokens "
            f"({t.train_tokens}) are both set; set only one (a command-line override of "
            f"either drops the other from the YAML file)")


def _check_layout(cfg) -> None:
    par, layers = cfg.parallel, cfg.model.num_layers
    TPMode.parse(par.mode)
    if layers % par.pp:
        raise ValueError(
            f"model.num_layers ({layers}) must be divisible by parallel.pp "
            f"({par.pp}) for an even pipeline split; change either")
    m = cfg.model
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ValueError(
            f"model.hidden_size ({m.hidden_size}) must be divisible by "
            f"model.num_attention_heads ({m.num_attention_heads}) when model.kv_channels is "
            f"null (the head dimension is hidden_size / heads); change either or set "
            f"model.kv_channels")
    if par.vpp:
        per_stage = layers // par.pp
        if par.pp < 2 or per_stage % par.vpp:
            raise ValueError(
                f"parallel.vpp ({par.vpp}) needs parallel.pp >= 2 and must divide "
                f"the layers per stage ({per_stage}); set parallel.vpp to null or a divisor")


def _check_dropout(cfg) -> None:
    """megatron's dropout probabilities: a probability of 1 or more would zero every
    activation, a negative one fails inside torch. boost's residual stream is sharded along
    the hidden dimension, and megatron draws the hidden dropout mask from the generator every
    TP rank shares (it forks a per-rank stream only under sequence parallelism): at tp > 1
    every shard would drop the same positions, so boost refuses hidden dropout there."""
    for name in ("hidden_dropout", "attention_dropout"):
        p = getattr(cfg.model, name)
        if not 0 <= p < 1:
            raise ValueError(f"model.{name} ({p}) must be a probability in [0, 1); set it to "
                             f"0.0 for no dropout or to the fraction of activations to drop "
                             f"(e.g. 0.1)")
    p, tp = cfg.model.hidden_dropout, cfg.parallel.tp
    if p > 0 and tp > 1 and TPMode.parse(cfg.parallel.mode) is TPMode.BOOST:
        raise ValueError(f"model.hidden_dropout ({p}) needs parallel.tp=1 in boost mode "
                         f"(parallel.tp is {tp}): its hidden shards would all drop the same "
                         f"positions; set model.hidden_dropout=0.0, parallel.tp=1, or "
                         f"parallel.mode=naive or full")


def _check_tp_split(cfg) -> None:
    """The rule the layers enforce, checked here too: a launcher's --check and a launch then
    refuse the layout before any rank starts, in one line from rank 0."""
    m, par = cfg.model, cfg.parallel
    mode = TPMode.parse(par.mode)
    sequence_parallel, _ = resolve_sequence_parallel(mode, par.tp, par.sequence_parallel)
    # the stream's sequence axis split over the TP ranks (the placement table: full with SP)
    stream_axis = tensor_split(mode, Tensor.STREAM, sequence_parallel=sequence_parallel)
    if sequence_parallel and stream_axis == 0 and m.seq_length % par.tp:
        raise ValueError(
            f"model.seq_length ({m.seq_length}) must be divisible by parallel.tp ({par.tp}) "
            f"with sequence parallelism (each TP rank holds seq_length / tp positions); "
            f"change either or set parallel.sequence_parallel=false")
    attn_rank, mlp_rank = m.resolved_ranks() if mode.is_lowrank else (None, None)
    check_tp_split(mode, par.tp, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
                   num_attention_heads=m.num_attention_heads,
                   num_query_groups=m.num_query_groups, attn_rank=attn_rank, mlp_rank=mlp_rank)


def _check_pipeline_sequence(cfg) -> None:
    """The sequence rule the boost model applies when it is driven through pipeline stages,
    checked here so that --check (and submit.sh) refuses it before a job is queued."""
    m, par = cfg.model, cfg.parallel
    try:
        check_pipeline_seq_length(par.mode, par.tp, par.pp, m.seq_length)
    except ValueError as e:
        raise ValueError(f"model.{e}") from None  # the key as the config names it


def _check_bottlenecks(cfg) -> None:
    """The model-shape rules BoostTransformerConfig enforces at build time, checked here so a
    launcher's --check (and submit.sh) refuses the layout: ranks no wider than the layer,
    lowrank recompute only in a bottleneck mode."""
    mode = TPMode.parse(cfg.parallel.mode)
    check_lowrank_recompute(mode, cfg.training.recompute == "lowrank")
    if mode.is_lowrank:
        attn_rank, mlp_rank = cfg.model.resolved_ranks()
        check_bottleneck_ranks(mode, cfg.model.hidden_size, attn_rank=attn_rank,
                               mlp_rank=mlp_rank)


def _check_one_of(field: str, value, allowed: Sequence, fix: Optional[str] = None) -> None:
    """The one rule of a key with a fixed set of values: unless ``value`` is one of
    ``allowed``, a ValueError naming the key, the value, the allowed values (None written as
    the YAML's null) and the fix: the allowed value a typo is closest to, else ``fix``."""
    if value in allowed:
        return
    names = ["null" if a is None else str(a) for a in allowed]
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else fix
    raise ValueError(f"{field} ({value!r}) must be one of {', '.join(names)}"
                     + (f"; {hint}" if hint else ""))


def _check_modes(cfg) -> None:
    t = cfg.training
    check_attention_backend(cfg.model.attention_backend)
    _check_one_of("training.precision", t.precision, _PRECISIONS,
                  "auto: bf16 on CUDA, fp32 on the CPU")
    _check_one_of("training.recompute", t.recompute, _RECOMPUTE,
                  "null recomputes nothing")
    _check_one_of("training.cuda_graph_impl", t.cuda_graph_impl, CUDA_GRAPH_IMPLS,
                  TE_GRAPHS_FIX)
    _check_one_of("training.cuda_graph_scope", t.cuda_graph_scope, CUDA_GRAPH_SCOPES,
                  "full captures the whole layer")
    check_cuda_graphs(t.cuda_graph_impl, t.recompute, t.device)
    _check_full_rank_fusion(cfg)
    _check_overlap_chunks(cfg)
    _check_interleave_halves(cfg)


def _check_full_rank_fusion(cfg) -> None:
    """model.bias_activation_fusion is megatron's MLP's: full rank only."""
    mode = TPMode.parse(cfg.parallel.mode)
    if cfg.model.bias_activation_fusion and mode is not TPMode.FULL:
        raise ValueError(
            f"model.bias_activation_fusion (true) applies to full rank (megatron's SwiGLU), "
            f"and parallel.mode is {mode.value}: the bottleneck MLP's product is a fused region "
            f"of its own, compiled on CUDA always; set model.bias_activation_fusion=null")


def _check_overlap_chunks(cfg) -> None:
    """parallel.bottleneck_overlap_chunks pipelines boost's forward all-reduces only."""
    chunks, mode = cfg.parallel.bottleneck_overlap_chunks, TPMode.parse(cfg.parallel.mode)
    if chunks > 1 and mode is not TPMode.BOOST:
        raise ValueError(
            f"parallel.bottleneck_overlap_chunks ({chunks}) needs parallel.mode=boost "
            f"(parallel.mode is {mode.value}): it pipelines boost's bottleneck all-reduces; "
            f"set it to 1")


def _check_interleave_halves(cfg) -> None:
    """parallel.interleave_halves splits boost's micro-batch in two around its forward
    all-reduces (parallel/interleave.py): it needs them (boost, tp > 1), two equal halves, the
    unchunked groups (the chunks' pipeline has its own overlap) and eager layers."""
    if not cfg.parallel.interleave_halves:
        return
    mode, tp = TPMode.parse(cfg.parallel.mode), cfg.parallel.tp
    mbs, chunks = cfg.training.micro_batch_size, cfg.parallel.bottleneck_overlap_chunks
    rules = [
        (mode is not TPMode.BOOST, f"needs parallel.mode=boost (it is {mode.value}): it hides "
                                   f"boost's bottleneck all-reduces"),
        (tp == 1, "needs parallel.tp > 1 (it is 1): there is no all-reduce to hide"),
        (mbs % 2 == 1, f"splits training.micro_batch_size ({mbs}) into two equal halves; "
                       f"make it even"),
        (chunks > 1, f"and parallel.bottleneck_overlap_chunks ({chunks}) are two overlap "
                     f"schedules; choose one (set the chunks to 1)"),
        (cfg.training.cuda_graph_impl != "none",
         f"runs eagerly; training.cuda_graph_impl ({cfg.training.cuda_graph_impl!r}) would "
         f"capture one half's hand-overs; set it to none"),
    ]
    for broken, why in rules:
        if broken:
            raise ValueError(f"parallel.interleave_halves (true) {why}; or set "
                             f"parallel.interleave_halves=false")


_OPTIMIZERS = ("adamw", "muon")
# The names train/muon.py implements (NS_COEFFICIENTS, SCALE_RULES); config sits below train.
_NS_COEFFICIENTS = ("jordan", "tuned5")
_MUON_SCALES = ("spectral", "shape", "unit_rms")


def _check_optimizer(cfg) -> None:
    o = cfg.optimizer
    _check_one_of("optimizer.name", o.name, _OPTIMIZERS,
                  "adamw: AdamW for every parameter; muon: Muon for the projection matrices")
    if o.name != "muon":
        return
    if not 0 <= o.muon_momentum < 1:
        raise ValueError(f"optimizer.muon_momentum ({o.muon_momentum}) must be in [0, 1) "
                         f"(typical: 0.95)")
    if o.muon_ns_steps < 1:
        raise ValueError(f"optimizer.muon_ns_steps ({o.muon_ns_steps}) must be >= 1 "
                         f"(typical: 5)")
    _check_one_of("optimizer.muon_ns_coefficients", o.muon_ns_coefficients, _NS_COEFFICIENTS)
    _check_one_of("optimizer.muon_scale", o.muon_scale, _MUON_SCALES)
    if not o.muon_extra_scale > 0:
        raise ValueError(f"optimizer.muon_extra_scale ({o.muon_extra_scale}) must be > 0")
    if cfg.parallel.use_distributed_optimizer:
        raise ValueError(
            "optimizer.name muon with parallel.use_distributed_optimizer true is not supported "
            "(Muon orthogonalises whole matrices; the distributed optimizer shards them flat "
            "over data-parallel ranks); set parallel.use_distributed_optimizer false or "
            "optimizer.name adamw")


def _check_budget(cfg) -> None:
    t, o = cfg.training, cfg.optimizer
    if t.train_tokens is None and t.train_iters is None:
        raise ValueError("set training.train_iters (a positive number of steps) or "
                         "training.train_tokens (a token budget)")
    decay = lr_decay_iterations(cfg)
    if decay < 1:
        raise ValueError(f"optimizer.lr_decay_iters ({decay}) must be >= 1")
    if o.warmup_iters < 0 or o.warmup_iters >= decay:
        raise ValueError(
            f"optimizer.warmup_iters ({o.warmup_iters}) must be >= 0 and smaller than the "
            f"decay length ({decay} = optimizer.lr_decay_iters or the number of training "
            f"iterations)")
    if o.min_lr > o.lr:
        raise ValueError(f"optimizer.min_lr ({o.min_lr}) must not exceed optimizer.lr ({o.lr})")
    _check_decay_style(o, decay)


def _check_decay_style(o, decay: int) -> None:
    """The decay style, and the WSD settings exactly when it is wsd (set otherwise, they
    would be ignored without a word)."""
    _check_one_of("optimizer.lr_decay_style", o.lr_decay_style, tuple(LR_DECAY_STYLES))
    if o.lr_decay_style != "wsd":
        if o.lr_wsd_decay_iters is not None:
            raise ValueError(f"optimizer.lr_wsd_decay_iters ({o.lr_wsd_decay_iters}) is only "
                             f"used with optimizer.lr_decay_style: wsd (it is "
                             f"{o.lr_decay_style!r}); remove it or set the style to wsd")
        return
    _check_one_of("optimizer.lr_wsd_decay_style", o.lr_wsd_decay_style, _WSD_DECAY_STYLES)
    stable = decay - o.warmup_iters
    if o.lr_wsd_decay_iters is None or not 1 <= o.lr_wsd_decay_iters <= stable:
        raise ValueError(f"optimizer.lr_wsd_decay_iters ({o.lr_wsd_decay_iters}) must be set "
                         f"with lr_decay_style: wsd, between 1 and the steps after the warmup "
                         f"({stable} = decay length {decay} - warmup_iters {o.warmup_iters})")


def _check_intervals(cfg) -> None:
    eval_interval, save_interval = cfg.training.eval_interval, cfg.checkpoint.save_interval
    if eval_interval is not None and eval_interval < 1:
        raise ValueError(f"training.eval_interval ({eval_interval}) must be >= 1")
    if cfg.logging.log_interval < 1:
        raise ValueError(f"logging.log_interval ({cfg.logging.log_interval}) must be >= 1")
    if save_interval is not None and save_interval < 1:
        raise ValueError(f"checkpoint.save_interval ({save_interval}) must be >= 1 or null")


def _check_launch(cfg, dims: ParallelDims) -> None:
    par, t = cfg.parallel, cfg.training
    if par.dp is not None and par.dp != dims.dp:
        raise ValueError(
            f"parallel.dp ({par.dp}) does not match the launch: world size {dims.world_size} / "
            f"(tp {dims.tp} × pp {dims.pp}) = {dims.dp}; set parallel.dp to null or {dims.dp}")
    mbs, gbs, dp = t.micro_batch_size, t.global_batch_size, dims.dp
    if gbs % (mbs * dp):
        raise ValueError(
            f"training.global_batch_size ({gbs}) must be divisible by "
            f"training.micro_batch_size × data-parallel size ({mbs} × {dp} = {mbs * dp}); "
            f"global_batch_size = micro_batch_size × dp × num_microbatches")


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_output_dir(name: str, value: str) -> None:
    """``value`` is, or can be created as, a writable directory. Probed by creating (and
    removing) a directory in its nearest existing ancestor: permission bits say nothing for
    root, read-only or virtual file systems refuse the creation itself."""
    path = Path(value).absolute()
    existing = _nearest_existing(path)
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is below the file {existing}"
        raise ValueError(f"{name} '{value}' {what}, not a directory; choose another path")
    try:
        probe = Path(tempfile.mkdtemp(prefix=".mboost-probe-", dir=existing))
    except OSError as err:
        raise ValueError(f"{name} '{value}' is not writable: cannot create a directory in "
                         f"{existing} ({err.strerror})") from None
    probe.rmdir()


def _check_paths(cfg) -> None:
    """Output directories writable, and ``checkpoint.load`` / ``checkpoint.init_from`` present,
    before anything is written."""
    _check_output_dir("logging.run_dir", cfg.logging.run_dir)
    _check_output_dir("checkpoint.save",
                      cfg.checkpoint.save or str(Path(cfg.logging.run_dir) / "checkpoints"))
    load, init_from = cfg.checkpoint.load, cfg.checkpoint.init_from
    if load and init_from:
        raise ValueError(f"checkpoint.load '{load}' and checkpoint.init_from '{init_from}' are "
                         f"both set; keep init_from (start from its weights, resume from the "
                         f"save directory on relaunch) or load (start from it on every launch)")
    for key, value in (("checkpoint.load", load), ("checkpoint.init_from", init_from)):
        if value and not Path(value).is_dir():
            raise ValueError(f"{key} '{value}' is not a directory; give a save directory "
                             "(with latest_checkpointed_iteration.txt) or one iter_* directory")
