"""CPU mode: run megatron-core's real code paths on CPU with the gloo backend (docs/design.md §9).

megatron-core assumes CUDA in a handful of places:

* ``device="cuda"`` / ``torch.cuda.current_device()`` allocations in the pipeline schedules and
  the p2p communication code;
* the tensor-parallel RNG tracker (``torch.cuda.get_rng_state`` and friends, plus megatron's
  private ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``, listed in compat.py);
* ``torch.cuda.synchronize`` and stream handling;
* ``Tensor.type()`` compared with ``'torch.cuda.FloatTensor'`` in the optimizers and grad clipping.

:func:`use_cpu` installs a small compatibility layer for exactly these calls: a
``TorchFunctionMode`` that maps CUDA devices to the CPU (and reports CPU tensors with their CUDA
type names), and patches of the CUDA-only functions listed above so that they act on the CPU
generator or do nothing. No Megatron file is edited or copied.

Why process-wide: megatron-core reaches these calls from deep inside model construction, the
pipeline schedules, the p2p code, the RNG tracker and the optimizer step, looking the functions
up on ``torch.cuda`` (or its own modules) at call time, and offers no hook to inject a device.
Replacing the module attributes is therefore the only way to redirect them without editing or
copying megatron, and a module attribute is global to the process. Likewise the function mode
must cover the whole run (every allocation of every step), so it stays entered on the thread
that activated it. CPU mode is meant for a whole process (a gloo worker, a test run on a
machine without GPUs): activation is explicit and idempotent; on a machine with a usable GPU it
refuses unless ``force=True`` is passed, so the layer is never active by accident on a CUDA
run; :func:`restore_cuda` undoes every patch and leaves the function mode.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from megatron_boost.compat import megatron_cuda_functions

__all__ = ["use_cpu", "restore_cuda", "is_cpu_mode", "maybe_use_cpu", "cuda_unusable_reason",
           "cpu_mode_left_as_found",
           "CudaToCpuMode"]

_LOCK = threading.Lock()
# The active function mode (None when CPU mode is off) and every patch as
# (owner, attribute, original value or _ABSENT), in installation order, for restore_cuda().
_STATE: dict[str, Any] = {"mode": None, "patches": []}
_ABSENT = object()

_CPU = torch.device("cpu")

# Tensor.type() names that megatron's optimizers compare against.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def _is_cuda_device(device: Any) -> bool:
    """True for every spelling of a CUDA device: 'cuda', 'cuda:1', torch.device, or an int
    (a bare int is a CUDA ordinal in torch's factory functions)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _renamed(kwargs: dict, **names) -> dict:
    return {names.get(k, k): v for k, v in kwargs.items()}


def _backward_in_mode(mode: TorchFunctionMode, tensors, grad_tensors=None, retain_graph=None,
                      create_graph: bool = False, inputs=None) -> None:
    """``torch.autograd.backward`` with ``mode`` active for the whole pass. torch pops a mode
    while its handler runs, and from torch 2.13 ``backward`` itself goes through the handler,
    so the pass would run without the mode; but megatron allocates on the "CUDA" device in
    backward functions too (the sequence-parallel reduce-scatter's output in
    tensor_parallel's linear layers and mappings). So the pass is started here on autograd's
    engine, as megatron's own ``custom_backward`` starts it, inside the mode."""
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
        grad_tensors = (grad_tensors,) * len(tensors)
    grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grad_tensors))
    for t, g in zip(tensors, grad_tensors):
        if g is None and t.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
    with mode:
        torch.autograd.Variable._execution_engine.run_backward(
            tensors, grads, create_graph if retain_graph is None else retain_graph,
            create_graph, tuple(inputs or ()), allow_unreachable=True, accumulate_grad=True)


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA devices in torch calls to the CPU while active.

    * any ``device=`` keyword naming CUDA becomes ``cpu`` (factory functions, ``Tensor.to``);
    * a positional CUDA device in ``Tensor.to`` becomes ``cpu``;
    * ``Tensor.cuda()`` returns the tensor unchanged (it already lives on the CPU);
    * ``Tensor.type()`` with no argument reports the CUDA type name megatron asserts on.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.autograd.backward:
            return _backward_in_mode(self, *args, **kwargs)
        if func is torch.Tensor.backward:
            tensor, *rest = args
            return _backward_in_mode(self, tensor, *rest, **_renamed(kwargs, gradient="grad_tensors"))
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for torch.cuda.Stream: work on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def record_event(self, *args, **kwargs):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cpu_get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # The CPU generator stands in for the CUDA one: seeding it is what megatron's
    # model_parallel_cuda_manual_seed intends for the device generator. (Not torch.manual_seed:
    # that calls torch.cuda.manual_seed_all, which is patched to a no-op below.)
    torch.default_generator.manual_seed(seed)


def _patch(owner: Any, name: str, value: Any) -> None:
    _STATE["patches"].append((owner, name, getattr(owner, name, _ABSENT)))
    setattr(owner, name, value)


def _undo_patches() -> None:
    for owner, name, original in reversed(_STATE["patches"]):
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _STATE["patches"].clear()


def _install_patches() -> None:
    cuda = torch.cuda
    # Device queries and synchronisation.
    _patch(cuda, "current_device", lambda: 0)
    _patch(cuda, "synchronize", lambda *a, **k: None)
    _patch(cuda, "Stream", _NullStream)
    _patch(cuda, "current_stream", lambda *a, **k: _NullStream())
    _patch(cuda, "default_stream", lambda *a, **k: _NullStream())
    _patch(cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    _patch(cuda, "set_device", lambda *a, **k: None)
    # Memory statistics: the CPU has none of the CUDA caching allocator's counters.
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        _patch(cuda, stat, lambda *a, **k: 0)
    _patch(cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    _patch(cuda, "empty_cache", lambda *a, **k: None)
    # RNG: the tensor-parallel tracker forks and restores the CPU generator instead.
    _patch(cuda, "get_rng_state", _cpu_get_rng_state)
    _patch(cuda, "set_rng_state", _cpu_set_rng_state)
    _patch(cuda, "manual_seed", _cpu_manual_seed)
    # torch.manual_seed seeds the CPU generator itself and then every CUDA device: none here.
    _patch(cuda, "manual_seed_all", lambda *a, **k: None)
    # megatron's own CUDA-only functions (compat.py lists them).
    replacement = {"get_rng_state": _cpu_get_rng_state, "set_rng_state": _cpu_set_rng_state}
    for owner, name, role in megatron_cuda_functions():
        _patch(owner, name, replacement[role])


def cuda_unusable_reason() -> Optional[str]:
    """None when a CUDA device is usable, else why not, in words (for the one line that says
    why a run falls back to the CPU)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        with warnings.catch_warnings(record=True) as caught:  # torch warns why, e.g. the driver
            warnings.simplefilter("always")
            available = torch.cuda.is_available()
            count = torch.cuda.device_count() if available else 0
    except Exception as err:  # a broken driver counts as no GPU
        first_line = (str(err).strip().splitlines() or [repr(err)])[0]
        return f"initialising CUDA failed: {first_line}"
    if available and count > 0:
        return None
    if hidden is not None and not hidden.strip(","):
        return f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU"
    why = next((str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()),
               "no NVIDIA driver, or no GPU visible to this process")
    return f"torch.cuda.is_available() is False ({why})"


def _cuda_usable() -> bool:
    return cuda_unusable_reason() is None


def use_cpu(force: bool = False) -> bool:
    """Activate CPU mode for this process. Idempotent; returns True once active.

    Args:
        force: activate even though CUDA is usable (testing the CPU path on a GPU machine).

    Raises:
        RuntimeError: CUDA is usable and ``force`` is False; the caller should use NCCL
            and the GPU instead.
    """
    with _LOCK:
        if _STATE["mode"] is not None:
            return True
        if _cuda_usable() and not force:
            raise RuntimeError(
                "use_cpu() called on a machine with a usable CUDA device; CPU mode is for "
                "machines without GPUs. Pass force=True to run on the CPU anyway."
            )
        _install_patches()
        mode = CudaToCpuMode()
        # Entered until restore_cuda(): the mode stays on this thread's function-mode stack
        # (autograd's CPU backward runs on this thread too).
        mode.__enter__()
        _STATE["mode"] = mode
        return True


def restore_cuda() -> None:
    """Deactivate CPU mode: undo every patch of :func:`use_cpu` and leave its function mode.
    A no-op when CPU mode is off. Call it on the thread that activated CPU mode, with no other
    function mode entered above it since."""
    with _LOCK:
        mode = _STATE["mode"]
        if mode is None:
            return
        stack = torch.overrides._get_current_function_mode_stack()
        if not stack or stack[-1] is not mode:
            raise RuntimeError("restore_cuda(): CPU mode's function mode is not the innermost "
                               "one on this thread; leave the modes entered after it first")
        mode.__exit__(None, None, None)
        _undo_patches()
        _STATE["mode"] = None


def is_cpu_mode() -> bool:
    """Whether :func:`use_cpu` has been activated in this process."""
    return _STATE["mode"] is not None


@contextlib.contextmanager
def cpu_mode_left_as_found():
    """On exit, switch CPU mode off again if it was off on entry: for an entry point's
    ``main(argv)`` or a tool's body called in a process that goes on (tests), which may switch
    CPU mode on for its run."""
    was_on = is_cpu_mode()
    try:
        yield
    finally:
        if not was_on:
            restore_cuda()


def maybe_use_cpu(device: str = "auto") -> str:
    """Pick the device kind for a run: ``'cuda'`` or ``'cpu'``; activates CPU mode when needed.

    Args:
        device: ``'auto'`` (GPU when usable), ``'cpu'`` (force CPU mode) or ``'cuda'``.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device ({device!r}) must be one of 'auto', 'cpu', 'cuda'")
    if device == "cuda" or (device == "auto" and _cuda_usable()):
        reason = cuda_unusable_reason()
        if reason is not None:
            raise RuntimeError(f"device='cuda' requested but CUDA is unusable: {reason}; fix "
                               f"the GPU set-up, or use device='cpu' to run in CPU mode")
        return "cuda"
    use_cpu(force=True)
    return "cpu"

