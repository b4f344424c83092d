"""Data order by consumed samples: the batch sampler and the data-iterator builder."""

from __future__ import annotations

import sys
from typing import Optional

import torch
from megatron.core import parallel_state

__all__ = ["ConsumedSamplesSampler", "make_data_iterator"]


class ConsumedSamplesSampler:
    """Batch sampler in the spirit of megatron's ``MegatronPretrainingSampler``.

    The global sample stream is ``start, start+1, ...`` (indices of the already shuffled
    GPTDataset, modulo its length). It is consumed in micro-steps of ``micro_batch_size × dp``
    samples; data-parallel rank k takes the k-th ``micro_batch_size`` slice of each. So the
    global order does not depend on the layout, and resuming at ``consumed_samples`` continues
    exactly where the saved run stopped (for any DP size).
    """

    def __init__(self, dataset_len: int, start: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, stop: Optional[int] = None):
        if dataset_len <= 0:
            raise ValueError("the dataset is empty; check data.data_path / data.split")
        self.n, self.start, self.mbs = dataset_len, start, micro_batch_size
        self.dp_rank, self.dp_size, self.stop = dp_rank, dp_size, stop

    def __iter__(self):
        step = self.mbs * self.dp_size
        pos = self.start
        while self.stop is None or pos + step <= self.stop:
            first = pos + self.dp_rank * self.mbs
            yield [(first + i) % self.n for i in range(self.mbs)]
            pos += step

    def __len__(self):  # pragma: no cover - DataLoader only needs it for len()
        if self.stop is None:
            return sys.maxsize
        return max(0, (self.stop - self.start) // (self.mbs * self.dp_size))


def make_data_iterator(dataset, start: int, micro_batch_size: int, stop: Optional[int],
                       num_workers: int):
    """This data-parallel rank's micro-batches of ``dataset`` from global sample ``start``."""
    sampler = ConsumedSamplesSampler(
        len(dataset), start, micro_batch_size, parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(), stop)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                         num_workers=num_workers, pin_memory=False)
    return iter(loader)
