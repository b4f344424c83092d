"""The run configuration: YAML sections as dataclasses, strict loading, dotted overrides.

A run file has one top-level key per section (``model``, ``parallel``, ``training``, ``data``,
``optimizer``, ``logging``, ``checkpoint``). YAML keys equal field names; an unknown key is fatal
and the error names the key, the section and the file. Command-line overrides use dotted paths:
``model.attn_rank=64 parallel.tp=2``; values are parsed as YAML scalars (``2``, ``true``,
``1e-3``, ``[a, b]``). An error about a key names its source (the override, or the file and
line) and, for an unknown key, the nearest valid one. An override of one budget key
(``training.train_iters`` or ``training.train_tokens``) drops the other from the file. Every
field is documented by the string literal under it; ``configs/reference.yaml`` is the commented
reference of all keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import yaml

from megatron_boost.config.layout import Layout
from megatron_boost.config.modes import default_rank
from megatron_boost.config.yaml_io import key_lines, read_yaml_mapping
from megatron_boost.config.validation import validate_run_config
from megatron_boost.data.datasets import DataConfig

__all__ = [
    "ModelConfig", "ParallelConfig", "TrainingConfig", "OptimizerConfig", "LoggingConfig",
    "CheckpointConfig", "RunConfig", "load_run_config", "apply_overrides",
    "drop_budget_overridden_on_command_line",
]


@dataclass
class ModelConfig:
    """Model shape and bottleneck settings (LLaMA-style decoder, CoLA bottlenecks)."""

    num_layers: int = 2
    """Number of decoder layers."""
    hidden_size: int = 64
    """Model width d."""
    ffn_hidden_size: int = 172
    """MLP width f (gate and up each project d -> f)."""
    num_attention_heads: int = 4
    """Attention heads h."""
    num_query_groups: Optional[int] = None
    """Key/value groups g for grouped-query attention; null means g = h (multi-head)."""
    kv_channels: Optional[int] = None
    """Head dimension e; null means hidden_size / num_attention_heads."""
    vocab_size: int = 256
    """Vocabulary size V (padded by Megatron to a multiple of 128·TP). With a data section
    that names a tokenizer, the tokenizer's size is used instead."""
    seq_length: int = 64
    """Training sequence length (also the maximum position for RoPE)."""
    attn_rank: Optional[int] = None
    """Rank of the q, k, v, o bottlenecks. null: rank_ratio · hidden_size."""
    mlp_rank: Optional[int] = None
    """Rank of the gate, up, down bottlenecks. null: rank_ratio · hidden_size."""
    rank_ratio: float = 0.25
    """Rank as a fraction of hidden_size when attn_rank / mlp_rank are null (CoLA: 1/4)."""
    bottleneck_activation: str = "silu"
    """σ inside every bottleneck: silu (CoLA), identity (vanilla low-rank), gelu, relu."""
    mlp_gate_activation: bool = False
    """Extra SiLU on the MLP gate branch (CoLA's 60M/130M configs keep it)."""
    cola_init: bool = True
    """CoLA init of both factors: randn · r^(-1/4) · (d_in + d_out)^(-1/4)."""
    init_method_std: float = 0.02
    """Std of the normal init of full-rank weights and embeddings."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    rotary_base: int = 10000
    """RoPE base."""
    share_embeddings_and_output_weights: bool = False
    """Tie the input embedding and the output layer (megatron's name; transformers'
    ``tie_word_embeddings``): one [V, d] table, held vocab-parallel [V/t, d] in every mode.
    With pp > 1 the last stage keeps a copy that megatron keeps equal by all-reducing its
    gradient with the first stage's. boost: the embedding reduce-scatters its partial lookup
    to the hidden shards (docs/design.md §2)."""
    attention_backend: str = "auto"
    """Core attention: auto (te on CUDA when transformer_engine imports, else sdpa), sdpa
    (torch scaled_dot_product_attention), local (megatron's DotProductAttention), te
    (Transformer Engine, CUDA only)."""
    hidden_dropout: float = 0.0
    """Dropout probability of megatron's hidden dropout (its field of that name): the
    embedding's output and the output of every attention and MLP block before its residual
    add; in [0, 1), 0 for none (CoLA and LLaMA pretrain without). Training mode only. boost
    refuses it at tp > 1: its residual stream is sharded along the hidden dimension, and
    megatron draws this mask from the generator every TP rank shares, so every shard would
    drop the same positions."""
    attention_dropout: float = 0.0
    """Dropout probability on the attention probabilities (megatron's field of that name;
    every attention backend applies it); in [0, 1), 0 for none. Training mode only."""
    bias_activation_fusion: Optional[bool] = None
    """Full rank: megatron's fused SwiGLU (its field of that name; megatron's jit_fuser,
    torch.compile, makes it one kernel forward and one backward). null: on for CUDA runs, off
    on the CPU (there the fuser compiles C++ in every process); true compiles it on the CPU
    too. naive and boost refuse true: their MLP product is a fused region of their own,
    compiled on CUDA always (docs/design.md §17)."""

    def resolved_ranks(self) -> tuple:
        """(attn_rank, mlp_rank): the given ranks, else the default rank of rank_ratio."""
        rank = default_rank(self.hidden_size, self.rank_ratio)
        return (self.attn_rank or rank, self.mlp_rank or rank)


@dataclass
class ParallelConfig:
    """Parallel layout. World size = tp · pp · dp."""

    mode: str = "boost"
    """Tensor-parallel mode: full (full-rank baseline), naive (vanilla TP of the bottleneck
    model), boost (bottleneck-aware TP)."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B); null disables interleaving."""
    dp: Optional[int] = None
    """Data-parallel size; null derives it from the world size."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (megatron's distributed optimizer)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with backward."""
    sequence_parallel: Optional[bool] = None
    """megatron's sequence parallelism (full mode only): the norms and the residual stream
    between TP blocks are sharded along the sequence over the TP group (all-gather before a
    block, reduce-scatter after it, in place of its all-reduce). null: on for full mode at
    tp > 1, as megatron users run it; false: the BOOST paper's full-rank baseline (plain TP).
    naive and boost refuse true (docs/design.md §2)."""
    overlap_bottleneck_grad_reduce: bool = True
    """Low-rank modes: run the backward all-reduce of each bottleneck's input gradient (boost:
    dz of the B factors; naive: dx of the A factors) asynchronously while the weight-gradient
    GEMMs proceed (docs/design.md §7); false runs them one after the other. Gradients are
    bitwise identical either way."""
    bottleneck_overlap_chunks: int = 1
    """boost: run each bottleneck group as one pipeline over this many blocks of the sequence,
    so that a block's all-reduce, forward and backward, travels beside the neighbouring blocks'
    GEMMs (docs/design.md §7); 1 issues one GEMM and one all-reduce. Outputs the same either
    way, weight gradients to fp32 rounding; the all-reduces per layer multiply by it, their
    bytes do not, and so do the groups' kernels. naive and full refuse > 1."""
    interleave_halves: bool = False
    """boost: run each decoder layer's forward as two halves of the micro-batch that hand over
    at every forward all-reduce, so that each half's all-reduce travels beside the other half's
    GEMMs and attention, and reduce each group's backward gradient where the other half's
    backward hides it (docs/design.md §7). Every kernel runs twice on half the rows. Needs an
    even training.micro_batch_size, tp > 1, bottleneck_overlap_chunks 1 and no CUDA graphs.
    Outputs and gradients the same to fp32 rounding."""
    timeout_minutes: float = 30.0
    """Process-group timeout: a collective that waits longer (a rank died or stopped
    responding) ends the job with an error naming the unresponsive rank. Fractions allowed
    (0.1 = 6 s)."""

    @property
    def layout(self) -> Layout:
        """The section's layout record (config/layout.py), built from its flat YAML fields."""
        return Layout(mode=self.mode, tp=self.tp, pp=self.pp, vpp=self.vpp, dp=self.dp,
                      sequence_parallel=self.sequence_parallel)


@dataclass
class TrainingConfig:
    """Batch sizes, budget, precision, recompute, seed."""

    micro_batch_size: int = 2
    """Sequences per micro-batch per data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks."""
    train_iters: Optional[int] = None
    """Optimizer steps. Set exactly one of train_iters and train_tokens (both set is an
    error); a command-line override of either drops the other from the YAML file."""
    train_tokens: Optional[int] = None
    """Token budget, converted to iterations of global_batch_size · seq_length tokens
    (rounded up)."""
    eval_interval: int = 10
    """Evaluate on the validation split every this many steps (and at the end)."""
    eval_iters: int = 2
    """Validation batches (global batches) per evaluation."""
    precision: str = "auto"
    """fp32, bf16, or auto (bf16 on GPU, fp32 on CPU)."""
    recompute: Optional[str] = None
    """Activation recompute: null; selective or full (megatron-core's); lowrank (BOOST's
    low-rank activation checkpointing: naive and boost modes, no collective re-run)."""
    cuda_graph_impl: str = "none"
    """megatron's per-layer CUDA graphs (its TransformerConfig field of that name): none, or
    local (megatron-core's own capture, every mode). CUDA only; refused with recompute lowrank
    or full. megatron's transformer_engine value is refused: megatron-LM's loop captures
    those graphs, not megatron-core (docs/design.md §7)."""
    cuda_graph_scope: str = "full"
    """What each layer's graph captures (megatron's ``cuda_graph_scope``, 0.19's
    ``cuda_graph_modules``): full (the whole layer), attn or mlp."""
    seed: int = 1234
    """Seed of the weight init and the data order."""
    device: str = "auto"
    """auto (GPU when usable), cpu (gloo + CPU mode) or cuda."""
    max_skipped_steps: int = 10
    """A step whose loss or gradients are not finite on any rank is skipped (no update; logged
    with ``skipped: true``); this many consecutive skips stop the run without saving."""
    exit_interval: Optional[int] = None
    """Stop, with a checkpoint and exit status 0, at the next iteration that is a multiple of
    this (megatron-LM's --exit-interval); the learning-rate schedule stays that of the whole
    budget, so a resumed run continues the uninterrupted one. null: never."""
    exit_duration_minutes: Optional[float] = None
    """Stop, with a checkpoint and exit status 0, at the first step boundary after this many
    minutes since the launch started (megatron-LM's --exit-duration-in-mins): set it below the
    job's wall-clock limit by the time of a save. Every rank agrees through the step's one
    all-reduce. null: never."""


@dataclass
class OptimizerConfig:
    """AdamW (or Muon for the 2-D weights) with warmup, then cosine, linear or
    warmup-stable-decay (WSD) decay."""

    name: str = "adamw"
    """adamw: megatron's AdamW for every parameter. muon: Muon (orthogonalised momentum, each
    projection's global matrix, train/muon.py) for every 2-D factor A_p, B_p and full mode's
    weight matrices; AdamW for the embeddings, the output head and the norm weights."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Final learning rate of the cosine decay."""
    warmup_iters: int = 2
    """Linear warmup steps."""
    lr_decay_iters: Optional[int] = None
    """Step at which the decay reaches min_lr (after it the LR stays at min_lr); null means the
    training length. With null, extending a run (a larger train_iters or train_tokens on
    resume) stretches the decay over the new length, so the LR rises again; a fixed value
    keeps the schedule of the first run (docs/fault-tolerance.md)."""
    lr_decay_style: str = "cosine"
    """Decay after the warmup: cosine, linear, or wsd (warmup-stable-decay, megatron's WSD: the
    LR stays at its peak, then falls to min_lr over the last lr_wsd_decay_iters steps before
    lr_decay_iters)."""
    lr_wsd_decay_iters: Optional[int] = None
    """wsd only (required there): steps of the final decay (megatron's wsd_decay_steps)."""
    lr_wsd_decay_style: str = "linear"
    """wsd only: shape of the final decay: linear, cosine, exponential or minus_sqrt."""
    weight_decay: float = 0.01
    """Decoupled weight decay p ← p·(1 − lr·wd), for AdamW's and Muon's parameters alike."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.95
    """Adam β2."""
    adam_eps: float = 1e-8
    """Adam ε."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    muon_momentum: float = 0.95
    """Muon's momentum β, in [0, 1): m ← β·m + (1 − β)·g."""
    muon_nesterov: bool = True
    """Muon orthogonalises the Nesterov direction g + β·(m − g) instead of m."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per update (>= 1)."""
    muon_ns_coefficients: str = "jordan"
    """Newton-Schulz coefficients: jordan (one quintic, Jordan 2024) or tuned5 (one set per
    step, tuned for five steps)."""
    muon_scale: str = "spectral"
    """Scale of an orthogonalised [m, n] update: spectral √max(m, n) (with muon_extra_scale
    0.2 the update's RMS matches AdamW's, so optimizer.lr serves both; Liu et al. 2025),
    shape √max(1, m/n) (Jordan 2024) or unit_rms √(m/n)."""
    muon_extra_scale: float = 0.2
    """Factor on every Muon update after the scale rule (> 0)."""


@dataclass
class WandbConfig:
    """Weights & Biases: the scalars of metrics.jsonl and the resolved configuration, from
    global rank 0 (the optional ``wandb`` extra: pip install wandb)."""

    project: Optional[str] = None
    """W&B project to log to; null turns W&B logging off."""
    name: Optional[str] = None
    """Display name of the W&B run; null: the last component of logging.run_dir."""
    dir: Optional[str] = None
    """Where wandb writes its files (a wandb/ folder inside); null: logging.run_dir."""
    mode: str = "offline"
    """offline (files only; upload later with wandb sync) or online (stream to the server)."""


@dataclass
class LoggingConfig:
    """Console, metrics.jsonl, TensorBoard and Weights & Biases output."""

    run_dir: str = "runs/debug"
    """Directory for metrics.jsonl, TensorBoard events and (by default) checkpoints."""
    log_interval: int = 1
    """Print and record a metrics line every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files under <run_dir>/tensorboard (if tensorboard is installed)."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s per device for MFU; null looks the device up in a table (CPU: none)."""
    measure_comm: bool = False
    """Measure the TP collectives of each logged step (tp_comm_bytes_measured, beside the
    formula's tp_comm_bytes): wraps torch.distributed process-wide for that step only."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging (off unless wandb.project is set); a resumed run continues
    the same W&B run (its id is kept in <run_dir>/wandb_run_id)."""


@dataclass
class CheckpointConfig:
    """megatron-core dist_checkpointing."""

    save: Optional[str] = None
    """Checkpoint directory; null means <run_dir>/checkpoints."""
    save_interval: Optional[int] = None
    """Save every this many steps (and at the end, and on SIGTERM/SIGUSR1); null: end only."""
    load: Optional[str] = None
    """Directory to resume from; null means the save directory (resume if it has one). Every
    launch starts from it, including relaunches and requeues: to start from imported or
    pretrained weights once and resume afterwards, use init_from."""
    init_from: Optional[str] = None
    """Weights to start from when the save directory has no checkpoint yet (a new run): a
    checkpoint directory, e.g. the output of tools/import_hf.py. Only the model weights are
    read; the iteration, the optimizer and the learning-rate schedule start fresh. Once the run
    has saved, every relaunch (and Slurm requeue) resumes from its own latest checkpoint and
    this key is ignored. Exclusive with load."""
    no_load_optim: bool = False
    """Load weights only (fine-tuning, or a layout change without optimizer state)."""
    keep_last: Optional[int] = None
    """Keep only the newest this many complete checkpoints (the one the tracker names is never
    removed); null keeps all."""
    async_save: bool = False
    """Write the shards in a background process (megatron's async dist_checkpointing) while
    training continues; the tracker moves only once the checkpoint is complete."""


@dataclass
class RunConfig:
    """One training run: every section of a YAML run file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape and bottleneck settings."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout and mode."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Batch sizes, budget, precision."""
    data: DataConfig = field(default_factory=DataConfig)
    """Tokenizer and datasets."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Logging."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""

    def validate(self, world_size: Optional[int] = None) -> "RunConfig":
        """Check every run-level rule (``config.validation.validate_run_config``); a
        ``world_size`` adds the launch rules. Returns self."""
        validate_run_config(self, world_size)
        return self


# ---------------------------------------------------------------------------------------------
# strict loading
# ---------------------------------------------------------------------------------------------


def _check_type(value, tp, where: str):
    """Accept ``value`` for a field annotated ``tp`` (int/float/str/bool/list, Optional)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, List):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads "1e-4" (no dot) as a string; accept any float literal.
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if tp is int and isinstance(value, bool):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if tp in (int, str, bool) and not isinstance(value, tp):
        raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


@dataclass
class _Sources:
    """Where each dotted key of a run came from, for its errors: the command-line override that
    set it, else the line of the YAML file that holds it."""

    path: Optional[str]
    """The YAML file (None: defaults and overrides only)."""
    lines: Dict[str, int]
    """Dotted key -> 1-based line in the file (yaml_io.key_lines)."""
    overrides: Dict[str, str]
    """Dotted key -> the override item that set it."""

    def of(self, dotted: str) -> str:
        """``the override 'x.y=1'``, ``'file.yaml:3'``, or ``'file.yaml'`` (no line known)."""
        if dotted in self.overrides:
            return f"the override '{self.overrides[dotted]}'"
        if self.path is None:
            return "the defaults"
        line = self.lines.get(dotted)
        return f"'{self.path}:{line}'" if line else f"'{self.path}'"


def _unknown(what: str, name: str, known, where: str) -> ValueError:
    """An unknown key or section, with the nearest valid name when one is close (a typo)."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"valid {what}s: {sorted(known)}"
    return ValueError(f"unknown {what} '{name}' {where}; {hint}")


def _build(cls, values: Dict[str, Any], section: str, sources: _Sources):
    """Instantiate dataclass ``cls`` from a mapping; ``section`` is its dotted path, ``sources``
    names where each key came from in errors."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ValueError(f"{sources.of(section)}: section '{section}' must be a mapping of keys "
                         f"to values, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        dotted = f"{section}.{key}"
        if key not in known:
            raise _unknown("key", key, known,
                           f"in section '{section}' (from {sources.of(dotted)})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, dotted, sources)
        else:
            kwargs[key] = _check_type(value, tp, f"{dotted} (from {sources.of(dotted)})")
    return cls(**kwargs)


def apply_overrides(raw: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Apply ``section.key=value`` overrides to a raw YAML mapping (values parsed as YAML)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override '{item}' must look like section.key=value "
                             f"(e.g. parallel.tp=2)")
        path, text = item.split("=", 1)
        keys = path.strip().split(".")
        if len(keys) < 2 or not all(keys):
            raise ValueError(f"override '{item}': the key must be dotted, section.key "
                             f"(e.g. model.attn_rank=64)")
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"override '{item}': '{k}' is not a section")
        # An empty value is the empty string; write null for None.
        node[keys[-1]] = yaml.safe_load(text) if text.strip() else ""
    return raw


#: The two keys that set a run's length; exactly one may be set (config/validation.py).
BUDGET_KEYS = ("train_iters", "train_tokens")


def _overridden_keys(overrides: Sequence[str]) -> set:
    """The dotted keys (``section.key``) that ``overrides`` set, malformed items skipped (they
    are reported by :func:`apply_overrides`)."""
    return {item.split("=", 1)[0].strip() for item in overrides if "=" in item}


def drop_budget_overridden_on_command_line(raw: Dict[str, Any],
                                           overrides: Sequence[str]) -> Dict[str, Any]:
    """A budget given on the command line replaces the file's budget: overriding
    ``training.train_iters`` removes the file's ``training.train_tokens`` and vice versa, so
    ``training.train_iters=50`` works on a config that sets a token budget. Both overridden
    stays both set (a validation error naming both)."""
    given = {key for key in BUDGET_KEYS if f"training.{key}" in _overridden_keys(overrides)}
    training = raw.get("training")
    if len(given) == 1 and isinstance(training, dict):
        (other,) = set(BUDGET_KEYS) - given
        training.pop(other, None)
    return raw


def load_run_config(path: Optional[str], overrides: Sequence[str] = (),
                    world_size: Optional[int] = None) -> RunConfig:
    """Read a YAML run file (or defaults when ``path`` is None), apply overrides, validate
    (with the launch rules when ``world_size`` is given). An unknown or mistyped key is
    reported with its source: the override that set it, or the file and line."""
    raw: Dict[str, Any] = {}
    lines: Dict[str, int] = {}
    if path is not None:
        raw = read_yaml_mapping(path)
        lines = key_lines(path)
    sources = _Sources(path, lines, {item.split("=", 1)[0].strip(): item
                                     for item in overrides if "=" in item})
    raw = apply_overrides(drop_budget_overridden_on_command_line(raw, overrides), overrides)
    cfg = RunConfig()
    known = {f.name for f in dataclasses.fields(RunConfig)}
    for section, values in raw.items():
        if section not in known:
            given = next((item for key, item in sources.overrides.items()
                          if key.split(".", 1)[0] == section), None)
            where = f"the override '{given}'" if given else sources.of(section)
            raise _unknown("section", section, known, f"(from {where})")
        setattr(cfg, section, _build(type(getattr(cfg, section)), values, section, sources))
    return cfg.validate(world_size)


def field_docs(cls) -> Dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def reference_yaml() -> str:
    """A commented YAML file with every section, key, default and its documentation."""
    lines = ["# megatron-boost run configuration: every key, its default and its meaning.",
             "# Generated by `python -m megatron_boost.config.run`; do not edit by hand.", ""]
    defaults = RunConfig()
    for section in dataclasses.fields(RunConfig):
        obj = getattr(defaults, section.name)
        lines.append(f"{section.name}:")
        lines += _reference_fields(obj, "  ")
        lines.append("")
    return "\n".join(lines)


def _reference_fields(obj, indent: str) -> List[str]:
    """The commented ``key: default`` lines of a dataclass (a nested one as its own block)."""
    import textwrap

    lines = []
    docs = field_docs(type(obj))
    for f in dataclasses.fields(obj):
        for doc_line in textwrap.wrap(docs.get(f.name, ""), 94 - len(indent)):
            lines.append(f"{indent}# {doc_line}")
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            lines.append(f"{indent}{f.name}:")
            lines += _reference_fields(value, indent + "  ")
            continue
        text = yaml.safe_dump(value, default_flow_style=True).strip()
        text = text.removesuffix("\n...").removesuffix("...").strip()
        lines.append(f"{indent}{f.name}: {text}")
    return lines


if __name__ == "__main__":
    print(reference_yaml(), end="")
