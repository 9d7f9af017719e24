"""DataModule: its hooks, the order the Trainer calls them in, and its defaults."""

from __future__ import annotations

import pytest

import ember
from tests.helpers.models import BoringModel, RecordingCallback, fast_trainer, regression_loader


class DM(ember.DataModule):
    def __init__(self, calls: list[str], with_val: bool = True) -> None:
        super().__init__()
        self.calls = calls
        self.with_val = with_val

    def prepare_data(self):
        self.calls.append("DataModule.prepare_data")

    def setup(self, stage):
        self.calls.append(f"DataModule.setup:{stage}")

    def teardown(self, stage):
        self.calls.append(f"DataModule.teardown:{stage}")

    def train_dataloader(self):
        self.calls.append("DataModule.train_dataloader")
        return regression_loader()

    def val_dataloader(self):
        self.calls.append("DataModule.val_dataloader")
        return regression_loader(n=8) if self.with_val else None

    def test_dataloader(self):
        self.calls.append("DataModule.test_dataloader")
        return regression_loader(n=8)

    def predict_dataloader(self):
        self.calls.append("DataModule.predict_dataloader")
        return regression_loader(n=8)


def test_fit_with_a_datamodule_calls_its_hooks_in_order():
    calls: list[str] = []
    dm = DM(calls)
    trainer = fast_trainer(callbacks=[RecordingCallback(calls)], num_sanity_val_steps=0)
    trainer.fit(BoringModel(), datamodule=dm)
    # As Lightning: the loaders are requested after on_fit_start (train first without a sanity check).
    assert calls[:6] == [
        "DataModule.prepare_data",
        "DataModule.setup:fit",
        "Callback.setup:fit",
        "Callback.on_fit_start",
        "DataModule.train_dataloader",
        "DataModule.val_dataloader",
    ]
    assert calls.count("DataModule.val_dataloader") == 1
    # As Lightning 2.6.6: the datamodule is torn down first, then the callbacks (the reverse of setup).
    assert calls[-2:] == ["DataModule.teardown:fit", "Callback.teardown:fit"]
    assert dm.trainer is trainer and trainer.datamodule is dm
    assert trainer.global_step == 4 and "val_loss" in trainer.callback_metrics


def test_datamodule_without_validation_data_skips_validation():
    class TrainOnly(DM):
        val_dataloader = ember.DataModule.val_dataloader  # not defined: DataModule's default

    calls: list[str] = []
    trainer = fast_trainer()
    trainer.fit(BoringModel(), datamodule=TrainOnly(calls))
    assert "val_loss" not in trainer.callback_metrics and trainer.global_step == 4
    assert "DataModule.val_dataloader" not in calls


def test_a_datamodules_val_dataloader_returning_none_is_refused():
    # Lightning 2.6.6: TypeError "An invalid dataloader was returned from `DM.val_dataloader()`. Found None."
    with pytest.raises(TypeError, match=r"DM.val_dataloader\(\) returned None; it must return a DataLoader"):
        fast_trainer().fit(BoringModel(), datamodule=DM([], with_val=False))


@pytest.mark.parametrize(
    "entry,stage,loader",
    [
        ("validate", "validate", "val_dataloader"),
        ("test", "test", "test_dataloader"),
        ("predict", "predict", "predict_dataloader"),
    ],
)
def test_eval_entry_points_with_a_datamodule(entry, stage, loader):
    calls: list[str] = []
    out = getattr(fast_trainer(), entry)(BoringModel(), datamodule=DM(calls))
    assert calls == [
        "DataModule.prepare_data",
        f"DataModule.setup:{stage}",
        f"DataModule.{loader}",
        f"DataModule.teardown:{stage}",
    ]
    assert len(out) == 1


def test_datamodule_defaults():
    dm = ember.DataModule()
    assert dm.trainer is None and dm.val_dataloader() is None and dm.state_dict() == {}
    dm.prepare_data(), dm.setup("fit"), dm.teardown("fit"), dm.load_state_dict({})
    for name, verb in (("train_dataloader", "fit"), ("test_dataloader", "test"), ("predict_dataloader", "predict")):
        with pytest.raises(NotImplementedError, match=rf"DataModule defines no {name}\(\); define it to {verb}"):
            getattr(dm, name)()


def test_fit_with_an_empty_datamodule_explains():
    with pytest.raises(NotImplementedError, match=r"DataModule defines no train_dataloader\(\); define it to fit"):
        fast_trainer().fit(BoringModel(), datamodule=ember.DataModule())


def test_a_datamodule_passed_in_the_dataloaders_position():
    # Lightning accepts trainer.fit(model, dm) and trainer.test(model, dm); so does ember.
    calls: list[str] = []
    dm = DM(calls)
    trainer = fast_trainer(num_sanity_val_steps=0)
    trainer.fit(BoringModel(), dm)
    assert trainer.datamodule is dm and trainer.global_step == 4 and "val_loss" in trainer.callback_metrics
    assert trainer.validate(BoringModel(), dm)[0].keys() == {"val_loss"}
    assert trainer.test(BoringModel(), dm)[0].keys() == {"test_loss"}
    assert len(trainer.predict(BoringModel(), dm)) == 1


def test_a_failing_fit_calls_the_datamodules_on_exception_after_the_callbacks():
    """As Lightning 2.6.6: on an exception, the callbacks' on_exception, then the datamodule's."""
    calls: list[str] = []

    class Fails(BoringModel):
        def training_step(self, batch, batch_idx):
            raise KeyError("boom")

    class Watching(DM):
        def on_exception(self, exception):
            calls.append(f"DataModule.on_exception:{type(exception).__name__}")

    class CallbackWatching(RecordingCallback):
        def on_exception(self, trainer, module, exception):
            calls.append("Callback.on_exception")

    with pytest.raises(KeyError, match="boom"):
        trainer = fast_trainer(callbacks=[CallbackWatching(calls)], num_sanity_val_steps=0)
        trainer.fit(Fails(), datamodule=Watching(calls))
    exceptions = [c for c in calls if "on_exception" in c]
    assert exceptions == ["Callback.on_exception", "DataModule.on_exception:KeyError"]


def test_datamodule_name_is_a_class_attribute_none_by_default():
    """As Lightning's ``LightningDataModule.name``: None unless a subclass (or an instance) sets it."""

    class Named(ember.DataModule):
        name = "mnist"

    assert ember.DataModule.name is None and ember.DataModule().name is None
    assert Named.name == "mnist" and Named().name == "mnist"
    dm = ember.DataModule()
    dm.name = "mine"
    assert dm.name == "mine" and ember.DataModule().name is None
