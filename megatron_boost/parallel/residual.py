"""The residual stream added in boost's GEMMs: its gradient in the A side's dgrad GEMM, and
the residual itself in the B side's GEMM of the block's output (docs/design.md §3).

In a boost layer the stream x feeds two consumers: the normed group's A side (qkv, fc1:
``down_project``, which holds the fused norm) and megatron's residual (``residual =
hidden_states``, added back by the ``self_attn_bda`` / ``mlp_bda`` slot). Left to autograd, the
A side's backward writes dx = dP·W (GEMM), adds the norm's term (one pass), and autograd's input
buffer then adds the residual's gradient (another kernel, another pass over [s, b, d/t]).
Here the A side starts from the residual's gradient instead: dx = (d_res + dP·W) in the GEMM's
epilogue (beta = 1, in place), then the norm's term; the residual hands autograd no gradient.

Both ends are layer-spec slots boost owns (``model/specs.py``), megatron's layer forward is
untouched:

* :class:`ResidualTap`, in the ``input_layernorm`` / ``pre_mlp_layernorm`` slots (an
  ``IdentityOp`` before): returns x through :class:`_ResidualTap`, whose node holds a
  :class:`ResidualSlot` made for this call; the slot also travels on x itself (the tensor that
  megatron keeps as ``residual``), where the bda finds it and takes it off again.
* :func:`residual_bias_dropout_add`, in the bda slots: megatron's own bias-dropout-add on the
  DETACHED residual, its output routed through :class:`_ResidualOut`, whose backward puts
  dL/d(out) (the residual's gradient: the residual is added last) into the slot.
* the A side finds the slot from its input's autograd node (:func:`residual_slot_of`) and takes
  the gradient in its backward (:func:`take_residual_gradient`).

The forward is the mirror image. The block's output is y + x: the B GEMM of ``linear_proj``
/ ``linear_fc2`` (``up_project``) writes y, megatron's bda then adds x (another kernel, another
pass over [s, b, d/t]). Here the tap offers x (the call's slot, in a context variable) and that
B side takes it (:func:`take_offered_residual`) and computes x + z·Bᵀ in
the GEMM's epilogue (beta = 1, as megatron's fused TP inference kernel adds the residual inside
``linear_proj``); the bda then adds nothing. Only where the bda's dropout is off (inference, or
``hidden_dropout`` = 0): dropout applies to y alone. A B side that does not take it (a
residual of another dtype or shape) leaves it to the bda.

Per call, never per module: the slot lives on the autograd nodes and on that call's tensor, so
two micro-batches in flight (pipeline parallelism) and a low-rank recompute (a fresh forward
on a fresh input, ``parallel/recompute.py``) each get their own, and no module attribute changes
from call to call (``tests/test_cuda_graph_ready.py``).

Order: the bda's node lies upstream of the whole sub-block's backward (its output's gradient is
what the attention / MLP branch back-propagates), so the slot is filled before the A side's
backward runs, and the tap's backward runs after its consumer, the A side.

In-place safety. The A side accumulates INTO the residual's gradient only when that tensor is
the very one the next tap returned (checked by identity, :class:`_ResidualOut`): the gradient
the A side of the next group produced, which nobody else holds. The bda hands the same tensor on
to its branch (bias, dropout and the attention / MLP output read it), but all of that backward
has finished before the A side's runs. A gradient from outside the layers (the final norm's,
a test's, megatron's pipeline receive buffer, a checkpointed layer's) is copied first, so the
GEMM still accumulates in its epilogue and the values are bitwise those of the in-place path.
Where no A side takes the gradient (the plain RMSNorm at TP=1, or a residual of another dtype),
the tap adds it, as autograd's input buffer did.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Optional

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.identity_op import IdentityOp

__all__ = ["ResidualSlot", "ResidualTap", "as_next_layer_input", "gradient_owner",
           "residual_bias_dropout_add", "residual_slot_of", "take_offered_residual",
           "take_residual_gradient"]

_SLOT_ATTRIBUTE = "_boost_residual_slot"
"""The attribute the tap puts on its input (megatron's ``residual``) for the bda to find."""


_OFFERED: contextvars.ContextVar = contextvars.ContextVar("boost_residual_offered",
                                                          default=None)
"""The slot whose residual the block's output B side may add in its GEMM: a context variable,
so each interleaved half (``parallel/interleave.py``, a context per half) has its own."""


class ResidualSlot:
    """One call's residual: offered to the B side of the block's output in the forward; its
    gradient from the bda's backward to the A side's."""

    __slots__ = ("offered", "added", "tapped", "gradient", "writable", "returned")

    def __init__(self):
        self.offered: Optional[torch.Tensor] = None
        """The residual (detached), until a B side takes it."""
        self.added = False
        """A B side added the residual in its GEMM: the bda adds nothing."""
        self.tapped = False
        """The tap put its node in the graph: the bda routes the gradient to this slot."""
        self.gradient: Optional[torch.Tensor] = None
        self.writable = False
        self.returned: Optional[weakref.ref] = None
        """The gradient the tap returned (its input's): one the next bda may write into. A
        weak reference: a strong one would keep autograd from taking it over as a leaf's
        ``.grad`` (it would copy it instead)."""

    def take(self):
        """(gradient, writable), once; (None, False) when there is none (left)."""
        gradient, writable = self.gradient, self.writable
        self.gradient, self.writable = None, False
        return gradient, writable


class _ResidualTap(torch.autograd.Function):
    """fwd: x unchanged (an alias), the call's slot kept on the node.
    bwd: the consumers' gradient, plus the residual's where no A side took it."""

    @staticmethod
    def forward(ctx, x, slot):
        ctx.residual_slot = slot
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        slot = ctx.residual_slot
        pending, _ = slot.take()
        if pending is not None:  # no A side accumulated it: autograd's own add
            grad = grad + pending
        slot.returned = weakref.ref(grad)
        return grad, None


class _ResidualOut(torch.autograd.Function):
    """fwd: the bda's output unchanged (computed on the detached residual).
    bwd: its gradient, which is also the residual's, into the slot, and on to the branch."""

    @staticmethod
    def forward(ctx, out, slot):
        ctx.residual_slot = slot
        ctx.source_slot = None  # set by the tap that reads this output (_link_source)
        # not a view: megatron's layer returns a viewless output (make_viewless_tensor), which
        # must stay this node's for the next layer's tap to find it
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        source = ctx.source_slot
        # writable only if it is the tensor the next tap returned: ours, held by nobody else
        ctx.residual_slot.gradient = grad
        ctx.residual_slot.writable = (source is not None and source.returned is not None
                                      and source.returned() is grad)
        return grad, None


def _link_source(x: torch.Tensor, slot: ResidualSlot) -> None:
    """When x is a boost bda's output, its node learns which tap's gradient it will receive."""
    node = x.grad_fn
    if node is not None and getattr(node, "_forward_cls", None) is _ResidualOut:
        node.source_slot = slot


def gradient_owner(out: torch.Tensor) -> ResidualSlot:
    """A slot standing in for the next tap of ``out``, for a consumer that hands ``out`` a
    gradient of its own (a fresh tensor nobody else holds): that consumer records it as
    ``returned`` in its backward, and when ``out`` is a boost bda's output, the A side that
    takes this gradient accumulates into it in place (module docstring, in-place safety). The
    interleaved halves' join is one (``parallel/interleave.py``)."""
    slot = ResidualSlot()
    _link_source(out, slot)
    return slot


class ResidualTap(IdentityOp):
    """boost's ``input_layernorm`` / ``pre_mlp_layernorm`` slot: the identity (the norm is
    fused into the A side), marking the residual branch point (module docstring). Built by
    megatron with the layer's config; without one (:func:`as_next_layer_input`) it offers no
    residual."""

    def __init__(self, *args, config=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.config = config

    def forward(self, x, *args, **kwargs):
        if not isinstance(x, torch.Tensor):
            return x
        slot = ResidualSlot()
        setattr(x, _SLOT_ATTRIBUTE, slot)  # for this call's bda, which takes it off
        if self._output_gemm_may_add():
            slot.offered = x.detach()
            _OFFERED.set(slot)
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x  # nothing to back-propagate (inference, a checkpointed forward)
        slot.tapped = True
        _link_source(x, slot)
        return _ResidualTap.apply(x, slot)

    def _output_gemm_may_add(self) -> bool:
        """Whether the bda's dropout is off, so the residual may join the output GEMM
        (dropout applies to the branch's output alone)."""
        return self.config is not None and not (self.training and self.config.hidden_dropout)


def residual_bias_dropout_add(training: bool, fused: bool):
    """boost's ``self_attn_bda`` / ``mlp_bda`` slot: megatron's bias-dropout-add
    (``get_bias_dropout_add``); for a residual the tap marked, computed on the detached
    residual, whose gradient goes to the tap's slot instead (:class:`_ResidualOut`)."""
    bias_dropout_add = get_bias_dropout_add(training, fused)

    def residual_into_slot(x_with_bias, residual, prob):
        slot = getattr(residual, _SLOT_ATTRIBUTE, None)
        if slot is None:
            return bias_dropout_add(x_with_bias, residual, prob)
        delattr(residual, _SLOT_ATTRIBUTE)
        _withdraw(slot)
        if slot.added:  # the output's B GEMM added the residual
            return _output_with_residual(x_with_bias, slot, training and prob > 0)
        if not slot.tapped or residual.dtype != x_with_bias[0].dtype:
            return bias_dropout_add(x_with_bias, residual, prob)  # megatron casts: autograd's
        return _ResidualOut.apply(bias_dropout_add(x_with_bias, residual.detach(), prob), slot)

    return residual_into_slot


def _withdraw(slot: ResidualSlot) -> None:
    """The slot's offer ends with its bda, taken or not."""
    slot.offered = None
    if _OFFERED.get() is slot:
        _OFFERED.set(None)


def _output_with_residual(x_with_bias, slot: ResidualSlot, dropout: bool) -> torch.Tensor:
    """The bda of an output that holds the residual already: its bias added (boost's linears
    have none), its gradient routed to the slot where the tap is in the graph."""
    if dropout:  # the tap offers only without dropout: a layer with its own dropout rate
        raise RuntimeError("boost's block output added the residual in its GEMM, but the bda "
                           "applies dropout; the tap must not offer it with dropout on")
    out, bias = x_with_bias
    if bias is not None:
        out = out + bias
    return _ResidualOut.apply(out, slot) if slot.tapped else out


def take_offered_residual(shape, dtype) -> Optional[torch.Tensor]:
    """The residual the tap offered, for the B GEMM that writes the block's output of
    ``shape`` and ``dtype`` to add (beta = 1); None when there is none or it does not fit
    (then the bda adds it). Taken once: the slot records that it was added."""
    slot = _OFFERED.get()
    if slot is None or slot.offered is None:
        return None
    if tuple(slot.offered.shape) != tuple(shape) or slot.offered.dtype != dtype:
        return None
    residual, slot.offered, slot.added = slot.offered, None, True
    _OFFERED.set(None)
    return residual


def residual_slot_of(x: torch.Tensor) -> Optional[ResidualSlot]:
    """The slot of the tap whose output x is (None otherwise): the A side's ctx keeps it."""
    node = x.grad_fn
    if node is None or getattr(node, "_forward_cls", None) is not _ResidualTap:
        return None
    return node.residual_slot


def take_residual_gradient(slot: Optional[ResidualSlot], like: torch.Tensor
                           ) -> Optional[torch.Tensor]:
    """The residual's gradient as a contiguous buffer of ``like``'s shape and dtype that the
    A side's dgrad GEMM accumulates into: the slot's own tensor when it is writable (module
    docstring), else a copy. None without one (or of another shape or dtype: then it stays in
    the slot and the tap adds it)."""
    if slot is None or slot.gradient is None:
        return None
    if slot.gradient.shape != like.shape or slot.gradient.dtype != like.dtype:
        return None
    gradient, writable = slot.take()
    if writable and gradient.is_contiguous():
        return gradient
    return gradient.clone(memory_format=torch.contiguous_format)


def as_next_layer_input(out: torch.Tensor) -> torch.Tensor:
    """A layer's output as the next boost layer's input tap takes it: the gradient handed to
    the result is then treated as that layer's A side's, which this layer's bda may accumulate
    into. For the op ledger (``measure/ledger.py``), which measures a layer inside the decoder
    (its own gradient buffer, never one a caller reads again)."""
    return ResidualTap()(out)
