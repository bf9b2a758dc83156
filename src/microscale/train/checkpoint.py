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

Restoring needs an *abstract* target (``jax.ShapeDtypeStruct`` leaves with shardings), so
the arrays come back directly sharded on the current mesh, which may differ from the
mesh that saved them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer", "abstract_like"]


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
        self._mgr = ocp.CheckpointManager(self.directory, options=opts,
                                          item_names=("state", "meta"))

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
        """Save (asynchronously when enabled); a step already on disk is left alone."""
        if step in self._mgr.all_steps():
            return
        self._mgr.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int | None, target: Any) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` (None: latest) into the structure/shardings of ``target``."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint under {self.directory}")
        out = self._mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_like(target)),
            meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        """Only the JSON metadata of a checkpoint (cheap: no arrays are read)."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint under {self.directory}")
        out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def wait(self) -> None:
        """Block until any in-flight asynchronous save is committed."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release the manager (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._mgr.wait_until_finished()
        self._mgr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
