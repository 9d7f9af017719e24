"""When a fit asks for its validation loader, and whose loaders the Trainer shows afterwards, as Lightning 2.6:
``val_dataloader()`` is called at the start of the first epoch that validates (or by the sanity check), a
sanity check's call counts as a load only when its epoch validates, and ``trainer.val_dataloaders`` /
``num_val_batches`` are those of the run, ``fit`` or ``validate``, that set them up last."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

import ember
from tests.helpers.models import BoringModel, TrainOnlyModel, fast_trainer, regression_loader


class Recorder(BoringModel):
    """Records each ``val_dataloader()`` call as ``(kind, epoch)``: ``"sanity"`` during the sanity check,
    else ``"val"``; and the epochs whose validation ran."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self.validated: list[int] = []

    def train_dataloader(self) -> DataLoader:
        return regression_loader(16)

    def val_dataloader(self) -> DataLoader:
        self.calls.append(("sanity" if self.trainer.sanity_checking else "val", self.current_epoch))
        return regression_loader(8)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.validated.append(self.current_epoch)


def _fit(module: Recorder, sanity: int, every: int | None, reload: int, epochs: int, **kwargs):
    trainer = fast_trainer(
        max_epochs=epochs,
        limit_train_batches=2,
        limit_val_batches=1,
        num_sanity_val_steps=sanity,
        check_val_every_n_epoch=every,
        reload_dataloaders_every_n_epochs=reload,
        **kwargs,
    )
    trainer.fit(module)
    return trainer


# (num_sanity_val_steps, check_val_every_n_epoch, reload_dataloaders_every_n_epochs, max_epochs) -> the calls,
# each checked against Lightning 2.6.6.
@pytest.mark.parametrize(
    ("sanity", "every", "reload", "epochs", "calls"),
    [
        # the first epoch that validates is 2: requested then, reloaded 4 or more epochs later (at 8, not 5)
        (0, 3, 4, 9, [("val", 2), ("val", 8)]),
        # the sanity check's load at epoch 0, which does not validate, does not count: epoch 2 loads again
        (1, 3, 4, 9, [("sanity", 0), ("val", 2), ("val", 8)]),
        (0, 2, 1, 8, [("val", 1), ("val", 3), ("val", 5), ("val", 7)]),
        # epoch 0 validates: the sanity check's load is its load, so the next is 2 epochs later
        (1, 1, 2, 9, [("sanity", 0), ("val", 2), ("val", 4), ("val", 6), ("val", 8)]),
        (0, 1, 0, 3, [("val", 0)]),
        # without reloading, the sanity check's loaders serve every validation
        (1, 3, 0, 7, [("sanity", 0)]),
    ],
)
def test_the_validation_loader_is_requested_when_its_first_epoch_validates(sanity, every, reload, epochs, calls):
    module = Recorder()
    _fit(module, sanity, every, reload, epochs)
    assert module.calls == calls
    assert module.validated == [e for e in range(epochs) if (e + 1) % every == 0]


def test_a_fit_whose_epochs_never_validate_never_requests_the_validation_loader():
    module = Recorder()
    trainer = _fit(module, 0, 3, 0, 2)
    assert module.calls == [] and module.validated == []
    assert trainer.val_dataloaders is None and trainer.num_val_batches == []


def test_the_validation_loader_arrives_at_the_start_of_the_first_epoch_that_validates():
    seen = []

    class M(Recorder):
        def on_train_start(self) -> None:
            seen.append(("start", self.trainer.val_dataloaders is None))

        def on_train_epoch_start(self) -> None:
            seen.append((self.current_epoch, list(self.trainer.num_val_batches)))

    _fit(M(), 0, 2, 0, 3)
    # ember requests it before on_train_epoch_start of epoch 1 (Lightning: when that epoch's validation starts)
    assert seen == [("start", True), (0, []), (1, [1]), (2, [1])]


def test_validation_counted_in_batches_across_epochs_requests_the_loader_at_the_start():
    module = Recorder()
    _fit(module, 0, None, 0, 2, val_check_interval=3)
    assert module.calls == [("val", 0)]
    assert module.validated == [1]  # after the 3rd batch, in epoch 1


def test_a_val_check_interval_beyond_the_epoch_is_refused_before_a_first_epoch_that_does_not_validate():
    module = Recorder()
    with pytest.raises(ValueError, match="val_check_interval=100 is larger than the 2 training batches"):
        _fit(module, 0, 2, 0, 2, val_check_interval=100)
    assert module.calls == []


def test_validation_data_without_a_validation_step_is_refused_before_training():
    started = []

    class M(TrainOnlyModel):
        def on_train_start(self) -> None:
            started.append(True)

    trainer = fast_trainer(max_epochs=3, check_val_every_n_epoch=3, num_sanity_val_steps=0)
    with pytest.raises(ValueError, match="defines no validation_step"):
        trainer.fit(M(), regression_loader(), regression_loader(8))
    assert started == []


# ---------------------------------------------------------------------- whose loaders the Trainer shows
def test_validate_after_fit_shows_its_own_loaders_and_batch_counts():
    fit_val, validate_val = regression_loader(16), regression_loader(24)
    module = BoringModel()
    trainer = fast_trainer(num_sanity_val_steps=0)
    trainer.fit(module, regression_loader(), fit_val)
    assert trainer.val_dataloaders is fit_val and trainer.num_val_batches == [2]

    trainer.validate(module, validate_val, verbose=False)
    assert trainer.val_dataloaders is validate_val and trainer.num_val_batches == [3]
    # a test or predict since does not change which validation ran last
    trainer.test(module, regression_loader(8), verbose=False)
    assert trainer.val_dataloaders is validate_val and trainer.num_val_batches == [3]
    assert trainer.num_test_batches == [1]
    trainer.predict(module, regression_loader(8))
    assert trainer.val_dataloaders is validate_val and trainer.num_val_batches == [3]

    # the next fit's validation loaders are shown from the time it requests them
    next_val = regression_loader(32)
    trainer = fast_trainer(max_epochs=2, num_sanity_val_steps=0)
    trainer.validate(module, validate_val, verbose=False)
    trainer.fit(module, regression_loader(), next_val)
    assert trainer.val_dataloaders is next_val and trainer.num_val_batches == [4]


def test_validate_with_no_batches_to_run_shows_none():
    module = BoringModel()
    trainer = fast_trainer(num_sanity_val_steps=0)
    trainer.fit(module, regression_loader(), regression_loader(16))
    trainer.limit_val_batches = 0
    trainer.validate(module, regression_loader(8), verbose=False)
    assert trainer.val_dataloaders is None and trainer.num_val_batches == []


def test_early_stopping_checks_after_validation_when_the_first_epoch_does_not_validate():
    # The val loaders are requested only at the first epoch that validates (as Lightning): EarlyStopping must
    # still check after validation, not at the end of epoch 0, whose metrics hold no val_loss.
    stopper = ember.callbacks.EarlyStopping(monitor="val_loss", patience=5)
    trainer = ember.Trainer(max_epochs=4, check_val_every_n_epoch=2, num_sanity_val_steps=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, callbacks=[stopper])  # fmt: skip
    trainer.fit(BoringModel(), regression_loader(), regression_loader())
    assert stopper._on_epoch_end is False and trainer.current_epoch == 4
