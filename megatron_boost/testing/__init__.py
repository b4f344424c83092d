"""Test harnesses shipped with the package: the layout-equivalence harness
(``verification.py``, also run by ``megatron-boost-verify-parallel``) and the host-sync counter
(``host_sync.py``). Nothing in the training path imports from here (docs/design.md §13)."""
