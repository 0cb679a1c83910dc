"""benchmarks/weight_sync.py on a tiny model: both paths into a worker of two processes,
and the transfer path's first sync checked against the host path's bytes (a pulled
parameter that differs stops the receiver)."""

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


@pytest.fixture
def weight_sync(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)  # sys.path restored after the test
    import weight_sync

    yield weight_sync
    sys.modules.pop("weight_sync", None)  # the benchmark module leaves with the test


def test_both_paths_reach_a_worker_of_two_processes(weight_sync):
    for path in ("host", "transfer"):
        r = weight_sync.bench("tiny", repeats=1, processes=2, path=path)
        assert r["gb"] > 0 and r["median_s"] > 0, (path, r)


def test_a_pulled_shard_that_differs_stops_the_receiver(weight_sync, monkeypatch):
    offer = weight_sync.offer

    def off_by_one(server, params, layout):
        import jax

        return offer(server, jax.tree.map(lambda x: x + 1, params), layout)

    monkeypatch.setattr(weight_sync, "offer", off_by_one)
    with pytest.raises(weight_sync.wire.Closed):
        weight_sync.bench("tiny", repeats=1, processes=2, path="transfer")
