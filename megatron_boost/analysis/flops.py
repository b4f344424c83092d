"""Analytic model FLOPs per token, achieved TFLOP/s and MFU.

The count is of *model* FLOPs: matrix multiplications only (norms, activations, softmax,
rotary embeddings and the loss are ignored, as in Megatron's and PaLM's MFU accounting), for
the model the config describes, independent of the parallel layout. In particular the naive
TP mode duplicates attention and the MLP activation on every TP rank; that duplicated work is
*not* counted (it is waste, not useful model work), so naive and boost have the same
FLOPs per token and their MFU compares directly.

Per token, forward pass, per decoder layer (d hidden, f ffn, h heads, g query groups,
e head dim, r the bottleneck ranks, s sequence length):

* a dense projection d_in -> d_out costs 2·d_in·d_out;
* a bottleneck projection y = B·σ(A·x) costs 2·r·(d_in + d_out) (A: d_in -> r, B: r -> d_out);
* q: d -> h·e, k and v: d -> g·e, o: h·e -> d; gate and up: d -> f, down: f -> d;
* attention core: Q·Kᵀ and P·V, 2·s·h·e each, i.e. 4·s·h·e = 2·2·s·d for h·e = d.
  Choice: the full s×s score matrix is counted (no halving for the causal mask), as
  Megatron's ``num_floating_point_operations`` does; pass ``causal=True`` to halve it.

Plus the LM head, 2·d·V per token (the embedding lookup is free). Training (forward + backward)
is 3× the forward count (backward = 2× forward: gradients w.r.t. inputs and weights).
Activation recompute is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["flops_per_token", "forward_flops_per_token", "peak_tflops", "PEAK_TFLOPS_BF16"]

#: Dense bf16 peak TFLOP/s per device (no sparsity), matched as substrings of the CUDA device
#: name, most specific first.
PEAK_TFLOPS_BF16 = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("A100", 312.0),
)


def _get(cfg: Any, *names, default=None):
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def _model_cfg(cfg: Any) -> Any:
    """Accept a RunConfig (uses its .model), a ModelConfig or a megatron TransformerConfig."""
    return cfg.model if hasattr(cfg, "model") and hasattr(cfg, "parallel") else cfg


def _mode_of(cfg: Any, mode: Optional[str]) -> str:
    if mode is None:
        if hasattr(cfg, "parallel"):
            mode = cfg.parallel.mode
        else:
            mode = getattr(cfg, "tp_mode", "boost")
    mode = getattr(mode, "value", mode)
    mode = str(mode).lower()
    if mode not in ("full", "naive", "boost"):
        raise ValueError(f"mode ({mode!r}) must be one of full, naive, boost")
    return mode


def forward_flops_per_token(cfg: Any, mode: Optional[str] = None, *,
                            vocab_size: Optional[int] = None,
                            seq_length: Optional[int] = None, causal: bool = False) -> float:
    """Forward-pass matmul FLOPs per token of the whole model (see the module doc).

    Args:
        cfg: a ``RunConfig``, its ``ModelConfig`` or a ``(Boost)TransformerConfig``.
        mode: 'full' (dense projections), 'naive' or 'boost' (bottlenecks); default: the
            config's own mode.
        vocab_size: the LM head width (e.g. the padded vocabulary); default: the config's.
        seq_length: attention span s; default: the config's ``seq_length``.
        causal: halve the attention-core term (count only the unmasked half).
    """
    mode = _mode_of(cfg, mode)
    m = _model_cfg(cfg)
    d = int(m.hidden_size)
    f = int(_get(m, "ffn_hidden_size", default=4 * d))
    L = int(m.num_layers)
    h = int(m.num_attention_heads)
    g = int(_get(m, "num_query_groups", default=h))
    e = int(_get(m, "kv_channels", default=d // h))
    V = int(vocab_size if vocab_size is not None else _get(m, "vocab_size", "padded_vocab_size"))
    s = int(seq_length if seq_length is not None else _get(m, "seq_length"))
    if mode == "full":
        ra = rm = None
    elif hasattr(m, "resolved_ranks"):
        ra, rm = m.resolved_ranks()
    else:
        ra, rm = int(m.attn_rank), int(m.mlp_rank)

    def proj(d_in: int, d_out: int, rank: Optional[int]) -> float:
        return 2.0 * d_in * d_out if rank is None else 2.0 * rank * (d_in + d_out)

    attn_proj = (proj(d, h * e, ra) + 2 * proj(d, g * e, ra) + proj(h * e, d, ra))
    mlp = 2 * proj(d, f, rm) + proj(f, d, rm)
    core = 4.0 * s * h * e * (0.5 if causal else 1.0)
    return L * (attn_proj + mlp + core) + 2.0 * d * V


def flops_per_token(cfg: Any, mode: Optional[str] = None, **kwargs) -> float:
    """Training (forward + backward) model FLOPs per token: 3 × :func:`forward_flops_per_token`."""
    return 3.0 * forward_flops_per_token(cfg, mode, **kwargs)


def peak_tflops(configured: Optional[float] = None, device_kind: str = "cpu") -> Optional[float]:
    """Peak TFLOP/s of one device: ``configured`` (logging.peak_tflops) if given, else the
    bf16 dense figure of a known GPU (A100 312, H100/H200 989), else None (CPU, unknown GPU:
    MFU is then reported as n/a)."""
    if configured:
        return float(configured)
    if device_kind != "cuda":
        return None
    try:
        import torch

        name = torch.cuda.get_device_name()
    except Exception:  # pragma: no cover - no driver
        return None
    for key, value in PEAK_TFLOPS_BF16:
        if key in name:
            return value
    return None
