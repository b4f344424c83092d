"""What megatron-boost finds in this Python environment: the first command to run in a new
environment or container (``python -m megatron_boost`` or ``megatron-boost-env``).

Prints the versions of Python, torch (CUDA or CPU build), megatron-core (and whether it is in
the tested range, docs/design.md §15), Transformer Engine, apex and flash-attn; the device a
run with ``training.device: auto`` would use; the attention backend that
``model.attention_backend: auto`` would pick there, and why; and the optimizer class megatron's
``get_megatron_optimizer`` builds for ``optimizer: adam``, read from the same module-level
choice megatron makes at import (TE's FusedAdam, else apex's, else torch's AdamW) without
building a model. Exit status 1 when megatron-core is missing or outside the tested range.
"""

from __future__ import annotations

import argparse
import platform
import sys
import warnings
from typing import List, Optional, Sequence, Tuple

from megatron_boost.runtime.backends import package_version

__all__ = ["environment_report", "package_version", "main"]

#: (label, import name, distribution names to ask for the version).
_OPTIONAL = [
    ("Transformer Engine", "transformer_engine.pytorch",
     ("transformer-engine", "transformer_engine", "transformer-engine-torch")),
    ("apex", "apex", ("apex",)),
    ("flash-attn", "flash_attn", ("flash-attn", "flash_attn")),
]


def _torch_line() -> Tuple[str, bool]:
    import torch

    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    return f"{torch.__version__} ({build})", True


def _megatron_line() -> Tuple[str, bool]:
    try:
        import megatron.core
    except ImportError:
        return "not installed", False
    from megatron_boost.compat import SUPPORTED_MEGATRON, megatron_supported

    ok = megatron_supported()
    verdict = "in" if ok else "OUTSIDE"
    return (f"{megatron.core.__version__} ({verdict} the tested range {SUPPORTED_MEGATRON})",
            ok)


def _device() -> Tuple[str, str]:
    """(device, why) of ``training.device: auto``."""
    import torch

    from megatron_boost.runtime.cpu_mode import cuda_unusable_reason

    why_not = cuda_unusable_reason()
    if why_not is None:
        return "cuda", f"{torch.cuda.device_count()} CUDA device(s): {torch.cuda.get_device_name(0)}"
    return "cpu", f"CUDA is unusable: {why_not} (CPU mode, gloo)"


#: What ``optimizer.name: muon`` builds (train/muon.py); it needs no package beyond the above.
MUON_ROW = ("megatron_boost.train.muon.BoostMuon for the 2-D weights (each projection's "
            "global matrix), the AdamW above for embeddings, output head and norms")


def _optimizer_class() -> str:
    """The class megatron's get_megatron_optimizer builds for ``optimizer: adam``: its module
    chooses ``Adam`` at import (TE's FusedAdam, else apex's, else torch's) and, with torch's,
    AdamW for decoupled weight decay (OptimizerConfig's default, which megatron-boost keeps)."""
    import megatron.core.optimizer as mopt

    if mopt.USING_PYTORCH_OPTIMIZER:
        return "torch.optim.AdamW (neither Transformer Engine nor apex imports)"
    cls = mopt.Adam
    source = "Transformer Engine" if cls.__module__.startswith("transformer_engine") else "apex"
    return f"{cls.__module__}.{cls.__qualname__} ({source})"


def environment_report() -> Tuple[List[Tuple[str, str]], bool]:
    """The report's (label, value) rows, and whether megatron-core is usable and supported."""
    warnings.filterwarnings("ignore")
    rows = [("Python", f"{platform.python_version()} ({sys.executable})")]
    torch_text, _ = _torch_line()
    rows.append(("torch", torch_text))
    mcore_text, mcore_ok = _megatron_line()
    rows.append(("megatron-core", mcore_text))
    for label, module, dists in _OPTIONAL:
        rows.append((label, package_version(module, dists)))
    device, why = _device()
    rows.append(("device (training.device: auto)", f"{device}: {why}"))
    from megatron_boost.runtime.backends import resolve_attention_backend, te_available

    backend, reason = resolve_attention_backend("auto", device, te_available())
    rows.append(("attention (attention_backend: auto)", f"{backend} ({reason})"))
    if mcore_text != "not installed":
        rows.append(("optimizer (get_megatron_optimizer)", _optimizer_class()))
        rows.append(("optimizer.name: muon", MUON_ROW))
    return rows, mcore_ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    argparse.ArgumentParser(
        prog="megatron-boost-env",
        description="Print the versions, device, attention backend and optimizer "
                    "megatron-boost would use in this environment.").parse_args(argv)
    rows, ok = environment_report()
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
