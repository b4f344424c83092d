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
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

__all__ = ["package_version", "ATTENTION_BACKENDS", "check_attention_backend", "te_available",
           "resolve_attention_backend", "FusedKernels", "fused_kernels", "resolve_fusions",
           "format_fusions"]

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


@dataclass(frozen=True)
class FusedKernels:
    """Which of megatron's optional fused kernels import in this process."""

    te: bool = False
    """Transformer Engine (fused RoPE; its own layers fuse the rest)."""
    wgrad_accumulation: bool = False
    """apex's ``fused_weight_gradient_mlp_cuda`` (megatron's linears accumulate their weight
    gradient into ``main_grad`` inside the GEMM)."""
    masked_softmax: bool = False
    """megatron's ``scaled_upper_triang_masked_softmax_cuda`` (FusedScaleMaskSoftmax)."""


def _imports(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or OSError from missing CUDA libraries
        return False
    return True


def fused_kernels() -> FusedKernels:
    """Probe the fused kernels once (the entry point's ``resolve_run``)."""
    return FusedKernels(te=te_available(),
                        wgrad_accumulation=_imports("fused_weight_gradient_mlp_cuda"),
                        masked_softmax=_imports("scaled_upper_triang_masked_softmax_cuda"))


def resolve_fusions(device: str, attention_backend: str, kernels: FusedKernels,
                    mode: str = "boost", bias_activation_fusion: Optional[bool] = None
                    ) -> Dict[str, Tuple[bool, str]]:
    """{megatron config field: (on, why)} for the fusions that depend on the device and the
    kernels installed (the bias-dropout fusion stays off in ``config/resolved.py``: no biases).

    * ``gradient_accumulation_fusion``: megatron's column/row-parallel linears (the output
      layer in every mode, TE's linears in its layer spec) need apex's wgrad kernel on CUDA.
      The bottleneck factors are not among them: their weight-gradient GEMMs accumulate into
      ``main_grad`` themselves (``bottleneck_grad_accumulation_fusion``, ``parallel/wgrad.py``);
    * ``apply_rope_fusion``: megatron's fused RoPE is Transformer Engine's kernel (CUDA);
    * ``masked_softmax_fusion``: only megatron's own attention (``local``) has a separate
      softmax to fuse, with megatron's CUDA kernel; SDPA and TE fuse it inside their kernels;
    * ``persist_layer_norm``: apex's persistent kernel is LayerNorm only; every mode here
      normalises with RMSNorm;
    * ``bias_activation_fusion`` (``model.bias_activation_fusion``, null: by device): full
      rank's SwiGLU through megatron's jit_fuser (torch.compile), on CUDA; on the CPU the fuser
      would compile C++ in every process, so only when asked. The bottleneck modes' MLP product
      is their own fused region (``parallel/fusion.py``), not megatron's.
    """
    cuda = device == "cuda"
    if not cuda:
        off = f"device {device}: the fused kernels are CUDA's"
        out = {name: (False, off) for name in ("gradient_accumulation_fusion",
                                               "apply_rope_fusion", "masked_softmax_fusion")}
    else:
        out = {
            "gradient_accumulation_fusion": (
                (True, "apex's fused_weight_gradient_mlp_cuda imports") if
                kernels.wgrad_accumulation else
                (False, "needs apex's fused_weight_gradient_mlp_cuda (megatron's linears)")),
            "apply_rope_fusion": (
                (True, "Transformer Engine's fused RoPE") if kernels.te else
                (False, "megatron's fused RoPE is Transformer Engine's; it does not import")),
            "masked_softmax_fusion": _masked_softmax(attention_backend, kernels),
        }
    out["persist_layer_norm"] = (False, "RMSNorm: apex's persistent kernel is LayerNorm only")
    out["bias_activation_fusion"] = _activation_fusion(cuda, mode, bias_activation_fusion)
    return out


def _activation_fusion(cuda: bool, mode: str, asked: Optional[bool]) -> Tuple[bool, str]:
    if str(getattr(mode, "value", mode)) != "full":
        return False, "megatron's fused SwiGLU is full rank's; the bottleneck MLP fuses its own"
    if asked is not None:
        return asked, f"model.bias_activation_fusion={str(asked).lower()}"
    if cuda:
        return True, "megatron's fused SwiGLU (jit_fuser)"
    return False, ("megatron's jit_fuser would compile C++ in every process on the CPU "
                   "(model.bias_activation_fusion=true asks for it)")


def _masked_softmax(attention_backend: str, kernels: FusedKernels) -> Tuple[bool, str]:
    if attention_backend != "local":
        return False, f"attention={attention_backend} fuses its softmax in its own kernel"
    if kernels.masked_softmax:
        return True, "megatron's scaled_upper_triang_masked_softmax_cuda imports"
    return False, "needs megatron's scaled_upper_triang_masked_softmax_cuda kernel"


def format_fusions(fusions) -> str:
    """The run header's fusion field: each (name, on, why) as name=on|off, names sharing a
    state and reason grouped under it."""
    groups: Dict[Tuple[bool, str], list] = {}
    for name, on, why in fusions:
        groups.setdefault((on, why), []).append(name)
    return "; ".join(f"{'+'.join(names)}={'on' if on else 'off'} ({why})"
                     for (on, why), names in groups.items())
