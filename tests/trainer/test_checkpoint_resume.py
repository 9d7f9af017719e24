"""Exact resume: a fit stopped anywhere and resumed from its checkpoint ends bitwise identical.

Also run as a script (``python test_checkpoint_resume.py ROOT WORKERS KILL_STEP``) by the
``kill -9`` test: it trains with step checkpoints and SIGKILLs itself at ``KILL_STEP``.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.trainer.preemption import Preempted

if __name__ != "__main__":  # the kill -9 test runs this file as a script, where there is no tests package
    from tests.helpers.weights import assert_same_weights

N, BATCH, EPOCHS = 48, 4, 3  # 12 batches per epoch, 36 steps


class DropoutNet(ember.TrainModule):
    """An MLP with dropout, Adam and a step-interval LR schedule: every source of state a resume must carry."""

    def __init__(self, hidden: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(hidden, 1)
        )
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen.extend(idx.tolist())
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g), torch.arange(N))


class StopAt(Callback):
    """Raise (or run ``action``) when the loop is about to run the batch after ``step`` optimizer steps."""

    def __init__(self, step: int, action: Any = None) -> None:
        self.step = step
        self.action = action

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            if self.action is not None:
                self.action()
            else:
                raise RuntimeError(f"stop at step {self.step}")


def fit(
    root: str,
    workers: int = 0,
    callbacks: list[Callback] | None = None,
    ckpt_path: str | None = None,
    checkpoint: ModelCheckpoint | None = None,
    val: bool = False,
    batch_size: int = BATCH,
    generator_seed: int | None = None,
    **trainer_kwargs: Any,
) -> tuple[DropoutNet, ember.Trainer]:
    ember.seed_everything(0)
    module = DropoutNet()
    cbs = [checkpoint or ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=4)]
    trainer_kwargs.setdefault("max_epochs", EPOCHS)
    trainer = ember.Trainer(
        enable_progress_bar=False,
        logger=False,
        default_root_dir=root,
        callbacks=cbs + list(callbacks or []),
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    generator = torch.Generator().manual_seed(generator_seed) if generator_seed is not None else None
    loader = DataLoader(dataset(), batch_size=batch_size, shuffle=True, num_workers=workers, generator=generator)
    val_loader = DataLoader(dataset(), batch_size=8) if val else None
    trainer.fit(module, loader, val_loader, ckpt_path=ckpt_path)
    return module, trainer


REF_HISTORY: dict[int, list[dict[str, float]]] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, DropoutNet]:
    """The uninterrupted run, once per worker count."""
    refs = {}
    for workers in (0, 2):
        module, trainer = fit(str(tmp_path_factory.mktemp(f"ref{workers}")), workers)
        assert trainer.global_step == EPOCHS * N // BATCH
        refs[workers] = module
        REF_HISTORY[workers] = trainer.history
    assert_same_weights(refs[0], refs[2], bitwise=True)
    return refs


@pytest.mark.processes
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [17, 12], ids=["mid-epoch", "between-epochs"])
def test_resume_after_callback_raises_is_bitwise(tmp_path, reference, workers, stop):
    root = str(tmp_path)
    with pytest.raises(RuntimeError, match="stop at step"):
        fit(root, workers, [StopAt(stop)])
    gc.collect()  # the traceback held the loader's iterator (and its worker processes)
    resumed, trainer = fit(root, workers, ckpt_path="last")
    assert trainer.ckpt_path.endswith("last.ckpt")
    assert trainer.global_step == EPOCHS * N // BATCH
    assert_same_weights(resumed, reference[workers], bitwise=True)
    # The resumed epoch's train metrics are the uninterrupted epoch's (its running sums were in the checkpoint).
    assert trainer.history == REF_HISTORY[workers][-len(trainer.history) :]
    # Resumed from the last multiple of 4 steps (12: the boundary after epoch 0's last batch).
    assert len(resumed.seen) == EPOCHS * N - stop // 4 * 4 * BATCH


@pytest.mark.parametrize("stop", [17, 12], ids=["mid-epoch", "between-epochs"])
def test_a_loader_with_its_own_generator_shuffles_the_later_epochs_as_the_uninterrupted_run(tmp_path, stop):
    # The epochs' orders are drawn from the loader's generator, not torch's global one: its state is saved with
    # the sampler (the resumed epoch's continuing iterator draws nothing from it), so the epochs after the
    # resumed one shuffle as they would have.
    reference, _ = fit(str(tmp_path / "ref"), generator_seed=3)
    root = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="stop at step"):
        fit(root, callbacks=[StopAt(stop)], generator_seed=3)
    resumed, trainer = fit(root, ckpt_path="last", generator_seed=3)
    assert trainer.global_step == EPOCHS * N // BATCH
    assert_same_weights(resumed, reference, bitwise=True)
    assert resumed.seen == reference.seen[len(reference.seen) - len(resumed.seen) :]


def test_resume_does_not_rerun_validation_or_epoch_end(tmp_path):
    """Checkpoints written after a mid-epoch validation and at an epoch end resume after that point."""

    class Count(Callback):
        def __init__(self) -> None:
            self.val = self.epoch_end = 0

        def on_validation_end(self, trainer, module):
            self.val += 1

        def on_train_epoch_end(self, trainer, module):
            self.epoch_end += 1

    ref_count = Count()
    ref, _ = fit(
        str(tmp_path / "ref"),
        val=True,
        val_check_interval=0.5,
        callbacks=[ref_count],
        checkpoint=ModelCheckpoint(dirpath=str(tmp_path / "ref" / "c")),
    )
    assert (ref_count.val, ref_count.epoch_end) == (6, 3)
    root = str(tmp_path / "run")
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "c"))  # saves after every validation (mid-epoch and end)
    with pytest.raises(RuntimeError):
        fit(root, val=True, val_check_interval=0.5, callbacks=[StopAt(20)], checkpoint=ckpt)
    # Stopped at step 20: the last save was the validation after batch 18 (mid-epoch 1).
    count = Count()
    resumed, trainer = fit(
        root,
        val=True,
        val_check_interval=0.5,
        callbacks=[count],
        ckpt_path="last",
        checkpoint=ModelCheckpoint(dirpath=os.path.join(root, "c")),
    )
    assert (count.val, count.epoch_end) == (3, 2)  # validations after batches 24, 30, 36; ends of epochs 1, 2
    assert_same_weights(resumed, ref, bitwise=True)


def test_resume_from_epoch_end_checkpoint_steps_epoch_schedulers_once(tmp_path):
    class EpochSched(DropoutNet):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    def run(root, **kw):
        ember.seed_everything(0)
        m = EpochSched()
        tk = {"max_epochs": 3, **kw.pop("tk", {})}
        t = ember.Trainer(
            enable_progress_bar=False,
            logger=False,
            num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "c"))],
            **tk,
        )
        t.fit(m, DataLoader(dataset(), batch_size=BATCH, shuffle=True), **kw)
        return m, t

    ref, rt = run(str(tmp_path / "ref"))
    run(str(tmp_path / "a"), tk={"max_epochs": 1})  # last.ckpt written at the end of epoch 0
    resumed, t = run(str(tmp_path / "a"), ckpt_path="last")
    assert t.optimizers[0].param_groups[0]["lr"] == rt.optimizers[0].param_groups[0]["lr"] == 0.1 * 0.5**3
    assert_same_weights(resumed, ref, bitwise=True)


def test_resume_whose_epoch_end_steps_the_scheduler_first_does_not_warn_of_the_call_order(tmp_path):
    """A resumed run whose first act is an epoch end (here: on_train_batch_start returns -1) steps the
    epoch scheduler before any optimizer step of its own: torch's "lr_scheduler.step() before
    optimizer.step()" warning would be wrong (they stepped before the checkpoint), so it is quieted there."""

    class SkipEpoch(DropoutNet):
        skip = False

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

        def on_train_batch_start(self, batch, batch_idx):
            return -1 if self.skip else None

    root = str(tmp_path)

    def run(skip: bool, **kw):
        m = SkipEpoch()
        m.skip = skip
        t = ember.Trainer(
            max_epochs=1,
            enable_progress_bar=False,
            logger=False,
            callbacks=kw.pop("callbacks", [])
            + [ModelCheckpoint(dirpath=os.path.join(root, "c"), every_n_train_steps=5)],
        )
        t.fit(m, DataLoader(dataset(), batch_size=BATCH), **kw)
        return t

    with pytest.raises(RuntimeError):
        run(False, callbacks=[StopAt(6)])  # last.ckpt at step 5: the optimizer stepped, the scheduler not yet
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = run(True, ckpt_path="last")
    assert t.optimizers[0].param_groups[0]["lr"] == 0.05  # the epoch-end step ran
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


def test_preemption_sigterm_saves_and_exits_then_resumes_exactly(tmp_path, reference):
    root = str(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.warns(UserWarning, match="Preempted by SIGTERM"), pytest.raises(Preempted) as info:
        fit(root, callbacks=[StopAt(9, lambda: os.kill(os.getpid(), signal.SIGTERM))])
    assert info.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    saved = torch.load(info.value.checkpoint_path, weights_only=True)
    assert saved["progress"]["global_step"] == 10  # stopped at the boundary after the step running when it arrived
    del info
    resumed, trainer = fit(root, ckpt_path="last")
    assert_same_weights(resumed, reference[0], bitwise=True)


def test_preemption_waits_for_the_accumulation_window_to_close(tmp_path):
    ref, _ = fit(str(tmp_path / "ref"), accumulate_grad_batches=5, max_epochs=2)
    root = str(tmp_path / "run")
    # 12 batches an epoch in windows of 5, 5, 2: step 3 is done after epoch 0; the signal arrives during
    # epoch 1's first batch, and the run stops after its fifth, when the window closes.
    kill = StopAt(3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.warns(UserWarning, match="Preempted"), pytest.raises(Preempted) as info:
        fit(root, callbacks=[kill], accumulate_grad_batches=5, max_epochs=2)
    progress = torch.load(info.value.checkpoint_path, weights_only=True)["progress"]
    assert (progress["current_epoch"], progress["batch_in_epoch"], progress["global_step"]) == (1, 5, 4)
    del info
    resumed, _ = fit(root, ckpt_path="last", accumulate_grad_batches=5, max_epochs=2)
    assert_same_weights(resumed, ref, bitwise=True)


class EverySixBatches(DropoutNet):
    """A step scheduler with frequency=6 under accumulate_grad_batches=2: it steps after each epoch's 6th and
    12th batch (the frequency counts the epoch's batches, as in Lightning)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 6}}


class RecordLR(Callback):
    def __init__(self) -> None:
        self.lrs: list[tuple[int, int, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.lrs.append((trainer.current_epoch, batch_idx, trainer.optimizers[0].param_groups[0]["lr"]))


def test_mid_epoch_resume_keeps_the_step_scheduler_frequency_of_the_epochs_batches(tmp_path):
    def run(root: str, callbacks: list[Callback], ckpt_path: str | None = None) -> tuple[DropoutNet, ember.Trainer]:
        ember.seed_everything(0)
        module = EverySixBatches()
        trainer = ember.Trainer(
            accelerator="cpu",
            max_epochs=EPOCHS,
            accumulate_grad_batches=2,
            enable_progress_bar=False,
            logger=False,
            num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=4), *callbacks],
        )
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH, shuffle=True), ckpt_path=ckpt_path)
        return module, trainer

    ref_lrs = RecordLR()
    ref, _ = run(str(tmp_path / "ref"), [ref_lrs])
    # 12 batches an epoch, 6 optimizer steps: halved after batches 6 and 12 of every epoch (Lightning 2.6.6's
    # schedule; counting global steps would halve after every sixth step, once an epoch).
    halvings = [(e, b) for (e, b, lr), (_, _, before) in zip(ref_lrs.lrs[1:], ref_lrs.lrs) if lr != before]
    assert halvings == [(0, 5), (0, 11), (1, 5), (1, 11), (2, 5), (2, 11)]
    assert ref_lrs.lrs[-1][2] == 0.01 * 0.5**6

    root = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="stop at step 10"):
        run(root, [StopAt(10)])  # last.ckpt at step 8: epoch 1 after its 4th batch, between two halvings
    saved = torch.load(os.path.join(root, "ckpts", "last.ckpt"), weights_only=True)["progress"]
    assert (saved["current_epoch"], saved["batch_in_epoch"], saved["global_step"]) == (1, 4, 8)
    lrs = RecordLR()
    resumed, _ = run(root, [lrs], ckpt_path="last")
    assert lrs.lrs == ref_lrs.lrs[-len(lrs.lrs) :] and lrs.lrs[0][:2] == (1, 4)
    assert_same_weights(resumed, ref, bitwise=True)


def test_checkpoint_from_two_ranks_resumes_on_one_from_the_next_unseen_sample(tmp_path):
    """Simulated 2 -> 1: positions count samples of the global order, so a smaller world continues it."""
    root = str(tmp_path)
    with pytest.raises(RuntimeError):
        fit(root, callbacks=[StopAt(17)])
    path = os.path.join(root, "ckpts", "last.ckpt")
    ckpt = torch.load(path, weights_only=True)
    assert (ckpt["progress"]["batch_in_epoch"], ckpt["sampler"]["position"]) == (4, 16)  # step 16 = epoch 1, batch 4
    # The same point as 2 ranks would record it: 2 batches each, 16 samples of the global order consumed.
    ckpt["strategy"]["world_size"] = 2
    ckpt["progress"]["batch_in_epoch"] = 2
    ckpt["rng"] = {"world_size": 2, "per_rank": ckpt["rng"]["per_rank"] * 2}
    torch.save(ckpt, path)
    with pytest.warns(UserWarning, match="per-rank random streams cannot carry over"):
        resumed, trainer = fit(root, ckpt_path="last")
    first_epoch_rest = resumed.seen[: N - 16]
    assert sorted(first_epoch_rest + ckpt_order(ckpt)[:16]) == list(range(N))  # each sample once in the epoch
    assert trainer.global_step == 16 + (N - 16) // BATCH + N // BATCH


def ckpt_order(ckpt: dict) -> list[int]:
    g = torch.Generator()
    g.manual_seed(ckpt["sampler"]["seed"])
    return torch.randperm(N, generator=g).tolist()


def test_shuffled_order_matches_a_plain_torch_loop():
    """The swapped-in sampler draws the same permutation, from the same global RNG, as RandomSampler."""
    ember.seed_everything(3)
    expected = [int(i) for _, _, idx in DataLoader(dataset(), batch_size=BATCH, shuffle=True) for i in idx]
    ember.seed_everything(3)
    module = DropoutNet()
    ember.seed_everything(3)
    ember.Trainer(max_epochs=1, enable_progress_bar=False, logger=False, enable_checkpointing=False).fit(
        module, DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    )
    assert module.seen == expected


def test_last_with_no_checkpoint_starts_fresh_with_notice(tmp_path):
    with pytest.warns(UserWarning, match="found no checkpoint"):
        _, trainer = fit(str(tmp_path), ckpt_path="last", max_epochs=1)
    assert trainer.global_step == N // BATCH and trainer.ckpt_path is None


def test_unresumable_loader_falls_back_to_skipping_batches(tmp_path):
    class MyLoader(DataLoader):
        pass

    def run(root, ckpt_path=None, stop=None):
        ember.seed_everything(0)
        m = DropoutNet()
        callbacks = [ModelCheckpoint(dirpath=root, every_n_train_steps=5)] + ([StopAt(stop)] if stop else [])
        t = ember.Trainer(max_epochs=2, enable_progress_bar=False, logger=False, callbacks=callbacks)
        t.fit(m, MyLoader(dataset(), batch_size=BATCH), ckpt_path=ckpt_path)  # not shuffled: deterministic order
        return m

    ref = run(str(tmp_path / "ref"))
    with pytest.raises(RuntimeError):
        run(str(tmp_path / "a"), stop=8)
    with pytest.warns(UserWarning, match="cannot resume at the sampler level"):
        resumed = run(str(tmp_path / "a"), ckpt_path="last")
    assert resumed.seen == ref.seen[5 * BATCH :]


def _kill_run(root: str, workers: int, kill_step: int) -> None:
    fit(root, workers, [StopAt(kill_step, lambda: os.kill(os.getpid(), signal.SIGKILL))])


@pytest.mark.processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_after_kill_9_is_bitwise(tmp_path, reference, workers):
    kill_step = random.randrange(6, EPOCHS * N // BATCH - 1)
    root = str(tmp_path)
    from tests.helpers.jobs import run_job  # here: this file also runs as a script, without the tests package

    # kill_the_rest: the run's DataLoader workers, orphaned by the kill.
    code, out = run_job([sys.executable, __file__, root, str(workers), str(kill_step)], 50, kill_the_rest=True)
    assert code == -signal.SIGKILL, out[-2000:]
    last = torch.load(os.path.join(root, "ckpts", "last.ckpt"), weights_only=True)
    assert last["progress"]["global_step"] == kill_step // 4 * 4
    resumed, _ = fit(root, workers, ckpt_path="last")
    assert_same_weights(resumed, reference[workers], bitwise=True)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    _kill_run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    sys.exit("the run was not killed")


def test_last_with_no_checkpoint_names_where_the_default_logger_runs_would_be(tmp_path):
    from tests.helpers.models import BoringModel, regression_loader

    trainer = ember.Trainer(
        max_epochs=1, enable_progress_bar=False, default_root_dir=str(tmp_path), log_every_n_steps=1
    )
    with pytest.warns(UserWarning, match="found no checkpoint") as record:
        trainer.fit(BoringModel(), regression_loader(), ckpt_path="last")
    message = next(str(w.message) for w in record if "found no checkpoint" in str(w.message))
    runs = os.path.join(str(tmp_path), "ember_logs", "*", "checkpoints")
    assert f"searched [{runs!r}, {os.path.join(str(tmp_path), 'checkpoints')!r}]" in message
