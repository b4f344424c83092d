"""Test harnesses shipped with the package: the layout-equivalence harness
(``verification.py``, also run by ``megatron-boost-verify-parallel`` and the GPU check), the
host-sync counter and CUDA sync recorder (``host_sync.py``), the GPU check's stages
(``gpu_stages.py``: their plans and shared pieces; ``gpu_training_stages.py``,
``gpu_layout_stages.py``, ``gpu_measure.py``) and the fault-tolerance tests' fault injection
(``faults.py``, installed through the trainer's callbacks). Nothing in the training path
imports from here (docs/design.md §13)."""
