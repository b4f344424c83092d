"""The megatron-core version differences (megatron_boost/compat.py, docs/design.md §15) and the
Transformer-Engine-safe parts that run on every version: the layer-spec accessor on both spec
shapes, the optimizer-reload workarounds touching torch's Adam only, model loading that accepts
only TE's unsaved ``_extra_state`` keys, the version range, and the environment report."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.fast, pytest.mark.compat]  # the tiers: docs/testing.md

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------
# layer specs: ModuleSpec (megatron-core <= 0.17) and functools.partial (0.18+) MLP slots
# ------------------------------------------------------------------------------------------


def _mlp_as_partial(spec):
    """The layer spec with its MLP slot in megatron 0.18's shape:
    ``functools.partial(<builder>, submodules=MLPSubmodules(...))``."""
    spec = copy.deepcopy(spec)
    mlp = spec.submodules.mlp
    if not isinstance(mlp, functools.partial):
        spec.submodules.mlp = functools.partial(mlp.module, submodules=mlp.submodules)
    return spec


def _mlp_as_module_spec(spec):
    """The layer spec with its MLP slot in megatron 0.16's shape: a ModuleSpec."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(spec)
    mlp = spec.submodules.mlp
    if isinstance(mlp, functools.partial):
        spec.submodules.mlp = ModuleSpec(module=mlp.func, submodules=mlp.keywords["submodules"])
    return spec


@pytest.mark.parametrize("shape", [_mlp_as_module_spec, _mlp_as_partial],
                         ids=["module_spec", "partial"])
def test_spec_accessor_reads_and_writes_both_mlp_shapes(shape):
    from megatron.core.transformer.mlp import MLPSubmodules

    from megatron_boost.compat import local_layer_spec, spec_submodules

    spec = shape(local_layer_spec())
    sub = spec_submodules(spec.submodules.mlp)
    assert isinstance(sub, MLPSubmodules)
    sub.linear_fc1 = "marker"  # the accessor hands out the spec's own object
    assert spec_submodules(spec.submodules.mlp).linear_fc1 == "marker"


@pytest.mark.parametrize("shape", [_mlp_as_module_spec, _mlp_as_partial],
                         ids=["module_spec", "partial"])
@pytest.mark.parametrize("mode", ["boost", "naive"])
def test_bottleneck_slots_fill_both_mlp_shapes(shape, mode):
    """The spec edits of both bottleneck modes on either MLP shape (before the fix, the
    partial shape raised AttributeError: 'functools.partial' object has no attribute
    'submodules')."""
    from megatron_boost.compat import local_layer_spec, spec_submodules
    from megatron_boost.model import specs
    from megatron_boost.parallel.layers import BoostLinearFC1, BoostLinearFC2, NaiveLinearFC1

    spec = shape(local_layer_spec())
    if mode == "boost":
        specs._boost_slots(spec)
        mlp = spec_submodules(spec.submodules.mlp)
        assert mlp.linear_fc1 is BoostLinearFC1 and mlp.linear_fc2 is BoostLinearFC2
    else:
        specs._naive_slots(spec, tp_group=None)
        mlp = spec_submodules(spec.submodules.mlp)
        assert mlp.linear_fc1.module is NaiveLinearFC1


# ------------------------------------------------------------------------------------------
# optimizer-reload workarounds: torch's Adam/AdamW only
# ------------------------------------------------------------------------------------------


class _FusedAdamLike(torch.optim.Optimizer):
    """Stands for TE's / apex's FusedAdam: not a torch Adam, step kept in the param groups,
    and (like TE's) a fixed set of state keys."""

    STATE_KEYS = ("exp_avg", "exp_avg_sq", "master_param")

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3, "step": 0})


class _MegatronOptimizerLike:
    """The two attributes the workarounds use of a megatron (Distributed)Optimizer."""

    def __init__(self, inner):
        self.optimizer = inner
        self.calls = []

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        self.calls.append(tensors)


def _params():
    return [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]


def test_reload_workarounds_leave_another_optimizer_untouched():
    from megatron_boost.train.megatron_fixes import finish_optimizer_load, prepare_optimizer_load

    inner = _FusedAdamLike(_params())
    opt = _MegatronOptimizerLike(inner)
    original_copy = opt._set_main_param_and_optimizer_states
    prepare_optimizer_load(opt, use_distributed_optimizer=True)
    finish_optimizer_load(opt)
    assert all(len(s) == 0 for s in inner.state.values()), dict(inner.state)
    assert opt._set_main_param_and_optimizer_states == original_copy  # not wrapped


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_reload_workarounds_prepare_torch_adam(cls):
    """The positive side: torch's Adam/AdamW get zero moments and a step of their own."""
    from megatron_boost.compat import optimizer_reload_defects
    from megatron_boost.train.megatron_fixes import finish_optimizer_load, prepare_optimizer_load

    params = _params()
    inner = cls(params)
    opt = _MegatronOptimizerLike(inner)
    prepare_optimizer_load(opt, use_distributed_optimizer=True)
    if "init_state" in optimizer_reload_defects():
        for p in params:
            state = inner.state[p]
            assert torch.equal(state["exp_avg"], torch.zeros_like(p))
            assert float(state["step"]) == 0.0
    if "shared_step" in optimizer_reload_defects():
        shared = torch.tensor(5.0)
        for p in params:
            inner.state[p]["step"] = shared
        finish_optimizer_load(opt)
        steps = [inner.state[p]["step"] for p in params]
        assert steps[0] is not steps[1] and all(float(s) == 5.0 for s in steps)


def test_reload_defects_per_version():
    from megatron_boost.compat import optimizer_reload_defects

    every = {"init_state", "step_on_copy", "shared_step"}
    for version in ("0.16.1", "0.17.1", "0.18.2", "0.19.2"):
        assert optimizer_reload_defects(version) == every, version


# ------------------------------------------------------------------------------------------
# loading a model state: TE's unsaved _extra_state keys only
# ------------------------------------------------------------------------------------------


class _WithExtraState(torch.nn.Module):
    """Like a TE module: ``state_dict()`` carries ``_extra_state`` (FP8 metadata), which
    megatron's sharded checkpoint does not save."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))

    def get_extra_state(self):
        return {"fp8_meta": 1}

    def set_extra_state(self, state):
        pass


def _model():
    model = torch.nn.Sequential(_WithExtraState(), torch.nn.Linear(2, 2))
    assert "0._extra_state" in model.state_dict()
    return model


def _saved_state(model) -> dict:
    """What a sharded checkpoint hands back: every tensor, no ``_extra_state``."""
    return {k: torch.full_like(v, 3.0) for k, v in model.state_dict().items()
            if not k.endswith("_extra_state")}


def test_loading_accepts_missing_extra_state():
    from megatron_boost.train.checkpointing import load_model_state

    model = _model()
    load_model_state(model, _saved_state(model))
    assert torch.equal(model[0].weight, torch.full((2,), 3.0))
    assert torch.equal(model[1].bias, torch.full((2,), 3.0))


def test_loading_rejects_any_other_missing_key():
    from megatron_boost.train.checkpointing import load_model_state

    model = _model()
    state = _saved_state(model)
    del state["1.weight"]
    with pytest.raises(RuntimeError, match=r"missing keys \['1\.weight'\]"):
        load_model_state(model, state)


def test_loading_through_megatrons_bf16_wrapper_checks_the_keys():
    """A bf16 chunk is megatron's Float16Module, whose load_state_dict delegates and returns
    nothing: the keys are checked on the module it wraps."""
    from megatron.core.transformer.module import Float16Module

    from megatron_boost.train.checkpointing import load_model_state

    model = _model()
    wrapped = Float16Module.__new__(Float16Module)  # only the wrapping matters here
    torch.nn.Module.__init__(wrapped)
    wrapped.module = model
    state = _saved_state(model)
    load_model_state(wrapped, state)
    assert torch.equal(model[0].weight, torch.full((2,), 3.0))
    del state["1.weight"]
    with pytest.raises(RuntimeError, match=r"missing keys \['1\.weight'\]"):
        load_model_state(wrapped, state)


def test_loading_rejects_an_unexpected_key():
    from megatron_boost.train.checkpointing import load_model_state

    model = _model()
    state = {**_saved_state(model), "2.weight": torch.zeros(2)}
    with pytest.raises(RuntimeError, match=r"unexpected keys \['2\.weight'\]"):
        load_model_state(model, state)


# ------------------------------------------------------------------------------------------
# version range, async-save strategy
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version,ok", [("0.16.0", True), ("0.16.1", True),
                                        ("0.19.2+5f0bb54", True), ("0.18.0rc1", True),
                                        ("0.15.2", False), ("0.20.0", False)])
def test_megatron_range(version, ok):
    from megatron_boost.compat import check_megatron_version, megatron_supported

    assert megatron_supported(version) is ok
    if ok:
        check_megatron_version(version)
    else:
        with pytest.raises(ValueError, match=rf"megatron-core {version} is outside the range "
                                             r"megatron-boost is tested with \(>=0\.16,<0\.20\)"):
            check_megatron_version(version)


def test_range_matches_pyproject_and_requirements():
    from megatron_boost.compat import SUPPORTED_MEGATRON

    assert f'"megatron-core{SUPPORTED_MEGATRON}"' in (ROOT / "pyproject.toml").read_text()
    assert f"megatron-core{SUPPORTED_MEGATRON}\n" in (ROOT / "requirements.txt").read_text()


@pytest.mark.parametrize("version,strategy", [("0.16.1", None), ("0.17.1", "mcore"),
                                              ("0.19.2", "mcore")])
def test_async_save_names_megatrons_own_strategy(monkeypatch, version, strategy):
    """0.17+ default to the nvrx strategy (nvidia-resiliency-ext), whose queue is not the one
    used here: megatron's own is named explicitly where the keyword exists."""
    import megatron.core
    from megatron.core import dist_checkpointing

    from megatron_boost import compat

    seen = {}
    monkeypatch.setattr(megatron.core, "__version__", version)
    monkeypatch.setattr(dist_checkpointing, "save", lambda sd, d, **kw: seen.update(kw))
    compat.save_sharded({}, "unused", async_save=True)
    assert seen.get("async_sharded_save") is True
    assert seen.get("async_strategy") == strategy


# ------------------------------------------------------------------------------------------
# python -m megatron_boost
# ------------------------------------------------------------------------------------------


def test_environment_report_runs():
    import megatron.core

    proc = subprocess.run([sys.executable, "-m", "megatron_boost"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for label in ("Python", "torch", "megatron-core", "Transformer Engine", "apex", "flash-attn",
                  "device (training.device: auto)", "attention (attention_backend: auto)",
                  "optimizer (get_megatron_optimizer)"):
        assert f"\n{label} " in "\n" + out, (label, out)
    assert f"{megatron.core.__version__} (in the tested range >=0.16,<0.20)" in out
    assert torch.__version__ in out


def test_environment_report_names_megatrons_optimizer_choice(monkeypatch):
    import megatron.core.optimizer as mopt

    from megatron_boost.cli import env

    class FusedAdam:
        pass

    FusedAdam.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"
    monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(mopt, "Adam", FusedAdam)
    assert env._optimizer_class() == ("transformer_engine.pytorch.optimizers.fused_adam."
                                      "test_environment_report_names_megatrons_optimizer_choice."
                                      "<locals>.FusedAdam (Transformer Engine)")
    monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", True)
    assert env._optimizer_class().startswith("torch.optim.AdamW")


def test_environment_report_fails_outside_the_range(monkeypatch, capsys):
    import megatron.core

    from megatron_boost.cli import env

    monkeypatch.setattr(megatron.core, "__version__", "0.20.0")
    assert env.main([]) == 1
    assert "0.20.0 (OUTSIDE the tested range >=0.16,<0.20)" in capsys.readouterr().out
