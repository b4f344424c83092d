"""Which attention backend a run uses (``model.attention_backend``), and why.

``auto`` takes Transformer Engine's fused attention on a CUDA device where
``transformer_engine`` imports, else torch SDPA (flash / memory-efficient kernels on CUDA, a
fused kernel on CPU). ``sdpa`` and ``local`` (megatron's DotProductAttention) run anywhere;
``te`` needs CUDA and transformer-engine, and asking for it without them is a configuration
error rather than a silent fallback.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Optional, Sequence, Tuple

__all__ = ["package_version", "ATTENTION_BACKENDS", "check_attention_backend", "te_available",
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


def _dist_version(names: Sequence[str]) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def package_version(module: str, dists: Sequence[str]) -> str:
    """``<version>``, ``<version> (does not import: <why>)`` or ``not installed``."""
    version = _dist_version(dists)
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # ImportError, or OSError from missing CUDA libraries
        if version is None and isinstance(err, ImportError):
            return "not installed"
        why = " ".join(str(err).split())[:120]
        return f"{version or 'installed'} (does not import: {type(err).__name__}: {why})"
    return version or getattr(mod, "__version__", None) or "installed (version unknown)"
