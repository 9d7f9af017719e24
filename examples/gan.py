"""Manual optimization: a small GAN that learns to draw scikit-learn's 8x8 digits (no download).

With ``automatic_optimization = False`` the module steps its optimizers itself: ``self.optimizers()``
gives the discriminator's and the generator's, ``self.manual_backward(loss)`` replaces
``loss.backward()``, and ``self.toggled_optimizer(opt)`` lets only that optimizer's parameters
compute gradients for the duration of a ``with`` block. Run::

    python examples/gan.py                    # 20 epochs of 29 batches: 8-30 s on 2 CPU cores

It prints one line per epoch with the epoch's mean losses (they move around as the two networks
compete: the discriminator's mostly between 0.5 and 1.3, the generator's between 1 and 3; one
going to 0 while the other grows would mean the game collapsed), then a generated digit in ASCII::

    epoch 1/20  d_loss 1.1952  g_loss 1.2544
    ...
    epoch 20/20  d_loss 0.8883  g_loss 1.8378
    trained 580 steps (one per batch, both optimizers stepping); a generated digit:
          ++%%%%++..
        ..@@==##%%
        ..##==##%%
          ...

``--max-epochs`` and ``--limit-batches`` make it smaller; ``--root-dir`` says where logs go.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember


class DigitsGAN(ember.TrainModule):
    def __init__(self, latent: int = 16, hidden: int = 128, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = torch.nn.Sequential(
            torch.nn.Linear(latent, hidden),
            torch.nn.LeakyReLU(0.2),
            torch.nn.Linear(hidden, hidden),
            torch.nn.LeakyReLU(0.2),
            torch.nn.Linear(hidden, 64),
            torch.nn.Sigmoid(),
        )
        self.discriminator = torch.nn.Sequential(
            torch.nn.Linear(64, hidden),
            torch.nn.LeakyReLU(0.2),
            torch.nn.Linear(hidden, hidden),
            torch.nn.LeakyReLU(0.2),
            torch.nn.Linear(hidden, 1),
        )
        self._sums: dict[str, float] = {}
        self._batches = 0

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Images (N, 8, 8) in [0, 1] from latent vectors (N, latent)."""
        return self.generator(z).view(-1, 8, 8)

    def training_step(self, batch, batch_idx):
        (real,) = batch
        real = real.flatten(1)
        n = real.shape[0]
        opt_d, opt_g = self.optimizers()
        ones, zeros = torch.ones(n, 1), torch.zeros(n, 1)

        # Discriminator: real images are 1, generated ones 0 (no gradient into the generator).
        with self.toggled_optimizer(opt_d):
            fake = self.generator(torch.randn(n, self.hparams.latent)).detach()
            d_loss = F.binary_cross_entropy_with_logits(
                self.discriminator(real), ones
            ) + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()

        # Generator: make the discriminator call its images real.
        with self.toggled_optimizer(opt_g):
            fake = self.generator(torch.randn(n, self.hparams.latent))
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)
        for name, value in (("d_loss", d_loss), ("g_loss", g_loss)):
            self._sums[name] = self._sums.get(name, 0.0) + value.item()
        self._batches += 1

    def on_train_epoch_end(self):
        means = {k: v / max(self._batches, 1) for k, v in self._sums.items()}
        print(
            f"epoch {self.current_epoch + 1}/{self.trainer.max_epochs}  "
            f"d_loss {means['d_loss']:.4f}  g_loss {means['g_loss']:.4f}",
            flush=True,
        )
        self._sums, self._batches = {}, 0

    def configure_optimizers(self):
        lr = self.hparams.lr
        return [
            torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999)),
            torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999)),
        ]


def digit_images(batch_size: int = 64) -> DataLoader:
    """All 1797 of scikit-learn's digits as (N, 8, 8) images in [0, 1], shuffled."""
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images, dtype=torch.float32) / 16.0
    return DataLoader(TensorDataset(x), batch_size=batch_size, shuffle=True)


def ascii_image(image: torch.Tensor) -> str:
    shades = " .:-=+*#%@"
    return "\n".join(
        "  " + "".join(shades[min(int(v * len(shades)), len(shades) - 1)] * 2 for v in row) for row in image.tolist()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-epochs", type=int, default=20)
    parser.add_argument("--limit-batches", type=int, default=None, help="training batches per epoch")
    parser.add_argument("--root-dir", default=None, help="where logs go (default: cwd)")
    args = parser.parse_args()

    ember.seed_everything(0)
    model = DigitsGAN()
    trainer = ember.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=args.max_epochs,
        limit_train_batches=args.limit_batches,
        default_root_dir=args.root_dir,
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, digit_images())
    model.eval()
    with torch.no_grad():
        sample = model(torch.randn(1, model.hparams.latent))[0]
    print(f"trained {trainer.global_step} steps (one per batch, both optimizers stepping); a generated digit:")
    print(ascii_image(sample))


if __name__ == "__main__":
    main()
