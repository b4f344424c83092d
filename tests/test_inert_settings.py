"""Values the validation pass refuses because they would be accepted and do nothing (or harm)
without a word (config/inert_settings.py), and their neighbours that stay valid. In this
process, on configs/debug.yaml (boost, 32 positions). The one-line form of the same refusals
at a launch is in tests/test_bad_input.py's table."""

import dataclasses

import pytest

from megatron_boost.config.inert_settings import MUON_KEYS, _float_values
from megatron_boost.config.run import RunConfig, load_run_config
from tests.test_training import DEBUG

pytestmark = pytest.mark.fast


def _validate(*overrides, world_size=None):
    return load_run_config(DEBUG, list(overrides)).validate(world_size)


def _float_keys(section=None, prefix: str = "") -> list:
    """Every key annotated float or Optional[float], by the dataclasses' annotations (the rule
    itself walks the values; a null one has none)."""
    section = RunConfig() if section is None else section
    keys = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            keys += _float_keys(value, f"{prefix}{f.name}.")
        elif "float" in str(f.type):
            keys.append(f"{prefix}{f.name}")
    return keys


def test_the_walk_finds_the_float_keys_of_every_section():
    keys = _float_keys()
    assert "model.norm_epsilon" in keys and "training.exit_duration_minutes" in keys
    assert {k for k, _ in _float_values(RunConfig(), "")} <= set(keys)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", _float_keys())
def test_every_float_key_refuses_a_non_finite_value(key, value):
    with pytest.raises(ValueError, match=rf"^{key} \({value}\) must be a finite number"):
        _validate(f"{key}={value}")


def test_null_float_keys_set_to_a_finite_value_pass_the_finite_rule():
    _validate("logging.peak_tflops=312.5", "training.exit_duration_minutes=60")


def _non_default(key: str):
    default = getattr(RunConfig().optimizer, key)
    if isinstance(default, str):
        return {"muon_ns_coefficients": "tuned5", "muon_scale": "shape"}[key]
    if isinstance(default, bool):
        return not default
    return default + 1 if isinstance(default, int) else default / 2


@pytest.mark.parametrize("key", MUON_KEYS)
def test_a_muon_key_changed_with_adamw_is_refused(key):
    value = _non_default(key)
    override = f"optimizer.{key}={str(value).lower() if isinstance(value, bool) else value}"
    with pytest.raises(ValueError, match=rf"optimizer.{key} .* only used with optimizer.name: "
                                         rf"muon \(it is 'adamw'\)"):
        _validate(override)
    _validate(override, "optimizer.name=muon")  # with Muon it means something


def test_muon_keys_at_their_defaults_stay_accepted_with_adamw():
    defaults = RunConfig().optimizer
    spelled = [f"optimizer.{k}={str(getattr(defaults, k)).lower()}" for k in MUON_KEYS]
    _validate(*spelled)


def test_overlap_chunks_beyond_the_positions_are_refused():
    with pytest.raises(ValueError, match=r"bottleneck_overlap_chunks \(33\) exceeds the 32 "
                                         r"sequence positions .* at most 32"):
        _validate("parallel.bottleneck_overlap_chunks=33")


@pytest.mark.parametrize("chunks", [3, 32])
def test_overlap_chunks_up_to_the_positions_stay_accepted(chunks):
    """3 over 32 positions: uneven blocks (11, 10, 11), valid on purpose."""
    _validate(f"parallel.bottleneck_overlap_chunks={chunks}")


def test_overlap_chunks_bound_is_the_layers_sequence_under_pipeline_parallelism():
    """boost with pp > 1 hands megatron's schedule s/t positions (the p2p buffer), but the
    layers see all s: 32 chunks over 32 positions at TP=2, PP=2 stay valid, 33 do not."""
    layout = ("parallel.tp=2", "parallel.pp=2")
    _validate(*layout, "parallel.bottleneck_overlap_chunks=32", world_size=4)
    with pytest.raises(ValueError, match=r"\(33\) exceeds the 32"):
        _validate(*layout, "parallel.bottleneck_overlap_chunks=33", world_size=4)


def test_wandb_dir_naming_a_file_is_refused_before_anything_is_made(tmp_path):
    (tmp_path / "f").write_text("x")
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"logging.wandb.dir '.*/f' is a file, not a "
                                         r"directory"):
        _validate("logging.wandb.project=p", f"logging.wandb.dir={tmp_path / 'f'}",
                  f"logging.run_dir={run}", world_size=1)
    assert not run.exists()
