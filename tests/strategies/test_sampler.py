"""ShardedSampler: disjoint shards of one global order, padding policy, epochs, resuming."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.data.sampler import ShardedSampler


def shards(n: int, world: int, **kwargs) -> list[list[int]]:
    return [list(ShardedSampler(n, world, rank, **kwargs)) for rank in range(world)]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 60), st.integers(1, 5), st.booleans(), st.integers(0, 3))
def test_eval_shards_are_disjoint_and_cover_the_data_once(n, world, shuffle, seed):
    parts = shards(n, world, shuffle=shuffle, seed=seed, even=False)
    flat = [i for part in parts for i in part]
    assert sorted(flat) == list(range(n))  # no sample twice, none missing
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [len(ShardedSampler(n, world, r, even=False)) for r in range(world)] == list(map(len, parts))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 60), st.integers(1, 5), st.booleans(), st.integers(0, 3))
def test_training_shards_are_equal_and_pad_with_at_most_world_minus_one(n, world, shuffle, seed):
    parts = shards(n, world, shuffle=shuffle, seed=seed, even=True)
    assert len({len(p) for p in parts}) == 1  # every rank takes the same number of steps
    flat = [i for part in parts for i in part]
    assert set(flat) == set(range(n)) and len(flat) - n < world


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(1, 4), st.integers(1, 5))
def test_batch_k_of_all_ranks_is_batch_k_of_one_process_with_the_global_batch(n, world, b):
    order = ShardedSampler(n, 1, 0, seed=7).global_order()
    parts = shards(n, world, seed=7, even=False)
    for k in range(-(-n // (world * b))):
        together = sorted(i for p in parts for i in p[k * b : (k + 1) * b])
        assert together == sorted(order[k * world * b : (k + 1) * world * b])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(1, 5), st.integers(1, 6), st.booleans(), st.booleans())
def test_eval_shards_with_a_batch_size_give_every_rank_the_same_batches(n, world, b, drop_last, shuffle):
    if n < world:
        return  # the ddp strategy refuses this (each rank needs a sample)
    samplers = [
        ShardedSampler(n, world, r, shuffle=shuffle, seed=1, even=False, batch_size=b, drop_last=drop_last)
        for r in range(world)
    ]
    loaders = [
        list(torch.utils.data.DataLoader(range(n), batch_size=b, drop_last=drop_last, sampler=s)) for s in samplers
    ]
    assert len({len(batches) for batches in loaders}) == 1  # every rank runs the same steps
    assert [len(s) for s in samplers] == [len(list(s)) for s in samplers]
    real = [batches[: s.real_batches] for s, batches in zip(samplers, loaders)]
    unpadded = [
        list(torch.utils.data.DataLoader(range(n), batch_size=b, drop_last=drop_last, sampler=p))
        for p in shards(n, world, shuffle=shuffle, seed=1, even=False)
    ]
    # Before the padding batch, each rank's batches are exactly its unpadded shard's.
    assert [[t.tolist() for t in batches] for batches in real] == [[t.tolist() for t in u] for u in unpadded]
    for s, batches in zip(samplers, loaders):
        assert s.padding in (0, 1)
        if s.real_batches is None:
            assert s.padding == 0
        else:  # one padding batch, last, shaped like the longest shards' last batch
            assert s.real_batches == len(batches) - 1 and s.padding == 1
            assert len(batches[-1]) == len(loaders[0][-1])


def test_eval_padding_needs_a_batch_size_and_never_touches_training_shards():
    assert [
        len(s)
        for s in (
            ShardedSampler(33, 2, 1, even=False),
            ShardedSampler(33, 2, 1, even=False, batch_size=4),
            ShardedSampler(33, 2, 1, even=True, batch_size=4),
        )
    ] == [16, 17, 17]
    assert list(ShardedSampler(33, 2, 1, shuffle=False, even=False, batch_size=4))[-1] == 0
    assert ShardedSampler(33, 2, 1, even=True, batch_size=4).real_batches is None


def test_every_epoch_reshuffles_without_set_epoch_and_ranks_agree():
    samplers = [ShardedSampler(20, 2, rank, seed=3) for rank in range(2)]
    first = [list(s) for s in samplers]
    second = [list(s) for s in samplers]
    assert first != second and samplers[0].epoch == 1
    for epoch in (first, second):
        assert sorted(epoch[0] + epoch[1]) == list(range(20))
    replay = ShardedSampler(20, 2, 0, seed=3)
    replay.set_epoch(1)
    assert list(replay) == second[0]


def test_drawn_seeds_follow_the_generator_and_agree_through_the_callback():
    torch.manual_seed(0)
    agreed = []
    sampler = ShardedSampler(10, 2, 1, agree=lambda seed: agreed.append(seed) or 42)
    order = list(sampler)
    assert agreed and sampler.seed == 42
    assert order == ShardedSampler(10, 2, 1, seed=42).global_order()[1::2]


@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_resume_mid_epoch_continues_with_the_next_unseen_samples_on_any_world(new_world):
    old = [ShardedSampler(24, 2, r, seed=5) for r in range(2)]
    seen = [list(s)[:4] for s in old]  # 4 batches of 1 per rank: global positions 0..7
    state = {**old[0].state_dict(), "position": 8}
    resumed = []
    for rank in range(new_world):
        s = ShardedSampler(24, new_world, rank, seed=None)
        s.load_state_dict(state)
        assert s.resuming and len(s) == -(-16 // new_world)  # the 16 left, padded to a multiple of the ranks
        resumed.append(list(s))
        assert not s.resuming
    assert len({len(part) for part in resumed}) == 1  # every rank takes the same number of steps
    everything = [i for part in seen for i in part] + [i for part in resumed for i in part]
    assert set(everything) == set(range(24)) and len(everything) - 24 <= new_world - 1


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 4), st.integers(1, 40), st.booleans())
def test_training_resume_on_any_world_gives_equal_shards_of_what_is_left(n, old_world, new_world, position, even):
    # (position >= 1: a state at position 0 is a fresh epoch, which draws its own seed)
    total = -(-n // old_world) * old_world if even else n
    position = min(position, total)
    order = ShardedSampler(n, old_world, 0, seed=3, even=even).global_order()
    state = {"seed": 3, "epoch": 0, "position": position}
    parts = []
    for rank in range(new_world):
        s = ShardedSampler(n, new_world, rank, even=even)
        s.load_state_dict(state)
        expected = len(s)
        parts.append(list(s))
        assert len(parts[-1]) == expected
    left = order[position:n]  # the samples not yet handed out (positions past n are padding)
    flat = [i for part in parts for i in part]
    if even:
        assert len({len(p) for p in parts}) == 1  # equal steps on every rank: no rank waits forever
        assert set(left) <= set(flat) and len(flat) - len(left) <= new_world - 1
    else:
        assert sorted(flat) == sorted(left)  # evaluation: no padding, no duplicates


def test_state_dict_reports_what_was_handed_out():
    s = ShardedSampler(10, 2, 0, seed=1)
    it = iter(s)
    next(it), next(it)
    assert s.state_dict() == {"seed": 1, "epoch": 0, "position": 4}


def test_bad_rank_is_explained():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        ShardedSampler(10, 2, 2)
