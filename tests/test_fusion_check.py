"""Fusion cannot vanish silently (megatron_boost/measure/fusion_check.py, the GPU check's
profiler stage, docs/gpu.md): a CUDA run whose megatron jit_fuser does not compile is named,
with what it costs, and fails the profiler stage. Simulated on the CPU by handing the check
the fuser object and the environment such a run would have. Negative control: a no-op fuser
passes for a compiling one if the check only looked at the environment (it fails here)."""

from __future__ import annotations

import pytest
import torch

from megatron_boost.measure.fusion_check import fusion_cost, jit_fuser_problem
from megatron_boost.measure.ledger import LedgerSpec, layer_ledger
from megatron_boost.config.layout import Layout
from megatron_boost.config.shape import ModelShape
from megatron_boost.runtime import stages

pytestmark = pytest.mark.fast

SMALL = ModelShape("small", num_layers=2, hidden=64, ffn=96, heads=4, query_groups=2,
                   vocab=256, seq_length=32, attn_rank=16, mlp_rank=24)


def _noop(fn):  # megatron's jit.py's noop_decorator
    return fn


@pytest.mark.parametrize("fuser, env, why", [
    (_noop, {}, "not torch.compile"),
    (torch.compile, {"TORCH_COMPILE_DISABLE": "1"}, "TORCH_COMPILE_DISABLE=1"),
    (torch.compile, {"TORCHINDUCTOR_DISABLE": "1"}, "TORCHINDUCTOR_DISABLE=1"),
])
def test_a_fuser_that_does_not_compile_is_named(fuser, env, why):
    assert why in jit_fuser_problem(fuser, env, dynamo_disabled=False)


def test_a_compiling_fuser_is_no_problem():
    assert jit_fuser_problem(torch.compile, {"TORCH_COMPILE_DISABLE": "0"},
                             dynamo_disabled=False) is None
    assert "disable" in jit_fuser_problem(torch.compile, {}, dynamo_disabled=True)


def test_the_cost_is_the_fused_regions_eager_kernels():
    ledger = layer_ledger(LedgerSpec(shape=SMALL, layout=Layout(mode="boost", tp=2), seq_length=32))
    kernels, traffic, unfused_kernels, unfused_traffic = fusion_cost(ledger)
    regions = [k for k in ledger.kernels if k.kind == "fused"
               and not k.name.startswith(("rope", "rms_norm", "attention"))]
    assert regions and kernels == ledger.count() and traffic == ledger.traffic()
    assert unfused_kernels == kernels + sum(k.eager_kernels - 1 for k in regions) > kernels
    assert unfused_traffic > traffic


def test_the_profiler_stage_fails_on_a_cuda_run_without_the_fuser(capsys, monkeypatch):
    from megatron_boost.testing.gpu_measure import fuser_check

    monkeypatch.setattr(stages, "_failed", [0])
    ledger = layer_ledger(LedgerSpec(shape=SMALL, layout=Layout(mode="boost", tp=2), seq_length=32))
    assert not fuser_check(7, True, jit_fuser=_noop, env={}, ledger=ledger)
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert "FAIL" in row and "jit_fuser" in row and "not torch.compile" in row
    kernels, _, unfused, _ = fusion_cost(ledger)
    assert f"launches {unfused} kernels" in row and f"instead of {kernels} " in row
    assert fuser_check(7, True, jit_fuser=torch.compile, env={})
    assert fuser_check(7, False, jit_fuser=_noop, env={})  # the CPU: n/a
    assert "n/a" in capsys.readouterr().out.strip().splitlines()[-1]
