"""naive mode's one-rank decoder group (megatron_boost/model/specs.py, docs/design.md §2): each
rank creates only its own group, with one call per model build, instead of every rank creating
all world-size one-rank groups; a process whose process group is created again gets a new
one."""

from __future__ import annotations

from tests.rank_pool import distributed


def _group_calls(rank, world):
    import torch.distributed as dist

    from megatron_boost.model.specs import default_pg_collection, replicated_decoder_pgs
    from megatron_boost.train.step import initialize_parallel

    initialize_parallel(world, 1, None, 1)
    calls, new_group = [], dist.new_group

    def counting(ranks=None, *args, **kwargs):
        calls.append(list(ranks))
        return new_group(ranks, *args, **kwargs)

    dist.new_group = counting
    try:
        pgs = replicated_decoder_pgs(default_pg_collection())  # one model build
    finally:
        dist.new_group = new_group
    return {"calls": calls, "size": dist.get_world_size(pgs.tp),
            "members": dist.get_process_group_ranks(pgs.tp)}


def test_each_rank_creates_only_its_own_group():
    # twice in the same processes (the rank pool keeps them): the second job's process group
    # is a new one, and the group made for the first was destroyed with the first's
    for _ in range(2):
        for rank, out in enumerate(distributed(_group_calls, 2)):
            assert out["calls"] == [[rank]], out
            assert out["size"] == 1 and out["members"] == [rank]

