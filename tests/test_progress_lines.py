"""The ``done:`` line of a launch (train/metrics.py's ``Progress.done_line``): a fresh run
reports its iterations, tokens and time; a resumed launch its own, with the run's totals apart
(tests/test_training.py checks it on a real resume)."""

from __future__ import annotations

import pytest

from megatron_boost.train.metrics import Progress


@pytest.mark.fast
def test_done_line_of_a_fresh_run_is_the_run():
    progress = Progress(start_s=10.0, start_iteration=0, start_tokens=0, train_iters=200)
    line = progress.done_line(now=70.0, launch_s=75.5, iteration=200, tokens=409_600)
    assert line == "done: 200 iterations, 409,600 tokens in 75.5s (1m16s, training loop 1m00s)"


@pytest.mark.fast
def test_done_line_of_a_resumed_launch_counts_this_launch():
    progress = Progress(start_s=10.0, start_iteration=134, start_tokens=274_432,
                        train_iters=200)
    line = progress.done_line(now=70.0, launch_s=75.5, iteration=200, tokens=409_600)
    assert line == ("done: 66 iterations this launch (134 -> 200), 135,168 tokens in 75.5s "
                    "(1m16s, training loop 1m00s); run total 200 iterations, 409,600 tokens")
