"""What the Trainer says is running (``training``, ``validating``, ``testing``, ``predicting``, ``evaluating``,
``sanity_checking``) at every hook of fit / validate / test / predict, and its device and run properties: the
expected table was recorded from PyTorch Lightning 2.6.6 running the same hooks."""

from __future__ import annotations

import signal

import pytest

import ember
from ember.trainer.preemption import Preempted
from tests.helpers.models import BoringModel, regression_loader

FLAGS = ("training", "validating", "testing", "predicting", "evaluating", "sanity_checking")
# Lightning 2.6.6, hook by hook: which of FLAGS are true.
EXPECTED = [
    ("setup validate", {"validating", "evaluating"}),
    ("on_validation_start", {"validating", "evaluating"}),
    ("on_validation_batch_start", {"validating", "evaluating"}),
    ("on_validation_end", {"validating", "evaluating"}),
    ("teardown validate", {"validating", "evaluating"}),
    ("setup fit", {"training"}),
    ("on_fit_start", {"training"}),
    ("on_sanity_check_start", {"evaluating", "sanity_checking"}),
    ("on_validation_start", {"evaluating", "sanity_checking"}),
    ("on_validation_batch_start", {"evaluating", "sanity_checking"}),
    ("on_validation_end", {"evaluating", "sanity_checking"}),
    ("on_sanity_check_end", {"evaluating", "sanity_checking"}),
    ("on_train_start", {"training"}),
    ("on_train_batch_start", {"training"}),
    ("on_validation_start", {"validating", "evaluating"}),
    ("on_validation_batch_start", {"validating", "evaluating"}),
    ("on_validation_end", {"validating", "evaluating"}),
    ("on_train_epoch_end", {"training"}),
    ("on_train_end", {"training"}),
    ("on_fit_end", {"training"}),
    ("teardown fit", {"training"}),
    ("setup test", {"testing", "evaluating"}),
    ("on_test_start", {"testing", "evaluating"}),
    ("on_test_batch_start", {"testing", "evaluating"}),
    ("teardown test", {"testing", "evaluating"}),
    ("setup predict", {"predicting"}),
    ("on_predict_batch_start", {"predicting"}),
    ("teardown predict", {"predicting"}),
]


class Record(ember.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, set[str]]] = []

    def _note(self, trainer, name: str) -> None:
        self.seen.append((name, {f for f in FLAGS if getattr(trainer, f)}))

    def setup(self, trainer, module, stage):
        self._note(trainer, f"setup {stage}")

    def teardown(self, trainer, module, stage):
        self._note(trainer, f"teardown {stage}")


for _hook in (
    "on_fit_start", "on_sanity_check_start", "on_sanity_check_end", "on_validation_start", "on_validation_end",
    "on_train_start", "on_train_epoch_end", "on_train_end", "on_fit_end", "on_test_start",
):  # fmt: skip
    setattr(Record, _hook, lambda self, trainer, module, _n=_hook: self._note(trainer, _n))
for _hook in ("on_train_batch_start", "on_validation_batch_start", "on_test_batch_start", "on_predict_batch_start"):

    def _first(self, trainer, module, batch, batch_idx, *rest, _n=_hook):
        if batch_idx == 0:
            self._note(trainer, _n)

    setattr(Record, _hook, _first)


def trainer(**kwargs) -> ember.Trainer:
    args = dict(max_epochs=1, limit_train_batches=2, limit_val_batches=2, limit_test_batches=1,
                limit_predict_batches=1, num_sanity_val_steps=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False)  # fmt: skip
    args.update(kwargs)
    return ember.Trainer(**args)


def test_what_is_running_at_every_hook_is_what_lightning_says():
    record = Record()
    module = BoringModel()
    trainer(callbacks=[record], limit_val_batches=1).validate(module, regression_loader())
    t = trainer(callbacks=[record])
    for flag in FLAGS:
        assert getattr(t, flag) is False
    t.fit(module, regression_loader(), regression_loader())
    assert not any(getattr(t, f) for f in FLAGS)  # after the run: nothing
    t.test(module, regression_loader())
    t.predict(module, regression_loader())
    assert record.seen == EXPECTED


def test_device_and_run_properties(capsys):
    t = trainer(enable_progress_bar=True)
    assert (t.num_devices, t.device_ids, t.num_nodes, t.node_rank) == (1, [0], 1, 0)
    assert t.scaler is None and trainer(precision="16-mixed").scaler is not None
    assert isinstance(t.progress_bar_callback, ember.callbacks.ProgressBar)
    assert trainer().progress_bar_callback is None
    t.print("from rank zero", 3)
    assert "from rank zero 3" in capsys.readouterr().out
    assert (t.interrupted, t.received_sigterm) == (False, False)


class Interrupt(ember.Callback):
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        raise self.exc


@pytest.mark.parametrize(
    "exc", [KeyboardInterrupt(), Preempted(signal.SIGTERM, None, False)], ids=["ctrl-c", "preempted"]
)
def test_interrupted_after_ctrl_c_or_preemption_until_the_next_run(exc):
    t = trainer(callbacks=[Interrupt(exc)], num_sanity_val_steps=0)
    with pytest.raises(type(exc)):
        t.fit(BoringModel(), regression_loader())
    assert t.interrupted
    t.validate(BoringModel(), regression_loader())
    assert not t.interrupted


def test_received_sigterm_is_the_fits_stop_signal(tmp_path):
    class Sigterm(ember.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 0:
                signal.raise_signal(signal.SIGTERM)

    t = trainer(callbacks=[Sigterm()], num_sanity_val_steps=0, default_root_dir=str(tmp_path), limit_train_batches=16)
    with pytest.raises(Preempted):
        t.fit(BoringModel(), regression_loader(n=64))
    assert t.received_sigterm and t.interrupted
