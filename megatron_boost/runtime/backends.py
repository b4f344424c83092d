"""Which attention backend a run uses (``model.attention_backend``), and why.

``auto`` takes Transformer Engine's fused attention on a CUDA device where
``transformer_engine`` imports, else torch SDPA (flash / memory-efficient kernels on CUDA, a
fused kernel on CPU). ``sdpa`` and ``local`` (megatron's DotProductAttention) run anywhere;
``te`` needs CUDA and transformer-engine, and asking for it without them is a configuration
error rather than a silent fallback.
"""

from __future__ import annotations

from typing import Tuple

__all__ = ["ATTENTION_BACKENDS", "check_attention_backend", "te_available",
           "resolve_attention_backend"]

#: Accepted values of ``model.attention_backend``.
ATTENTION_BACKENDS = ("auto", "sdpa", "local", "te")


def check_attention_backend(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is one of :data:`ATTENTION_BACKENDS`."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention_backend ({name!r}) must be one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")


def te_available() -> bool:
    """Whether Transformer Engine's PyTorch extension imports (it needs CUDA libraries)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or OSError from missing CUDA libraries
        return False
    return True


def resolve_attention_backend(requested: str, device: str,
                              te_available: bool) -> Tuple[str, str]:
    """(backend, reason) for a requested backend on ``device`` ('cuda' or 'cpu').

    Raises:
        ValueError: an unknown name, or ``te`` on the CPU or without transformer-engine.
    """
    check_attention_backend(requested)
    if requested == "te":
        if device != "cuda":
            raise ValueError(f"model.attention_backend=te needs a CUDA device (this run is on "
                             f"{device}); use sdpa or auto")
        if not te_available:
            raise ValueError("model.attention_backend=te but transformer_engine does not import;"
                             " pip install transformer-engine[pytorch], or use sdpa or auto")
        return "te", "requested"
    if requested != "auto":
        return requested, "requested"
    if device != "cuda":
        return "sdpa", f"auto: device {device} (Transformer Engine needs CUDA)"
    if te_available:
        return "te", "auto: CUDA device and transformer_engine imports"
    return "sdpa", "auto: CUDA device but transformer_engine does not import"

