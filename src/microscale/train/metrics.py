"""Training metrics: ``metrics.jsonl``, TensorBoard, progress display, weight-quantization stats.

``OUT/metrics.jsonl`` holds one JSON object per line, each with a ``kind``:

* ``"train"`` (every ``log_every`` steps): ``step``, ``loss`` (that step's mean loss),
  ``loss_avg`` (mean since the previous line), ``lr``, ``grad_norm`` (before clipping),
  ``tokens`` (seen so far), ``tokens_per_s`` (since the previous line, compile and eval
  time excluded), ``nonfinite`` (skipped updates so far), ``phase`` (``"main"`` or
  ``"late"``), ``time`` (seconds since start);
* ``"eval"``: ``step``, ``tokens``, ``val_loss``, ``val_ppl``, and ``quant`` --
  per-layer weight-quantization statistics (below);
* ``"event"``: ``step`` and ``event`` (``"late_switch"``, ``"nonfinite"``, ``"resume"``,
  ``"abort"``) with details.

On resume the file is cut back to the checkpoint's step, so it always reads as one
run. The same records go to TensorBoard (``OUT/tb/``, via tensorboardX) and to the
``callbacks`` passed to :func:`microscale.train.train`.

Weight-quantization statistics (:func:`weight_quant_stats`) quantize a layer's master
weight exactly as its recipe's forward weight operand does (format, block shape, scale
rule taken from the layer's :class:`~microscale.ops.OperandSpec`, blocks along the
contraction axis) and report, over the elements and blocks of that tensor:

* ``zero`` -- fraction of elements that decode to zero: code 0 (small weights flushed),
  or a block scale of 0;
* ``saturated`` -- fraction at the largest element magnitude (``spec.elem_max``, e.g.
  E2M1's 6) in a block with a non-zero scale;
* ``scale_underflow`` -- fraction of non-zero blocks whose block scale rounded to 0
  (the whole block is lost; NVFP4's per-tensor scale makes this rare).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from microscale.files import atomic_write_text
from microscale.formats import block_scales_f32, e2m1_decode, quantize
from microscale.outputs import TrainingRun
from microscale.progress import Progress

__all__ = ["MetricsLogger", "weight_quant_stats"]


# ----------------------------------------------------------------------------- quant stats


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _stats(w, spec, block_shape, scale_rounding):
    shape = w.shape
    q = quantize(
        w.astype(jnp.float32), spec, axis=-2, block_shape=block_shape, scale_rounding=scale_rounding
    )
    codes = q.codes()
    elems = jnp.abs(e2m1_decode(codes) if spec.packed else codes.astype(jnp.float32))
    if spec.block_size is None:  # one scale per tensor
        live = jnp.broadcast_to(q.scales > 0, elems.shape)
        under = jnp.float32(0.0)
    else:
        scales = block_scales_f32(q)
        # block amax of the (padded) input on the scales' grid
        blocks = q.block_shape
        xf = jnp.abs(w.astype(jnp.float32))
        xf = jnp.pad(xf, [(0, -d % b) for d, b in zip(shape, blocks, strict=True)])
        grid = []
        for d, b in zip(xf.shape, blocks, strict=True):
            grid += [d // b, b]
        bamax = jnp.max(xf.reshape(grid), axis=tuple(range(1, 2 * xf.ndim, 2)))
        nz = bamax > 0
        under = jnp.sum(nz & (scales == 0)) / jnp.maximum(jnp.sum(nz), 1)
        live = scales > 0
        for ax, b in enumerate(blocks):  # block scale -> element grid
            live = jnp.repeat(live, b, axis=ax)
    region = tuple(slice(0, d) for d in shape)
    elems, live = elems[region], live[region]
    # An element is zero when its code is 0 or its block scale is 0 (the whole block lost).
    zero = jnp.mean((elems == 0) | ~live)
    sat = jnp.mean((elems >= spec.elem_max) & live)
    return jnp.stack([zero, sat, under.astype(jnp.float32)])


def weight_quant_stats(kernel: jax.Array, operand) -> dict[str, float] | None:
    """Stats of ``kernel`` (``[..., K, N]``, contraction on ``K``) quantized as ``operand``
    (an :class:`~microscale.ops.OperandSpec`); None for a pass-through (bf16) operand."""
    spec = operand.spec
    if not spec.quantized:
        return None
    # (along, other) is already array order for a [K, N] weight contracted on K.
    z, s, u = np.asarray(
        jax.device_get(_stats(kernel, spec, operand.block_shape, operand.scale_rounding))
    )
    return {"zero": float(z), "saturated": float(s), "scale_underflow": float(u)}


# ----------------------------------------------------------------------------- logging


def _clean(v: Any) -> Any:
    """JSON-safe: numpy/jax scalars to Python, non-finite floats kept as strings."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf": valid JSON, visibly not a number
    return v


def _summary_writer_cls():
    """tensorboardX's SummaryWriter, imported without PyTorch.

    tensorboardX imports torch when it is installed (seconds of start-up, and a broken
    torch install breaks it); scalars need none of it, so torch is hidden during the
    import unless something already imported it."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsLogger:
    """Writes records to ``metrics.jsonl`` + TensorBoard and drives the progress display.

    Only the main process (``jax.process_index() == 0``) writes files or prints;
    callbacks run everywhere.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        tensorboard: bool = True,
        main: bool = True,
        callbacks: Sequence[Callable[[dict], None]] | None = None,
        description: str = "train",
        stream=None,
    ):
        self.out = Path(out)
        self.total = int(total_steps)
        self.main = main
        self.callbacks = list(callbacks or [])
        self.stream = stream if stream is not None else sys.stdout
        self.path = self.out / TrainingRun.METRICS
        self._file = None
        self._tb = None
        self._bar: Progress | None = None
        self.description = description
        if not main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            try:
                SummaryWriter = _summary_writer_cls()
                self._tb = SummaryWriter(logdir=str(self.out / "tb"), flush_secs=30)
            except Exception as e:  # a broken optional import must not stop training
                print(
                    f"warning: TensorBoard logging disabled ({type(e).__name__}: {e})",
                    file=sys.stderr,
                )
                self._tb = None
        self._bar = Progress(
            self.total,
            description,
            unit="step",
            show=progress,
            stream=self.stream,
            initial=start_step,
        )

    def _truncate_after(self, step: int) -> None:
        """Drop lines of steps > ``step`` (left over from a run that died after it); a run
        starting at step 0 starts a fresh file."""
        if not self.path.exists():
            return
        if step == 0:
            self.path.unlink()
            return
        keep = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line of a killed process
                if rec.get("step", 0) <= step:
                    keep.append(json.dumps(rec) + "\n")
        atomic_write_text(self.path, "".join(keep))

    # ------------------------------------------------------------------ records
    def log(self, record: dict[str, Any]) -> None:
        """Append one record (must have ``kind`` and ``step``) everywhere."""
        rec = _clean(record)
        for cb in self.callbacks:
            cb(dict(rec))
        if not self.main:
            return
        assert self._file is not None  # opened by __init__ on the main process
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tensorboard(self._tb, rec)

    def _tensorboard(self, tb: Any, rec: dict) -> None:
        step = int(rec["step"])
        kind = rec.get("kind")
        if kind == "train":
            for k in ("loss", "loss_avg", "lr", "grad_norm", "tokens_per_s", "nonfinite"):
                if isinstance(rec.get(k), (int, float)):
                    tb.add_scalar(f"train/{k}", rec[k], step)
        elif kind == "eval":
            for k in ("val_loss", "val_ppl"):
                if isinstance(rec.get(k), (int, float)):
                    tb.add_scalar(f"eval/{k}", rec[k], step)
            for layer, stats in (rec.get("quant") or {}).items():
                for k, v in stats.items():
                    tb.add_scalar(f"quant/{k}/{layer}", v, step)

    # ------------------------------------------------------------------ progress
    def progress(
        self,
        step: int,
        *,
        loss: float | None = None,
        val_loss: float | None = None,
        tokens_per_s: float | None = None,
        lr: float | None = None,
        force: bool = False,
    ) -> None:
        """Advance the bar to ``step`` (TTY) or print a plain line (at most every 5 s
        unless ``force``). Values given once stay displayed until replaced."""
        if not self.main:
            return
        post = {}
        if loss is not None:
            post["loss"] = f"{loss:.4f}"
        if val_loss is not None:
            post["val"] = f"{val_loss:.4f}"
        if tokens_per_s is not None:
            post["tok/s"] = f"{tokens_per_s:,.0f}"
        if lr is not None:
            post["lr"] = f"{lr:.2e}"
        if self._bar is not None:
            self._bar.update(max(step - self._bar.n, 0), force=force, **post)

    def message(self, text: str) -> None:
        """A line for the user that does not break the progress bar."""
        if not self.main:
            return
        if self._bar is not None:
            self._bar.write(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
