"""``groups_released`` (megatron_boost/train/distributed.py): the process groups a layout
made end with it, the caller's default group stays. Without it each layout's gloo groups stay
registered (and their threads running) until the process group ends: a rank of the test
suite that checks layout after layout (tests/test_parallel.py) gathers threads with each."""


def test_a_layouts_groups_end_with_it_and_the_default_group_stays():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found, use_cpu
    from megatron_boost.train.distributed import (_registered_groups, groups_released,
                                                  init_world_of_one, shutdown)
    from megatron_boost.train.step import initialize_parallel

    with cpu_mode_left_as_found():
        use_cpu(force=True)
        init_world_of_one()
        try:
            before = _registered_groups()
            for _ in range(2):  # one layout after another
                with groups_released():
                    initialize_parallel(1, 1, None, 1234)
                    made = _registered_groups() - before
                    assert made, "megatron's groups are registered while the layout runs"
                assert _registered_groups() == before, "the layout's groups were left"
                assert not parallel_state.model_parallel_is_initialized()
            assert dist.is_initialized()
            dist.barrier()  # the default group still works
        finally:
            shutdown()
