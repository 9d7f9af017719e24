"""A training script with the default Trainer configuration (logger and checkpointing on) that the
exit-status tests run as a real program: ``python exit_script.py --out DIR [--strategy ddp_spawn|dp|auto]``
(``auto``: one process on one device).

Each rank writes ``<out>/pid<r>`` when fit starts (so a test can check that no process outlived
the job), ``<out>/training<r>`` once it has taken a few steps (so a test knows when a signal
lands mid-training), and ``<out>/exception<r>``, the exception's type, from a callback's
``on_exception``. Steps are slowed down a little so that training outlasts any signal.
``--end exit3|segv|term|term-abort --end-rank r`` makes rank ``r`` end that way at step 3:
``os._exit(3)``, SIGSEGV, a SIGTERM sent to itself alone, or that SIGTERM and then ``os.abort()`` once
the job has stopped (a rank that dies on its way out).

Each process writes ``<out>/threads-<pid>``: the native threads still alive once every exit handler
(ember's included) has run, which is when the interpreter starts to shut down; no gloo thread may be
among them (one that outlives the interpreter can abort the process on its way out). It starts as a
program started from a terminal does: Ctrl-C raises KeyboardInterrupt, whatever the harness that
started it ignored or blocked (inherited dispositions and masks survive exec); what it inherited is
written to ``<out>/inherited-<pid>``.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember

_OUT: list[str] = []  # the --out directory, once this process knows it (at fit start)


def _record_threads() -> None:
    """Registered before ember is imported, so it runs after ember's exit handlers (atexit runs them in
    reverse order): the threads left when the interpreter starts to shut down."""
    if _OUT and os.path.isdir("/proc/self/task"):
        names = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        with open(os.path.join(_OUT[0], f"threads-{os.getpid()}"), "w") as f:
            f.write("\n".join(names))


atexit.register(_record_threads)
_BLOCKED = sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))
_INHERITED = f"SIGINT {signal.getsignal(signal.SIGINT)!r}, blocked {_BLOCKED}"
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
atexit.register(gc.freeze)  # end without the shutdown garbage collection: see tests/conftest.py

STEPS = 3000  # far more than any test lets run


class RecordException(ember.callbacks.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_exception(self, trainer, module, exception: BaseException) -> None:
        with open(os.path.join(self.out, f"exception{trainer.global_rank}"), "w") as f:
            f.write(type(exception).__name__)


class Net(ember.TrainModule):
    def __init__(self, out: str, end: str = "none", end_rank: int = -1) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.out, self.end, self.end_rank = out, end, end_rank

    def on_fit_start(self) -> None:
        _OUT[:] = [self.out]
        self._touch(f"inherited-{os.getpid()}", _INHERITED)
        self._touch(f"pid{self.global_rank}", str(os.getpid()))

    def training_step(self, batch, batch_idx):
        if batch_idx == 3 and self.global_rank == self.end_rank:
            if self.end == "exit3":
                os._exit(3)
            if self.end == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.end in ("term", "term-abort"):
                if self.end == "term-abort":
                    atexit.register(os.abort)  # stops with the others, then dies on its way out
                os.kill(os.getpid(), signal.SIGTERM)
        if batch_idx == 5:
            self._touch(f"training{self.global_rank}", "")
        time.sleep(0.01)
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def _touch(self, name: str, text: str) -> None:
        with open(os.path.join(self.out, name), "w") as f:
            f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--end", default="none")
    parser.add_argument("--end-rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 2, 4, generator=g), torch.randn(STEPS * 2, 1, generator=g))
    trainer = ember.Trainer(
        strategy=args.strategy,
        devices=1 if args.strategy == "auto" else 2,
        accelerator="cpu",
        max_epochs=1,
        enable_progress_bar=False,
        callbacks=[RecordException(args.out)],
    )
    trainer.fit(Net(args.out, args.end, args.end_rank), DataLoader(data, batch_size=1))


if __name__ == "__main__":
    main()
