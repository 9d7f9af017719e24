"""The warnings ember raises point at the user's line, never at ember's source (``ember/user_frames.py``).

Each test triggers one warning the way a user does (a call from this file, directly or through ``trainer.fit``)
and checks that ``warnings`` names this file. Two unit checks of ``user_stacklevel`` itself: torch's
``nn.Module.__call__`` between the user's call and ember's ``forward`` is passed over, and a thread ember
started, with no user frame at all, names no file (``sys``) rather than ``threading.py``.
"""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ember
from ember.loggers import TensorBoardLogger
from ember.parallel.distributed import DistributedDataParallel
from ember.parallel.scatter_gather import gather
from ember.tuner.lr_finder import LRFinder
from tests.helpers.models import BoringModel, fast_trainer, regression_loader

EMBER_DIR = os.path.dirname(os.path.abspath(ember.__file__))


def only(record, text: str) -> warnings.WarningMessage:
    (found,) = [w for w in record if text in str(w.message)]
    return found


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_wrapper_nothing_unused_points_at_the_users_call_through_module_call(group):
    ddp = DistributedDataParallel(nn.Linear(4, 4), find_unused_parameters=True)
    with pytest.warns(UserWarning) as record:
        ddp(torch.randn(2, 4)).sum().backward()
    w = only(record, "every parameter received a gradient")
    assert w.filename == __file__, w
    assert "pass find_unused_parameters=False" in str(w.message)  # the engine's own words, for its users


def test_gathering_scalars_points_at_the_users_call():
    with pytest.warns(UserWarning) as record:
        gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu")
    assert only(record, "were scalars").filename == __file__


def test_tensorboard_log_graph_without_an_input_points_at_the_users_call(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), log_graph=True)
    with pytest.warns(UserWarning) as record:
        logger.log_graph(BoringModel())
    assert only(record, "Could not log the computational graph").filename == __file__
    logger.finalize("success")


def test_lr_finder_without_enough_points_points_at_the_users_call():
    finder = LRFinder("exponential", 1e-3, 1.0, 3)
    finder.results = {"lr": [1.0, 2.0, 3.0], "loss": [3.0, 2.0, 1.0]}
    with pytest.warns(UserWarning) as record:
        assert finder.suggestion() is None
    assert only(record, "too few points").filename == __file__


def test_tuner_under_fast_dev_run_points_at_the_users_call():
    tuner = ember.tuner.Tuner(fast_trainer(fast_dev_run=True))
    with pytest.warns(UserWarning) as record:
        assert tuner.lr_find(BoringModel(), regression_loader()) is None
    assert only(record, "Skipping the learning rate finder").filename == __file__


class WithHparams(BoringModel):
    def __init__(self, d: int = 4, lr: float = 0.1) -> None:
        super().__init__(d, lr)
        self.save_hyperparameters()


def test_load_from_checkpoint_with_an_unknown_argument_points_at_the_users_call(tmp_path):
    trainer = fast_trainer(max_steps=1)
    trainer.fit(WithHparams(), regression_loader(n=8), regression_loader(n=8))
    path = str(tmp_path / "m.ckpt")
    trainer.save_checkpoint(path)
    with pytest.warns(UserWarning) as record:
        WithHparams.load_from_checkpoint(path, nonsense=1)
    assert only(record, "takes no argument named ['nonsense']").filename == __file__


# ------------------------------------------------------------------------------ user_stacklevel itself
def as_embers(source: str, name: str) -> dict:
    """Runs ``source`` as if it were a file of ember's (its frames count as ember's), returning its namespace."""
    namespace: dict = {"warnings": warnings, "nn": nn}
    exec(compile(source, os.path.join(EMBER_DIR, f"_test_{name}.py"), "exec"), namespace)  # noqa: S102
    return namespace


WARNS = """
from ember.user_frames import user_stacklevel

def warn():
    warnings.warn("from ember", UserWarning, stacklevel=user_stacklevel())

class Warns(nn.Module):
    def forward(self, x):
        warn()
        return x
"""


def test_torch_module_call_between_the_user_and_ember_is_passed_over():
    module = as_embers(WARNS, "module")["Warns"]()
    with pytest.warns(UserWarning) as record:
        module(torch.zeros(1))
    assert only(record, "from ember").filename == __file__


def test_a_thread_ember_started_names_no_file_rather_than_threading():
    warn = as_embers(WARNS, "thread")["warn"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        thread = threading.Thread(target=warn)  # as if ember had started it: warn() is ember's
        thread.start()
        thread.join()
    assert only(record, "from ember").filename == "sys"


def test_callbacks_and_trainer_warnings_point_at_the_users_fit(tmp_path):
    # ModelCheckpoint saving (every 2 steps) before its monitored key is logged; a callback's on_exception
    # raising while another error ends the fit.
    class Raises(ember.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 3:
                raise KeyError("stop")

        def on_exception(self, trainer, module, exception):
            raise RuntimeError("in on_exception")

    checkpoint = ember.callbacks.ModelCheckpoint(dirpath=str(tmp_path), monitor="val_loss", every_n_train_steps=2)
    trainer = fast_trainer(max_epochs=1, callbacks=[checkpoint, Raises()], default_root_dir=str(tmp_path),
                           enable_checkpointing=True)  # fmt: skip
    with pytest.warns(UserWarning) as record, pytest.raises(KeyError):
        trainer.fit(BoringModel(), regression_loader(), regression_loader())
    assert only(record, "could not find 'val_loss'").filename == __file__
    assert only(record, "on_exception raised RuntimeError").filename == __file__


def test_rank_zero_warnings_point_at_the_users_call_too(monkeypatch):
    # rank_zero_warn adds lightning-utilities' frames between ember's call and warnings.warn.
    pytest.importorskip("jsonargparse")
    from ember.cli import EmberCLI

    monkeypatch.setattr("sys.argv", ["prog", "--trainer.max_epochs=1"])
    with pytest.warns(UserWarning) as record:
        EmberCLI(BoringModel, run=False, args=[])
    assert only(record, "was given both args= and command-line arguments").filename == __file__
