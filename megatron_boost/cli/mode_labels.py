"""The entry points' mode labels, built from and read back into a :class:`TPMode` here only.

A label names what a tool measures: a mode (``full``, ``naive``, ``boost``), or full rank as
megatron users run it (``full+sp``: sequence parallelism) or with megatron's fused SwiGLU
(``full+swiglu``). The labels stay strings because the tools print them and key their JSON
by them; everything else reads the :class:`ModeLayout` a label stands for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_boost.config.modes import TPMode

SP_SUFFIX = "+sp"
SWIGLU_SUFFIX = "+swiglu"


@dataclass(frozen=True)
class ModeLayout:
    """What a label sets in a run config."""

    mode: TPMode
    """parallel.mode."""
    sequence_parallel: Optional[bool] = None
    """parallel.sequence_parallel; None keeps the mode's default (full rank's label sets it,
    False being the BOOST paper's baseline)."""
    bias_activation_fusion: Optional[bool] = None
    """model.bias_activation_fusion; None keeps the config's resolution."""

    @property
    def label(self) -> str:
        return label_of(self.mode, bool(self.sequence_parallel),
                        bool(self.bias_activation_fusion))


def label_of(mode: TPMode, sequence_parallel: bool = False, fused_swiglu: bool = False) -> str:
    """The label of ``mode`` with sequence parallelism / fused SwiGLU (full rank only)."""
    mode = TPMode.parse(mode)
    if mode.is_lowrank and (sequence_parallel or fused_swiglu):
        raise ValueError(f"{mode} has no sequence-parallel or fused-SwiGLU label")
    return f"{mode}{SP_SUFFIX if sequence_parallel else ''}" \
           f"{SWIGLU_SUFFIX if fused_swiglu else ''}"


#: The labels besides the modes themselves.
FULL_SP = label_of(TPMode.FULL, sequence_parallel=True)
FULL_SWIGLU = label_of(TPMode.FULL, fused_swiglu=True)


def layout_of(label: str) -> ModeLayout:
    """The layout ``label`` stands for (ValueError for a label no tool uses)."""
    if label == FULL_SP:
        return ModeLayout(TPMode.FULL, True)
    if label == FULL_SWIGLU:
        return ModeLayout(TPMode.FULL, False, True)
    mode = TPMode.parse(label)
    # full rank's plain label is the paper's baseline: no sequence parallelism
    return ModeLayout(mode, False if mode is TPMode.FULL else None)


def mode_of(label: str) -> TPMode:
    """The mode of ``label`` (``full+sp`` -> TPMode.FULL)."""
    return layout_of(label).mode
