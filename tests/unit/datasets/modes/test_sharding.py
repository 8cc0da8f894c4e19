"""Sharding and shuffling across simulated ranks."""

import numpy as np
import pytest

from pycls_fast.datasets.modes import sharding
from pycls_fast.datasets.modes.sharding import num_train_batches, train_batches


def test_train_shards_disjoint_equal_and_deterministic():
    n, bs, seed = 103, 8, 1
    ranks = [train_batches(n, bs, seed, epoch=3, rank=r, world_size=2) for r in (0, 1)]
    assert [len(b) for b in ranks] == [6, 6] == [num_train_batches(n, bs, 2)] * 2
    assert all(len(batch) == bs for batches in ranks for batch in batches)
    flat = [np.concatenate(b) for b in ranks]
    assert not set(flat[0]) & set(flat[1])
    assert all(0 <= i < n for f in flat for i in f)
    # Same (seed, epoch): identical; another epoch or seed: a different order.
    again = train_batches(n, bs, seed, epoch=3, rank=0, world_size=2)
    assert all(np.array_equal(a, b) for a, b in zip(again, ranks[0]))
    other = np.concatenate(train_batches(n, bs, seed, epoch=4, rank=0, world_size=2))
    assert not np.array_equal(other, flat[0])
    other_seed = np.concatenate(train_batches(n, bs, 2, epoch=3, rank=0, world_size=2))
    assert not np.array_equal(other_seed, flat[0])


def test_train_one_rank_is_a_permutation_prefix():
    batches = train_batches(20, 5, seed=0, epoch=0, rank=0, world_size=1)
    flat = np.concatenate(batches)
    assert len(flat) == 20 and sorted(flat.tolist()) == list(range(20))
    assert flat.tolist() != list(range(20))


def test_test_split_covered_exactly_once():
    n, bs = 101, 16
    parts = [sharding.test_batches(n, bs, r, 2) for r in (0, 1)]
    flat = np.concatenate([np.concatenate(p) for p in parts])
    assert sorted(flat.tolist()) == list(range(n))  # every image once, none twice
    assert [len(b) for b in parts[0]] == [16, 16, 16, 2]
    assert [len(b) for b in parts[1]] == [16, 16, 16, 3]


def test_more_ranks_than_images():
    parts = [sharding.test_batches(3, 4, r, 4) for r in range(4)]
    assert sorted(np.concatenate([b for p in parts for b in p]).tolist()) == [0, 1, 2]
    assert train_batches(3, 4, 0, 0, 0, 4) == []


def test_rank_defaults_without_distributed():
    assert sharding.rank_and_world_size() == (0, 1)
    assert sharding.rank_and_world_size(1, 2) == (1, 2)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_repeated_augmentation_sends_what_deits_sampler_sends(world_size):
    # timm's RepeatAugSampler is DeiT's RASampler; unshuffled, its per-rank indices
    # must be ours for the identity order (images mod N: copies are virtual indices).
    from timm.data.distributed_sampler import RepeatAugSampler

    n, batch = 96, 4
    order = sharding.repeat_order(np.arange(n, dtype=np.int64), 3)
    assert len(order) == n and sorted(set(order % n)) == list(range(32))
    for rank in range(world_size):
        deit = RepeatAugSampler(range(n), world_size, rank, shuffle=False,
                                num_repeats=3, selected_round=0)  # fmt: skip
        ours = np.concatenate(sharding.split_order(order, batch, rank, world_size))
        assert (ours % n).tolist() == list(deit)
    # The three copies of an image are distinct virtual indices (own seeds), and with
    # 3 or more ranks each lands on a different rank in the same step.
    assert len(set(order.tolist())) == n
    if world_size >= 3:
        ranks = {}
        for rank in range(world_size):
            for v in sharding.split_order(order, batch, rank, world_size)[0]:
                ranks.setdefault(int(v) % n, set()).add(rank)
        assert all(len(r) == 3 for i, r in ranks.items() if i < world_size // 3)
