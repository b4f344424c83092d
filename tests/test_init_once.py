"""Weights are drawn once: megatron's per-layer init is off where the layout-independent init
(docs/design.md §8) overwrites every parameter, and nothing is left uninitialised.

For each mode at TP=2 (two gloo ranks), the model built the way the trainer builds it
(``build_run``, which draws through ``build_globally_initialised``: megatron's
``perform_initialization`` off, then ``init_global_weights``) must equal, bitwise, the model
``build_run`` builds when that one step is replaced by megatron's init on and then
``init_global_weights`` over it. A parameter the global init missed would keep uninitialised
memory on one side and megatron's draw on the other. megatron sets the TP attributes of its
layers' weights only in its init functions; they must be the same on both sides too (else the
gradient norm counts those weights on one TP rank). A parameter without a global checkpoint
key is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from tests.rank_pool import distributed

MODES = ("full", "naive", "boost")
SEED = 7


class _Unkeyed(torch.nn.Module):
    """A submodule whose parameter has no entry in sharded_state_dict."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(3))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}


def _built_chunks(overrides, megatron_init_first: bool = False):
    """This rank's model chunks of configs/debug.yaml with ``overrides`` at seed SEED, built
    through the one builder (``build_run``, no optimizer). ``megatron_init_first``: the
    reference: the builder's one initialising step (``build_globally_initialised``) replaced
    by the build with megatron's own init (``perform_initialization`` on) and
    ``init_global_weights`` over it."""
    import megatron_boost.train.build as build
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.config.run import load_run_config
    from megatron_boost.model.init import init_global_weights

    def megatron_init_then_global_init(build_chunks, config, seed):
        assert config.perform_initialization  # megatron draws its init first
        chunks = build_chunks()
        init_global_weights(chunks, seed, config)
        return chunks

    cfg = load_run_config("configs/debug.yaml", [*overrides, f"training.seed={SEED}"])
    run = resolve_run(cfg, "cpu", vocab_size=cfg.model.vocab_size)
    once = build.build_globally_initialised
    if megatron_init_first:
        build.build_globally_initialised = megatron_init_then_global_init
    try:
        built = build.build_run(run, training=False)
    finally:
        build.build_globally_initialised = once  # the rank pool's processes run on
    assert built.config.perform_initialization  # restored after the build
    return built.chunks


def _models(mode):
    overrides = [f"parallel.mode={mode}", "parallel.tp=2"]
    return _built_chunks(overrides, megatron_init_first=True), _built_chunks(overrides)


def _renamed_slots(chunk) -> None:
    """Rename every decoder layer's linear_proj, linear_fc2 and norms, and the final norm, in
    place (their checkpoint keys change with the names; the modules and their types do not)."""
    def rename(parent, old, new):
        parent._modules = {new if k == old else k: v for k, v in parent._modules.items()}

    for layer in chunk.decoder.layers:
        rename(layer.self_attention, "linear_proj", "out_renamed")
        rename(layer.mlp, "linear_fc2", "down_renamed")
        rename(layer, "input_layernorm", "before_attention")
        rename(layer, "pre_mlp_layernorm", "before_mlp")
    rename(chunk.decoder, "final_layernorm", "last_renamed")


def _init_stds(chunks, config):
    """{parameter: std} after the global init with SEED."""
    from megatron_boost.model.init import init_global_weights

    init_global_weights(chunks, SEED, config)
    return {id(p): p.detach().float().std().item() for p in chunks[0].parameters()}


def _rename_changes_no_std(mode) -> list:
    """Parameters whose init std changes when the output slots and the norms are renamed:
    none, since the std follows the holding module's type. Without CoLA's init (which ignores
    the slot), each std is megatron's, scaled by 1/sqrt(2L) = 1/2 for the output projections
    and B factors; 1/2 against 1 stands far outside the 25 % a draw of >= 256 values can
    stray. A norm's scale starts at ones (std 0): any draw moves it."""
    chunks = _built_chunks([f"parallel.mode={mode}", "parallel.tp=2", "model.cola_init=false"])
    config = chunks[0].config
    before = _init_stds(chunks, config)
    _renamed_slots(chunks[0])
    after = _init_stds(chunks, config)
    names = {id(p): n for n, p in chunks[0].named_parameters()}
    return [names[k] for k in before
            if abs(after[k] - before[k]) > 0.25 * max(before[k], 1e-12)]


def _tp_attributes(param):
    """megatron's TP attributes: the gradient norm counts a parameter without
    ``tensor_model_parallel`` on TP rank 0 only."""
    return tuple(getattr(param, a, None) for a in ("tensor_model_parallel", "partition_dim"))


def _worker(rank, world):
    from megatron_boost.model.init import init_global_weights
    from megatron_boost.train.step import initialize_parallel

    initialize_parallel(2, 1, None, seed=SEED)
    out = {}
    for mode in MODES:
        reference, once = _models(mode)
        ref = dict(reference[0].named_parameters())
        got = dict(once[0].named_parameters())
        assert ref.keys() == got.keys()
        out[mode] = {"n": len(ref), "differ": [k for k in ref if not torch.equal(ref[k], got[k])],
                     "attributes_differ": [k for k in ref if _tp_attributes(ref[k])
                                           != _tp_attributes(got[k])]}
    out["renamed"] = {mode: _rename_changes_no_std(mode) for mode in MODES}
    # a parameter with no global checkpoint key cannot be initialised: refused by name
    once[0].unkeyed = _Unkeyed()
    try:
        init_global_weights(once, SEED, once[0].config)
        out["unkeyed"] = None
    except RuntimeError as err:
        out["unkeyed"] = str(err)
    return out


@pytest.fixture(scope="module")
def results():
    return distributed(_worker, 2)


@pytest.mark.parametrize("mode", MODES)
def test_weights_drawn_once_equal_megatron_init_then_global_init(results, mode):
    for r in results:
        assert r[mode]["n"] > 0 and r[mode]["differ"] == [], r[mode]
        assert r[mode]["attributes_differ"] == [], r[mode]


def test_parameter_without_global_key_is_refused(results):
    for r in results:
        assert r["unkeyed"] is not None and "unkeyed" in r["unkeyed"], r["unkeyed"]


@pytest.mark.parametrize("mode", MODES)
def test_renaming_a_submodule_changes_no_init_std(results, mode):
    """The scaled output init and the norms' ones follow the type of the module holding a
    parameter, not its name in the checkpoint key (model/init.py ``uses_output_init``,
    ``starts_at_one``)."""
    for r in results:
        assert r["renamed"][mode] == [], r["renamed"][mode]
