"""The resume contract (megatron_boost/config/resume_contract.py), in-process on run configs as a
checkpoint saves them (``dataclasses.asdict``); the refusal through the entry point is the
``checkpoint_tied_changed`` case of tests/test_bad_input.py."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_boost.config.resume_contract import (
    MAY_CHANGE, MODEL, OPTIMIZER_STATE, RESUME_CONTRACT, WEIGHTS, check_resume_contract,
    config_keys)
from megatron_boost.config.run import RunConfig

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

CKPT = "/runs/a/checkpoints/iter_0000010"


def _cfg(**changes) -> dict:
    """A run config as a checkpoint holds it, with ``changes`` ({"model.norm_epsilon": 1e-6})."""
    cfg = dataclasses.asdict(RunConfig())
    for dotted, value in changes.items():
        *path, key = dotted.split(".")
        node = cfg
        for part in path:
            node = node[part]
        assert key in node, dotted
        node[key] = value
    return cfg


def _refusal(saved: dict, current: dict, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        check_resume_contract(CKPT, saved, current, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_every_config_key_is_classified():
    keys = set(config_keys(RunConfig))
    assert keys - set(RESUME_CONTRACT) == set(), "keys the resume contract does not classify"
    assert set(RESUME_CONTRACT) - keys == set(), "the contract names keys the config lacks"
    for key, rule in RESUME_CONTRACT.items():
        assert rule.kind in (MAY_CHANGE, WEIGHTS, MODEL, OPTIMIZER_STATE) and rule.meaning, key


def test_tying_an_untied_run_is_refused_on_resume():
    message = _refusal(_cfg(), _cfg(**{"model.share_embeddings_and_output_weights": True}))
    for part in ("model.share_embeddings_and_output_weights=False", "sets True", CKPT,
                 "set model.share_embeddings_and_output_weights=False",
                 f"checkpoint.init_from={CKPT}", "output layer"):
        assert part in message, message


def test_another_norm_epsilon_is_refused_on_resume():
    message = _refusal(_cfg(), _cfg(**{"model.norm_epsilon": 1e-6}))
    assert "model.norm_epsilon=1e-05" in message and "sets 1e-06" in message, message


def test_a_new_run_from_the_weights_may_change_the_model_but_not_their_function():
    """checkpoint.init_from (weights only) takes the weights into another ε or tying, which
    the refusal offers as the fix, but not into another RoPE base."""
    check_resume_contract(CKPT, _cfg(), _cfg(**{"model.norm_epsilon": 1e-6,
                                                "model.share_embeddings_and_output_weights":
                                                True}), weights_only=True)
    message = _refusal(_cfg(), _cfg(**{"model.rotary_base": 500000}), weights_only=True)
    assert "model.rotary_base=10000" in message and "500000" in message, message


@pytest.mark.parametrize("changes", [
    {"parallel.tp": 2, "parallel.pp": 2, "parallel.vpp": 2, "parallel.dp": 1},
    {"parallel.bottleneck_overlap_chunks": 3},
    {"parallel.mode": "naive", "parallel.sequence_parallel": False},
    {"training.train_iters": 100, "optimizer.lr": 3e-4, "logging.run_dir": "elsewhere",
     "checkpoint.async_save": True},
], ids=["layout", "overlap_chunks", "boost_to_naive", "budget_schedule_logging"])
def test_valid_changes_are_accepted(changes):
    check_resume_contract(CKPT, _cfg(), _cfg(**changes))


def test_spellings_of_one_model_agree():
    """A derived value is compared, not the raw key: the default rank given explicitly, the
    head count as query groups."""
    saved = _cfg()
    current = _cfg(**{"model.attn_rank": 16, "model.mlp_rank": 16,
                      "model.num_query_groups": 4, "model.kv_channels": 16})
    check_resume_contract(CKPT, saved, current)
    assert "model.attn_rank" in _refusal(saved, _cfg(**{"model.attn_rank": 8}))


def test_full_rank_and_low_rank_are_other_models():
    message = _refusal(_cfg(), _cfg(**{"parallel.mode": "full"}), weights_only=True)
    assert "parallel.mode='boost'" in message and "'full'" in message, message


def test_another_optimizer_state_is_refused_unless_it_is_not_loaded():
    current = _cfg(**{"parallel.use_distributed_optimizer": True})
    message = _refusal(_cfg(), current)
    assert "checkpoint.no_load_optim=true" in message, message
    check_resume_contract(CKPT, _cfg(), current, load_optim=False)


def test_a_key_the_saved_config_lacks_counts_as_its_default():
    """A checkpoint written before a key existed: the key had its default's behaviour."""
    saved = _cfg()
    del saved["model"]["share_embeddings_and_output_weights"]
    check_resume_contract(CKPT, saved, _cfg())
    assert "share_embeddings" in _refusal(
        saved, _cfg(**{"model.share_embeddings_and_output_weights": True}))
