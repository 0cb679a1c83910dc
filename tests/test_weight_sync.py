"""benchmarks/weight_sync.py's transfer path (`jax.experimental.transfer`, each process
of a worker pulling its own shards) on a tiny model: its first sync is checked bitwise
against the host path's bytes in the worker, and a pulled parameter that differs stops
it. The host path into a worker of two processes is the workers' own
(tests/test_workers.py)."""

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


def test_the_transfer_path_reaches_a_worker_of_two_processes_bitwise(weight_sync, monkeypatch):
    pytest.importorskip("jax.experimental.transfer")  # not in every jax build
    r = weight_sync.bench("tiny", repeats=1, processes=2, path="transfer")
    assert r["gb"] > 0 and r["median_s"] > 0, r

    cast = weight_sync.transfer.Offer.cast

    def off_by_one(params, dtype):
        import jax

        return cast(jax.tree.map(lambda x: x + 1, params), dtype)

    monkeypatch.setattr(weight_sync.transfer.Offer, "cast", staticmethod(off_by_one))
    with pytest.raises(weight_sync.wire.Closed):
        weight_sync.bench("tiny", repeats=1, processes=2, path="transfer")
