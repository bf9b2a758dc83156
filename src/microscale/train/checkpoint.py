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
them and that every float is finite (:func:`array_problems`, the one check of restored
arrays), and reports a checkpoint that does not restore (a
truncated or missing file, a bit flip, bad JSON) as :class:`CheckpointCorruptError`
naming the step folder and the tensor. :meth:`Checkpointer.restore_newest_intact` (used to
resume) then moves the damaged step to ``OUT/damaged-checkpoints/`` and falls back to the
next older one.

:func:`check_step` checks one step folder without a restore target (``microscale
verify``): its arrays restored into numpy a batch at a time, through the same
:func:`array_problems`, every problem named. The folder names are
:class:`microscale.outputs.CheckpointStep`'s.

Restoring needs an *abstract* target (``jax.ShapeDtypeStruct`` leaves with shardings), so
the arrays come back directly sharded on the current mesh, which may differ from the
mesh that saved them.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from microscale.files import disk_cause, disk_error
from microscale.integrity import (
    CorruptDataError,
    check_finite,
    crc32_many,
    root_cause,
    silence_checkpoint_reader_noise,
    tree_path_parts,
)
from microscale.outputs import CheckpointStep, TrainingRun

__all__ = [
    "CheckpointCorruptError",
    "Checkpointer",
    "StepCheck",
    "abstract_like",
    "array_problems",
    "check_step",
    "host_leaves",
]

# (tensor or None for the step as a whole, message naming it)
_Problem = tuple[str | None, str]
_RESTORE_BYTES = 1 << 28  # arrays check_step restores per orbax call (then checks, drops)


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


class _OrbaxDiskNoise(logging.Filter):
    """Drops orbax's logs (with tracebacks) of a save that failed on a full disk or
    read-only file system -- each failing write thread, the background commit, the
    finalize: the same error is raised to the caller of the save (:class:`Checkpointer`
    names the folder)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and disk_cause(exc) is not None)


def _closed_loop_callback(u) -> bool:
    """An unraisable ``RuntimeError('Event loop is closed')`` from asyncio's
    ``call_soon_threadsafe``: a tensorstore write finishing after orbax closed the event
    loop of a save that had already failed (its ``asyncio.gather`` stops at the first
    error; the other writes complete later, in tensorstore's threads)."""
    tb = u.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (
        isinstance(u.exc_value, RuntimeError)
        and str(u.exc_value) == "Event loop is closed"
        and tb is not None
        and tb.tb_frame.f_code.co_name == "_check_closed"
    )


def _quiet_failed_save_teardown() -> None:
    """Keep the teardown of a failed orbax save (a full disk: one error per tensor write
    and a traceback per write that finishes after the loop closed, some of them after the
    caller has printed its error) off stderr; the save's own error still reaches the
    caller. Installed once per process, on the first :class:`Checkpointer`."""
    global _teardown_quiet
    if _teardown_quiet:
        return
    _teardown_quiet = True
    logging.getLogger("absl").addFilter(_OrbaxDiskNoise())
    previous = sys.unraisablehook

    def hook(u) -> None:
        if not _closed_loop_callback(u):
            previous(u)

    sys.unraisablehook = hook


_teardown_quiet = False


class Checkpointer:
    """Save / restore ``(state pytree, meta dict)`` pairs under a directory, keep the last K."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        _quiet_failed_save_teardown()
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
            self.directory, options=opts, item_names=(CheckpointStep.STATE, CheckpointStep.META)
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
        meta = {**meta, CheckpointStep.CHECKSUMS: crc32_many(host_leaves(state))}
        with self._disk_errors():
            self._mgr.save(
                int(step),
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )

    @contextlib.contextmanager
    def _disk_errors(self):
        """A save that met a full disk or read-only file system (tensorstore's text in a
        ValueError) as one :class:`~microscale.files.DiskWriteError` naming the folder."""
        try:
            yield
        except Exception as e:
            err = disk_error(
                e,
                self.directory,
                what="checkpoint folder",
                outcome="the step being saved was not kept (earlier steps are intact)",
            )
            if err is None:
                raise
            raise err from None

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
        meta = dict(out[CheckpointStep.META] or {})
        sums = meta.pop(CheckpointStep.CHECKSUMS, None)
        problems, _ = array_problems(
            host_leaves(out[CheckpointStep.STATE]), sums if isinstance(sums, dict) else None
        )
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CheckpointCorruptError(f"{where}: {problems[0][1]}{more}: the file is damaged")
        return out[CheckpointStep.STATE], meta

    def _check_shapes(self, step: int, target: Any, where: str) -> None:
        """Raise :class:`CheckpointMismatchError` naming the tensors whose stored shapes
        differ from ``target``'s, before orbax is asked to read them (its own error blames
        nothing in particular, and its asynchronous readers print tracebacks while failing).
        Unreadable metadata is left to the restore, which reports damage."""
        try:
            handler = ocp.StandardCheckpointHandler()
            try:
                meta = handler.metadata(self.directory / str(step) / CheckpointStep.STATE)
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
        dest = self.directory.parent / TrainingRun.DAMAGED / f"{step}-{int(time.time())}"
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
        meta = dict(out[CheckpointStep.META] or {})
        meta.pop(CheckpointStep.CHECKSUMS, None)
        return meta

    def wait(self) -> None:
        """Block until any in-flight asynchronous save is committed."""
        with self._disk_errors():
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
        with self._disk_errors():
            self._mgr.wait_until_finished()
        await_cleanup = getattr(self._mgr, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:  # orbax >= 0.11; earlier ones clean up in __init__
            await_cleanup()
        self._mgr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------ checking a step alone


@dataclasses.dataclass(frozen=True)
class StepCheck:
    """What :func:`check_step` found in one step folder."""

    # Arrays in the step's state (0 when its metadata cannot be read).
    tensors: int
    # Arrays compared with a stored CRC-32.
    checked: int
    # Whether the step stores checksums (meta["checksums"]).
    checksums: bool
    problems: tuple[_Problem, ...] = ()


_KEYSTR_TOKEN = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\]|\.([A-Za-z_]\w*)")


def _keystr_parts(s: str) -> tuple[str, ...]:
    """``"['opt_state'][1].mu['layers'][0]"`` -> ``('opt_state', '1', 'mu', 'layers', '0')``:
    a ``jax.tree_util.keystr`` (the names ``meta["checksums"]`` uses) as plain strings,
    comparable with the paths of an orbax metadata tree (dict keys there are strings)."""
    return tuple(str(ast.literal_eval(a)) if a else b for a, b in _KEYSTR_TOKEN.findall(s))


def _read_meta_checksums(step_dir: Path, problems: list[_Problem]) -> dict[str, str] | None:
    """``meta["checksums"]`` of a step (None when none are stored or meta is unreadable)."""
    meta_file = step_dir / CheckpointStep.META / CheckpointStep.META_FILE
    try:
        meta = json.loads(meta_file.read_text("utf-8"))
    except FileNotFoundError:
        problems.append((None, f"{meta_file} is missing"))
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append((None, f"{meta_file} is not JSON ({e}); the metadata is damaged"))
        return None
    sums = meta.get(CheckpointStep.CHECKSUMS) if isinstance(meta, dict) else None
    if sums is not None and not (
        isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values())
    ):
        problems.append(
            (
                None,
                f"{meta_file}: {CheckpointStep.CHECKSUMS!r} is not an object of "
                "checksums; the metadata is damaged",
            )
        )
        return None
    return sums


def _nbytes(m) -> int:
    """Bytes of an array (or its metadata: ``shape`` and ``dtype``)."""
    return int(np.prod(m.shape, dtype=np.int64)) * np.dtype(m.dtype).itemsize


def _batches(leaves: list) -> list[list]:
    """``(path, metadata)`` leaves in restore batches of at most ``_RESTORE_BYTES`` (a larger
    array alone)."""
    batches: list[list] = [[]]
    size = 0
    for leaf in leaves:
        if batches[-1] and size + _nbytes(leaf[1]) > _RESTORE_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(leaf)
        size += _nbytes(leaf[1])
    return batches


def array_problems(
    named: Mapping[str, np.ndarray], sums: Mapping[str, str] | None
) -> tuple[list[_Problem], int]:
    """The one check of restored arrays (:meth:`Checkpointer.restore` and
    :func:`check_step`): each against its stored CRC-32 (``sums``, ``meta["checksums"]``;
    None: none stored), a missing checksum where the step stores them, and non-finite
    values. Returns ``([(tensor, message), ...], how many were hashed)``."""
    stored: Mapping[str, str] = sums or {}
    got = crc32_many({n: a for n, a in named.items() if n in stored})
    problems: list[_Problem] = []
    for n, a in named.items():
        if n in got and got[n] != str(stored[n]).lower():
            problems.append(
                (n, f"tensor {n!r} fails its checksum (crc32 {got[n]}, stored {stored[n]})")
            )
            continue
        if sums and n not in sums:
            problems.append(
                (
                    n,
                    f"tensor {n!r} has no stored checksum although "
                    "the step stores them; the metadata is damaged",
                )
            )
        try:
            check_finite([(n, a)], where="-")
        except CorruptDataError as e:
            problems.append((n, str(e).removeprefix("-: ")))
    return problems, len(got)


def _hashed(
    named: dict[str, np.ndarray], sums: dict[str, str] | None, where: Path, problems: list[_Problem]
) -> int:
    found, hashed = array_problems(named, sums)
    problems.extend(found)
    return hashed


def _is_array(m: Any) -> bool:
    """Whether an orbax metadata leaf describes an array."""
    return hasattr(m, "shape") and hasattr(m, "dtype")


def _orbax_tree(ckptr, state: Path) -> tuple[Any, str]:
    """The array metadata tree of an orbax step's ``state`` (None when unreadable) and
    what is wrong when it is None."""
    try:
        tree = getattr(ckptr.metadata(state).item_metadata, "tree", None)
        why = (
            "orbax reads no array metadata from it (state/_METADATA or its OCDBT index is "
            "damaged, truncated or missing)"
        )
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds
        tree, why = (
            None,
            f"its array metadata cannot be read (a damaged, truncated or "
            f"missing file): {root_cause(e)}",
        )
    return tree, why


def _restore_selected(ckptr, state: Path, tree: Any, selected: list) -> dict:
    """The arrays of ``selected`` (``(path, metadata)`` pairs) restored into numpy, keyed
    by tree path; every other array is skipped (a placeholder)."""
    chosen = {p for p, _ in selected}

    def pick(make):
        return lambda p, m: (make(m) if p in chosen else ocp.PLACEHOLDER) if _is_array(m) else m

    out = ckptr.restore(
        state,
        args=ocp.args.PyTreeRestore(
            item=jax.tree_util.tree_map_with_path(pick(lambda m: m), tree, is_leaf=_is_array),
            restore_args=jax.tree_util.tree_map_with_path(
                pick(lambda _: ocp.RestoreArgs(restore_type=np.ndarray)), tree, is_leaf=_is_array
            ),
        ),
    )
    return {
        p: np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(out)[0] if p in chosen
    }


def check_step(step_dir: Path, progress: Callable[[int], None] = lambda n: None) -> StepCheck:
    """Check one finished step folder without a restore target (``microscale verify``;
    the module doc): arrays are restored into numpy a batch at a time (a failed batch
    again one array at a time, to name the damaged one), compared with ``meta``'s CRC-32s
    and checked finite by :func:`array_problems` (as :meth:`Checkpointer.restore` does),
    and dropped. ``progress(n)`` counts the bytes of each batch."""
    step_dir = Path(step_dir)
    state = step_dir.absolute() / CheckpointStep.STATE  # orbax resolves relative paths elsewhere
    problems: list[_Problem] = []
    sums = _read_meta_checksums(step_dir, problems)
    by_parts = {_keystr_parts(k): k for k in (sums or {})}
    ckptr = ocp.PyTreeCheckpointer()
    tree, why = _orbax_tree(ckptr, state)
    if tree is None:
        problems.append((None, f"{state}: {why}"))
        return StepCheck(0, 0, sums is not None, tuple(problems))
    leaves = [
        (p, m)
        for p, m in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_array)[0]
        if _is_array(m)
    ]

    def name_of(path) -> str:
        return by_parts.get(tree_path_parts(path), jax.tree_util.keystr(path))

    def restore(selected: list) -> dict:
        return _restore_selected(ckptr, state, tree, selected)

    batches = _batches(leaves)
    seen: set[tuple[str, ...]] = set()
    checked = 0
    for batch in batches:
        try:
            arrays = restore(batch)
        except Exception:  # noqa: BLE001 - find which arrays, one at a time (below)
            arrays = None
        if arrays is None:  # outside the handler: each error's own cause, not the batch's
            arrays = {}
            for p, m in batch:
                try:
                    arrays.update(restore([(p, m)]))
                except Exception as e:  # noqa: BLE001
                    seen.add(tree_path_parts(p))
                    problems.append(
                        (
                            name_of(p),
                            f"tensor {name_of(p)!r} cannot be "
                            "restored (a damaged, truncated or "
                            f"missing file): {root_cause(e)}",
                        )
                    )
        named = {name_of(p): a for p, a in arrays.items()}
        seen.update(tree_path_parts(p) for p in arrays)
        del arrays
        checked += _hashed(named, sums, step_dir, problems)
        progress(sum(_nbytes(m) for _, m in batch))
        del named
    for parts, n in sorted(by_parts.items(), key=lambda kv: kv[1]):
        if parts not in seen:
            problems.append(
                (
                    n,
                    f"tensor {n!r} has a stored checksum but is not in "
                    f"{state}; the checkpoint is damaged",
                )
            )
    return StepCheck(len(leaves), checked, sums is not None, tuple(problems))
