"""Deterministic, resumable batching with a background prefetch thread.

A training batch is ``[rows, seq_len + 1]`` int32 token windows: ``inputs = batch[:, :-1]``,
``targets = batch[:, 1:]``. :meth:`Batcher.batch_at` is a pure function of
``(tokens, seed, step)`` and the shape settings, so a run resumed at step ``s`` sees exactly
the batches it would have seen, with no iterator state to checkpoint.

Sampling (``mode``)
    ``"epoch"`` (default): the token stream is cut into non-overlapping windows of
    ``seq_len + 1`` tokens at stride ``seq_len`` (every token is a target exactly once per
    epoch), starting at a random offset in ``[0, seq_len)`` drawn per epoch, and the windows
    are visited in a random permutation per epoch (``numpy`` PCG64 seeded by
    ``(seed, epoch)``). Global sample ``i = step * batch_size + row`` is window
    ``perm_e[i % n]`` of epoch ``e = i // n``; batches run across epoch boundaries without
    gaps, so no token is repeated before every window of the epoch has been seen.
    ``"random"``: each row starts at an independent uniform position (PCG64 seeded by
    ``(seed, step)``); windows may overlap and repeat.

Global batch, microbatches and hosts
    ``batch_size`` is the global number of sequences per optimizer step. With ``grad_accum = A``
    microbatches and ``process_count = P`` hosts, the global batch's rows are split as
    ``global.reshape(A, P, b)`` with ``b = batch_size / (A * P)``: microbatch ``m`` is always
    the same ``batch_size / A`` global rows, whatever ``P`` is, and host ``p`` holds rows
    ``[:, p]`` of it. So one host and eight hosts (or one and eight accumulation steps) see
    the same data per optimizer step, which is what makes losses comparable across meshes.
    Each host computes only its own rows. In JAX, feed a host's microbatch to
    ``jax.make_array_from_process_local_data`` with the batch axis sharded over the data axes.

Validation
    :func:`val_batches` takes non-overlapping windows from the start of the val tokens (window
    ``k`` starts at ``k * seq_len``) and groups them into full batches: fixed, identical on
    every call and every run with the same tokens.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator

import numpy as np

_MODES = ("epoch", "random")


def _check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)


def _check_tokens(tokens, seq_len: int, what: str) -> np.ndarray:
    if not hasattr(tokens, "shape") or len(tokens.shape) != 1:
        raise ValueError(
            f"{what} must be a 1-D token array, got "
            f"{getattr(tokens, 'shape', type(tokens).__name__)}"
        )
    if tokens.shape[0] < seq_len + 1:
        raise ValueError(
            f"{what} has {tokens.shape[0]} tokens; one window needs seq_len + 1 = {seq_len + 1}"
        )
    return tokens


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    out = np.empty((starts.shape[0], seq_len + 1), dtype=np.int32)
    for r, s in enumerate(starts.tolist()):
        out[r] = tokens[s : s + seq_len + 1]
    return out


class Batcher:
    """Token windows for each training step, as a pure function of ``(seed, step)``."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        mode: str = "epoch",
        grad_accum: int = 1,
        process_index: int = 0,
        process_count: int = 1,
    ):
        # tokens: 1-D ids (ndarray or memmap), never copied. batch_size: global sequences per
        # optimizer step. seq_len: tokens per input row (rows hold seq_len + 1). seed: data
        # order. mode: "epoch" or "random". grad_accum: microbatches per step.
        # process_index/process_count: this host's share of the global batch.
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.grad_accum = _check_int("grad_accum", grad_accum, 1)
        self.process_count = _check_int("process_count", process_count, 1)
        self.process_index = _check_int("process_index", process_index, 0)
        self.seed = _check_int("seed", seed, 0)
        if self.process_index >= self.process_count:
            raise ValueError(
                f"process_index must be < process_count={process_count}, got {process_index}"
            )
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        self.mode = mode
        if batch_size % (grad_accum * process_count):
            raise ValueError(
                f"batch_size={batch_size} must be divisible by grad_accum * process_count = "
                f"{grad_accum} * {process_count}"
            )
        self.tokens = _check_tokens(tokens, self.seq_len, "train tokens")
        n_tok, L = int(tokens.shape[0]), self.seq_len
        n_full = (n_tok - 1) // L  # windows of L + 1 tokens at stride L from offset 0
        if n_full >= 2:
            self.windows_per_epoch, self._max_offset = n_full - 1, L - 1
        else:
            self.windows_per_epoch, self._max_offset = 1, n_tok - 1 - L
        b = batch_size // (grad_accum * process_count)
        rows = np.arange(grad_accum)[:, None] * (process_count * b) + process_index * b
        # Global row indices this host owns, microbatch-major.
        self._rows = (rows + np.arange(b)[None, :]).reshape(-1).astype(np.int64)
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}
        self._lock = threading.Lock()  # batch_at may run on the prefetch and main threads

    @property
    def local_batch_size(self) -> int:
        """Rows of ``batch_at`` on this host: ``batch_size / process_count``."""
        return self.batch_size // self.process_count

    @property
    def micro_batch_size(self) -> int:
        """Rows of one microbatch on this host: ``batch_size / (grad_accum * process_count)``."""
        return self.local_batch_size // self.grad_accum

    @property
    def steps_per_epoch(self) -> float:
        """Optimizer steps per pass over the train windows (``"epoch"`` mode)."""
        return self.windows_per_epoch / self.batch_size

    def _epoch(self, e: int) -> tuple[int, np.ndarray]:
        with self._lock:
            hit = self._epochs.pop(e, None)
            if hit is None:
                rng = np.random.default_rng([self.seed, e])
                offset = int(rng.integers(0, self._max_offset + 1))
                hit = (offset, rng.permutation(self.windows_per_epoch))
            self._epochs[e] = hit  # most recently used last
            while len(self._epochs) > 2:
                self._epochs.pop(next(iter(self._epochs)))
            return hit

    def starts_at(self, step: int) -> np.ndarray:
        """Start positions in ``tokens`` of this host's rows at ``step`` (int64)."""
        step = _check_int("step", step, 0)
        if self.mode == "random":
            rng = np.random.default_rng([self.seed, step])
            hi = int(self.tokens.shape[0]) - self.seq_len  # start + seq_len + 1 <= n_tokens
            return rng.integers(0, hi, size=self.batch_size)[self._rows]
        i = step * self.batch_size + self._rows
        epochs, pos = np.divmod(i, self.windows_per_epoch)
        starts = np.empty_like(i)
        for e in np.unique(epochs).tolist():
            offset, perm = self._epoch(e)
            sel = epochs == e
            starts[sel] = offset + perm[pos[sel]] * self.seq_len
        return starts

    def batch_at(self, step: int) -> np.ndarray:
        """This host's rows at ``step``: int32 ``[local_batch_size, seq_len + 1]``."""
        return _gather(self.tokens, self.starts_at(step), self.seq_len)

    def microbatches_at(self, step: int) -> np.ndarray:
        """``batch_at(step)`` as ``[grad_accum, micro_batch_size, seq_len + 1]``."""
        return self.batch_at(step).reshape(self.grad_accum, self.micro_batch_size, -1)

    def iterate(
        self,
        start_step: int = 0,
        num_steps: int | None = None,
        *,
        prefetch: int = 2,
        microbatches: bool = False,
    ) -> PrefetchIterator:
        """Yield ``(step, batch)`` for ``start_step, start_step + 1, ...`` (``num_steps`` of
        them; forever if None), built ``prefetch`` steps ahead on a background thread.
        ``microbatches=True`` yields ``microbatches_at`` shapes. Close it (or use ``with``)
        to stop the thread early."""
        start_step = _check_int("start_step", start_step, 0)
        if num_steps is not None:
            _check_int("num_steps", num_steps, 0)
        fn = self.microbatches_at if microbatches else self.batch_at
        return PrefetchIterator(fn, start_step, num_steps, prefetch=prefetch)


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


class PrefetchIterator(Iterator):
    """Iterator of ``(step, fn(step))`` computed ahead on a daemon thread (bounded queue).

    ``prefetch=0`` computes synchronously (no thread). An exception in ``fn`` is re-raised in
    the consumer at the step where it happened.
    """

    def __init__(self, fn, start_step: int, num_steps: int | None, *, prefetch: int = 2):
        self._fn, self._next = fn, start_step
        self._stop_at = None if num_steps is None else start_step + num_steps
        self._prefetch = _check_int("prefetch", prefetch, 0)
        self._closed = False
        if self._prefetch:
            self._queue: queue.Queue = queue.Queue(maxsize=self._prefetch)
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._produce, daemon=True, name="microscale-prefetch"
            )
            self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        step = self._next
        while self._stop_at is None or step < self._stop_at:
            if self._stop.is_set():
                return
            try:
                item = (step, self._fn(step))
            except BaseException as e:  # re-raised in the consumer
                self._put(_Failure(e))
                return
            if not self._put(item):
                return
            step += 1
        self._put(_END)

    def __next__(self):
        if self._closed or (self._stop_at is not None and self._next >= self._stop_at):
            self.close()
            raise StopIteration
        if not self._prefetch:
            item = (self._next, self._fn(self._next))
        else:
            item = self._queue.get()
            if item is _END:
                self.close()
                raise StopIteration
            if isinstance(item, _Failure):
                self.close()
                raise item.exc
        self._next += 1
        return item

    def close(self) -> None:
        """Stop the producer thread and drop prefetched batches."""
        if self._closed:
            return
        self._closed = True
        if self._prefetch:
            self._stop.set()
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=5.0)

    def __enter__(self) -> PrefetchIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def val_batches(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> np.ndarray:
    """Fixed validation batches: int32 ``[n, batch_size / process_count, seq_len + 1]``.

    Window ``k`` is ``tokens[k * seq_len : k * seq_len + seq_len + 1]``; windows ``j * batch_size
    ... (j + 1) * batch_size - 1`` form batch ``j``; the incomplete last batch is dropped and
    at most ``max_batches`` are returned. Host ``p`` gets rows ``[p * b, (p + 1) * b)`` of each
    batch, ``b = batch_size / process_count``.
    """
    seq_len = _check_int("seq_len", seq_len, 1)
    batch_size = _check_int("batch_size", batch_size, 1)
    process_count = _check_int("process_count", process_count, 1)
    process_index = _check_int("process_index", process_index, 0)
    if process_index >= process_count:
        raise ValueError(
            f"process_index must be < process_count={process_count}, got {process_index}"
        )
    if batch_size % process_count:
        raise ValueError(
            f"batch_size={batch_size} must be divisible by process_count={process_count}"
        )
    if max_batches is not None:
        _check_int("max_batches", max_batches, 1)
    tokens = _check_tokens(tokens, seq_len, "val tokens")
    n_windows = (int(tokens.shape[0]) - 1) // seq_len
    n = n_windows // batch_size
    if n == 0:
        raise ValueError(
            f"val tokens ({tokens.shape[0]}) hold {n_windows} windows of seq_len + 1 = "
            f"{seq_len + 1}, fewer than one batch of {batch_size}; lower the eval batch size "
            "or seq_len, or use a larger val split"
        )
    if max_batches is not None:
        n = min(n, max_batches)
    b = batch_size // process_count
    win = np.arange(n)[:, None] * batch_size + process_index * b + np.arange(b)[None, :]
    return _gather(tokens, win.reshape(-1) * seq_len, seq_len).reshape(n, b, seq_len + 1)
