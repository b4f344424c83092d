"""The training position a checkpoint stores besides model, optimizer, scheduler and RNG."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """Where a run stands: completed optimizer steps and samples drawn from the global stream
    (the data position; :class:`~megatron_boost.train.sampler.ConsumedSamplesSampler`)."""

    iteration: int = 0
    consumed_samples: int = 0

    def advance(self, global_batch_size: int) -> None:
        """One optimizer step over one global batch."""
        self.iteration += 1
        self.consumed_samples += global_batch_size

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> "TrainState":
        return cls(iteration=int(state["iteration"]),
                   consumed_samples=int(state["consumed_samples"]))
