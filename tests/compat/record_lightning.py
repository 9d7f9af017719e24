"""Record the expectation ``lightning_2_6_6.json`` by running ``scenario.run`` on PyTorch Lightning.

Run by hand in an environment with Lightning installed (never a dependency of ember, and never run
by the test suite)::

    pip install torch==2.13.0 pytorch-lightning==2.6.6  # imported as pytorch_lightning
    python tests/compat/record_lightning.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types

import pytorch_lightning as L  # noqa: N812

sys.path.insert(0, os.path.dirname(__file__))
from scenario import run  # noqa: E402

namespace = types.SimpleNamespace(
    Module=L.LightningModule,
    Trainer=L.Trainer,
    Logger=L.loggers.Logger,
    ModelCheckpoint=L.callbacks.ModelCheckpoint,
    EarlyStopping=L.callbacks.EarlyStopping,
)

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as root:
        result = run(namespace, root)
    result["recorded_with"] = f"lightning {L.__version__}"
    out = os.path.join(os.path.dirname(__file__), "lightning_2_6_6.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {out}")
