"""The op ledger's recorder (``measure/ledger.py``, docs/design.md §17): a
``TorchDispatchMode`` that turns every ATen operator autograd issues into one :class:`Kernel`
(its class, bytes, GEMM FLOPs, module scope), the fused regions into one kernel each, and notes
which collectives' results each kernel reads (its ``deps``: what it must wait for on a GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["Kernel", "Scopes", "recorder_class", "attention_flops"]


@dataclass
class Kernel:
    """One kernel of the layer's forward or backward."""

    phase: str
    """'fwd' or 'bwd'."""
    kind: str
    """One of :data:`KINDS`."""
    name: str
    """The ATen operator, or the fused region."""
    scope: str
    """The module of the layer that issued it ('layer': the layer's own operators)."""
    read: int
    write: int
    flops: float = 0.0
    eager_kernels: int = 1
    """Kernels the CPU's eager path launches for it (a fused region's operators)."""
    shapes: Tuple[tuple, ...] = ()
    dtype: str = ""
    eager_bytes: int = 0
    """Bytes the CPU's eager kernels of a fused region move (0 for a single kernel)."""
    accumulates: bool = False
    """It adds a weight gradient into a parameter's ``main_grad`` (DDP's hook, or a layer's own
    in-place accumulation: ``measure/grad_accumulation.py``)."""
    deps: Tuple[int, ...] = ()
    """The collectives (their indices in the ledger's kernels) whose result it reads: on a GPU
    it cannot start before they end, waited for or not."""

    @property
    def bytes(self) -> int:
        return self.read + self.write



# ---------------------------------------------------------------------------------------------
# classification
# ---------------------------------------------------------------------------------------------

# in-place forms: a GEMM accumulating into its output (beta = 1)
_GEMMS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmm_", "baddbmm_", "addbmm_"}
_NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                "detach", "alias", "lift_fresh", "lift_fresh_copy", "_unsafe_view",
                "_reshape_alias", "view", "resize_", "set_", "_local_scalar_dense"}
_COPIES = {"cat", "clone", "copy_", "stack", "contiguous", "slice_backward",
           "select_backward", "index_put_", "_to_copy_layout"}
_OVERWRITE = {"copy_", "fill_", "zero_", "normal_", "uniform_"}


def _tensors(tree) -> List:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _distinct(tensors) -> List:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _is_zero(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


def _kind(func, args, out) -> Optional[str]:
    """The class of an ATen operator, or None when it launches no kernel."""
    name = func.overloadpacket.__name__
    if func.namespace == "c10d":
        return "collective"
    if func.namespace != "aten" or name in _NOT_KERNELS or getattr(func, "is_view", False):
        return None
    if name in _GEMMS:
        return "gemm"
    if "attention" in name or "flash" in name:
        return "attention"
    if name == "_to_copy":
        return "cast" if _tensors(out)[0].dtype != _tensors(args)[0].dtype else "copy"
    if name in _COPIES:
        return "copy"
    if name in ("add", "sub") and len(args) > 1 and _is_zero(args[1]):
        return "copy"  # x + 0: a copy of x
    return "elementwise"


def _is_accumulator(t) -> bool:
    """``t`` is a parameter's ``main_grad``, or a view of one."""
    return getattr(t, "gradient_accumulator", False) or \
        getattr(getattr(t, "_base", None), "gradient_accumulator", False)


def _gemm_flops(func, args) -> float:
    name = func.overloadpacket.__name__
    mats = [t for t in _tensors(args) if t.dim() >= 2]
    a, b = mats[-2], mats[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if name in ("addbmm", "addbmm_"):
        batch = a.shape[0]
    return 2.0 * batch * m * n * k


# ---------------------------------------------------------------------------------------------
# scopes: forward by module hooks, backward by the autograd nodes each module created
# ---------------------------------------------------------------------------------------------

_SCOPE_KEY = "megatron_boost_ledger_scope"


class Scopes:
    """The module scope of the operator now running, forward and backward."""

    def __init__(self, layer):
        # one stack per interleaved half (parallel/interleave.py), each a call stack of its own
        self._stacks: Dict[Any, List[str]] = {}
        self.backward_scope = "layer"
        self._handles = []
        for name, module in layer.named_modules():
            scope = name or "layer"
            self._handles.append(module.register_forward_pre_hook(self._enter(scope)))
            self._handles.append(module.register_forward_hook(self._leave(scope)))

    @property
    def stack(self) -> List[str]:
        """The module scopes entered by the running half (or the layer's caller)."""
        from megatron_boost.parallel.interleave import current_half

        return self._stacks.setdefault(current_half(), ["layer"])

    @property
    def current(self) -> str:
        import torch

        return self.backward_scope if torch._C._current_graph_task_id() != -1 else self.stack[-1]

    def _enter(self, scope: str):
        def hook(module, args):
            # autograd nodes behind the inputs, not yet claimed, were created by the enclosing
            # scope's own operators
            self._claim(_tensors(args), self.stack[-1])
            self.stack.append(scope)
        return hook

    def _leave(self, scope: str):
        def hook(module, args, output):
            self._claim(_tensors(output), scope)
            self.stack.pop()
        return hook

    def _claim(self, tensors, scope: str) -> None:
        """Tag every untagged autograd node behind ``tensors`` with ``scope`` (stopping at
        tagged ones: an inner module's, or an earlier one's) and make each set the backward
        scope when it runs."""
        todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or _SCOPE_KEY in node.metadata:
                continue
            node.metadata[_SCOPE_KEY] = scope
            if type(node).__name__ != "AccumulateGrad":
                node.register_prehook(self._backward_enter(scope))
            todo.extend(fn for fn, _ in node.next_functions)

    def _backward_enter(self, scope: str):
        def prehook(grad_outputs):
            self.backward_scope = scope
        return prehook

    def close(self, outputs) -> None:
        self._claim(_tensors(outputs), "layer")
        for h in self._handles:
            h.remove()


# ---------------------------------------------------------------------------------------------
# the recorder
# ---------------------------------------------------------------------------------------------


def _phase() -> str:
    import torch

    return "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"


def _storage(t) -> int:
    """A tensor's storage, by address (fake tensors have storages without data)."""
    return t.untyped_storage()._cdata


def attention_flops(name: str, tensors) -> float:
    """FLOPs of an attention stand-in kernel (``measure/kernel_models.py``): the causal core
    (the GPT model's attention is causal; a flash kernel skips the masked half) on q's
    [b, heads, s, e], times the kernel's share of the work (backward: 2.5x forward, the five
    matmuls of FlashAttention-2's backward against the forward's two)."""
    from megatron_boost.analysis.flops import attention_core_flops
    from megatron_boost.measure.kernel_models import ATTENTION_FLOP_SHARE

    share = ATTENTION_FLOP_SHARE.get(name, 0.0)
    if not share or not tensors:
        return 0.0
    b, heads, s, e = tensors[0].shape
    return share * b * s * attention_core_flops(s, heads, e, causal=True)


class _Recording:
    """What the recorder does, apart from the torch classes it derives from (defined on first
    use by :func:`recorder_class`, torch being imported lazily): every operator with a kernel
    becomes a :class:`Kernel`, a fused region's operators one kernel."""

    def __init__(self, scopes: Scopes):
        super().__init__()
        self.scopes = scopes
        self.kernels: List[Kernel] = []
        self._regions: List[List[Kernel]] = []
        # storage of a collective's result -> (its kernel index, the tensor: held, so
        # that no later tensor reuses the storage's address)
        self._comm_results: Dict[int, Tuple[int, Any]] = {}

    def record(self, func, args, kwargs):
        """Run one ATen operator and record its kernel (if it launches one)."""
        out = func(*args, **kwargs)
        kind = _kind(func, args, out)
        if kind is not None:
            reads, writes = _traffic(func, args, kwargs, out)
            deps = () if kind == "collective" else self._deps(reads)
            self._add(_op_kernel(func, kind, args, out, reads, writes, self.scopes.current,
                                 deps))
            if kind == "collective" and not self._regions:
                for t in writes:
                    self._comm_results[_storage(t)] = (len(self.kernels) - 1, t)
        return out

    def _deps(self, reads) -> Tuple[int, ...]:
        """The collectives whose results ``reads`` include."""
        found = {self._comm_results[key][0] for key in map(_storage, reads)
                 if key in self._comm_results}
        return tuple(sorted(found))

    def _add(self, kernel: Kernel) -> None:
        (self._regions[-1] if self._regions else self.kernels).append(kernel)

    # RegionObserver
    def enter(self, name: str) -> None:
        self._regions.append([])

    def exit(self, name: str, args: tuple, result: Any, kind: str = "fused") -> None:
        inner = self._regions.pop()
        reads = _distinct(_tensors(args))
        self._add(_region_kernel(name, kind, reads, _distinct(_tensors(result)), inner,
                                 self.scopes.current, self._deps(reads)))


def _dtype_name(tensors) -> str:
    return str(tensors[0].dtype).replace("torch.", "") if tensors else ""


def _op_kernel(func, kind, args, out, reads, writes, scope: str, deps) -> Kernel:
    """The kernel of one ATen operator that reads ``reads`` and writes ``writes``."""
    return Kernel(phase=_phase(), kind=kind, name=str(func), scope=scope,
                  read=sum(_nbytes(t) for t in reads), write=sum(_nbytes(t) for t in writes),
                  flops=_gemm_flops(func, args) if kind == "gemm" else 0.0,
                  shapes=tuple(tuple(t.shape) for t in _tensors(args)[:3]),
                  dtype=_dtype_name(_tensors(out) or writes),
                  accumulates=any(_is_accumulator(t) for t in writes), deps=deps)


def _region_kernel(name: str, kind: str, reads, outs, inner: List[Kernel], scope: str,
                   deps) -> Kernel:
    """The one kernel of a fused region that read ``reads`` and wrote ``outs``, holding the
    eager kernels ``inner`` the CPU ran for it."""
    return Kernel(phase=_phase(), kind=kind, name=name, scope=scope,
                  read=sum(_nbytes(t) for t in reads), write=sum(_nbytes(t) for t in outs),
                  eager_kernels=len(inner), eager_bytes=sum(k.bytes for k in inner),
                  flops=attention_flops(name, reads) if kind == "attention" else 0.0,
                  shapes=tuple(tuple(t.shape) for t in reads[:3]), dtype=_dtype_name(outs),
                  deps=deps)


def recorder_class():
    """The dispatch-mode recorder (defined on first use: torch is imported lazily, so that the
    ledger's records and the perf model import without it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_boost.parallel.fusion import RegionObserver

    class Recorder(_Recording, TorchDispatchMode, RegionObserver):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return self.record(func, args, kwargs or {})

    return Recorder


def _traffic(func, args, kwargs, out) -> Tuple[List, List]:
    """(tensors read, tensors written) by one operator: it writes its mutated arguments (in
    place, ``out=``) or else its results, and reads every other tensor argument, and the
    mutated ones it updates (``add_``) but not those it only overwrites (``copy_``, fills,
    ``out=``)."""
    schema = func._schema
    mutated, overwritten = [], []
    overwrite_only = func.overloadpacket.__name__ in _OVERWRITE
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        mutated += _tensors(value)
        if arg.kwarg_only or overwrite_only:
            overwritten += _tensors(value)
    reads = [t for t in _distinct(_tensors((args, kwargs)))
             if not any(t is w for w in overwritten)]
    writes = _distinct(mutated) if mutated else _distinct(_tensors(out))
    return reads, writes

