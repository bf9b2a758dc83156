"""Atomic, rotating training checkpoints with orbax.

Layout under ``OUT/checkpoints/``::

    <step>/state/   params, optimizer state and step (orbax StandardSave: sharded arrays,
                    every host writes its own shards)
    <step>/meta/    JSON: data position, token count, non-finite counters, precision phase,
                    the resolved config and the microscale version

Atomicity: orbax writes a checkpoint into a temporary directory
(``<step>.orbax-checkpoint-tmp-*``) and renames it to ``<step>`` only after every file
(and, with several hosts, every process) is done; readers only ever see finished steps,
so a process killed during a save leaves the previous checkpoint untouched. Only the last
``keep`` finished steps are kept. Saving may be asynchronous (the arrays are copied to
host memory first and written in a background thread); :meth:`Checkpointer.wait` blocks
until the last save is committed.

Integrity: ``meta`` also carries a CRC-32 of every array of the state, computed from the
host copy at save time (:mod:`microscale.integrity`); :meth:`Checkpointer.restore` checks
them and that every float is finite, and reports a checkpoint that does not restore (a
truncated or missing file, a bit flip, bad JSON) as :class:`CheckpointCorruptError`
naming the step folder and the tensor. :meth:`Checkpointer.restore_newest_intact` (used to
resume) then moves the damaged step to ``OUT/damaged-checkpoints/`` and falls back to the
next older one.

Restoring needs an *abstract* target (``jax.ShapeDtypeStruct`` leaves with shardings), so
the arrays come back directly sharded on the current mesh, which may differ from the
mesh that saved them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from microscale.integrity import (
    CorruptDataError,
    check_finite,
    crc32_many,
    root_cause,
    silence_checkpoint_reader_noise,
    tree_path_parts,
    verify_crc32,
)

__all__ = ["CheckpointCorruptError", "Checkpointer", "abstract_like", "host_leaves"]


class CheckpointCorruptError(CorruptDataError):
    """A checkpoint step does not restore, fails its checksums or holds non-finite values."""


class CheckpointMismatchError(ValueError):
    """A sound checkpoint that does not fit the config it is restored with (an edited
    ``config.yaml``): nothing is damaged, so nothing is set aside."""


def host_leaves(tree) -> dict[str, np.ndarray]:
    """``{tree path: numpy array}`` of a pytree's array leaves (fully addressable ones; PRNG
    keys as their key data), fetched from the devices in one call."""
    names, arrays = [], []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array):
            if not x.is_fully_addressable:
                continue
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
        elif not isinstance(x, (np.ndarray, np.generic)):
            continue
        names.append(jax.tree_util.keystr(path))
        arrays.append(x)
    return dict(zip(names, (np.asarray(a) for a in jax.device_get(arrays)), strict=True))


def abstract_like(tree):
    """``ShapeDtypeStruct`` leaves (with the arrays' shardings) for an orbax restore target."""

    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


class Checkpointer:
    """Save / restore ``(state pytree, meta dict)`` pairs under a directory, keep the last K."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._closed = False
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=max(int(keep), 1),
            create=True,
            enable_async_checkpointing=async_save,
            # Leftover `*.orbax-checkpoint-tmp-*` folders of a killed save are removed
            # when the manager opens; finished steps are never touched.
            cleanup_tmp_directories=True,
        )
        self._mgr = ocp.CheckpointManager(
            self.directory, options=opts, item_names=("state", "meta")
        )

    # ------------------------------------------------------------------ queries
    def latest_step(self) -> int | None:
        """The newest *finished* checkpoint step, or None."""
        self._mgr.reload()
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        self._mgr.reload()
        return sorted(self._mgr.all_steps())

    # ------------------------------------------------------------------ save / restore
    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Save (asynchronously when enabled); a step already on disk is left alone. The
        state's checksums are stored in ``meta["checksums"]``."""
        if step in self._mgr.all_steps():
            return
        meta = {**meta, "checksums": crc32_many(host_leaves(state))}
        self._mgr.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def restore(self, step: int | None, target: Any) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` (None: latest) into the structure/shardings of ``target``,
        verified: raises :class:`CheckpointCorruptError` naming the step folder (and the
        tensor) when it does not restore, fails a checksum or holds non-finite values."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint under {self.directory}")
        if step not in self.all_steps():
            raise FileNotFoundError(
                f"no checkpoint step {step} under {self.directory}; "
                f"available steps: {self.all_steps()}"
            )
        where = f"checkpoint {self.directory / str(step)}"
        self._check_shapes(step, target, where)
        silence_checkpoint_reader_noise()
        try:
            out = self._mgr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_like(target)),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds
            raise CheckpointCorruptError(
                f"{where} cannot be restored (a damaged, truncated "
                f"or missing file): {root_cause(e)}"
            ) from e
        meta = dict(out["meta"] or {})
        sums = meta.pop("checksums", None)
        host = host_leaves(out["state"])
        try:
            if isinstance(sums, dict):
                verify_crc32(host, sums, where=where)
            check_finite(host.items(), where=where)
        except CorruptDataError as e:
            raise CheckpointCorruptError(str(e)) from None
        return out["state"], meta

    def _check_shapes(self, step: int, target: Any, where: str) -> None:
        """Raise :class:`CheckpointMismatchError` naming the tensors whose stored shapes
        differ from ``target``'s, before orbax is asked to read them (its own error blames
        nothing in particular, and its asynchronous readers print tracebacks while failing).
        Unreadable metadata is left to the restore, which reports damage."""
        try:
            handler = ocp.StandardCheckpointHandler()
            try:
                meta = handler.metadata(self.directory / str(step) / "state")
            finally:
                handler.close()
        except Exception:  # noqa: BLE001 - damaged metadata: restore() names it
            return
        stored = {
            ".".join(tree_path_parts(p)): tuple(getattr(v, "shape", ()))
            for p, v in jax.tree_util.tree_flatten_with_path(getattr(meta, "tree", meta))[0]
        }
        wanted = {
            ".".join(tree_path_parts(p)): tuple(np.shape(v))
            for p, v in jax.tree_util.tree_flatten_with_path(target)[0]
        }
        if not stored:
            return
        names = sorted(wanted, key=lambda k: not k.startswith("params."))  # weights first
        diff = [
            f"{k} stored {stored[k]}, configured {wanted[k]}"
            for k in names
            if k in stored and stored[k] != wanted[k]
        ]
        diff += [f"{k} configured but not stored" for k in names if k not in stored]
        diff += [f"{k} stored but not configured" for k in stored if k not in wanted]
        if diff:
            more = f" (and {len(diff) - 4} more)" if len(diff) > 4 else ""
            raise CheckpointMismatchError(
                f"{where} holds a model of another shape than its config: "
                + "; ".join(diff[:4])
                + more
                + ". Was config.yaml edited after training?"
            )

    def restore_newest_intact(
        self, target: Any, *, upto: int | None = None, say: Callable[[str], None] = print
    ) -> tuple[Any, dict[str, Any], int] | None:
        """Restore the newest step (at most ``upto``) that passes :meth:`restore`'s
        checks; damaged newer steps are moved to ``../damaged-checkpoints/`` (kept for
        inspection, out of the way of later saves) and reported through ``say``. None
        when no step is left."""
        for step in sorted(self.all_steps(), reverse=True):
            if upto is not None and step > upto:
                continue
            try:
                state, meta = self.restore(step, target)
            except CorruptDataError as e:
                dest = self._set_aside(step)
                say(f"{e}\n  -> moved to {dest}; falling back to an older checkpoint")
                continue
            return state, meta, step
        return None

    def _set_aside(self, step: int) -> Path:
        dest = self.directory.parent / "damaged-checkpoints" / f"{step}-{int(time.time())}"
        if jax.process_index() == 0:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.rename(self.directory / str(step), dest)
        self._mgr.reload()
        return dest

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        """Only the JSON metadata of a checkpoint (cheap: no arrays are read)."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint under {self.directory}")
        silence_checkpoint_reader_noise()
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            raise CheckpointCorruptError(
                f"checkpoint {self.directory / str(step)}: its "
                f"metadata cannot be read: {root_cause(e)}"
            ) from e
        meta = dict(out["meta"] or {})
        meta.pop("checksums", None)
        return meta

    def wait(self) -> None:
        """Block until any in-flight asynchronous save is committed."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and for the removal of a killed save's leftovers (started
        in the background when the manager opens; orbax's ``close`` does not wait for it,
        so a caller that removes the folder next -- a run that failed before its first
        step -- would race it into a traceback from orbax's thread), then release the
        manager (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._mgr.wait_until_finished()
        await_cleanup = getattr(self._mgr, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:  # orbax >= 0.11; earlier ones clean up in __init__
            await_cleanup()
        self._mgr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
