"""Test helpers: gloo workers on localhost (see megatron_boost.spawn)."""

from megatron_boost.spawn import free_port, run_distributed  # noqa: F401
