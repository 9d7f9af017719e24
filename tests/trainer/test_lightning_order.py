"""Four points of order and counting where ember was believed to differ from Lightning.

Every expectation below was observed by running PyTorch Lightning 2.6.6 on the same small module,
callback and datamodule (recorded in the format of tests/helpers/hook_recorder.py: ``C.`` callback,
``M.`` module, ``D.`` datamodule). Where ember does not match yet, the test is marked
``xfail(strict=True)`` with what differs: it starts passing, and then fails as XPASS, once ember is fixed.

1. when the loaders are requested relative to the sanity check;
2. where callbacks', the datamodule's and the optimizers' states are restored when a fit resumes;
3. ``trainer.global_step`` in the batch hooks, and the step loggers get;
4. an overridden ``optimizer_step`` with a closure optimizer (LBFGS), and an overridden ``backward``
   under ``strategy="ddp"``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import ember
from ember.callbacks import Callback
from ember.loggers import Logger
from tests.helpers.dist import run_ranks
from tests.helpers.hook_recorder import HookCallback, RecordingHookModule, _fmt, _loader, trainer


def xfail(what: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=f"differs from Lightning: {what}")


def lines(text: str) -> list[str]:
    return text.split()


class RecordingData(ember.DataModule):
    """A datamodule of 4 training samples and 1 validation sample that records its hooks as ``D.<hook>``."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def prepare_data(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("D." + _fmt("prepare_data", args, kwargs))

    def setup(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("D." + _fmt("setup", args, kwargs))

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("D." + _fmt("teardown", args, kwargs))

    def train_dataloader(self) -> DataLoader:
        self.calls.append("D.train_dataloader")
        return _loader(4)

    def val_dataloader(self) -> DataLoader:
        self.calls.append("D.val_dataloader")
        return _loader(1)


# ------------------------------------------------------------------------------------ 1. loaders, sanity check
# One fit: 1 epoch of 2 training batches, 1 validation batch; SGD with an epoch StepLR (HookModule's).
CLIP = (
    "M.configure_gradient_clipping(gradient_clip_val=,gradient_clip_algorithm=) "
    "M.clip_gradients(gradient_clip_val=,gradient_clip_algorithm=)"
)
VALIDATION = """
    M.on_validation_model_eval C.on_validation_start M.on_validation_start
    C.on_validation_epoch_start M.on_validation_epoch_start
    M.on_before_batch_transfer(0) M.transfer_batch_to_device(0) M.on_after_batch_transfer(0)
    C.on_validation_batch_start(0) M.on_validation_batch_start(0) M.validation_step(0)
    C.on_validation_batch_end(0) M.on_validation_batch_end(0)
    C.on_validation_epoch_end M.on_validation_epoch_end C.on_validation_end M.on_validation_end
    M.on_validation_model_train
"""
TRAINING = f"""
    C.on_train_start M.on_train_start C.on_train_epoch_start M.on_train_epoch_start
    M.on_before_batch_transfer(0) M.transfer_batch_to_device(0) M.on_after_batch_transfer(0)
    C.on_train_batch_start(0) M.on_train_batch_start(0) M.optimizer_step(0,0) M.training_step(0)
    C.on_before_zero_grad M.on_before_zero_grad M.optimizer_zero_grad(0,0)
    C.on_before_backward M.on_before_backward M.backward C.on_after_backward M.on_after_backward
    C.on_before_optimizer_step M.on_before_optimizer_step {CLIP}
    C.on_train_batch_end(0) M.on_train_batch_end(0)
    M.on_before_batch_transfer(0) M.transfer_batch_to_device(0) M.on_after_batch_transfer(0)
    C.on_train_batch_start(1) M.on_train_batch_start(1) M.optimizer_step(0,1) M.training_step(1)
    C.on_before_zero_grad M.on_before_zero_grad M.optimizer_zero_grad(0,1)
    C.on_before_backward M.on_before_backward M.backward C.on_after_backward M.on_after_backward
    C.on_before_optimizer_step M.on_before_optimizer_step {CLIP}
    M.lr_scheduler_step
    C.on_train_batch_end(1) M.on_train_batch_end(1)
    M.on_validation_model_zero_grad {VALIDATION}
    C.on_train_epoch_end M.on_train_epoch_end C.on_train_end M.on_train_end C.on_fit_end M.on_fit_end
"""
START = """
    M.configure_callbacks M.prepare_data C.setup(stage='fit') M.setup(stage='fit') M.configure_model
    M.configure_optimizers C.on_fit_start M.on_fit_start
"""
START_DATA = """
    M.configure_callbacks D.prepare_data M.prepare_data D.setup(stage='fit') C.setup(stage='fit') M.setup(stage='fit')
    M.configure_model M.configure_optimizers C.on_fit_start M.on_fit_start
"""
END = "C.teardown(stage='fit') M.teardown(stage='fit')"
END_DATA = "D.teardown(stage='fit') C.teardown(stage='fit') M.teardown(stage='fit')"  # the datamodule's first

# Lightning 2.6.6 with a sanity check: val_dataloader is requested inside it (after on_sanity_check_start),
# train_dataloader after it (after on_sanity_check_end, before on_train_start).
WITH_SANITY = {
    "module": START
    + "C.on_sanity_check_start M.val_dataloader"
    + VALIDATION
    + "C.on_sanity_check_end"
    + " M.train_dataloader"
    + TRAINING
    + END,
    "datamodule": START_DATA
    + "C.on_sanity_check_start D.val_dataloader"
    + VALIDATION
    + "C.on_sanity_check_end"
    + " D.train_dataloader"
    + TRAINING
    + END_DATA,
}
# Lightning 2.6.6 without one: train_dataloader then val_dataloader, both after on_fit_start and before on_train_start.
WITHOUT_SANITY = {
    "module": START + "M.train_dataloader M.val_dataloader" + TRAINING + END,
    "datamodule": START_DATA + "D.train_dataloader D.val_dataloader" + TRAINING + END_DATA,
}


def fit_recorded(source: str, sanity: int) -> list[str]:
    calls: list[str] = []
    t = trainer(calls, max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=sanity)
    if source == "datamodule":
        t.fit(RecordingHookModule(calls), datamodule=RecordingData(calls))
    else:
        t.fit(RecordingHookModule(calls, n_val=1))
    return calls


@pytest.mark.parametrize(
    "source",
    [
        "module",
        "datamodule",
    ],
)
def test_loaders_are_requested_around_the_sanity_check(source):
    assert fit_recorded(source, sanity=2) == lines(WITH_SANITY[source])


@pytest.mark.parametrize("source", ["module", "datamodule"])
def test_loaders_without_a_sanity_check(source):
    assert fit_recorded(source, sanity=0) == lines(WITHOUT_SANITY[source])


def test_only_the_loader_order_around_the_sanity_check():
    """Point 1 alone, without the rest of the sequence: where the two loader requests fall."""
    calls = fit_recorded("datamodule", sanity=2)
    marks = (
        "C.on_fit_start",
        "C.on_sanity_check_start",
        "D.val_dataloader",
        "C.on_sanity_check_end",
        "D.train_dataloader",
        "C.on_train_start",
    )
    assert [c for c in calls if c in marks] == list(marks)


# ------------------------------------------------------------------------------------ 2. resume order
_PROBED: dict[str, Any] = {"saved": None, "module": None}  # the checkpoint's layer.weight, the resumed module


def probe(trainer: Any) -> str:
    """What a hook sees: the first optimizer's state, global_step, current_epoch, and whose weights the module holds."""
    opts = trainer.optimizers
    opt = "none" if not opts else ("loaded" if opts[0].state else "empty")
    saved, module = _PROBED["saved"], _PROBED["module"]
    w = (
        "?"
        if saved is None or module is None
        else ("ckpt" if torch.equal(module.layer.weight.detach(), saved) else "init")
    )
    return f"[opt={opt},step={trainer.global_step},epoch={trainer.current_epoch},w={w}]"


class ResumeModule(RecordingHookModule):
    """SGD with momentum (its state is empty until the first step, or until it is loaded); probes its hooks."""

    def configure_optimizers(self) -> Any:
        self.calls.append("M.configure_optimizers" + probe(self.trainer))
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.calls.append("M.on_load_checkpoint" + probe(self.trainer))

    def configure_model(self) -> None:
        self.calls.append("M.configure_model" + probe(self.trainer))

    def on_fit_start(self) -> None:
        self.calls.append("M.on_fit_start" + probe(self.trainer))

    def on_train_start(self) -> None:
        self.calls.append("M.on_train_start" + probe(self.trainer))


class StateCallback(HookCallback):
    """A callback with state; its ``state_dict`` is not recorded (see the resume test)."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__(calls)
        self.value = 0
        self.trainer: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"value": 5}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls.append(f"C.load_state_dict(value={state_dict['value']})" + probe(self.trainer))
        self.value = state_dict["value"]

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        self.trainer = trainer
        self.calls.append("C.setup" + probe(trainer))

    def on_load_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        self.calls.append("C.on_load_checkpoint" + probe(trainer) + f"[value={self.value}]")

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.calls.append("C.on_fit_start" + probe(trainer))

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.calls.append("C.on_train_start" + probe(trainer))


class StateData(RecordingData):
    def train_dataloader(self) -> DataLoader:
        self.calls.append("D.train_dataloader" + probe(self.trainer))
        return _loader(2)

    def val_dataloader(self) -> DataLoader:
        self.calls.append("D.val_dataloader" + probe(self.trainer))
        return _loader(1)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": 7}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls.append(f"D.load_state_dict(seen={state_dict['seen']})" + probe(self.trainer))


# Lightning 2.6.6, resuming a 1-epoch fit (2 steps) with max_epochs=2: the module's weights (on_load_checkpoint
# first), the datamodule's and the callbacks' states are restored after configure_model and before
# configure_optimizers; the optimizer state, global_step and current_epoch after on_fit_start and before the
# loaders are requested. Lightning calls no state_dict() while resuming (ember snapshots the callbacks' and the
# datamodule's state there; not asserted here).
RESUME_RESTORE = """
    M.configure_callbacks D.prepare_data M.prepare_data D.setup(stage='fit')
    C.setup[opt=none,step=0,epoch=0,w=init] M.setup(stage='fit')
    M.configure_model[opt=none,step=0,epoch=0,w=init]
    M.on_load_checkpoint[opt=none,step=0,epoch=0,w=init]
    M.load_state_dict(strict=)
    D.load_state_dict(seen=7)[opt=none,step=0,epoch=0,w=ckpt]
    C.on_load_checkpoint[opt=none,step=0,epoch=0,w=ckpt][value=0]
    C.load_state_dict(value=5)[opt=none,step=0,epoch=0,w=ckpt]
    M.configure_optimizers[opt=none,step=0,epoch=0,w=ckpt]
    C.on_fit_start[opt=empty,step=0,epoch=0,w=ckpt]
    M.on_fit_start[opt=empty,step=0,epoch=0,w=ckpt]
"""
RESUME_LOADERS = """
    D.train_dataloader[opt=loaded,step=2,epoch=1,w=ckpt]
    D.val_dataloader[opt=loaded,step=2,epoch=1,w=ckpt]
    C.on_train_start[opt=loaded,step=2,epoch=1,w=ckpt]
    M.on_train_start[opt=loaded,step=2,epoch=1,w=ckpt]
"""


def resumed(tmp_path: Any, sanity: int = 0) -> tuple[list[str], list[str]]:
    """Fit 1 epoch, save, resume with max_epochs=2 (and ``sanity`` sanity-check steps): the calls up to and
    including M.on_fit_start, and the calls after it up to on_train_epoch_start."""
    path = str(tmp_path / "one_epoch.ckpt")
    first = trainer([], max_epochs=1, limit_val_batches=1, num_sanity_val_steps=0, callbacks=[StateCallback([])])
    first.fit(ResumeModule([]), datamodule=StateData([]))
    first.save_checkpoint(path)

    calls: list[str] = []
    module = ResumeModule(calls)
    _PROBED.update(saved=torch.load(path, weights_only=True)["state_dict"]["layer.weight"], module=module)
    try:
        torch.manual_seed(1)
        again = trainer(
            calls, max_epochs=2, limit_val_batches=1, num_sanity_val_steps=sanity, callbacks=[StateCallback(calls)]
        )
        again.fit(module, datamodule=StateData(calls), ckpt_path=path)
    finally:
        _PROBED.update(saved=None, module=None)
    assert again.global_step == 4
    fit_start = next(i for i, c in enumerate(calls) if c.startswith("M.on_fit_start"))
    return calls[: fit_start + 1], calls[fit_start + 1 : calls.index("C.on_train_epoch_start")]


def test_resume_restores_the_datamodule_and_callbacks_before_configure_optimizers(tmp_path):
    restore, _ = resumed(tmp_path)
    assert restore == lines(RESUME_RESTORE)


def test_resume_restores_the_optimizers_and_progress_before_the_loaders(tmp_path):
    _, rest = resumed(tmp_path)
    assert [
        c
        for c in rest
        if c.startswith(("D.train_dataloader", "D.val_dataloader", "C.on_train_start", "M.on_train_start"))
    ] == lines(RESUME_LOADERS)


# Lightning 2.6.6, the same resume with num_sanity_val_steps=1: the sanity check runs on a resume too, after the
# training state is restored (the validation loader sees the loaded optimizer state and step 2).
RESUME_SANITY = """
    C.on_sanity_check_start
    D.val_dataloader[opt=loaded,step=2,epoch=1,w=ckpt]
    C.on_sanity_check_end
    D.train_dataloader[opt=loaded,step=2,epoch=1,w=ckpt]
    C.on_train_start[opt=loaded,step=2,epoch=1,w=ckpt]
    M.on_train_start[opt=loaded,step=2,epoch=1,w=ckpt]
"""


def test_a_resume_runs_the_sanity_check_after_restoring_the_training_state(tmp_path):
    _, rest = resumed(tmp_path, sanity=1)
    assert [
        c
        for c in rest
        if c.startswith(
            ("C.on_sanity_check", "D.train_dataloader", "D.val_dataloader", "C.on_train_start", "M.on_train_start")
        )
    ] == lines(RESUME_SANITY)


# ------------------------------------------------------------------------------------ 3. global_step, log steps
class StepModule(ember.TrainModule):
    """Records ``trainer.global_step`` in the batch hooks; logs ``b`` (the batch index) every step."""

    def __init__(self, seen: list[str], n_val: int = 0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen = seen
        self.n_val = n_val

    def _seen(self, what: str) -> None:
        self.seen.append(f"{what}:{self.trainer.global_step}")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._seen(f"M.training_step({batch_idx})")
        self.log("b", float(batch_idx))
        if self.n_val:
            self.log("e", float(batch_idx), on_step=False, on_epoch=True)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("v", float(batch_idx))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._seen(f"M.on_train_batch_start({batch_idx})")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._seen(f"M.on_train_batch_end({batch_idx})")

    def on_after_backward(self) -> None:
        self._seen("M.on_after_backward")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._seen("M.on_before_optimizer_step")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return _loader(4)

    def val_dataloader(self) -> DataLoader:
        return _loader(self.n_val)


class StepCallback(Callback):
    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(f"C.on_train_batch_start({batch_idx}):{trainer.global_step}")

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(f"C.on_train_batch_end({batch_idx}):{trainer.global_step}")

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        self.seen.append(f"C.on_after_backward:{trainer.global_step}")

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.seen.append(f"C.on_before_optimizer_step:{trainer.global_step}")


class StepLogger(Logger):
    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.records.append((step, {k: float(v) for k, v in sorted(metrics.items())}))


def step_fit(accumulate: int, max_epochs: int = 1, n_val: int = 0) -> tuple[list[str], StepLogger, ember.Trainer]:
    seen: list[str] = []
    logger = StepLogger()
    t = ember.Trainer(
        max_epochs=max_epochs,
        limit_train_batches=4,
        limit_val_batches=n_val,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[StepCallback(seen)],
        enable_progress_bar=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    t.fit(StepModule(seen, n_val))
    return seen, logger, t


# Lightning 2.6.6, 4 batches: global_step already counts the batch's optimizer step in on_train_batch_end (callback
# and module); everywhere before (on_train_batch_start, training_step, on_after_backward, on_before_optimizer_step)
# it does not.
STEPS = {
    1: """
    C.on_train_batch_start(0):0 M.on_train_batch_start(0):0 M.training_step(0):0 C.on_after_backward:0
    M.on_after_backward:0 C.on_before_optimizer_step:0 M.on_before_optimizer_step:0
    C.on_train_batch_end(0):1 M.on_train_batch_end(0):1
    C.on_train_batch_start(1):1 M.on_train_batch_start(1):1 M.training_step(1):1 C.on_after_backward:1
    M.on_after_backward:1 C.on_before_optimizer_step:1 M.on_before_optimizer_step:1
    C.on_train_batch_end(1):2 M.on_train_batch_end(1):2
    C.on_train_batch_start(2):2 M.on_train_batch_start(2):2 M.training_step(2):2 C.on_after_backward:2
    M.on_after_backward:2 C.on_before_optimizer_step:2 M.on_before_optimizer_step:2
    C.on_train_batch_end(2):3 M.on_train_batch_end(2):3
    C.on_train_batch_start(3):3 M.on_train_batch_start(3):3 M.training_step(3):3 C.on_after_backward:3
    M.on_after_backward:3 C.on_before_optimizer_step:3 M.on_before_optimizer_step:3
    C.on_train_batch_end(3):4 M.on_train_batch_end(3):4
    """,
    2: """
    C.on_train_batch_start(0):0 M.on_train_batch_start(0):0 M.training_step(0):0 C.on_after_backward:0
    M.on_after_backward:0
    C.on_train_batch_end(0):0 M.on_train_batch_end(0):0
    C.on_train_batch_start(1):0 M.on_train_batch_start(1):0 M.training_step(1):0 C.on_after_backward:0
    M.on_after_backward:0 C.on_before_optimizer_step:0 M.on_before_optimizer_step:0
    C.on_train_batch_end(1):1 M.on_train_batch_end(1):1
    C.on_train_batch_start(2):1 M.on_train_batch_start(2):1 M.training_step(2):1 C.on_after_backward:1
    M.on_after_backward:1
    C.on_train_batch_end(2):1 M.on_train_batch_end(2):1
    C.on_train_batch_start(3):1 M.on_train_batch_start(3):1 M.training_step(3):1 C.on_after_backward:1
    M.on_after_backward:1 C.on_before_optimizer_step:1 M.on_before_optimizer_step:1
    C.on_train_batch_end(3):2 M.on_train_batch_end(3):2
    """,
}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_global_step_in_the_batch_hooks(accumulate):
    seen, _, t = step_fit(accumulate)
    assert t.global_step == 4 // accumulate
    assert seen == lines(STEPS[accumulate])


def test_global_step_before_the_optimizer_step_matches():
    """The part of point 3 ember matches: every hook before on_train_batch_end."""
    for accumulate in (1, 2):
        seen, _, _ = step_fit(accumulate)
        expected = [s for s in lines(STEPS[accumulate]) if "on_train_batch_end" not in s]
        assert [s for s in seen if "on_train_batch_end" not in s] == expected


# Lightning 2.6.6, log_every_n_steps=1, 2 epochs of 4 batches, 2 validation batches per epoch: a training step's
# metrics are written at the step index before its optimizer step (global_step - 1 after it: 0, 1, 2, ...); only
# the batches that step write (with accumulation the accumulating batches' values are not written); validation and
# epoch-end metrics are written at the epoch's last step index. Every record carries "epoch".
LOGGED = {
    1: [
        (0, {"b": 0.0, "epoch": 0.0}),
        (1, {"b": 1.0, "epoch": 0.0}),
        (2, {"b": 2.0, "epoch": 0.0}),
        (3, {"b": 3.0, "epoch": 0.0}),
        (3, {"epoch": 0.0, "v": 0.5}),
        (3, {"e": 1.5, "epoch": 0.0}),
        (4, {"b": 0.0, "epoch": 1.0}),
        (5, {"b": 1.0, "epoch": 1.0}),
        (6, {"b": 2.0, "epoch": 1.0}),
        (7, {"b": 3.0, "epoch": 1.0}),
        (7, {"epoch": 1.0, "v": 0.5}),
        (7, {"e": 1.5, "epoch": 1.0}),
    ],
    2: [
        (0, {"b": 1.0, "epoch": 0.0}),
        (1, {"b": 3.0, "epoch": 0.0}),
        (1, {"epoch": 0.0, "v": 0.5}),
        (1, {"e": 1.5, "epoch": 0.0}),
        (2, {"b": 1.0, "epoch": 1.0}),
        (3, {"b": 3.0, "epoch": 1.0}),
        (3, {"epoch": 1.0, "v": 0.5}),
        (3, {"e": 1.5, "epoch": 1.0}),
    ],
}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_logged_steps(accumulate):
    _, logger, _ = step_fit(accumulate, max_epochs=2, n_val=2)
    assert logger.records == LOGGED[accumulate]


def test_logged_values_match_lightnings_apart_from_the_step():
    for accumulate in (1, 2):
        _, logger, _ = step_fit(accumulate, max_epochs=2, n_val=2)
        assert [m for _, m in logger.records] == [m for _, m in LOGGED[accumulate]]


# ------------------------------------------------------------------------------------ 4. optimizer_step, backward
class LBFGSModule(ember.TrainModule):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen = seen

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(f"training_step({batch_idx}):{self.trainer.global_step}")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append(f"on_before_optimizer_step:{self.trainer.global_step}")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(f"on_train_batch_end({batch_idx})")  # global_step here is point 3

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)

    def train_dataloader(self) -> DataLoader:
        return _loader(4)


class LBFGSOverride(LBFGSModule):
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        self.seen.append(f"optimizer_step({epoch},{batch_idx}):{self.trainer.global_step}")
        optimizer.step(closure=optimizer_closure)
        self.seen.append(f"optimizer_step_done({batch_idx}):{self.trainer.global_step}")


def lbfgs_fit(cls: type[LBFGSModule]) -> tuple[list[str], LBFGSModule, ember.Trainer]:
    seen: list[str] = []
    torch.manual_seed(0)
    module = cls(seen)
    t = ember.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    t.fit(module)
    return seen, module, t


# Lightning 2.6.6, LBFGS(max_iter=3), 2 batches: LBFGS calls the closure 3 times per batch, each running
# training_step and (after backward) on_before_optimizer_step; global_step counts one step per batch.
LBFGS_DEFAULT = """
    training_step(0):0 on_before_optimizer_step:0 training_step(0):0 on_before_optimizer_step:0
    training_step(0):0 on_before_optimizer_step:0 on_train_batch_end(0)
    training_step(1):1 on_before_optimizer_step:1 training_step(1):1 on_before_optimizer_step:1
    training_step(1):1 on_before_optimizer_step:1 on_train_batch_end(1)
"""
# ... and an overridden optimizer_step is called once per batch, the closure calls inside its optimizer.step.
LBFGS_OVERRIDE = """
    optimizer_step(0,0):0
    training_step(0):0 on_before_optimizer_step:0 training_step(0):0 on_before_optimizer_step:0
    training_step(0):0 on_before_optimizer_step:0
    optimizer_step_done(0):0 on_train_batch_end(0)
    optimizer_step(0,1):1
    training_step(1):1 on_before_optimizer_step:1 training_step(1):1 on_before_optimizer_step:1
    training_step(1):1 on_before_optimizer_step:1
    optimizer_step_done(1):1 on_train_batch_end(1)
"""


def test_lbfgs_calls_training_step_per_closure_and_counts_one_step_per_batch():
    seen, _, t = lbfgs_fit(LBFGSModule)
    assert seen == lines(LBFGS_DEFAULT)
    assert t.global_step == 2


def test_lbfgs_with_an_overridden_optimizer_step():
    seen, module, t = lbfgs_fit(LBFGSOverride)
    _, plain, _ = lbfgs_fit(LBFGSModule)
    assert seen == lines(LBFGS_OVERRIDE)
    assert t.global_step == 2
    assert torch.equal(module.layer.weight, plain.layer.weight)  # the override only forwards the closure


class BackwardModule(ember.TrainModule):
    """Records each call of its overridden ``backward`` (as Lightning calls it in automatic optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.seen.append(f"backward(step={self.trainer.global_step},args={len(args)},kwargs={sorted(kwargs)})")
        loss.backward()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return _loader(8)


def _backward_rank(rank: int, world: int) -> list[str]:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )
    torch.manual_seed(0)
    module = BackwardModule()
    ember.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        accelerator="cpu",
        strategy="ddp",
        devices=world,
    ).fit(module)
    return module.seen


# Lightning 2.6.6 (strategy="ddp" and "ddp_spawn", devices=2 on CPU): the override is called on every rank, once per
# batch, with the loss alone.
BACKWARD_DDP = ["backward(step=0,args=0,kwargs=[])", "backward(step=1,args=0,kwargs=[])"]


def test_backward_override_without_ddp():
    module = BackwardModule()
    ember.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        accelerator="cpu",
    ).fit(module)
    assert module.seen == BACKWARD_DDP


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_backward_override_under_ddp():
    assert run_ranks(_backward_rank, 2, timeout=50) == [BACKWARD_DDP, BACKWARD_DDP]


def test_a_stop_requested_in_on_fit_start_skips_training():
    """Lightning 2.6.6: should_stop set in on_fit_start -> on_fit_start, on_sanity_check_start, on_fit_end;
    no on_train_start / on_train_end, global_step 0."""
    calls: list[str] = []

    class Stops(Callback):
        def on_fit_start(self, trainer: Any, module: Any) -> None:
            trainer.should_stop = True
            calls.append("on_fit_start")

        def on_train_start(self, trainer: Any, module: Any) -> None:
            calls.append("on_train_start")

        def on_train_end(self, trainer: Any, module: Any) -> None:
            calls.append("on_train_end")

        def on_fit_end(self, trainer: Any, module: Any) -> None:
            calls.append("on_fit_end")

        def on_sanity_check_start(self, trainer: Any, module: Any) -> None:
            calls.append("on_sanity_check_start")

    t = ember.Trainer(
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[Stops()],
        accelerator="cpu",
    )
    t.fit(RecordingHookModule([]))
    assert calls == ["on_fit_start", "on_sanity_check_start", "on_fit_end"] and t.global_step == 0
