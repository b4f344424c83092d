"""boost's online-RMSNorm statistic in bf16: fp32 from x to 1/rms, and no fp32 copy of x kept.

Two gloo ranks (TP=2) run one bf16 BoostLinearFC1 (fused norm) forward and backward, plainly
and under low-rank activation checkpointing. Checked:

* the forward all-reduces: the sum of squares as a separate fp32 collective, one value (4
  bytes) per token, and the bf16 products (2r wide): a bf16 statistic would have 2^-9
  relative error where megatron's RMSNorm computes it in fp32;
* the statistic's all-reduce is started asynchronously before the A GEMM and the products'
  all-reduce follows that GEMM, so the GEMM runs while the statistic travels;
* nothing autograd saves in the forward is an fp32 tensor of x's shape (an fp32 copy of x would
  double the fused norm's activation memory in bf16);
* the checkpointed run (replaying the two recorded reductions) gives bitwise the same input and
  weight gradients as the plain one.
"""

from __future__ import annotations

import pytest
import torch

from tests.rank_pool import distributed

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

S, B, D, FFN, RANK = 8, 2, 64, 96, 24


def _layer(group):
    from megatron_boost.config.transformer import BoostTransformerConfig
    from megatron_boost.parallel.layers import BoostLinearFC1

    config = BoostTransformerConfig(
        num_layers=1, hidden_size=D, num_attention_heads=4, ffn_hidden_size=FFN,
        tensor_model_parallel_size=2, tp_mode="boost", attn_rank=RANK, mlp_rank=RANK,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.bfloat16,
        bf16=True, hidden_dropout=0.0, attention_dropout=0.0)
    return BoostLinearFC1(D, 2 * FFN, config=config, tp_group=group, tp_comm_buffer_name="fc1")


def _grads(layer, x, checkpointed):
    from megatron_boost.parallel.recompute import lowrank_checkpoint

    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    def run(h):  # gate ⊙ up: one tensor out, as the MLP makes of the group's two outputs
        gate, up = layer(h)[0]
        return gate * up

    out = lowrank_checkpoint(run, x) if checkpointed else run(x)
    out.float().pow(2).sum().backward()
    return [x.grad] + [p.grad for p in layer.parameters()]


def _worker(rank, world):
    from megatron.core import parallel_state

    from megatron_boost.measure.collectives import record_collectives

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    layer = _layer(group)
    x = torch.randn(S, B, D // 2, dtype=torch.bfloat16, requires_grad=True)  # [s, b, d/t]
    saved = []
    with record_collectives(group) as log:
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
            gate, up = layer(x)[0]  # the forward's saved tensors
        (gate.sum() + up.sum()).backward()
    fwd = [(r.width, r.nbytes // (r.numel or 1)) for r in log.select("fwd")]
    plain, checkpointed = _grads(layer, x, False), _grads(layer, x, True)
    return {"fwd": fwd, "fp32_copies_of_x": saved.count((torch.float32, tuple(x.shape))),
            "bitwise": all(torch.equal(a, b) for a, b in zip(plain, checkpointed)),
            "forward_events": _forward_events(layer, x)}


class _Events(torch.overrides.TorchFunctionMode):
    """Logs the GEMM calls (torch.mm, torch.matmul, torch.bmm) and (through a wrapper installed
    for the block) all-reduces, in call order."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.mm, torch.matmul, torch.bmm):
            self.events.append(("gemm", tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._all_reduce = torch.distributed.all_reduce

        def all_reduce(tensor, *args, async_op=False, **kwargs):
            self.events.append(("all_reduce", str(tensor.dtype), async_op))
            return self._all_reduce(tensor, *args, async_op=async_op, **kwargs)

        torch.distributed.all_reduce = all_reduce
        return super().__enter__()

    def __exit__(self, *exc):
        torch.distributed.all_reduce = self._all_reduce
        return super().__exit__(*exc)


def _forward_events(layer, x):
    with torch.no_grad(), _Events() as log:
        layer(x)
    return log.events


@pytest.fixture(scope="module")
def res():
    return distributed(_worker, 2)[0]


def test_bf16_statistic_is_fp32_and_replayed_exactly(res):
    # (width, bytes per element): the fp32 statistic (issued first), then the bf16 products
    assert res["fwd"] == [(1, 4), (2 * RANK, 2)], res
    assert res["fp32_copies_of_x"] == 0, res
    assert res["bitwise"], res


def test_bf16_statistic_all_reduce_starts_before_the_a_gemm(res):
    events = res["forward_events"]
    # the statistic's fp32 all-reduce in flight, then the A GEMM ([2r, d/t] fused A factors),
    # then the products' (synchronous) all-reduce; the B GEMMs follow
    assert events[:3] == [("all_reduce", "torch.float32", True), ("gemm", (D // 2, 2 * RANK)),
                          ("all_reduce", "torch.bfloat16", False)], events
