"""Batching: determinism, resumption, prefetch, epochs, microbatches, hosts, val batches."""

import threading

import numpy as np
import pytest

from microscale.data import Batcher, val_batches

TOKENS = np.arange(5000, dtype=np.uint32)  # a window's content reveals where it starts


def _assert_windows(batch, seq_len):
    assert batch.dtype == np.int32 and batch.shape[-1] == seq_len + 1
    rows = batch.reshape(-1, seq_len + 1)
    np.testing.assert_array_equal(
        rows - rows[:, :1], np.arange(seq_len + 1)[None].repeat(len(rows), 0)
    )


@pytest.mark.parametrize("mode", ["epoch", "random"])
def test_batch_at_is_pure(mode):
    a = Batcher(TOKENS, batch_size=8, seq_len=16, seed=3, mode=mode)
    b = Batcher(TOKENS, batch_size=8, seq_len=16, seed=3, mode=mode)
    for step in [0, 1, 7, 100, 5, 0]:
        np.testing.assert_array_equal(a.batch_at(step), b.batch_at(step))
        _assert_windows(a.batch_at(step), 16)
    c = Batcher(TOKENS, batch_size=8, seq_len=16, seed=4, mode=mode)
    assert not np.array_equal(a.batch_at(0), c.batch_at(0))
    assert a.batch_at(0).shape == (8, 17) and int(a.batch_at(3).max()) < TOKENS.size


def test_epoch_visits_every_window_once():
    b = Batcher(TOKENS, batch_size=10, seq_len=16, seed=0)
    n = b.windows_per_epoch
    assert n == (TOKENS.size - 1) // 16 - 1
    starts = np.concatenate([b.starts_at(s) for s in range(int(np.ceil(2 * n / 10)) + 1)])
    first, second = starts[:n], starts[n : 2 * n]
    for epoch in (first, second):
        offsets = set((epoch % 16).tolist())
        assert len(offsets) == 1 and len(set(epoch.tolist())) == n  # one offset, no repeats
    assert int(starts.max()) + 17 <= TOKENS.size


def test_iterate_resumes_and_matches_batch_at():
    b = Batcher(TOKENS, batch_size=4, seq_len=32, seed=1)
    fresh = Batcher(TOKENS, batch_size=4, seq_len=32, seed=1)
    for prefetch in (0, 1, 3):
        got = list(fresh.iterate(10, 6, prefetch=prefetch))
        assert [s for s, _ in got] == list(range(10, 16))
        for step, batch in got:
            np.testing.assert_array_equal(batch, b.batch_at(step))
    # 20 straight steps == 10 + "resume" + 10
    straight = [x for _, x in b.iterate(0, 20)]
    resumed = [x for _, x in b.iterate(0, 10)] + [x for _, x in fresh.iterate(10, 10)]
    for x, y in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(x, y)
    assert list(b.iterate(5, 0)) == []


def test_prefetch_close_and_errors():
    b = Batcher(TOKENS, batch_size=4, seq_len=32)
    before = threading.active_count()
    with b.iterate(0, None, prefetch=2) as it:
        for _ in range(3):
            next(it)
    assert threading.active_count() <= before
    with pytest.raises(StopIteration):
        next(it)

    def boom(step):
        if step == 2:
            raise RuntimeError("bad step 2")
        return step

    from microscale.data import PrefetchIterator

    it = PrefetchIterator(boom, 0, 5, prefetch=2)
    assert [next(it), next(it)] == [(0, 0), (1, 1)]
    with pytest.raises(RuntimeError, match="bad step 2"):
        next(it)


@pytest.mark.parametrize("mode", ["epoch", "random"])
def test_microbatches_and_hosts_partition_the_global_batch(mode):
    kw = dict(batch_size=8, seq_len=16, seed=5, mode=mode)
    whole = Batcher(TOKENS, **kw).batch_at(3)
    accum = Batcher(TOKENS, grad_accum=2, **kw)
    np.testing.assert_array_equal(accum.batch_at(3), whole)
    micro = accum.microbatches_at(3)
    assert micro.shape == (2, 4, 17)
    np.testing.assert_array_equal(micro.reshape(8, 17), whole)
    hosts = [
        Batcher(TOKENS, grad_accum=2, process_index=p, process_count=2, **kw) for p in range(2)
    ]
    assert hosts[0].local_batch_size == 4 and hosts[0].micro_batch_size == 2
    per_host = [h.microbatches_at(3) for h in hosts]
    for m in range(2):  # microbatch m over all hosts == microbatch m of one host
        np.testing.assert_array_equal(np.concatenate([x[m] for x in per_host]), micro[m])
    it = hosts[1].iterate(3, 1, microbatches=True)
    np.testing.assert_array_equal(next(it)[1], per_host[1])


def test_val_batches_fixed():
    v = val_batches(TOKENS, 4, 16, max_batches=3)
    assert v.shape == (3, 4, 17) and v.dtype == np.int32
    np.testing.assert_array_equal(v[:, :, 0].reshape(-1), np.arange(12) * 16)
    np.testing.assert_array_equal(v, val_batches(TOKENS, 4, 16, 3))
    parts = [val_batches(TOKENS, 4, 16, 3, process_index=p, process_count=2) for p in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), v)
    assert val_batches(TOKENS, 4, 16).shape[0] == ((TOKENS.size - 1) // 16) // 4
    with pytest.raises(ValueError, match="fewer than one batch"):
        val_batches(TOKENS[:100], 8, 16)


def test_batcher_errors():
    with pytest.raises(ValueError, match="divisible by grad_accum"):
        Batcher(TOKENS, batch_size=6, seq_len=8, grad_accum=4)
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 5001"):
        Batcher(TOKENS, batch_size=2, seq_len=5000)
    with pytest.raises(ValueError, match="mode must be one of"):
        Batcher(TOKENS, batch_size=2, seq_len=8, mode="shuffle")
    with pytest.raises(ValueError, match="process_index must be < process_count"):
        Batcher(TOKENS, batch_size=2, seq_len=8, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="step must be an int"):
        Batcher(TOKENS, batch_size=2, seq_len=8).batch_at(-1)
    with pytest.raises(ValueError, match="1-D"):
        Batcher(TOKENS.reshape(50, 100), batch_size=2, seq_len=8)


def test_tiny_corpus_still_batches():
    b = Batcher(np.arange(20, dtype=np.uint16), batch_size=3, seq_len=12)
    assert b.windows_per_epoch == 1
    for s in range(4):
        _assert_windows(b.batch_at(s), 12)
