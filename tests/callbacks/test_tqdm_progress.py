"""TQDMProgressBar: Lightning's name and arguments for ember's progress bar."""

from __future__ import annotations

import io

import pytest

from ember.callbacks import ProgressBar, TQDMProgressBar
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


def test_lightning_arguments_and_output():
    bar = TQDMProgressBar(refresh_rate=2, process_position=1)
    assert isinstance(bar, ProgressBar) and bar.refresh_rate == 2 and bar.leave is False
    stream = io.StringIO()
    trainer = fast_trainer(callbacks=[TQDMProgressBar(mode="lines", stream=stream)], enable_progress_bar=True)
    trainer.fit(BoringModel(), regression_loader(n=16))
    assert "Epoch 0/0 done" in stream.getvalue()
    assert [c for c in trainer.callbacks if isinstance(c, ProgressBar)] == trainer.callbacks[:1]  # no second bar


def test_bad_arguments_say_what_is_expected():
    with pytest.raises(ValueError, match="process_position"):
        TQDMProgressBar(process_position=-1)
    with pytest.raises(TypeError):
        TQDMProgressBar(refresh_rat=3)  # a misspelt argument is not swallowed
