"""``remove_ignored_hparams`` on TrainModule and DataModule, and ``save_hyperparameters(ignore=...)``'s use of it.

Every expected value was first observed on Lightning 2.6.6 with the same classes (as LightningModule /
LightningDataModule), unless a test says that ember deliberately differs.
"""

from __future__ import annotations

from typing import Any

import ember


class Base(ember.TrainModule):
    def __init__(self, a: int = 1, b: int = 2, **kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters()


class HPData(ember.DataModule):
    def __init__(self, bs: int = 4, root: str = "x") -> None:
        super().__init__()
        self.save_hyperparameters()


class ThreeArgs(ember.TrainModule):
    def __init__(self, a: int = 1, b: int = 2, c: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()


class RecordsRemovals(Base):
    def __init__(self, c: int = 3, **kwargs: Any) -> None:
        self.removed: list[list[str]] = []
        super().__init__(**kwargs)
        self.save_hyperparameters(ignore=["b", "zz"])

    def remove_ignored_hparams(self, ignore_list: list[str]) -> None:
        self.removed.append(sorted(ignore_list))
        super().remove_ignored_hparams(ignore_list)


def test_remove_ignored_hparams_drops_names_from_hparams_only():
    """Lightning 2.6.6: {'b': 2, 'c': 3}, hparams_initial unchanged; then {'c': 3}."""
    m = ThreeArgs()
    m.remove_ignored_hparams(["a", "not_saved"])
    assert dict(m.hparams) == {"b": 2, "c": 3}
    assert dict(m.hparams_initial) == {"a": 1, "b": 2, "c": 3}
    m.remove_ignored_hparams("b")  # one name as a string
    assert dict(m.hparams) == {"c": 3}
    dm = HPData(bs=8)
    dm.remove_ignored_hparams(["root"])
    assert dict(dm.hparams) == {"bs": 8}


def test_remove_ignored_hparams_before_anything_was_saved_does_nothing():
    # ember deliberately differs: Lightning raises AttributeError ('_hparams') on a module that saved nothing.
    m = ember.TrainModule()
    m.remove_ignored_hparams(["a"])
    assert dict(m.hparams) == {}


def test_save_hyperparameters_removes_through_the_method():
    """As Lightning, ``ignore=`` goes through ``remove_ignored_hparams`` (a subclass may override it): what
    the base class's call saved is dropped too."""
    m = RecordsRemovals(a=5)
    assert m.removed == [[], ["b", "zz"]]  # the base class's call (no ignore), then the subclass's
    assert dict(m.hparams) == {"a": 5, "c": 3}
