"""``FSDPStrategy``'s arguments and names, checked when it is built (no processes: the 2-rank runs are
``test_fsdp.py``), and ``Trainer.init_module``."""

from __future__ import annotations

import pytest
import torch

import ember
from ember.strategies import FSDPStrategy, get_strategy


def test_fsdp_is_registered_and_a_typo_is_pointed_at_it():
    assert isinstance(get_strategy("fsdp"), FSDPStrategy)
    with pytest.raises(ValueError, match="Did you mean 'fsdp'"):
        get_strategy("fdsp")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"sharding_strategy": "NO_SHARD"}, ValueError, "use strategy='ddp'"),
        ({"sharding_strategy": "full"}, ValueError, "not one fsdp offers"),
        ({"state_dict_type": "local"}, ValueError, "'sharded'.*'full'"),
        ({"device_mesh": (2, 2)}, ValueError, "hybrid strategies only"),
        ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": [1, 2]}, ValueError, "two positive ints"),
        ({"mixed_precision": torch.bfloat16}, TypeError, "MixedPrecisionPolicy"),
        ({"auto_wrap_policy": "Linear"}, TypeError, "set of torch.nn.Module classes"),
        ({"auto_wrap_policy": {torch.nn.Linear, int}}, TypeError, "torch.nn.Module classes"),
        ({"activation_checkpointing_policy": 3}, TypeError, "activation_checkpointing_policy"),
    ],
)
def test_a_wrong_argument_says_what_to_pass(kwargs, error, match):
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)


def test_sharding_strategy_takes_torchs_enum_and_policies_their_forms():
    from torch.distributed.fsdp import ShardingStrategy

    assert FSDPStrategy(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP).sharding_strategy == "SHARD_GRAD_OP"
    linear, relu = torch.nn.Linear(2, 2), torch.nn.ReLU()
    for policy in ({torch.nn.Linear}, [torch.nn.Linear], torch.nn.Linear, lambda m: isinstance(m, torch.nn.Linear)):
        rule = FSDPStrategy(auto_wrap_policy=policy).auto_wrap_policy
        assert rule(linear) and not rule(relu)
    big = FSDPStrategy(auto_wrap_policy=lambda module, recurse, numel: numel >= 6).auto_wrap_policy  # FSDP1's form
    assert big(linear) and not big(relu)


def test_a_sharded_save_refuses_a_background_write():
    from ember.checkpoint import BackgroundSave

    with pytest.raises(ValueError, match="storage_options=None"):
        FSDPStrategy().save_checkpoint({}, "x.ckpt", BackgroundSave())
    assert not FSDPStrategy().background_saves and FSDPStrategy(state_dict_type="full").background_saves


def test_init_module_creates_on_the_strategys_device_in_the_precisions_dtype():
    with ember.Trainer(precision="64-true", logger=False).init_module():
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.dtype == torch.float64 and torch.get_default_dtype() == torch.float32
    with ember.Trainer(strategy="fsdp", devices=1, logger=False).init_module(empty_init=True):
        meta = torch.nn.Linear(2, 2)
    assert meta.weight.is_meta
    with ember.Trainer(strategy="fsdp", devices=1, logger=False).init_module():
        plain = torch.nn.Linear(2, 2)
    assert plain.weight.device.type == "cpu" and not plain.weight.is_meta
