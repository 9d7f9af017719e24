"""Lightning's Trainer members ``accelerator``, ``precision_plugin`` and ``distributed_sampler_kwargs``, and the
module's ``device_mesh`` and deprecated ``configure_sharded_model`` hook."""

from __future__ import annotations

import warnings

import pytest
import torch

import ember
from ember.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator, accelerator_for
from tests.helpers.models import BoringModel, regression_loader


def quiet(**kwargs) -> ember.Trainer:
    args = dict(max_epochs=1, limit_train_batches=1, limit_val_batches=0, logger=False,
                enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    args.update(kwargs)
    return ember.Trainer(**args)


def test_accelerator_is_the_device_kind():
    t = quiet(accelerator="cpu")
    assert isinstance(t.accelerator, CPUAccelerator) and isinstance(t.accelerator, Accelerator)
    assert t.accelerator.is_available() and t.accelerator.auto_device_count() == 1
    assert t.accelerator.get_parallel_devices(2) == [torch.device("cpu")] * 2
    pytest.importorskip("psutil")
    assert set(t.accelerator.get_device_stats("cpu")) == {"cpu_vm_percent", "cpu_percent", "cpu_swap_percent"}
    with pytest.raises(ValueError, match="not a cpu device"):
        t.accelerator.setup_device(torch.device("meta"))
    assert CUDAAccelerator.is_available() == torch.cuda.is_available()
    assert CUDAAccelerator.get_parallel_devices([1, 3]) == [torch.device("cuda", 1), torch.device("cuda", 3)]
    with pytest.raises(ValueError, match="ember runs on 'cpu' and 'cuda'"):
        accelerator_for("tpu")


def test_precision_plugin_is_what_applies_precision():
    t = quiet(precision="bf16-mixed")
    plugin = t.precision_plugin
    assert plugin is t.fit_state.precision
    with plugin.autocast():
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    assert quiet().precision_plugin.scaler is None


def test_distributed_sampler_kwargs():
    assert quiet().distributed_sampler_kwargs is None
    assert quiet(strategy="dp", devices=2).distributed_sampler_kwargs is None  # one process reads all the data
    assert quiet(strategy="ddp", devices=2).distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert quiet(strategy="fsdp", devices=3).distributed_sampler_kwargs == {"num_replicas": 3, "rank": 0}


def test_device_mesh_is_none_without_a_sharding_strategy():
    module = BoringModel()
    assert module.device_mesh is None
    seen = []

    class Look(ember.Callback):
        def on_train_start(self, trainer, module):
            seen.append(module.device_mesh)

    quiet(callbacks=[Look()]).fit(module, regression_loader())
    assert seen == [None]


class Sharded(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def configure_sharded_model(self) -> None:
        self.calls.append("configure_sharded_model")


def test_configure_sharded_model_still_runs_with_a_deprecation_warning():
    module = Sharded()
    with pytest.warns(DeprecationWarning, match="Sharded.configure_sharded_model is deprecated") as caught:
        quiet().fit(module, regression_loader())
    assert module.calls == ["configure_sharded_model"]
    assert any(w.filename == __file__ for w in caught)  # points at the user's line


def test_configure_sharded_model_beside_configure_model_is_an_error():
    class Both(Sharded):
        def configure_model(self) -> None:
            self.calls.append("configure_model")

    module = Both()
    with pytest.raises(RuntimeError, match="overrides both configure_model and configure_sharded_model"):
        quiet().fit(module, regression_loader())
    assert module.calls == []


def test_a_module_without_the_old_hook_is_not_warned():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        quiet().fit(BoringModel(), regression_loader())


def test_epoch_limits_read_none_until_a_fit_sets_them_as_lightnings():
    from ember.exceptions import PossibleUserWarning

    t = ember.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, limit_train_batches=1,
                      limit_val_batches=0)  # fmt: skip
    assert (t.max_epochs, t.min_epochs) == (None, None)
    with pytest.warns(PossibleUserWarning, match="`max_epochs` was not set. Setting it to 1000 epochs") as caught:
        t.fit(BoringModel(), regression_loader())
    assert (t.max_epochs, t.min_epochs, t.current_epoch) == (1000, 0, 1000)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", PossibleUserWarning)  # a max_steps or a Timer ends the fit: no warning
        stepped = quiet(max_epochs=None, max_steps=2, min_steps=1)
        assert (stepped.max_epochs, stepped.min_epochs) == (None, None)
        stepped.fit(BoringModel(), regression_loader())
        assert (stepped.max_epochs, stepped.min_epochs, stepped.global_step) == (-1, 1, 2)
        timed = quiet(max_epochs=None, max_time={"seconds": 0.2}, limit_train_batches=None)
        timed.fit(BoringModel(), regression_loader())
        assert timed.max_epochs == -1
    given = quiet(max_epochs=3, min_epochs=2)
    assert (given.max_epochs, given.min_epochs) == (3, 2)


@pytest.mark.parametrize(("interval", "expected"), [(1.0, 8), (0.25, 2), (0.1, 1), (3, 3)])
def test_val_check_batch_is_the_training_batches_between_validations(interval, expected):
    seen = []

    class Look(ember.Callback):
        def on_train_start(self, trainer, module):
            seen.append(trainer.val_check_batch)

    t = quiet(val_check_interval=interval, limit_train_batches=None, limit_val_batches=1, callbacks=[Look()])
    assert t.val_check_batch is None  # as Lightning's, until a fit has its train loader
    t.fit(BoringModel(), regression_loader(n=64), regression_loader())  # 8 batches of 8
    assert seen == [expected] and t.val_check_batch == expected


def test_num_training_batches_is_infinite_until_a_fit_has_its_loader():
    t = quiet(limit_train_batches=3)
    assert t.num_training_batches == float("inf")  # as Lightning's, before any fit
    t.fit(BoringModel(), regression_loader())
    assert t.num_training_batches == 3
