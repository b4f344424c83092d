"""The one layout record: how a layer or a run is laid out over ranks.

Every layout the package describes composes this record rather than repeating its fields: the
run configuration's ``parallel`` section builds one (``ParallelConfig.layout``), the perf model's
layout extends it with the batch and the run settings it prices (``perf/model.py``), and the
ledger (``measure/ledger.py``), the per-layer comm measurement (``measure/layer_comm.py``) and
the layout-equivalence harness (``testing/verification.py``) each hold one as ``layout``.

Plain Python, like ``config/modes.py``: the perf model and config checks read it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_boost.config.modes import TPMode, resolve_sequence_parallel

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """A tensor-parallel mode and the sizes of the parallel groups (world = tp · pp · dp)."""

    mode: TPMode = TPMode.BOOST
    """Tensor-parallel mode (a mode name is parsed to the enum when the record is built)."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank; None: no interleaving."""
    dp: Optional[int] = None
    """Data-parallel size; None: derived from the world size where one is known."""
    sequence_parallel: Optional[bool] = None
    """megatron's sequence parallelism (full mode); None: on for full at tp > 1, the rule of
    ``parallel.sequence_parallel``."""

    def __post_init__(self) -> None:
        # One vocabulary past parsing: whoever builds a layout from a name gets the enum.
        object.__setattr__(self, "mode", TPMode.parse(self.mode))

    @property
    def resolved_sequence_parallel(self) -> bool:
        """megatron's sequence parallelism, resolved as ``parallel.sequence_parallel`` is."""
        return resolve_sequence_parallel(self.mode, self.tp, self.sequence_parallel)[0]
