"""tools/gpu_check.sh: the per-rank layer shapes, and the whole script as a CPU dry run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_boost.cli.gpu_check import cpu_plan, rank_local_model

ROOT = Path(__file__).resolve().parents[1]
COLA_7B = dict(hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, attn_rank=1024,
               mlp_rank=1024)


@pytest.mark.parametrize("mode,expected", [
    # full: megatron shards heads and ffn; the hidden stream stays whole
    ("full", dict(hidden_size=4096, ffn_hidden_size=2752, num_attention_heads=8,
                  attn_rank=1024, mlp_rank=1024)),
    # naive: A column- and B row-parallel shard the ranks; attention and MLP are replicated
    ("naive", dict(hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                   attn_rank=256, mlp_rank=256)),
    # boost: hidden stream, heads and ffn sharded; the full rank r on every rank
    ("boost", dict(hidden_size=1024, ffn_hidden_size=2752, num_attention_heads=8,
                   attn_rank=1024, mlp_rank=1024)),
])
def test_rank_local_shapes_at_tp4(mode, expected):
    assert rank_local_model(COLA_7B, mode, 4) == dict(expected, kv_channels=128)


def test_gpu_check_cpu_dry_run():
    env = dict(os.environ, PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    proc = subprocess.run([str(ROOT / "tools" / "gpu_check.sh"), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    table = proc.stdout[proc.stdout.index("check "):].splitlines()
    checks = [line.split()[0] + " " + line.split()[1] for line in table[1:]]
    plan = cpu_plan()
    assert checks.count("a smoke") == 1 and checks.count("b throughput") == 2
    assert checks.count("c layer") == 3 * len(plan.layer_cases)
    assert checks.count("d attention") == 2
    assert all(" ok " in line for line in table[1:]), "\n".join(table)
    assert "resumed 4-6 max |diff| 0.0e+00" in table[1]
