"""The resolved run: a validated configuration plus the facts of this process, frozen
(docs/design.md §9).

A :class:`~megatron_boost.config.run.RunConfig` says what the user asked for; several of its
values only mean something on a given process: ``training.device: auto``,
``training.precision: auto``, ``model.attention_backend: auto``, the vocabulary (the
tokenizer's, padded for the TP size) and megatron's process groups. :func:`resolve_run` reads
those facts ONCE, at the entry point, and :class:`ResolvedRun` carries them; from there on
nothing reads process state. :func:`to_transformer_config` is a pure function of a resolved run,
and ``train.build.build_run`` builds every tool's model from one.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import yaml

from megatron_boost.compat import cuda_graph_fields
from megatron_boost.config.inert_settings import check_cuda_graphs
from megatron_boost.config.run import RunConfig
from megatron_boost.config.modes import TPMode, resolve_sequence_parallel
from megatron_boost.config.transformer import BoostTransformerConfig
from megatron_boost.runtime.backends import (
    FusedKernels,
    fused_kernels,
    resolve_attention_backend,
    resolve_fusions,
    te_available,
)

__all__ = ["ResolvedRun", "resolve_run", "resolved_config_yaml", "resolve_device",
           "resolve_precision",
           "padded_vocab_size", "run_vocab_size", "to_transformer_config", "check_model_rules"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Vocabulary padded to a multiple of lcm(128, tp): the same global size at every TP size
    that divides 128, so checkpoints move between layouts."""
    m = multiple * tp // math.gcd(multiple, tp)
    return int(math.ceil(vocab_size / m) * m)


@dataclass(frozen=True)
class ResolvedRun:
    """A validated run configuration and the facts of the process that runs it."""

    cfg: RunConfig
    """The validated configuration (a private copy, not to be mutated)."""
    device: str
    """'cuda' or 'cpu' (CPU mode, docs/design.md §9)."""
    precision: str
    """'fp32' or 'bf16' (``training.precision: auto`` resolved for the device)."""
    attention_backend: str
    """sdpa, local or te (``model.attention_backend: auto`` resolved)."""
    attention_reason: str
    """Why that backend (printed in the trainer's banner)."""
    vocab_size: int
    """The tokenizer's vocabulary (``model.vocab_size`` without a tokenizer)."""
    padded_vocab_size: int
    """Rows of the embedding table and the output layer (:func:`padded_vocab_size`, or a
    checkpoint's rows for the conversion tools)."""
    sequence_parallel: bool = False
    """megatron's sequence parallelism on (``parallel.sequence_parallel`` resolved)."""
    sequence_parallel_reason: str = ""
    """Why on or off (printed in the trainer's banner)."""
    fusions: Tuple[Tuple[str, bool, str], ...] = ()
    """(megatron config field, on, why) of each device-dependent fusion
    (``runtime.backends.resolve_fusions``; printed in the trainer's banner)."""
    process_groups: Any = None
    """megatron's ProcessGroupCollection of this rank; None: megatron's global groups."""

    @property
    def params_dtype(self) -> torch.dtype:
        return _DTYPES[self.precision]

    @property
    def mode(self) -> TPMode:
        return TPMode.parse(self.cfg.parallel.mode)

    @property
    def seed(self) -> int:
        return self.cfg.training.seed

    @property
    def seq_length(self) -> int:
        return self.cfg.model.seq_length

    def with_precision(self, precision: str) -> "ResolvedRun":
        """The same run in another precision ('fp32' or 'bf16'; the precision check runs
        both)."""
        return dataclasses.replace(self, precision=resolve_precision(precision, self.device))


def resolve_device(requested: str) -> str:
    """'cuda' or 'cpu' for ``training.device`` (auto: CUDA when usable and CPU mode is not
    active). Activates nothing: the CLI's ``select_device`` switches CPU mode on."""
    from megatron_boost.runtime.cpu_mode import is_cpu_mode

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() and not is_cpu_mode() else "cpu"
    return requested


def resolve_precision(requested: str, device: str) -> str:
    """'fp32' or 'bf16' for ``training.precision`` (auto: bf16 on CUDA, fp32 on the CPU)."""
    if requested == "auto":
        return "bf16" if device == "cuda" else "fp32"
    if requested not in _DTYPES:
        raise ValueError(f"training.precision ({requested!r}) must be one of auto, fp32, bf16")
    return requested


def run_vocab_size(cfg: RunConfig, tokenizer=None) -> int:
    """The vocabulary of a run: the tokenizer's when the data section names one (``tokenizer``
    if already loaded), else ``model.vocab_size``."""
    if tokenizer is not None and cfg.data.tokenizer_model:
        return int(tokenizer.vocab_size)
    if cfg.data.tokenizer_model:
        from megatron_boost.data.datasets import build_tokenizer

        return int(build_tokenizer(cfg.data).vocab_size)
    return cfg.model.vocab_size


def resolve_run(cfg: RunConfig, device: Optional[str] = None, *, tokenizer=None,
                vocab_size: Optional[int] = None, padded_vocab: Optional[int] = None,
                process_groups=None, kernels: Optional[FusedKernels] = None) -> ResolvedRun:
    """Resolve ``cfg`` (validated) for this process.

    Args:
        device: 'cuda' or 'cpu'; None resolves ``training.device``.
        tokenizer: the run's tokenizer if the caller already loaded it.
        vocab_size: the vocabulary, when it comes from elsewhere than the data section.
        padded_vocab: the embedding rows to build (a checkpoint's); default: the vocabulary
            padded for ``parallel.tp``.
        process_groups: megatron's ProcessGroupCollection; default: megatron's global groups
            if they exist.
        kernels: the fused kernels that import; default: probed (none on the CPU).
    """
    device = resolve_device(device or cfg.training.device)
    check_cuda_graphs(cfg.training.cuda_graph_impl, cfg.training.recompute, device)
    backend, reason = resolve_attention_backend(cfg.model.attention_backend, device,
                                                te_available())
    vocab = vocab_size if vocab_size is not None else run_vocab_size(cfg, tokenizer)
    sequence_parallel, sp_reason = resolve_sequence_parallel(cfg.parallel.mode, cfg.parallel.tp,
                                                             cfg.parallel.sequence_parallel)
    if kernels is None:
        kernels = fused_kernels() if device == "cuda" else FusedKernels()
    fusions = resolve_fusions(device, backend, kernels, mode=cfg.parallel.mode,
                              bias_activation_fusion=cfg.model.bias_activation_fusion)
    if process_groups is None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            from megatron.core.process_groups_config import ProcessGroupCollection

            process_groups = ProcessGroupCollection.use_mpu_process_groups()
    return ResolvedRun(
        cfg=copy.deepcopy(cfg), device=device,
        precision=resolve_precision(cfg.training.precision, device),
        attention_backend=backend, attention_reason=reason, vocab_size=vocab,
        padded_vocab_size=padded_vocab or padded_vocab_size(vocab, cfg.parallel.tp),
        sequence_parallel=sequence_parallel, sequence_parallel_reason=sp_reason,
        fusions=tuple((name, on, why) for name, (on, why) in fusions.items()),
        process_groups=process_groups)


def resolved_config(run: ResolvedRun) -> dict:
    """The configuration with every value resolved for this process written in its key
    (``model.vocab_size``: the tokenizer's; ``training.device``, ``training.precision``,
    ``model.attention_backend``: as used, not ``auto``), as a plain dict."""
    cfg = copy.deepcopy(run.cfg)
    cfg.model.vocab_size = run.vocab_size
    cfg.model.attention_backend = run.attention_backend
    cfg.training.device = run.device
    cfg.training.precision = run.precision
    return dataclasses.asdict(cfg)


def resolved_config_yaml(run: ResolvedRun) -> str:
    """The run file of the run as it ran (the trainer's ``<run_dir>/config.yaml``):
    :func:`resolved_config`, so it reproduces the run alone; a comment above records the
    padded vocabulary and why that attention backend."""
    header = (f"# The resolved run: vocabulary {run.vocab_size} (padded to "
              f"{run.padded_vocab_size} rows for tp={run.cfg.parallel.tp}), device {run.device}, "
              f"precision {run.precision}, attention {run.attention_backend} "
              f"({run.attention_reason}).\n")
    return header + yaml.safe_dump(resolved_config(run), sort_keys=False)


def to_transformer_config(run: ResolvedRun, *,
                          perform_initialization: bool = True) -> BoostTransformerConfig:
    """The megatron-core config (with the bottleneck fields) of a resolved run; a pure function
    of ``run``. ``perform_initialization=False`` leaves the weights uninitialised (megatron's
    field of that name), for tools that only time a layer or measure its memory; nothing else
    of the config can be changed here: it is the run's."""
    if not isinstance(run, ResolvedRun):
        raise TypeError(f"to_transformer_config takes a ResolvedRun (config.resolved."
                        f"resolve_run), not {type(run).__name__}")
    cfg, params_dtype = run.cfg, run.params_dtype
    m, par = cfg.model, cfg.parallel
    mode = TPMode.parse(par.mode)
    attn_rank, mlp_rank = m.resolved_ranks() if mode.is_lowrank else (None, None)
    lowrank_recompute = cfg.training.recompute == "lowrank"
    recompute = None if lowrank_recompute else cfg.training.recompute
    kwargs = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels, tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp, sequence_parallel=run.sequence_parallel,
        tp_mode=mode, attn_rank=attn_rank,
        mlp_rank=mlp_rank, bottleneck_activation=m.bottleneck_activation,
        mlp_gate_activation=m.mlp_gate_activation, cola_init=m.cola_init,
        init_method_std=m.init_method_std, layernorm_epsilon=m.norm_epsilon,
        normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        # no biases: nothing for the bias-dropout fusion to fuse (dropout, when on, runs
        # unfused); bias_activation_fusion is megatron's fused SwiGLU (resolve_fusions)
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, use_cpu_initialization=True,
        recompute_granularity=recompute, lowrank_recompute=lowrank_recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
        # Interleaved pipelines with batched p2p give silently wrong results at PP=2 on gloo
        # (docs/design.md §10.6); unbatched p2p is correct everywhere, so it is used with vpp.
        batch_p2p_comm=not par.vpp,
        attention_backend=run.attention_backend,
        overlap_bottleneck_grad_reduce=par.overlap_bottleneck_grad_reduce,
        bottleneck_overlap_chunks=par.bottleneck_overlap_chunks,
        interleave_halves=par.interleave_halves,
        share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
        perform_initialization=perform_initialization,
        **cuda_graph_fields(cfg.training.cuda_graph_impl, cfg.training.cuda_graph_scope),
    )
    kwargs.update({name: on for name, on, _ in run.fusions})  # device and kernels (resolve_run)
    return BoostTransformerConfig(**kwargs)


def check_model_rules(cfg: RunConfig) -> BoostTransformerConfig:
    """megatron's config of ``cfg`` resolved for this process with ``model.vocab_size`` (no
    tokenizer read), for tools that only check the model-shape rules before spawning; raises
    ValueError naming the rule a layout breaks."""
    return to_transformer_config(resolve_run(cfg, vocab_size=cfg.model.vocab_size))
