"""A custom Callback and a custom Logger, used together on the digits CNN of ``digits.py``.

- ``JSONLinesLogger`` subclasses ``ember.loggers.Logger``: ``log_hyperparams``, ``log_metrics``
  and ``finalize`` each append one JSON object per line to ``<save_dir>/jsonl/version_N/metrics.jsonl``
  (on rank zero only). Having a ``save_dir``, it is also where checkpoints go.
- ``TargetAccuracy`` subclasses ``ember.callbacks.Callback``: after each validation it prints the
  epoch's accuracy, and once it reaches ``--target`` it sets ``trainer.should_stop`` to end the fit.

Run (from any directory; files go under the current one)::

    python examples/custom_callback_logger.py          # at most 10 epochs: about 10 s on 2 CPU cores

It prints, with the numbers of your run::

    epoch 0: val/acc 0.8500
    epoch 1: val/acc 0.9194
    epoch 2: val/acc 0.9611 -> reached the target 0.95, stopping
    3 epochs; the JSON lines logger wrote 11 records to ./jsonl/version_0/metrics.jsonl
    checkpoints in jsonl/version_0/checkpoints

and ``metrics.jsonl`` reads::

    {"hparams": {"lr": 0.003, "channels": 32}}
    {"step": 9, "metrics": {"train/loss": 1.906..., "epoch": 0.0}}
    {"step": 19, "metrics": {"train/loss": 0.795..., "epoch": 0.0}}
    {"step": 22, "metrics": {"val/loss": 0.583..., "val/acc": 0.850..., "epoch": 0.0}}
    ...
    {"status": "success"}

``--max-epochs``, ``--limit-batches`` and ``--target`` change the run; ``--root-dir`` where it writes.
"""

from __future__ import annotations

import argparse
import json
import os

from digits import DigitsCNN, digits_loaders  # the module beside this file

import ember


class JSONLinesLogger(ember.loggers.Logger):
    """Appends each logging event to ``<save_dir>/jsonl/version_N/metrics.jsonl`` as one JSON object."""

    def __init__(self, save_dir: str = ".") -> None:
        self._save_dir = save_dir
        self._version: int | None = None
        self._writes = True

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def version(self) -> int:
        if self._version is None:  # the first version_N not taken yet, chosen once
            root = os.path.join(self._save_dir, self.name)
            taken = set(os.listdir(root)) if os.path.isdir(root) else set()
            self._version = next(n for n in range(len(taken) + 1) if f"version_{n}" not in taken)
        return self._version

    @property
    def path(self) -> str:
        return os.path.join(self.log_dir, "metrics.jsonl")

    def setup(self, trainer, module, stage):
        self._writes = trainer.is_global_zero  # several ddp ranks: only rank zero writes

    def _write(self, record: dict) -> None:
        if self._writes:
            os.makedirs(self.log_dir, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    def log_hyperparams(self, params=None, metrics=None, step=None):
        self._write({"hparams": ember.loggers.logger.hparams_dict(params)})

    def log_metrics(self, metrics, step=None):
        self._write({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}})

    def finalize(self, status):
        self._write({"status": status})


class TargetAccuracy(ember.callbacks.Callback):
    """Prints each epoch's validation accuracy and stops the fit once it reaches ``target``."""

    def __init__(self, target: float, monitor: str = "val/acc") -> None:
        self.target, self.monitor = target, monitor
        self.history: list[float] = []

    def on_validation_epoch_end(self, trainer, module):
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        value = float(trainer.callback_metrics[self.monitor])
        self.history.append(value)
        line = f"epoch {trainer.current_epoch}: {self.monitor} {value:.4f}"
        if value >= self.target:
            trainer.should_stop = True  # the fit ends after this epoch
            line += f" -> reached the target {self.target:g}, stopping"
        if trainer.is_global_zero:
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-epochs", type=int, default=10)
    parser.add_argument("--limit-batches", type=int, default=None, help="training batches per epoch")
    parser.add_argument("--target", type=float, default=0.95, help="stop once val/acc reaches this")
    parser.add_argument("--root-dir", default=".", help="where logs and checkpoints go (default: cwd)")
    args = parser.parse_args()

    ember.seed_everything(0)
    train, val = digits_loaders()
    logger, target = JSONLinesLogger(args.root_dir), TargetAccuracy(args.target)
    trainer = ember.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=args.max_epochs,
        limit_train_batches=args.limit_batches,
        default_root_dir=args.root_dir,
        logger=logger,
        callbacks=[target],
        log_every_n_steps=10,
        enable_progress_bar=False,
    )
    trainer.fit(DigitsCNN(), train, val)
    with open(logger.path, encoding="utf-8") as fh:
        records = sum(1 for _ in fh)
    print(f"{len(target.history)} epochs; the JSON lines logger wrote {records} records to {logger.path}")
    print(f"checkpoints in {os.path.relpath(os.path.dirname(trainer.checkpoint_callback.best_model_path))}")


if __name__ == "__main__":
    main()
