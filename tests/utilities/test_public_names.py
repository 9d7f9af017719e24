"""The Lightning names issue 39 adds: ``ember.Callback`` at the top, and the helpers in ``ember.utilities``."""

from __future__ import annotations

import ember
import ember.utilities
from ember.callbacks import Callback


def test_callback_at_the_top_level():
    assert ember.Callback is Callback  # as lightning.pytorch.Callback is lightning.pytorch.callbacks.Callback
    assert "Callback" in ember.__all__ and "Callback" in dir(ember)


def test_utilities_names():
    # Every name below is in pytorch_lightning.utilities (2.6.6).
    names = {
        "AttributeDict",
        "CombinedLoader",
        "GradClipAlgorithmType",
        "LightningEnum",
        "disable_possible_user_warnings",
        "find_shared_parameters",
        "grad_norm",
        "is_picklable",
        "is_shared_filesystem",
        "measure_flops",
        "move_data_to_device",
        "rank_zero_deprecation",
        "rank_zero_info",
        "rank_zero_only",
        "rank_zero_warn",
        "set_shared_parameters",
        "suggested_max_num_workers",
    }
    assert set(ember.utilities.__all__) == names
    assert all(callable(getattr(ember.utilities, n)) for n in names)
