"""User-facing helpers under Lightning's names (``lightning.pytorch.utilities``)."""

from __future__ import annotations

from ember.utilities.apply_func import move_data_to_device
from ember.utilities.combined_loader import CombinedLoader
from ember.utilities.enums import GradClipAlgorithmType, LightningEnum
from ember.utilities.flops import measure_flops
from ember.utilities.grads import grad_norm
from ember.utilities.parameter_tying import find_shared_parameters, set_shared_parameters
from ember.utilities.parsing import AttributeDict, is_picklable
from ember.utilities.rank_zero import rank_zero_deprecation, rank_zero_info, rank_zero_only, rank_zero_warn
from ember.utilities.system import is_shared_filesystem, suggested_max_num_workers
from ember.utilities.warnings import disable_possible_user_warnings

__all__ = [
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
]
