"""Sharding and shuffling across simulated ranks."""

import numpy as np

from pycls_fast.datasets import sharding
from pycls_fast.datasets.sharding import num_train_batches, train_batches


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
