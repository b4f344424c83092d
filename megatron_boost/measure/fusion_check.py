"""Whether megatron's ``jit_fuser`` really compiles, and what it costs when it does not
(docs/gpu.md, docs/design.md §17).

The op ledger's kernel count holds only where megatron's ``jit_fuser`` compiles the layers'
fused regions (``parallel/fusion.py``) and megatron's SwiGLU into one kernel each. It does not
when megatron's ``jit.py`` leaves ``jit_fuser`` a no-op decorator (a torch it rejects) or
torch.compile is switched off (``TORCH_COMPILE_DISABLE=1``, torch's dynamo ``disable``; and
``TORCHINDUCTOR_DISABLE`` / ``TORCHDYNAMO_DISABLE``, which the issue's runs and some
containers set to the same end): then every region runs as its eager kernels, silently.
:func:`jit_fuser_problem` says why from the fuser object and the environment (callable on the
CPU); :func:`fusion_cost` what it costs from a layer's ledger."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Tuple

import torch
from megatron.core import jit

from megatron_boost.config.modes import TPMode
from megatron_boost.config.shape import ModelShape
from megatron_boost.measure.ledger import LedgerSpec, layer_ledger

__all__ = ["COMPILE_OFF_VARIABLES", "jit_fuser_problem", "fusion_cost", "fuser_notice"]

#: Environment variables that turn torch.compile into eager execution.
COMPILE_OFF_VARIABLES = ("TORCH_COMPILE_DISABLE", "TORCHDYNAMO_DISABLE", "TORCHINDUCTOR_DISABLE")

#: The ledger's fused kernels that are not megatron's jit_fuser's (Transformer Engine's and
#: flash attention's, which need no compiler).
_NOT_JIT = ("rope", "rms_norm", "attention")


def jit_fuser_problem(jit_fuser: Any = None, env: Optional[Mapping[str, str]] = None,
                      dynamo_disabled: Optional[bool] = None) -> Optional[str]:
    """Why megatron's ``jit_fuser`` will not compile (None: it will). Defaults: megatron's own
    ``jit_fuser``, this process's environment and torch's dynamo switch."""
    if jit_fuser is None:
        jit_fuser = jit.jit_fuser
    env = os.environ if env is None else env
    if jit_fuser is not torch.compile:
        name = getattr(jit_fuser, "__qualname__", type(jit_fuser).__name__)
        return (f"megatron's jit_fuser is {name}, not torch.compile (megatron's jit.py "
                f"rejected this torch or was disabled)")
    for var in COMPILE_OFF_VARIABLES:
        if env.get(var, "0") not in ("", "0"):
            return f"{var}={env[var]} turns torch.compile, megatron's jit_fuser, off"
    if dynamo_disabled is None:
        dynamo_disabled = bool(torch._dynamo.config.disable)
    if dynamo_disabled:
        return "torch._dynamo.config.disable is set: torch.compile runs eagerly"
    return None


def fusion_cost(ledger) -> Tuple[int, int, int, int]:
    """(kernels, memory-bound bytes) of a layer's ledger with megatron's jit_fuser compiling,
    then (kernels, bytes) without: each of its fused regions as its eager kernels."""
    jit = [k for k in ledger.kernels
           if k.kind == "fused" and not k.name.startswith(_NOT_JIT)]
    fused_bytes = ledger.traffic()
    unfused_kernels = ledger.count() - len(jit) + sum(k.eager_kernels for k in jit)
    unfused_bytes = fused_bytes - sum(k.bytes for k in jit) + sum(k.eager_bytes for k in jit)
    return ledger.count(), fused_bytes, unfused_kernels, unfused_bytes


def fuser_notice(problem: Optional[str], ledger=None) -> Optional[str]:
    """The one line a CUDA run prints at its start when its fuser does not compile (None when
    it does): why, and the layer's kernels and bytes with and without fusion."""
    if problem is None:
        return None
    line = f"warning: fused regions will run unfused: {problem}"
    if ledger is not None:
        k, b, uk, ub = fusion_cost(ledger)
        line += (f"; one layer launches {uk} kernels moving {ub / 1e9:.2f} GB instead of "
                 f"{k} and {b / 1e9:.2f} GB (op ledger)")
    return line


def run_fuser_notice(cfg, problem: Optional[str]) -> Optional[str]:
    """:func:`fuser_notice` for a run's configuration: its layer's ledger (one TP rank, the
    run's micro-batch and sequence) is measured only when there is a problem to price."""
    if problem is None:
        return None
    par, t = cfg.parallel, cfg.training
    layout = par.layout
    sequence_parallel = bool(par.sequence_parallel) and layout.mode is TPMode.FULL and par.tp > 1
    spec = LedgerSpec(shape=ModelShape.from_config(cfg, "run"),
                      layout=dataclasses.replace(layout, sequence_parallel=sequence_parallel),
                      micro_batch=t.micro_batch_size, seq_length=cfg.model.seq_length,
                      dtype="fp32" if t.precision == "fp32" else "bf16")
    try:
        ledger = layer_ledger(spec)
    except Exception:  # the notice must not stop a run: the cost is then left out
        ledger = None
    return fuser_notice(problem, ledger)
