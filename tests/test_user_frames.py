"""Warnings about the user's code point at the user's line (``ember/user_frames.py``)."""

from __future__ import annotations

import warnings

import pytest

from ember.user_frames import user_stacklevel
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


def test_the_no_validation_data_warning_points_at_the_users_fit_call():
    with pytest.warns(UserWarning, match="no validation data") as record:
        fast_trainer(max_epochs=1).fit(BoringModel(), regression_loader())
    (warning,) = [w for w in record if "no validation data" in str(w.message)]
    assert warning.filename == __file__


def test_called_outside_ember_it_points_at_the_warning_line_itself():
    def warns() -> None:
        warnings.warn("here", UserWarning, stacklevel=user_stacklevel())

    with pytest.warns(UserWarning) as record:
        warns()
    assert record[0].filename == __file__ and record[0].lineno == warns.__code__.co_firstlineno + 1
