"""find_shared_parameters / set_shared_parameters: the groups Lightning 2.6.6 finds, and tying restored."""

from __future__ import annotations

from torch import nn

from ember.utilities import find_shared_parameters, set_shared_parameters


class Tied(nn.Module):
    """A decoder tied to an embedding, and one Linear reached through three paths."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.out = nn.Linear(3, 4)
        self.out.weight = self.emb.weight
        self.shared = nn.Linear(2, 2)
        self.block = nn.Sequential(self.shared, nn.ReLU(), self.shared)


GROUPS = [  # what Lightning returns for Tied()
    ["emb.weight", "out.weight"],
    ["shared.weight", "block.0.weight", "block.2.weight"],
    ["shared.bias", "block.0.bias", "block.2.bias"],
]


def test_find_shared_parameters():
    assert find_shared_parameters(Tied()) == GROUPS
    assert find_shared_parameters(nn.Linear(2, 2)) == []


def test_set_shared_parameters_ties_again():
    model = Tied()
    model.out.weight = nn.Parameter(model.out.weight.detach().clone())  # untied, as a per-parameter move leaves it
    assert find_shared_parameters(model) == GROUPS[1:]
    assert set_shared_parameters(model, [["emb.weight", "out.weight"]]) is model
    assert model.out.weight is model.emb.weight
    assert find_shared_parameters(model) == GROUPS


def test_set_shared_parameters_on_top_level_names():
    model = nn.Module()
    model.a = nn.Parameter(nn.Linear(1, 1).weight.detach())
    model.b = nn.Parameter(model.a.detach().clone())
    set_shared_parameters(model, [["a", "b"]])
    assert model.b is model.a and find_shared_parameters(model) == [["a", "b"]]
