"""Every difference between the megatron-core versions megatron-boost supports, in one place
(docs/design.md §15). Nothing else in the package looks at megatron's version.

Supported and tested: megatron-core :data:`SUPPORTED_MEGATRON` (0.16.1 on Python 3.11 and
0.19.2 on Python 3.12 in CI; 0.17 and later need Python >= 3.12). What differs, and how it
is handled here:

* layer specs (0.18): ``spec.submodules.mlp`` became ``functools.partial(MLP.as_mlp_submodule,
  submodules=...)``; :func:`spec_submodules` reads either shape (megatron's own
  ``get_submodules``, 0.17+).
* ``get_gpt_layer_local_spec`` (0.17 dropped ``moe_use_legacy_grouped_gemm``),
  ``linear_with_grad_accumulation_and_async_allreduce`` (0.17 dropped ``async_grad_allreduce``,
  0.19 added ``gtp_remat_size``), ``get_forward_backward_func`` (0.19 added
  ``schedule_pg_collection``), ``dist_checkpointing.load`` (0.19 dropped ``common_strategy``):
  called here with the keywords every supported version shares, and nowhere else.
* the null tokenizer of mock data (0.17): its ``library`` is ``null-text``, no longer ``null``
  (:func:`null_tokenizer`).
* async checkpoint save (0.17): ``dist_checkpointing.save(..., async_sharded_save=True)``
  defaults to the ``nvrx`` strategy (needs nvidia-resiliency-ext). :func:`save_sharded` names
  megatron's own ``mcore`` strategy and :func:`async_calls_queue` returns its matching queue.
* the distributed-optimizer reload defects (docs/design.md §10.5): which versions have which
  (:func:`optimizer_reload_defects`).
* ``BlendedDataset`` with a cache path calls ``torch.distributed.get_rank()`` without checking
  for a process group before 0.19 (0.16 seen; 0.19 checks): :func:`rank_zero_without_process_group`.
* megatron's parameter groups (``_get_param_groups``, what its own Muon builds on): 0.19 no
  longer fills in the standard weight-decay overrides when none are passed; the 2-D weights
  Muon takes get weight decay either way (:func:`optimizer_param_groups`).
* per-layer CUDA graphs: ``cuda_graph_impl`` is the same field, but what a layer's graph
  captures is ``cuda_graph_scope`` up to 0.18 and ``cuda_graph_modules`` in 0.19 (the old name
  deprecated): :func:`cuda_graph_fields`.

megatron knowledge that is the same in every supported version, kept here with why:

* CPU mode (runtime/cpu_mode.py, docs/design.md §9) replaces megatron's own CUDA-only
  functions, by module attribute (0.16 to 0.19 alike): the tensor-parallel RNG state calls
  (:func:`megatron_cuda_functions`).
  With the distributed-optimizer reload workarounds (train/megatron_fixes.py, gated by
  :func:`optimizer_reload_defects`), these are every megatron attribute megatron-boost
  replaces for a run; the collective recorder (measure/collectives.py) only wraps, without
  changing them, megatron's gather/scatter functions while a measurement runs.

megatron-core's (and torch's) known notices on this stack: "Transformer Engine and Apex are
not installed" and the like, printed at import by every process that imports megatron (four
lines for one tokenizer load) though nothing is wrong. :func:`quiet_known_warnings` filters
exactly these messages (:data:`KNOWN_WARNINGS`); every entry point runs it first, as
``megatron_boost/cli/__init__.py`` does (importing this module does not import megatron, so it
runs before megatron is imported).

Differences that need no branch, because one call serves every version: the checkpoint's
common state moved from ``common.pt`` into the torch_dist shards in 0.17 (megatron's
``load_common_state_dict`` reads both; train/checkpoint_guard.py), and 0.19's vocab-parallel
loss reads ``LanguageModule.tp_group`` (naive mode sets it with ``pg_collection``;
model/gpt.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import warnings
from typing import FrozenSet, Optional, Tuple

from packaging.version import Version

__all__ = ["SUPPORTED_MEGATRON", "megatron_version", "megatron_supported",
           "check_megatron_version", "spec_submodules", "with_module_class",
           "custom_mlp_slot",
           "local_layer_spec", "te_layer_spec",
           "linear_with_dgrad_allreduce", "forward_backward_func", "save_sharded",
           "load_sharded", "async_calls_queue", "ASYNC_SAVE_STRATEGY",
           "optimizer_reload_defects", "null_tokenizer", "rank_zero_without_process_group",
           "optimizer_param_groups", "megatron_cuda_functions", "KNOWN_WARNINGS",
           "quiet_known_warnings", "cuda_graph_fields"]

#: Notices megatron-core 0.16-0.19 and torch print on this stack that say nothing is wrong:
#: the CPU / no-TE fallbacks megatron takes by design here, and the deprecations of APIs that
#: megatron itself still calls (megatron_boost calls none of them).
KNOWN_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                  "full scope is deprecated",
                  "The .grad attribute of a Tensor that is not a leaf",
                  "`torch.distributed.all_gather_into_tensor` is deprecated",
                  "`torch.distributed.reduce_scatter_tensor` is deprecated",
                  "`load_state_dict` is deprecated", "Please use DTensor instead")


def quiet_known_warnings() -> None:
    """Filter :data:`KNOWN_WARNINGS` in this process (any other warning still prints)."""
    for message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


#: The megatron-core versions megatron-boost is tested with (pyproject.toml says the same).
SUPPORTED_MEGATRON = ">=0.16,<0.20"
_LOWEST, _END = (0, 16), (0, 20)

#: megatron's own async-save strategy; the other one, ``nvrx`` (0.17+ default), needs
#: nvidia-resiliency-ext and its own queue. ``mcore`` works on every supported version (0.17+
#: log a deprecation notice once).
ASYNC_SAVE_STRATEGY = "mcore"


def megatron_version(version: Optional[str] = None) -> Tuple[int, int, int]:
    """(major, minor, patch) of megatron-core (or of ``version``). A source checkout appends
    ``+<git hash>`` to ``megatron.core.__version__``; pre-release tags are ignored too."""
    import megatron.core  # here, not at the top: quiet_known_warnings runs before megatron

    release = Version(version or megatron.core.__version__).release
    return tuple((list(release) + [0, 0, 0])[:3])


def megatron_supported(version: Optional[str] = None) -> bool:
    """Whether megatron-core (or ``version``) is inside :data:`SUPPORTED_MEGATRON`."""
    return _LOWEST <= megatron_version(version)[:2] < _END


def check_megatron_version(version: Optional[str] = None) -> None:
    """Stop (``ValueError``, one line) on a megatron-core outside the tested range. Called
    before any distributed work (train/distributed.py)."""
    if not megatron_supported(version):
        import megatron.core

        found = version or megatron.core.__version__
        raise ValueError(
            f"megatron-core {found} is outside the range megatron-boost is tested with "
            f"({SUPPORTED_MEGATRON}); install one inside it: "
            f"pip install 'megatron-core{SUPPORTED_MEGATRON}'")


def _since(minor: int) -> bool:
    return megatron_version()[:2] >= (0, minor)


# --------------------------------------------------------------------------------------------
# layer specs
# --------------------------------------------------------------------------------------------


def _get_submodules_fallback(spec):
    """megatron 0.16 has no accessor; its specs are always ModuleSpecs. The partial shape is
    read too, so that the same code (and its test) covers both shapes on every version."""
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    return spec.submodules


def spec_submodules(spec):
    """The ``submodules`` of a layer-spec slot: a ModuleSpec's field or, from megatron 0.18
    on, the ``submodules=`` keyword of a ``functools.partial`` (``MLP.as_mlp_submodule``).
    The object returned is the spec's own: changing it changes the spec."""
    try:  # megatron 0.17+
        from megatron.core.transformer.spec_utils import get_submodules
    except ImportError:
        get_submodules = _get_submodules_fallback
    return get_submodules(spec)


def with_module_class(spec, cls):
    """A ModuleSpec slot building ``cls`` (a subclass of its module) instead; its params and
    submodules are kept."""
    spec = copy.copy(spec)
    spec.module = cls
    return spec


@dataclasses.dataclass
class _MLPSlot:
    """An MLP slot that megatron's ``build_module`` builds from its fields as from a
    ModuleSpec (it reads ``module``, ``params``, ``submodules``), but that is not one."""

    module: type
    params: dict
    submodules: object


def custom_mlp_slot(spec, cls, tp_group):
    """The MLP slot ``spec`` building ``cls``, a subclass of megatron's MLP, with the TP group
    megatron hands its own MLP.

    From megatron 0.18 the slot is ``functools.partial(MLP.as_mlp_submodule, submodules=...)``,
    which passes the layer's TP group to any class: ``cls.as_mlp_submodule`` takes its place.
    Before (0.16, 0.17) it is a ModuleSpec, and ``TransformerLayer`` passes ``tp_group`` only
    when the spec's module IS megatron's MLP (an identity test), warning "Unknown MLP type" for
    any other ModuleSpec; so the slot becomes a plain object with the same three fields
    (:class:`_MLPSlot`), ``tp_group`` among its params, which the layer hands to
    ``build_module`` without either."""
    if isinstance(spec, functools.partial):
        return functools.partial(cls.as_mlp_submodule, *spec.args, **spec.keywords)
    return _MLPSlot(module=cls, params={**(spec.params or {}), "tp_group": tp_group},
                    submodules=spec.submodules)


def local_layer_spec(normalization: str = "RMSNorm"):
    """megatron's local-module GPT layer spec (keywords only: 0.17 removed a positional
    parameter, ``moe_use_legacy_grouped_gemm``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(normalization=normalization)


def te_layer_spec():
    """megatron's Transformer Engine GPT layer spec (defaults on every version)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec()


# --------------------------------------------------------------------------------------------
# tensor-parallel linear and pipeline schedule
# --------------------------------------------------------------------------------------------


def linear_with_dgrad_allreduce(x, weight, tp_group, allreduce_dgrad: bool):
    """``x · weight^T`` with the input-gradient all-reduce over ``tp_group`` overlapped with the
    weight-gradient GEMM: megatron's ``linear_with_grad_accumulation_and_async_allreduce``,
    with only the keywords every supported version has (0.17 dropped
    ``async_grad_allreduce``; 0.19 added ``gtp_remat_size``, default 1)."""
    from megatron.core.tensor_parallel.layers import (
        linear_with_grad_accumulation_and_async_allreduce,
    )

    return linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=False, allreduce_dgrad=allreduce_dgrad,
        sequence_parallel=False, tp_group=tp_group)


def forward_backward_func():
    """megatron's pipeline schedule for the current parallel_state (no arguments: 0.19 added
    ``schedule_pg_collection``, for multi-module pipelines)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


def null_tokenizer(vocab_size: int):
    """megatron's null tokenizer (ids only; its last id, ``vocab_size``, is EOD). 0.17 renamed
    its library from ``null`` to ``null-text``."""
    from megatron.core.tokenizers import MegatronTokenizer

    library = "null-text" if _since(17) else "null"
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": library, "model_type": "gpt"}, vocab_size=vocab_size)


# --------------------------------------------------------------------------------------------
# dist_checkpointing
# --------------------------------------------------------------------------------------------


def save_sharded(sharded_sd: dict, directory: str, async_save: bool):
    """``dist_checkpointing.save``; with ``async_save`` the shards are staged and megatron's
    ``AsyncRequest`` is returned, to be scheduled on :func:`async_calls_queue`. 0.17+ take an
    ``async_strategy`` whose default, ``nvrx``, needs nvidia-resiliency-ext: name megatron's
    own, which matches the queue."""
    from megatron.core import dist_checkpointing

    if not async_save:
        return dist_checkpointing.save(sharded_sd, directory)
    strategy = {"async_strategy": ASYNC_SAVE_STRATEGY} if _since(17) else {}
    return dist_checkpointing.save(sharded_sd, directory, async_sharded_save=True, **strategy)


def async_calls_queue():
    """The queue that runs and finalizes :func:`save_sharded`'s requests: megatron's
    ``AsyncCallsQueue``, the one of the ``mcore`` strategy (the ``nvrx`` strategy has its own
    in nvidia_resiliency_ext)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    return AsyncCallsQueue()


def load_sharded(sharded_sd: dict, directory: str) -> dict:
    """``dist_checkpointing.load`` with default strategies (0.19 dropped ``common_strategy``
    and added ``verify_integrity`` / ``process_group``: none is passed)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(sharded_sd, directory)


# --------------------------------------------------------------------------------------------
# distributed-optimizer reload (docs/design.md §10.5)
# --------------------------------------------------------------------------------------------

#: The reload defects of megatron's DistributedOptimizer (``fully_reshardable``, torch Adam)
#: and the megatron-core versions [first, end) that have them. Verified by resuming bit-exactly
#: (tests/test_training.py::test_resume_reproduces_uninterrupted_run_exactly) with each
#: workaround removed in turn, on 0.16.1 and 0.19.2 (and 0.18.2): every removal fails.
#:   init_state:   without optimizer state (and its ``step``) before
#:                 ``sharded_state_dict(is_loading=True)``, megatron's load fails
#:                 (``assert len(steps) == 1`` on 0.19.2)
#:   step_on_copy: ``KeyError: 'step'`` when the loaded tensors are copied into the state
#:   shared_step:  one ``step`` tensor shared by every parameter after the load: the losses
#:                 after the resume differ from the uninterrupted run's
_DEFECTS = {
    "init_state": ((0, 16), (0, 20)),
    "step_on_copy": ((0, 16), (0, 20)),
    "shared_step": ((0, 16), (0, 20)),
}


def optimizer_reload_defects(version: Optional[str] = None) -> FrozenSet[str]:
    """The reload defects (see ``_DEFECTS``) megatron-core (or ``version``) has."""
    release = megatron_version(version)[:2]
    return frozenset(name for name, (first, end) in _DEFECTS.items() if first <= release < end)


@contextlib.contextmanager
def rank_zero_without_process_group():
    """Let megatron-core call ``torch.distributed.get_rank()`` in a single process.

    Before 0.19 ``BlendedDataset`` calls ``get_rank()`` whenever a cache path is set, which
    raises when no process group is initialized (0.19 checks ``is_initialized`` first). A
    single process is rank 0, so that is the answer while the block runs; with a process group,
    or from 0.19 on, nothing is changed (tests/test_data.py builds a cached blend without a
    process group)."""
    import torch

    if _since(19) or torch.distributed.is_initialized():
        yield
        return
    original = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        torch.distributed.get_rank = original


# --------------------------------------------------------------------------------------------
# optimizer parameter groups (train/muon.py)
# --------------------------------------------------------------------------------------------


def optimizer_param_groups(model_chunks, config) -> list:
    """megatron's parameter groups of the chunks' trainable parameters (``lr``/``wd`` multipliers,
    ``max_lr``, ``min_lr``: what the learning-rate scheduler reads), as its own Muon builds
    them. Private in every supported version, with the same signature."""
    from megatron.core.optimizer import _get_param_groups

    return _get_param_groups(model_chunks, config, None)


def megatron_cuda_functions():
    """megatron's own functions that assume CUDA, looked up by module attribute at call time,
    that CPU mode replaces (runtime/cpu_mode.py): ``(module, attribute, role)`` where ``role``
    names the CPU replacement (``get_rng_state``, ``set_rng_state``). The same in megatron-core
    0.16 to 0.19; each is still needed because megatron calls it on ``torch.cuda`` with no
    device argument or hook, which CPU mode's function mode cannot map (tests/test_cpu_mode.py
    fails without each).

    * ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: the RNG
      tracker's ``add`` and ``fork`` and megatron's activation checkpoint.

    megatron's causal-mask helper (``get_default_causal_mask``, ``device="cuda"``) needs no
    replacement: CPU mode runs every backward pass inside its function mode (the recomputes
    included), so the mode maps that allocation like any other."""
    import megatron.core.tensor_parallel.random as mrandom

    return ((mrandom, "_get_cuda_rng_state", "get_rng_state"),
            (mrandom, "_set_cuda_rng_state", "set_rng_state"))


def cuda_graph_fields(impl: str, scope: str) -> dict:
    """megatron's TransformerConfig keywords of ``training.cuda_graph_impl`` and
    ``training.cuda_graph_scope``: the scope goes to ``cuda_graph_modules`` where megatron has
    that field (0.19), else to ``cuda_graph_scope``; by field, not version, so the deprecated
    name is never passed where the new one exists."""
    from megatron.core.transformer import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    scope_field = "cuda_graph_modules" if "cuda_graph_modules" in names else "cuda_graph_scope"
    return {"cuda_graph_impl": impl, scope_field: scope}
