"""One description of a decoder's shape, read once from any config, for every formula.

:class:`ModelShape` holds the widths of a LLaMA-style decoder (CoLA bottleneck or full rank,
docs/design.md §1): hidden d, ffn f, heads h, query groups g (GQA), head dim e, vocabulary V,
sequence s and the bottleneck ranks r_attn / r_mlp. :meth:`ModelShape.projections` lists the
seven projections of one layer with their (d_in, d_out, rank); the FLOP count
(:mod:`megatron_boost.analysis.flops`), the TP communication widths
(:mod:`megatron_boost.analysis.comm`), the parameter counts below and the cluster performance
model (:mod:`megatron_boost.perf.model`) are all derived from it, so each formula exists once.

:meth:`ModelShape.from_config` is the one config reader: it accepts a ``RunConfig`` (uses its
``.model``), a ``ModelConfig`` or a megatron ``(Boost)TransformerConfig``, told apart by type
(:func:`config_mode` reads the mode a config names the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from megatron_boost.config.modes import TPMode, default_rank
from megatron_boost.config.run import ModelConfig, RunConfig

__all__ = ["ModelShape", "Projection", "MODES", "check_mode", "config_mode"]

#: The modes, from the one enum (``config.modes.TPMode``; each reads as its name).
MODES = tuple(TPMode)


def check_mode(mode: Any) -> TPMode:
    """The TPMode of a mode or its name ('full', 'naive', 'boost'); ValueError otherwise."""
    return TPMode.parse(mode)


@dataclass(frozen=True)
class Projection:
    """One projection of a layer: d_in -> d_out, dense (rank None) or a CoLA bottleneck
    y = B·σ(A·x) with A: d_in -> rank and B: rank -> d_out (docs/design.md §1). The formulas
    read it from :meth:`ModelShape.projections`; the bottleneck layers (``parallel/layers.py``)
    build their groups from it."""

    name: str
    """Its name, the suffix of its factors' parameters: A_<name>, B_<name>."""
    d_in: int
    """Global input size."""
    d_out: int
    """Global output size."""
    rank: Optional[int]
    """Bottleneck rank r; None for a dense projection (the full-rank twin)."""

    @property
    def params(self) -> int:
        if self.rank is None:
            return self.d_in * self.d_out
        return self.rank * (self.d_in + self.d_out)

    @property
    def flops_per_token(self) -> float:
        """Forward matmul FLOPs per token: 2 per multiply-add, i.e. 2 · params."""
        return 2.0 * self.params


def _transformer_config(cfg: Any):
    """``cfg`` as megatron's TransformerConfig (imported only for one: the other configs are
    read without torch); TypeError for anything else."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not isinstance(cfg, TransformerConfig):
        raise TypeError(f"a model shape is read from a RunConfig, a ModelConfig, a "
                        f"TransformerConfig or a ModelShape, not {type(cfg).__name__}")
    return cfg


def config_mode(cfg: Any) -> TPMode:
    """The TP mode a config names: a RunConfig's ``parallel.mode``, a BoostTransformerConfig's
    ``tp_mode``; boost for a config that names none (a ModelConfig, a ModelShape, megatron's
    own TransformerConfig)."""
    if isinstance(cfg, RunConfig):
        return TPMode.parse(cfg.parallel.mode)
    if isinstance(cfg, (ModelConfig, ModelShape)):
        return TPMode.BOOST
    return TPMode.parse(getattr(_transformer_config(cfg), "tp_mode", TPMode.BOOST))


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA-style decoder. The bottleneck modes use attn_rank / mlp_rank."""

    name: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    query_groups: Optional[int] = None
    head_dim: Optional[int] = None
    vocab: Optional[int] = 32000
    seq_length: Optional[int] = 4096
    attn_rank: Optional[int] = None
    mlp_rank: Optional[int] = None
    tied_embeddings: bool = False
    bottleneck_activation: str = "silu"
    """σ of the bottlenecks (the op ledger builds the layer with it)."""
    mlp_gate_activation: bool = False
    """SiLU on the MLP's gate branch (CoLA's 60M / 130M)."""

    @classmethod
    def from_config(cls, cfg: Any, name: str = "config") -> "ModelShape":
        """From a RunConfig, a ModelConfig or a (Boost)TransformerConfig, told apart by type.
        A TransformerConfig has no vocabulary or sequence length: those stay None (pass them
        to the formulas); megatron's own has no ranks (the default rank applies)."""
        m = cfg.model if isinstance(cfg, RunConfig) else cfg
        if isinstance(m, ModelConfig):
            ra, rm = m.resolved_ranks()  # explicit ranks or rank_ratio · d
            vocab, seq = m.vocab_size, m.seq_length
        else:
            m = _transformer_config(m)
            ra, rm = getattr(m, "attn_rank", None), getattr(m, "mlp_rank", None)
            vocab = seq = None
        d = int(m.hidden_size)
        return cls(name=name, num_layers=int(m.num_layers), hidden=d,
                   ffn=int(m.ffn_hidden_size or 4 * d), heads=int(m.num_attention_heads),
                   query_groups=m.num_query_groups, head_dim=m.kv_channels,
                   vocab=None if vocab is None else int(vocab),
                   seq_length=None if seq is None else int(seq),
                   attn_rank=None if ra is None else int(ra),
                   mlp_rank=None if rm is None else int(rm),
                   tied_embeddings=bool(getattr(m, "share_embeddings_and_output_weights",
                                                False)),
                   bottleneck_activation=str(getattr(m, "bottleneck_activation", "silu")),
                   mlp_gate_activation=bool(getattr(m, "mlp_gate_activation", False)))

    @property
    def g(self) -> int:
        """Query groups (key/value heads); = heads without GQA."""
        return int(self.query_groups or self.heads)

    @property
    def e(self) -> int:
        """Head dimension (kv_channels); d / h by default."""
        return int(self.head_dim or self.hidden // self.heads)

    @property
    def q_width(self) -> int:
        return self.heads * self.e

    @property
    def kv_width(self) -> int:
        return self.g * self.e

    @property
    def r_attn(self) -> int:
        """Attention bottleneck rank; the configuration's default rank when not given."""
        return self.attn_rank or default_rank(self.hidden)

    @property
    def r_mlp(self) -> int:
        """MLP bottleneck rank; the configuration's default rank when not given."""
        return self.mlp_rank or default_rank(self.hidden)

    def projections(self, mode: str) -> List[Projection]:
        """The seven projections of one layer: q, k, v, o (attention rank), gate, up, down
        (MLP rank); dense in mode 'full' (the full-rank twin), bottlenecks otherwise."""
        lowrank = check_mode(mode).is_lowrank
        ra = self.r_attn if lowrank else None
        rm = self.r_mlp if lowrank else None
        d, f, qw, kvw = self.hidden, self.ffn, self.q_width, self.kv_width
        return [Projection("q", d, qw, ra), Projection("k", d, kvw, ra),
                Projection("v", d, kvw, ra), Projection("o", qw, d, ra),
                Projection("gate", d, f, rm), Projection("up", d, f, rm),
                Projection("down", f, d, rm)]

    def projection_params(self, mode: str) -> int:
        """Parameters of one layer's seven projections."""
        return sum(p.params for p in self.projections(mode))

    def layer_params(self, lowrank: bool) -> int:
        """Parameters of one decoder layer: the projections and two RMSNorm weights."""
        return self.projection_params(TPMode.BOOST if lowrank else TPMode.FULL) + 2 * self.hidden

    def model_params(self, lowrank: bool) -> int:
        """Parameters of the whole model: every layer, the embedding, head and final norm."""
        return self.num_layers * self.layer_params(lowrank) + self.embedding_params()

    def embedding_params(self) -> int:
        """Input embedding, LM head (unless tied) and the final norm; always full rank."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden
