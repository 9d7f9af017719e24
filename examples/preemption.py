"""Resume after preemption: SIGTERM mid-fit saves ``last.ckpt`` and exits 143; ``ckpt_path="last"`` continues.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM before they kill a job. During ``fit``
ember catches it, finishes the current step, writes ``last.ckpt`` and exits with status 143
(128 + SIGTERM), as a killed process would; running the same script with ``ckpt_path="last"``
continues from that step. Try it (run from any directory; logs go to ``./ember_logs``)::

    python examples/preemption.py --stop-after-step 30; echo "exit status $?"
    python examples/preemption.py --resume

The first command sends itself SIGTERM after step 30 (a real scheduler's ``kill -TERM <pid>`` does
the same) and prints::

    sending SIGTERM to myself after step 30
    preempted at step 30: saved .../ember_logs/version_0/checkpoints/last.ckpt
    exit status 143

The second resumes and trains to the end (5 epochs of 23 steps)::

    resumed from step 30 (epoch 1)
    finished at step 115 (5 epochs), validation accuracy 0.9...

Without ``--resume`` and ``--stop-after-step`` it trains from scratch, and ``kill -TERM`` from
another shell preempts it just the same. ``--max-epochs`` and ``--limit-batches`` make it smaller.
"""

from __future__ import annotations

import argparse
import os
import signal

from digits import DigitsCNN, digits_loaders  # the module beside this file

import ember
from ember.exceptions import Preempted


class StepReporter(ember.callbacks.Callback):
    """Prints where training starts (after a resume: the restored step) and, with ``stop_after``,
    sends this process SIGTERM once that many steps are done, as a scheduler would."""

    def __init__(self, stop_after: int | None, every: int) -> None:
        self.stop_after = stop_after
        self.every = every

    def on_train_start(self, trainer, module):
        if trainer.global_step:
            print(f"resumed from step {trainer.global_step} (epoch {trainer.current_epoch})", flush=True)
        else:
            print("training from scratch", flush=True)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self.every and step % self.every == 0:
            print(f"step {step}", flush=True)  # a marker a watching process can wait for
        if step == self.stop_after:
            print(f"sending SIGTERM to myself after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the end of this step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resume", action="store_true", help='continue with ckpt_path="last"')
    parser.add_argument("--stop-after-step", type=int, default=None, help="SIGTERM this process after this step")
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--limit-batches", type=int, default=None, help="training batches per epoch")
    parser.add_argument("--print-every", type=int, default=0, help='print "step N" every N steps (0: never)')
    parser.add_argument("--root-dir", default=None, help="where logs and checkpoints go (default: cwd)")
    args = parser.parse_args()

    ember.seed_everything(0)
    train, val = digits_loaders()
    trainer = ember.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=args.max_epochs,
        limit_train_batches=args.limit_batches,
        default_root_dir=args.root_dir,
        log_every_n_steps=10,
        enable_progress_bar=False,
        callbacks=[StepReporter(args.stop_after_step, args.print_every)],
    )
    try:
        trainer.fit(DigitsCNN(), train, val, ckpt_path="last" if args.resume else None)
    except Preempted as exc:  # a SystemExit: re-raised, the process ends with exc.code (143)
        print(f"preempted at step {trainer.global_step}: saved {exc.checkpoint_path}", flush=True)
        raise
    acc = float(trainer.callback_metrics["val/acc"])
    print(f"finished at step {trainer.global_step} ({trainer.current_epoch} epochs), validation accuracy {acc:.4f}")


if __name__ == "__main__":
    main()
