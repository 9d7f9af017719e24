"""The ``dataloader_iter`` step flavor, ``training_step(self, dataloader_iter)`` (and the evaluation steps), in
one process.

The expected sequences were recorded from PyTorch Lightning 2.6.6 running the same modules (imports changed):
what ``next(dataloader_iter)`` returns, which batch and index the batch hooks get, when an epoch ends, what
counts toward ``global_step``, the validation interval, accumulation and ``log_every_n_steps``. Where ember
deliberately differs (docs/from-lightning.md: the epoch whose data runs out inside a step still validates and
steps its epoch schedulers; an evaluation value is weighed by, and filed under, the batch fetched last), the test
says so.

Every sample of the data is its own index (``x = y = i``), so a record shows which batches a step got.
"""

from __future__ import annotations

import functools
import os
import signal
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.module import takes_dataloader_iter
from ember.trainer.preemption import Preempted
from tests.helpers.models import BoringModel, RecordingLogger, fast_trainer


# ---------------------------------------------------------------------- data and records
def loader(n: int, batch_size: int = 2, start: int = 0, **kwargs: Any) -> DataLoader:
    x = torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)
    return DataLoader(TensorDataset(x, x.clone()), batch_size=batch_size, **kwargs)


class Stream(IterableDataset):
    """``n`` samples in batches of 2, without a length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(0, self.n, 2):
            x = torch.arange(i, min(i + 2, self.n), dtype=torch.float32).unsqueeze(1)
            yield x, x.clone()


def ids(batch: Any) -> Any:
    return None if batch is None else [int(v) for v in batch[0][:, 0].tolist()]


class Record(Callback):
    """Records the epoch, batch and validation hooks as short strings, in order, into ``calls``."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def on_train_epoch_start(self, trainer, module):
        self.calls.append("epoch")

    def on_train_epoch_end(self, trainer, module):
        self.calls.append(f"epoch_end gs={trainer.global_step}")

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.calls.append(f"start {ids(batch)}@{batch_idx}")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.calls.append(f"end {ids(batch)}@{batch_idx} gs={trainer.global_step}")

    def on_validation_start(self, trainer, module):
        self.calls.append(f"validate gs={trainer.global_step}")

    def _eval(self, name: str, batch: Any, batch_idx: int, dataloader_idx: tuple[int, ...]) -> None:
        self.calls.append(f"{name} {ids(batch)}@{batch_idx}" + "".join(f"/{i}" for i in dataloader_idx))

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, *dataloader_idx):
        self._eval("vstart", batch, batch_idx, dataloader_idx)

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, *dataloader_idx):
        self._eval("vend", batch, batch_idx, dataloader_idx)

    def on_predict_batch_start(self, trainer, module, batch, batch_idx, *dataloader_idx):
        self._eval("pstart", batch, batch_idx, dataloader_idx)

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, *dataloader_idx):
        self._eval("pend", batch, batch_idx, dataloader_idx)


class Pulls(ember.TrainModule):
    """Each step takes ``k`` batches (evaluation steps ``eval_k``) and records what ``next`` returned."""

    def __init__(self, calls: list[str] | None = None, k: int = 1, eval_k: int = 1, lr: float = 0.01) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1, 1)
        self.calls = calls if calls is not None else []
        self.k, self.eval_k, self.lr = k, eval_k, lr

    def pull(self, it: Any, k: int, tag: str) -> list[Any]:
        got = []
        for _ in range(k):
            item = next(it)
            assert isinstance(item, tuple) and len(item) == 3
            got.append(item)
            self.calls.append(f"{tag} {ids(item[0])}@{item[1]}/{item[2]}")
        return got

    def training_step(self, dataloader_iter):
        x = torch.cat([b[0] for b, _, _ in self.pull(dataloader_iter, self.k, "train")])
        return self.layer(x).pow(2).mean()

    def validation_step(self, dataloader_iter):
        self.pull(dataloader_iter, self.eval_k, "val")

    def test_step(self, dataloader_iter):
        self.pull(dataloader_iter, self.eval_k, "test")

    def predict_step(self, dataloader_iter):
        return [ids(b) for b, _, _ in self.pull(dataloader_iter, self.eval_k, "predict")]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(module: Pulls, train: Any, val: Any = None, **kwargs: Any) -> ember.Trainer:
    kwargs.setdefault("num_sanity_val_steps", 0)
    trainer = fast_trainer(callbacks=[Record(module.calls), *kwargs.pop("callbacks", [])], **kwargs)
    trainer.fit(module, train, val)
    return trainer


def hooks(calls: list[str]) -> list[str]:
    """The hook records only (not the step's own)."""
    return [c for c in calls if not c.startswith(("train ", "val ", "predict ", "test "))]


# ---------------------------------------------------------------------- what the step gets
def test_signature_detection():
    class Steps:
        def iter_step(self, dataloader_iter):
            pass

        def with_more(self, dataloader_iter, extra=None):
            pass

        def batch_step(self, batch, batch_idx):
            pass

        def varargs(self, *args):
            pass

        def keyword_only(self, *, dataloader_iter):
            pass

        @functools.wraps(iter_step)
        def decorated(self, *args, **kwargs):
            pass

    s = Steps()
    assert takes_dataloader_iter(s.iter_step) and takes_dataloader_iter(s.with_more)
    assert takes_dataloader_iter(s.decorated)  # read through functools.wraps, as Lightning
    assert not takes_dataloader_iter(s.batch_step)
    assert not takes_dataloader_iter(s.varargs)  # as Lightning: the parameter must be declared
    assert not takes_dataloader_iter(s.keyword_only)
    assert not takes_dataloader_iter(None)


def test_next_returns_the_loaders_own_batch_its_index_and_loader_index():
    transfers: list[str] = []

    class NoTransfer(Pulls):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            transfers.append("before")
            return batch

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            transfers.append("transfer")
            return batch

    module = NoTransfer()
    trainer = fit(module, loader(6), max_epochs=2)
    steps = [c for c in module.calls if c.startswith("train ")]
    assert steps == ["train [0, 1]@0/0", "train [2, 3]@1/0", "train [4, 5]@2/0"] * 2
    # As Lightning: the step's batches are not moved, and the transfer hooks do not run (the step moves them).
    assert transfers == []
    assert trainer.global_step == 6


def test_batch_hooks_get_the_last_batch_fetched_before_and_after_the_step():
    module = Pulls(k=2)
    trainer = fit(module, loader(8), max_epochs=2)
    epoch = [
        "epoch",
        "start None@0",  # as Lightning: nothing fetched yet
        "end [2, 3]@1 gs={}",
        "start [2, 3]@1",
        "end [6, 7]@3 gs={}",
        "epoch_end gs={}",
    ]
    expected = [c.format(g) for c, g in zip(epoch, [0, 0, 1, 0, 2, 2])] + [
        c.format(g) for c, g in zip(epoch, [0, 0, 3, 0, 4, 4])
    ]
    assert hooks(module.calls) == expected
    assert trainer.global_step == 4
    assert trainer.progress.batch_in_epoch == 0 and trainer.current_epoch == 2


def test_the_epoch_ends_once_its_last_batch_is_fetched():
    module = Pulls(k=1)
    fit(module, loader(6))
    # No fourth step: the loader's length says the third batch was its last.
    assert hooks(module.calls) == [
        "epoch",
        "start None@0",
        "end [0, 1]@0 gs=1",
        "start [0, 1]@0",
        "end [2, 3]@1 gs=2",
        "start [2, 3]@1",
        "end [4, 5]@2 gs=3",
        "epoch_end gs=3",
    ]


def test_a_step_that_asks_past_the_last_batch_is_dropped_and_ends_the_epoch():
    module = Pulls(k=2)
    trainer = fit(module, loader(10), max_epochs=2)  # 5 batches: the third step gets one, then StopIteration
    epoch = ["epoch", "start None@0", "end [2, 3]@1", "start [2, 3]@1", "end [6, 7]@3", "start [6, 7]@3", "epoch_end"]
    assert [c.split(" gs=")[0] for c in hooks(module.calls)] == epoch * 2
    assert module.calls.count("train [8, 9]@4/0") == 2  # fetched by the dropped step
    assert trainer.global_step == 4 and trainer.current_epoch == 2


def test_limit_train_batches_bounds_the_steps_and_the_batches_fetched():
    # limit 3, one batch per step: three steps.
    assert fit(Pulls(k=1), loader(12), limit_train_batches=3).global_step == 3
    # limit 3, two per step: the second step gets the third batch, then StopIteration (as Lightning).
    module = Pulls(k=2)
    assert fit(module, loader(12), limit_train_batches=3).global_step == 1
    assert [c for c in module.calls if c.startswith("train")] == [
        "train [0, 1]@0/0",
        "train [2, 3]@1/0",
        "train [4, 5]@2/0",
    ]
    # limit 4 of 10 batches, two per step: two steps, ending on the limit.
    assert fit(Pulls(k=2), loader(20), limit_train_batches=4).global_step == 2


def test_max_steps_counts_steps():
    trainer = fit(Pulls(k=2), loader(12), max_steps=2, max_epochs=-1)
    assert trainer.global_step == 2 and trainer.progress.batch_in_epoch == 0  # (the epoch ended cut short)


def test_a_loader_without_length_ends_the_epoch_with_its_last_batch():
    module = Pulls(k=1)
    trainer = fit(module, DataLoader(Stream(6), batch_size=None))
    # ember looks one batch ahead, so no step is begun after the last batch (Lightning begins a fourth step,
    # whose first next() raises StopIteration).
    assert hooks(module.calls)[-3:] == ["start [2, 3]@1", "end [4, 5]@2 gs=3", "epoch_end gs=3"]
    assert trainer.global_step == 3
    module = Pulls(k=2)
    assert fit(module, DataLoader(Stream(10), batch_size=None)).global_step == 2  # third step dropped


def test_on_train_batch_start_returning_minus_one_ends_the_epoch():
    class Refuses(Pulls):
        def on_train_batch_start(self, batch, batch_idx):
            if self.trainer.current_epoch == 0 and self.trainer.global_step == 2:
                return -1
            return None

    module = Refuses()
    trainer = fit(module, loader(10), max_epochs=2)
    assert trainer.global_step == 7 and trainer.current_epoch == 2  # 2 steps, then all 5 (as Lightning)

    class RefusesFirst(Pulls):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if self.trainer.current_epoch == 0 else None

    trainer = fit(RefusesFirst(), loader(10), max_epochs=2)
    assert trainer.global_step == 5 and trainer.current_epoch == 2  # an epoch refused before fetching is not empty


def test_manual_optimization_counts_the_steps_that_stepped():
    class Manual(Pulls):
        def __init__(self) -> None:
            super().__init__(k=2)
            self.automatic_optimization = False

        def training_step(self, dataloader_iter):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(dataloader_iter))
            opt.step()

    assert fit(Manual(), loader(8)).global_step == 2


# ---------------------------------------------------------------------- schedule: steps, not batches
def validations(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("validate")]


def test_validation_interval_counts_steps_and_every_epoch_end_validates():
    module = Pulls(k=2)
    fit(module, loader(16), loader(2), val_check_interval=2)
    assert validations(module.calls) == ["validate gs=2", "validate gs=4"]
    module = Pulls(k=2)
    fit(module, loader(16), loader(2), val_check_interval=0.5)  # every int(8 * 0.5) = 4 steps: once
    assert validations(module.calls) == ["validate gs=4"]
    # As Lightning for this flavor: every epoch's end validates too, whatever the interval.
    module = Pulls(k=2)
    fit(module, loader(8), loader(2), val_check_interval=3, check_val_every_n_epoch=None, max_epochs=2)
    assert validations(module.calls) == ["validate gs=2", "validate gs=3", "validate gs=4"]


def test_gradient_accumulation_counts_steps():
    module = Pulls(k=1)
    fit(module, loader(10), accumulate_grad_batches=2)
    # The optimizer steps after steps 2 and 4, and after the epoch's last step (5).
    assert [c.split("gs=")[1] for c in hooks(module.calls) if c.startswith("end")] == ["0", "1", "1", "2", "3"]
    module = Pulls(k=2)
    fit(module, loader(16), accumulate_grad_batches=2)
    assert [c.split("gs=")[1] for c in hooks(module.calls) if c.startswith("end")] == ["0", "1", "1", "2"]


@pytest.mark.parametrize(
    "accumulate,expected", [(1, [(0, 2), (0, 4), (1, 7), (1, 9)]), (2, [(0, 1), (0, 2), (1, 3), (1, 4)])]
)
def test_a_step_scheduler_frequency_counts_the_epochs_steps(accumulate, expected):
    class Scheduled(Pulls):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5**i)
            original = sched.step

            def step(*args, **kwargs):
                stepped_at.append((self.trainer.current_epoch, self.trainer.global_step))
                return original(*args, **kwargs)

            sched.step = step
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 2}}

    stepped_at: list[tuple[int, int]] = []
    # 5 steps of 2 batches an epoch: the frequency counts the epoch's steps (Lightning's batch_idx for this
    # flavor), from 0 again each epoch, on steps where the optimizer steps (as Lightning 2.6.6).
    fit(Scheduled(k=2), loader(20), max_epochs=2, accumulate_grad_batches=accumulate)
    assert stepped_at == expected


def test_log_every_n_steps_counts_optimizer_steps():
    class Logs(Pulls):
        def training_step(self, dataloader_iter):
            loss = super().training_step(dataloader_iter)
            self.log("loss", loss, batch_size=4)
            return loss

    logger = RecordingLogger()
    fit(Logs(k=2), loader(16), logger=logger, log_every_n_steps=2)
    assert logger.steps_with("loss") == [1, 3]  # after global steps 2 and 4


def test_self_log_in_training_needs_batch_size():
    class NoBatchSize(Pulls):
        def training_step(self, dataloader_iter):
            loss = super().training_step(dataloader_iter)
            self.log("loss", loss)
            return loss

    with pytest.raises(ValueError, match=r"self\.log\('loss', \.\.\.\) in training.*dataloader_iter.*batch_size=n"):
        fit(NoBatchSize(), loader(4))

    class InEpochEnd(Pulls):
        def on_train_epoch_end(self):
            self.log("x", 1.0)

    with pytest.raises(ValueError, match=r"self\.log\('x', \.\.\.\) in training"):
        fit(InEpochEnd(), loader(4))

    class WithBatchSize(Pulls):
        def training_step(self, dataloader_iter):
            loss = super().training_step(dataloader_iter)
            self.log("loss", loss, batch_size=2, on_epoch=True)
            return loss

        def validation_step(self, dataloader_iter):
            batch, _, _ = next(dataloader_iter)
            self.log("val", batch[0].sum())  # evaluation infers it, from the batch fetched last

    trainer = fit(WithBatchSize(), loader(4), loader(4))
    assert set(trainer.callback_metrics) >= {"loss", "loss_step", "loss_epoch", "val"}


def test_the_usual_step_still_infers_batch_size():
    trainer = fast_trainer()
    trainer.fit(BoringModel(), DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4))
    assert "train_loss" in trainer.callback_metrics


# ---------------------------------------------------------------------- where ember differs from Lightning
class EpochScheduled(Pulls):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


@pytest.mark.parametrize(
    ("train", "k"),
    [(loader(10), 2), (loader(8), 2), (DataLoader(Stream(6), batch_size=None), 1)],
    ids=["ran-out-inside-a-step", "last-batch-fetched-by-a-step", "stream"],
)
def test_an_epoch_whose_data_runs_out_validates_and_steps_its_epoch_schedulers(train, k):
    module = EpochScheduled(k=k)
    trainer = fit(module, train, loader(2), max_epochs=2)
    # Lightning 2.6.6 steps no epoch-interval scheduler in any of these (its epoch end is seen after the step),
    # and validates in none but the second; ember ends every one as an epoch that ran to its last batch.
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.25
    assert len(validations(module.calls)) == 2


# ---------------------------------------------------------------------- evaluation and predict
def test_evaluation_hands_one_iterator_over_every_loader_in_turn():
    module = Pulls(eval_k=2)
    trainer = fast_trainer(callbacks=[Record(module.calls)])
    trainer.validate(module, [loader(6), loader(6, start=100)])
    # A step may take batches of two loaders; the hooks get the last one fetched, with its loader's index.
    assert module.calls == [
        "validate gs=0",
        "vstart None@0/0",
        "val [0, 1]@0/0",
        "val [2, 3]@1/0",
        "vend [2, 3]@1/0",
        "vstart [2, 3]@1/0",
        "val [4, 5]@2/0",
        "val [100, 101]@0/1",
        "vend [100, 101]@0/1",
        "vstart [100, 101]@0/1",
        "val [102, 103]@1/1",
        "val [104, 105]@2/1",
        "vend [104, 105]@2/1",
    ]


def test_evaluation_of_one_loader_ends_with_its_batches():
    module = Pulls(eval_k=2)
    trainer = fast_trainer(callbacks=[Record(module.calls)])
    assert trainer.validate(module, loader(10)) == [{}]
    # The third step gets the fifth batch, then StopIteration: it is dropped and the loop ends (as Lightning).
    assert hooks(module.calls) == [
        "validate gs=0",
        "vstart None@0",
        "vend [2, 3]@1",
        "vstart [2, 3]@1",
        "vend [6, 7]@3",
        "vstart [6, 7]@3",
    ]
    assert module.calls[-1] == "val [8, 9]@4/0"


def test_limits_and_the_sanity_check_bound_each_loader():
    module = Pulls()
    trainer = fast_trainer(limit_val_batches=2)
    trainer.validate(module, [loader(6), loader(6, start=100)])
    assert module.calls == ["val [0, 1]@0/0", "val [2, 3]@1/0", "val [100, 101]@0/1", "val [102, 103]@1/1"]
    module = Pulls()
    fit(module, loader(4), [loader(6), loader(6, start=100)], num_sanity_val_steps=1, max_steps=1)
    assert [c for c in module.calls if c.startswith("val ")][:2] == ["val [0, 1]@0/0", "val [100, 101]@0/1"]


def test_test_runs_the_test_step():
    module = Pulls()
    assert fast_trainer().test(module, loader(4)) == [{}]
    assert module.calls == ["test [0, 1]@0/0", "test [2, 3]@1/0"]


def test_predictions_go_to_the_loader_of_the_last_batch_fetched():
    module = Pulls(eval_k=2)
    trainer = fast_trainer(callbacks=[Record(module.calls)])
    got = trainer.predict(module, [loader(6), loader(4, start=100)])
    # The second step takes the last batch of loader 0 and the first of loader 1 (as Lightning).
    assert got == [[[[0, 1], [2, 3]]], [[[4, 5], [100, 101]]]]
    assert hooks(module.calls) == [
        "pstart None@0/0",
        "pend [2, 3]@1/0",
        "pstart [2, 3]@1/0",
        "pend [100, 101]@0/1",
        "pstart [100, 101]@0/1",
    ]
    assert fast_trainer().predict(Pulls(), loader(4)) == [[[0, 1]], [[2, 3]]]


class LogsEach(Pulls):
    def validation_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        self.log("v", batch[0].sum())


def test_an_evaluation_value_is_weighed_by_and_filed_under_the_batch_fetched_last():
    # Batches [0, 1], [2, 3], [4]: sums 1, 5, 4 weighted 2, 2, 1 -> 16 / 5 (Lightning weighs each value by the
    # previous step's batch, 1 for the first: 3.8).
    got = fast_trainer().validate(LogsEach(), loader(5), verbose=False)
    assert got == [{"v": pytest.approx(3.2)}]
    # Loader 1's first value (201, weight 2) is filed under loader 1 (Lightning files it under loader 0).
    got = fast_trainer().validate(LogsEach(), [loader(5), loader(3, start=100)], verbose=False)
    assert got == [{"v/dataloader_idx_0": pytest.approx(3.2)}, {"v/dataloader_idx_1": pytest.approx(168.0)}]


# ---------------------------------------------------------------------- the same training as the usual step
class Dropout(ember.TrainModule):
    """Dropout, Adam and a step-interval scheduler, over a shuffled loader of indexed samples."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.seen: list[int] = []

    def step(self, batch: Any) -> torch.Tensor:
        x, y, idx = batch
        self.seen.extend(idx.tolist())
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, batch_size=len(x))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), batch_size=len(x))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class UsualStep(Dropout):
    def training_step(self, batch, batch_idx):
        return self.step(batch)


class OneBatchPerStep(Dropout):
    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        return self.step(batch)


class TwoBatchesPerStep(Dropout):
    def training_step(self, dataloader_iter):
        (x1, y1, i1), _, _ = next(dataloader_iter)
        (x2, y2, i2), _, _ = next(dataloader_iter)
        return self.step((torch.cat([x1, x2]), torch.cat([y1, y2]), torch.cat([i1, i2])))


def indexed(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g), torch.arange(n))


def run(cls: type, root: str, callbacks: list[Callback] = (), ckpt_path: str | None = None, **kwargs: Any):
    ember.seed_everything(0)
    module = cls()
    kwargs.setdefault("max_epochs", 3)
    trainer = ember.Trainer(
        accelerator="cpu",
        enable_progress_bar=False,
        logger=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=2), *callbacks],
        **kwargs,
    )
    trainer.fit(
        module,
        DataLoader(indexed(), batch_size=4, shuffle=True),
        DataLoader(indexed(16), batch_size=8),
        ckpt_path=ckpt_path,
    )
    return module, trainer


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_one_batch_per_step_trains_bitwise_as_the_usual_step(tmp_path):
    usual, t1 = run(UsualStep, str(tmp_path / "usual"), val_check_interval=0.5)
    fetching, t2 = run(OneBatchPerStep, str(tmp_path / "iter"), val_check_interval=0.5)
    assert same_weights(usual, fetching)
    assert usual.seen == fetching.seen and t1.global_step == t2.global_step == 36
    assert {k: float(v) for k, v in t1.callback_metrics.items()} == {
        k: float(v) for k, v in t2.callback_metrics.items()
    }
    assert sorted(os.listdir(tmp_path / "usual" / "ckpts")) == sorted(os.listdir(tmp_path / "iter" / "ckpts"))


class StopAt(Callback):
    """Raises (or runs ``action``) as the step after ``step`` optimizer steps starts."""

    def __init__(self, step: int, action: Any = None) -> None:
        self.step, self.action, self.done = step, action, False

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step and not self.done:
            self.done = True
            if self.action is None:
                raise RuntimeError(f"stop at step {self.step}")
            self.action()


@pytest.mark.parametrize("stop", [9, 6], ids=["mid-epoch", "between-epochs"])
def test_resume_continues_with_the_next_batch_the_step_would_fetch_bitwise(tmp_path, stop):
    reference, ref_trainer = run(TwoBatchesPerStep, str(tmp_path / "ref"))
    assert ref_trainer.global_step == 18  # 6 steps of 2 batches per epoch
    root = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="stop at step"):
        run(TwoBatchesPerStep, root, [StopAt(stop)])
    resumed, trainer = run(TwoBatchesPerStep, root, ckpt_path="last")
    assert trainer.global_step == 18
    assert same_weights(resumed, reference)
    # Resumed from the last even step: 8 steps (16 batches of 4) or 6, and from there the same samples.
    done = stop // 2 * 2
    assert resumed.seen == reference.seen[done * 8 :]
    assert trainer.history == ref_trainer.history[-len(trainer.history) :]


def test_preemption_waits_for_the_accumulation_window_of_steps_to_close(tmp_path):
    reference, _ = run(TwoBatchesPerStep, str(tmp_path / "ref"), accumulate_grad_batches=2, max_epochs=2)
    # 6 steps of 2 batches an epoch, in windows of 2 steps: 3 optimizer steps an epoch. The signal arrives as
    # epoch 1's first step starts; the run stops after its second step, when the window closes (after 4
    # batches, where counting batches would have stopped it inside the window).
    kill = StopAt(3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    root = str(tmp_path / "run")
    with pytest.warns(UserWarning, match="Preempted"), pytest.raises(Preempted) as info:
        run(TwoBatchesPerStep, root, [kill], accumulate_grad_batches=2, max_epochs=2)
    progress = torch.load(info.value.checkpoint_path, weights_only=True)["progress"]
    assert (progress["current_epoch"], progress["steps_in_epoch"], progress["batch_in_epoch"]) == (1, 2, 4)
    assert progress["global_step"] == 4
    del info
    resumed, trainer = run(TwoBatchesPerStep, root, ckpt_path="last", accumulate_grad_batches=2, max_epochs=2)
    assert trainer.global_step == 6
    assert same_weights(resumed, reference)


# ---------------------------------------------------------------------- errors and warnings
class IterEverywhere(Pulls):
    pass


@pytest.mark.parametrize("run_name", ["fit", "validate", "test", "predict"])
def test_dp_refuses_a_step_taking_dataloader_iter_saying_what_to_do(run_name):
    trainer = fast_trainer(strategy="dp", devices=2)
    step = {"fit": "training_step", "validate": "validation_step", "test": "test_step", "predict": "predict_step"}
    with pytest.raises(
        ValueError,
        match=rf"strategy='dp' cannot run IterEverywhere\.{step[run_name]}\(self, dataloader_iter\).*"
        r"Use strategy='ddp'.*or 'single'",
    ):
        getattr(trainer, run_name)(IterEverywhere(), loader(4))
    assert trainer.global_step == 0


def test_dp_runs_the_usual_step_of_a_module_whose_other_steps_take_the_iterator():
    class IterEvalOnly(BoringModel):
        def predict_step(self, dataloader_iter):
            return next(dataloader_iter)

    trainer = fast_trainer(strategy="dp", devices=2)
    trainer.fit(IterEvalOnly(), DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4))
    assert trainer.global_step == 2


class IterValidation(BoringModel):
    """The usual training_step; validation_step fetches its own batches."""

    def validation_step(self, dataloader_iter):
        next(dataloader_iter)


def regression(n: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 4), torch.randn(n, 1)), batch_size=4)


@pytest.mark.parametrize("val", ["none", "limit 0"])
def test_dp_fits_a_module_whose_validation_step_takes_the_iterator_when_the_fit_does_not_validate(val):
    trainer = fast_trainer(strategy="dp", devices=2, limit_val_batches=0 if val == "limit 0" else 1.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IterValidation defines validation_step, but this fit has no")
        trainer.fit(IterValidation(), regression(), regression() if val == "limit 0" else None)
    assert trainer.global_step == 2


def test_dp_refuses_a_validation_step_taking_the_iterator_before_training_when_the_fit_validates():
    trainer = fast_trainer(strategy="dp", devices=2)
    with pytest.raises(ValueError, match=r"strategy='dp' cannot run IterValidation\.validation_step\(self, dataloader"):
        trainer.fit(IterValidation(), regression(), regression())
    assert trainer.global_step == 0


def test_an_optimizer_that_calls_its_closure_several_times_is_warned_about():
    class WithLBFGS(Pulls):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)

    with pytest.warns(UserWarning, match=r"LBFGS\.step calls its closure.*fetches new batches each time"):
        fit(WithLBFGS(k=1), loader(40))


def test_an_empty_loader():
    with pytest.raises(ValueError, match="The train dataloader is empty"):
        fit(Pulls(), loader(0))
    with pytest.warns(UserWarning, match="yielded no batch"):
        trainer = fit(Pulls(), DataLoader(Stream(0), batch_size=None))
    assert trainer.global_step == 0
