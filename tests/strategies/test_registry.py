"""The strategy registry: built-in names, clear errors, and third-party strategies registered by name."""

from __future__ import annotations

import pytest
import torch

from ember.strategies import (
    SingleDeviceStrategy,
    Strategy,
    available_strategies,
    get_strategy,
    register_strategy,
    registry,
)
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


@pytest.fixture
def clean_registry(monkeypatch):
    """Registrations made by a test disappear after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_builtin_names():
    assert {"single", "dp", "ddp", "ddp_spawn"} <= set(available_strategies())
    assert available_strategies() == sorted(available_strategies())


def test_get_single():
    s = get_strategy("single")
    assert isinstance(s, SingleDeviceStrategy) and s.strategy_name == "single"


def test_unknown_name_lists_the_registered_ones_and_suggests():
    with pytest.raises(ValueError) as info:
        get_strategy("ddp_spwan")
    msg = str(info.value)
    assert msg.startswith("Unknown strategy 'ddp_spwan'. Did you mean 'ddp_spawn'?")
    assert "Registered strategies: " + ", ".join(available_strategies()) in msg
    assert "ember.strategies.register_strategy(name, factory)" in msg


class Recording(SingleDeviceStrategy):
    """A third-party strategy: a single device that counts backward calls."""

    def __init__(self, tag: str = "none", **kwargs):
        super().__init__(**kwargs)
        self.tag = tag
        self.backwards = 0

    def backward(self, loss, backward=None):
        self.backwards += 1
        super().backward(loss, backward)


@pytest.mark.usefixtures("clean_registry")
def test_register_a_class_by_name_and_use_it_in_the_trainer():
    register_strategy("recording", Recording, "counts backward calls", tag="bound")
    assert "recording" in available_strategies()
    trainer = fast_trainer(strategy="recording")
    assert isinstance(trainer.strategy, Recording) and trainer.strategy.tag == "bound"
    assert trainer.strategy.strategy_name == "recording"
    trainer.fit(BoringModel(), regression_loader())
    assert trainer.strategy.backwards == 4


@pytest.mark.usefixtures("clean_registry")
def test_register_a_factory_function_and_a_module_path():
    register_strategy("fn", lambda tag="fn", **kw: Recording(tag=tag, **kw))
    register_strategy("path", "ember.strategies.single:SingleDeviceStrategy")
    assert get_strategy("fn").tag == "fn"
    assert type(get_strategy("path")) is SingleDeviceStrategy
    assert get_strategy("fn", tag="extra").tag == "extra"  # call-time arguments win over bound ones


@pytest.mark.usefixtures("clean_registry")
def test_registering_a_taken_name_needs_override():
    with pytest.raises(ValueError, match=r"A strategy named 'single' is already registered. Pass override=True"):
        register_strategy("single", Recording)
    register_strategy("single", Recording, override=True)
    assert isinstance(get_strategy("single"), Recording)


def test_suggestions_allow_one_slip_per_three_letters_a_swap_counting_one():
    known = ["ddp", "ddp_spawn", "dp", "single"]
    assert registry.suggestions("dpp", known) == ["ddp", "dp"]  # one substitution / one deletion
    assert registry.suggestions("pdd", known) == ["ddp"]  # one swap (Levenshtein: two)
    assert registry.suggestions("ddp_spwan", known) == ["ddp_spawn"]
    assert registry.suggestions("Single", known) == ["single"]
    assert registry.suggestions("zzzzzz", known) == []


@pytest.mark.usefixtures("clean_registry")
def test_registered_strategy_shows_up_in_suggestions():
    register_strategy("my_fancy_strategy", Recording)
    with pytest.raises(ValueError, match="Did you mean 'my_fancy_strategy'"):
        get_strategy("my_fancy_strateg")


def test_base_strategy_single_process_verbs_are_identities():
    s = Strategy()
    t = torch.tensor([1.0, 2.0])
    assert s.reduce(t, "sum") is t
    assert s.all_gather(t) is t  # as Lightning's single-device strategy: no leading world dimension
    assert s.gather_per_rank(t).tolist() == [[1.0, 2.0]]  # what the trainer's own bookkeeping gathers: by rank
    assert s.broadcast({"a": 1}) == {"a": 1}
    assert s.reduce_boolean_decision(True) is True
    assert (s.world_size, s.global_rank, s.local_rank, s.is_global_zero) == (1, 0, 0, True)
    assert s.root_device == torch.device("cpu")
    with s.no_backward_sync():
        pass
    with pytest.raises(ValueError, match=r"reduce op must be one of \('mean', 'sum', 'min', 'max'\), got 'avg'"):
        s.reduce(t, "avg")
    assert s.launch(lambda a, b=0: a + b, 1, b=2) == 3


@pytest.mark.parametrize(
    # Lightning 2.6.6 registers these names with these DDPStrategy arguments.
    "name, find_unused, start_method",
    [
        ("ddp_find_unused_parameters_true", True, "popen"),
        ("ddp_find_unused_parameters_false", False, "popen"),
        ("ddp_spawn_find_unused_parameters_true", True, "spawn"),
        ("ddp_spawn_find_unused_parameters_false", False, "spawn"),
    ],
)
def test_find_unused_parameters_names(name, find_unused, start_method):
    from ember.strategies.ddp import DDPStrategy

    assert name in available_strategies()
    strategy = get_strategy(name)
    assert type(strategy) is DDPStrategy and strategy.strategy_name == name
    assert strategy.ddp_kwargs["find_unused_parameters"] is find_unused
    assert strategy.start_method == start_method
    trainer = fast_trainer(strategy=name)
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy.ddp_kwargs["find_unused_parameters"] is find_unused
