"""CPU mode: megatron-core's own GPTModel (local spec) through get_forward_backward_func."""

import pytest
import torch

from tests.rank_pool import distributed


def _megatron_gpt_tp2_pp2(rank, world_size):

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2,
                                             pipeline_model_parallel_size=2)
    model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, normalization="RMSNorm", gated_linear_unit=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
    pre = parallel_state.is_pipeline_first_stage()
    post = parallel_state.is_pipeline_last_stage()
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size=64, max_sequence_length=16, pre_process=pre,
        post_process=post, position_embedding_type="rope")

    seq, mb, n_micro = 16, 2, 3
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (mb, seq + 1), generator=g) for _ in range(n_micro)]
    it = iter(batches)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        inp, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(seq).unsqueeze(0).expand(mb, -1)
        out = model(inp, pos, None, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=it, model=[model],
        num_microbatches=n_micro, seq_length=seq, micro_batch_size=mb, forward_only=False)
    grads = [p.grad is not None or getattr(p, "main_grad", None) is not None
             for p in model.parameters()]
    return {"post": post, "losses": [float(l["loss"]) for l in losses],
            "all_params_have_grads": all(grads)}


def test_megatron_gpt_runs_on_cpu_tp2_pp2():
    results = distributed(_megatron_gpt_tp2_pp2, 4)
    last = [r for r in results if r["post"]]
    assert len(last) == 2
    # Three micro-batches reported by both last-stage TP ranks, identical, finite, near ln(64).
    assert len(last[0]["losses"]) == 3
    assert last[0]["losses"] == last[1]["losses"]
    for loss in last[0]["losses"]:
        assert 3.0 < loss < 5.5
    assert all(r["all_params_have_grads"] for r in results)


def test_use_cpu_is_idempotent_and_maps_devices():
    from megatron_boost.runtime.cpu_mode import is_cpu_mode, restore_cuda, use_cpu

    try:
        assert use_cpu(force=True) and use_cpu(force=True)
        assert is_cpu_mode()
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"
        assert torch.cuda.current_device() == 0
        assert t.cuda() is t
    finally:
        restore_cuda()  # leave the process as it was for the tests after this one


def _patched_namespaces():
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.utils as tutils

    return (torch.cuda, mrandom, tutils, fused_softmax)


def test_restore_cuda_undoes_every_patch():
    from megatron_boost.runtime.cpu_mode import CudaToCpuMode, is_cpu_mode, restore_cuda, use_cpu

    before = [dict(vars(ns)) for ns in _patched_namespaces()]
    use_cpu(force=True)
    assert torch.cuda.current_device is not before[0]["current_device"]
    restore_cuda()
    assert not is_cpu_mode()
    after = [dict(vars(ns)) for ns in _patched_namespaces()]
    for b, a in zip(before, after):
        assert a.keys() == b.keys()
        assert all(a[k] is b[k] for k in b), [k for k in b if a[k] is not b[k]]
    stack = torch.overrides._get_current_function_mode_stack()
    assert not any(isinstance(m, CudaToCpuMode) for m in stack)
    assert torch.zeros(3).type() == "torch.FloatTensor"
    # And it can be activated again.
    try:
        assert use_cpu(force=True) and torch.zeros(3, device="cuda").device.type == "cpu"
    finally:
        restore_cuda()


# ---------------------------------------------------------------------------------------------
# the device choice: why CUDA is unusable, and the one line of an 'auto' fallback
# ---------------------------------------------------------------------------------------------


def test_cuda_unusable_reason_names_the_cause(monkeypatch):
    import warnings

    from megatron_boost.runtime.cpu_mode import cuda_unusable_reason

    monkeypatch.setattr(torch.version, "cuda", None)
    assert cuda_unusable_reason() == f"torch {torch.__version__} is a CPU-only build"
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build from here on
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def driver_too_old():
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old")
        return False

    monkeypatch.setattr(torch.cuda, "is_available", driver_too_old)
    assert "NVIDIA driver on your system is too old" in cuda_unusable_reason()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_unusable_reason() == "CUDA_VISIBLE_DEVICES='' hides every GPU"

    def broken():
        raise RuntimeError("CUDA driver initialization failed\nmore detail")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert cuda_unusable_reason() == ("initialising CUDA failed: CUDA driver initialization "
                                      "failed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cuda_unusable_reason() is None


def test_auto_falling_back_to_the_cpu_says_why_in_one_line():
    """In a fresh process (CPU mode is process-wide): 'cuda' is an error naming the cause,
    'cpu' is silent, 'auto' prints exactly one line with the cause and the settings to use."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.version.cuda is not None and torch.cuda.is_available():
        import pytest

        pytest.skip("a usable GPU: 'auto' takes it")
    code = ("from megatron_boost.cli.pretrain import select_device\n"
            "try:\n    select_device('cuda')\n"
            "except ValueError as err:\n    print('cuda error:', err)\n"
            "print('cpu ->', select_device('cpu'))\n"
            "print('auto ->', select_device('auto'))\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(root),
                                           "RANK": "0"}, check=True).stdout.splitlines()
    from megatron_boost.runtime.cpu_mode import cuda_unusable_reason

    reason = cuda_unusable_reason()
    assert out[0].startswith("cuda error: device='cuda' requested but CUDA is unusable: "
                             f"{reason}"), out
    assert out[1] == "cpu -> cpu", out
    assert out[2] == (f"note: training.device=auto falls back to the CPU: CUDA is unusable "
                      f"({reason}); set training.device=cuda to make this an error, or "
                      f"training.device=cpu to silence this line"), out
    assert out[3:] == ["auto -> cpu"], out


def test_cpu_mode_left_as_found():
    """Switched off again on exit when it was off on entry; left on when it was on."""
    from megatron_boost.runtime.cpu_mode import (cpu_mode_left_as_found, is_cpu_mode,
                                                 restore_cuda, use_cpu)

    with cpu_mode_left_as_found():
        use_cpu(force=True)
        assert is_cpu_mode()
    assert not is_cpu_mode()
    try:
        use_cpu(force=True)
        with cpu_mode_left_as_found():
            use_cpu(force=True)
        assert is_cpu_mode()
    finally:
        restore_cuda()


# ---------------------------------------------------------------------------------------------
# megatron's CUDA-only functions (compat.megatron_cuda_functions): each replacement is needed
# ---------------------------------------------------------------------------------------------


def _megatron_rng_and_recompute():
    """What megatron does with the functions CPU mode replaces: the RNG tracker adds and forks
    a state (its own stream inside, the default stream untouched outside), and an activation
    checkpoint re-runs a causal, unfused softmax (its mask allocated on "CUDA") in a backward
    started as megatron's schedules start it; CPU mode runs that pass inside its function mode,
    so the mask needs no replacement."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.pipeline_parallel.schedules import custom_backward
    from megatron.core.tensor_parallel import checkpoint, get_cuda_rng_tracker
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    try:
        default_stream = torch.get_rng_state()
        tracker.add("cpu-mode-test", 1234)
        with tracker.fork("cpu-mode-test"):
            drawn = torch.rand(2)
        assert torch.equal(drawn, torch.rand(2, generator=torch.Generator().manual_seed(1234))), \
            "the fork did not draw from the tracker's own stream"
        assert torch.equal(torch.get_rng_state(), default_stream), "the default stream moved"
        softmax = FusedScaleMaskSoftmax(
            input_in_fp16=False, input_in_bf16=False, attn_mask_type=AttnMaskType.causal,
            scaled_masked_softmax_fusion=False, mask_func=attention_mask_func,
            softmax_in_fp32=True, scale=None)
        scores = torch.randn(1, 2, 4, 4, requires_grad=True)  # [b, heads, sq, sk]
        # x * 1.0: the mask is applied in place, and the recompute's input is a detached leaf.
        # The backward as megatron's schedules start it with deallocated pipeline outputs
        # (custom_backward: the C++ engine directly, not torch.autograd.backward, which CPU mode
        # runs inside its function mode)
        custom_backward(checkpoint(lambda x: softmax(x * 1.0, None), False, scores).sum(), None)
        assert scores.grad is not None
    finally:
        tracker.reset()


@pytest.mark.compat
@pytest.mark.parametrize("dropped", [None, "_get_cuda_rng_state", "_set_cuda_rng_state"])
def test_each_replaced_megatron_function_is_needed(monkeypatch, dropped):
    """With every entry of compat.megatron_cuda_functions replaced, megatron's RNG tracker and
    a recompute run in CPU mode; with any one left as megatron wrote it, they fail (CUDA is
    reached without a GPU, or the tracker's fork leaves the default stream moved)."""
    from megatron_boost import compat
    from megatron_boost.runtime import cpu_mode

    if torch.cuda.is_available():
        pytest.skip("shows CUDA being reached on a machine without a usable GPU")
    kept = tuple(entry for entry in compat.megatron_cuda_functions() if entry[1] != dropped)
    assert len(kept) == len(compat.megatron_cuda_functions()) - (dropped is not None)
    monkeypatch.setattr(cpu_mode, "megatron_cuda_functions", lambda: kept)
    cpu_mode.use_cpu(force=True)
    try:
        if dropped is None:
            _megatron_rng_and_recompute()
        else:
            with pytest.raises((AssertionError, RuntimeError),
                               match="not compiled with CUDA|no NVIDIA driver|the default stream moved"):
                _megatron_rng_and_recompute()
    finally:
        cpu_mode.restore_cuda()
