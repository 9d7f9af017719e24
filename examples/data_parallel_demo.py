"""The classic data-parallel demonstration, on ember's engine and on CPU replicas.

A random data set of 100 samples of size 5, batches of 30, and a ``Linear(5, 2)`` model whose
forward prints the input and output sizes it sees. With N replicas each batch of 30 is split into
chunks (15 + 15 for two, 10 + 10 + 10 for three; the last batch of 10 into 5 + 5 or 4 + 4 + 2),
each replica prints its chunk, and the output is gathered back to the full batch. The model is
seeded, so ``--strategy dp`` and ``--strategy single`` print the same losses: the dp loss is the
chunk-size-weighted mean of the replicas' losses, which is the loss of the whole batch.

The same thing twice:

1. ``ember.parallel.DataParallel`` (a drop-in for ``torch.nn.DataParallel``) in a plain loop;
2. ``ember.Trainer(strategy="dp", devices=N)`` with a ``TrainModule``.

Run::

    python examples/data_parallel_demo.py --devices 2
    python examples/data_parallel_demo.py --part trainer --strategy dp --devices 3
    python examples/data_parallel_demo.py --part loop --accelerator cuda --devices 2   # on GPUs
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone without installing

import ember  # noqa: E402
from ember.parallel import DataParallel  # noqa: E402

INPUT_SIZE, OUTPUT_SIZE, DATA_SIZE, BATCH_SIZE = 5, 2, 100, 30


class RandomDataset(Dataset):
    """``length`` random vectors of size ``size``."""

    def __init__(self, size: int, length: int) -> None:
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(0))

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return len(self.data)


def say(*parts: Any) -> None:
    # Replicas print from their own threads: one write per line keeps lines whole.
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


class Model(nn.Module):
    """A Linear layer that tells what it sees."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.fc(x)
        say(
            f"\tIn Model ({threading.current_thread().name}): input size",
            tuple(x.shape),
            "output size",
            tuple(output.shape),
        )
        return output


def device_ids(accelerator: str, n: int) -> list[Any]:
    return list(range(n)) if accelerator == "cuda" else ["cpu"] * n


def hand_written_loop(accelerator: str, devices: int) -> None:
    say(f"== ember.parallel.DataParallel in a hand-written loop, {devices} {accelerator} replica(s) ==")
    loader = DataLoader(RandomDataset(INPUT_SIZE, DATA_SIZE), batch_size=BATCH_SIZE)
    ids = device_ids(accelerator, devices)
    torch.manual_seed(0)
    model = Model(INPUT_SIZE, OUTPUT_SIZE).to("cuda:0" if accelerator == "cuda" else "cpu")
    model = DataParallel(model, device_ids=ids)  # the one line that changes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, data in enumerate(loader):
        output = model(data)  # data may stay on the CPU: scatter sends each chunk to its device
        say(f"Outside (step {step}): input size", tuple(data.shape), "gathered output size", tuple(output.shape))
        loss = output.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # every replica's gradient lands in model.module's parameters
        optimizer.step()


class DemoModule(ember.TrainModule):
    """The same model as a TrainModule: pull the outputs towards zero, print what it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(INPUT_SIZE, OUTPUT_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        output = self(batch)
        loss = output.pow(2).mean()
        self.log("loss", loss)  # combined over the replicas, weighted by chunk size
        return {"loss": loss, "output": output.detach()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SayGathered(ember.callbacks.Callback):
    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        say(
            f"Outside (step {batch_idx}): input size",
            tuple(batch.shape),
            "gathered output size",
            tuple(outputs["output"].shape),
            f"loss {float(outputs['loss'].detach()):.4f}",
        )


def with_the_trainer(strategy: str, accelerator: str, devices: int) -> None:
    say(f"\n== ember.Trainer(strategy={strategy!r}, devices={devices}), {accelerator} ==")
    loader = DataLoader(RandomDataset(INPUT_SIZE, DATA_SIZE), batch_size=BATCH_SIZE)
    trainer = ember.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=devices,
        max_epochs=1,
        callbacks=[SayGathered()],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    torch.manual_seed(0)
    trainer.fit(DemoModule(), loader)
    say("logged loss (last step):", f"{float(trainer.callback_metrics['loss']):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="ember's data-parallel demonstration")
    parser.add_argument("--part", choices=["loop", "trainer", "both"], default="both")
    parser.add_argument("--strategy", default="dp", help="for the Trainer part: dp or single")
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="number of replicas")
    args = parser.parse_args()
    if args.part in ("loop", "both"):
        hand_written_loop(args.accelerator, args.devices)
    if args.part in ("trainer", "both"):
        devices = 1 if args.strategy == "single" else args.devices
        with_the_trainer(args.strategy, args.accelerator, devices)


if __name__ == "__main__":
    main()
