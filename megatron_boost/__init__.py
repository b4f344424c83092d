"""megatron-boost: CoLA low-rank bottleneck LLMs on megatron-core with BOOST's bottleneck-aware
tensor parallelism (docs/design.md)."""

from megatron_boost.runtime.lifetime import exit_with_parent

# In a process spawned by a rank (dist_checkpointing's helpers re-import the main module, which
# imports this package): die with the rank, even after a SIGKILL (runtime/lifetime.py).
exit_with_parent()
