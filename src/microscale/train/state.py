"""The trainer's state, built from a config, and a run folder's checkpoint read back.

:func:`build_state` (model graph per phase, sharded float32 parameters, AdamW state) and
:func:`load_checkpoint` sit below both :mod:`~microscale.train.loop` (which trains that
state) and :mod:`~microscale.train.init` (``init_from=`` a run folder reads its weights
with ``load_checkpoint``), so neither imports the other's module to reach them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from microscale.config import load_yaml, to_dict
from microscale.integrity import CorruptDataError
from microscale.model import ModelConfig, PrecisionRules, Transformer, late_switch, partition_specs
from microscale.outputs import TrainingRun
from microscale.train.adaptive import bf16_rules
from microscale.train.checkpoint import Checkpointer, CheckpointMismatchError
from microscale.train.config import TrainConfig
from microscale.train.mesh import build_mesh
from microscale.train.optim import make_optimizer

__all__ = ["build_state", "load_checkpoint"]


def _param_shardings(abs_params: nnx.State, mesh, replicated: list | None = None) -> dict:
    """Pure-dict tree of NamedShardings from the parameters' logical axes; dimensions
    left replicated (not divisible, no rule) are appended to ``replicated``."""
    specs = partition_specs(abs_params, mesh=mesh, replicated=replicated)
    return nnx.to_pure_dict(
        jax.tree.map(
            lambda v: v.replace(NamedSharding(mesh, v.get_value())),
            specs,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
    )


@dataclasses.dataclass
class _State:
    """Everything built from a config before the loop starts."""

    cfg: TrainConfig
    mesh: Any
    graphdefs: dict[str, Any]  # phase -> graphdef
    rules: dict[str, PrecisionRules]  # phase -> rules
    rest: Any
    params: Any
    opt_state: Any
    tx: optax.GradientTransformation
    param_shardings: Any
    opt_shardings: Any
    replicated: list  # model.Replicated: parameter dims the mesh could not shard
    abs_model: Any  # the abstract model the graphdefs are split from

    def set_main_rules(self, main: PrecisionRules) -> None:
        """Replace the main phase's rules (and the late phase's, derived from them)."""
        self.rules = _phase_rules(self.cfg, main)
        self.graphdefs = _graphdefs(self.abs_model, self.rules)


def _phase_rules(cfg: TrainConfig, main: PrecisionRules) -> dict[str, PrecisionRules]:
    """{phase: rules}: "main"; "late" with a late switch; "warmup" (all bf16) before a
    sensitivity-chosen allocation."""
    rules = {"main": main}
    if cfg.precision.late.fraction > 0:
        rules["late"] = late_switch(main, cfg.precision.late.bf16)
    if cfg.warmup_steps:
        rules["warmup"] = PrecisionRules(default="bf16")
    return rules


def _graphdefs(abs_model, rules: dict[str, PrecisionRules]) -> dict[str, Any]:
    out = {}
    for phase, r in rules.items():
        abs_model.set_rules(r)
        out[phase] = nnx.split(abs_model, nnx.Param, ...)[0]
    abs_model.set_rules(rules["main"])
    return out


def build_state(cfg: TrainConfig, mesh=None, *, abstract: bool = False) -> _State:
    """Model graph(s), sharded float32 params and AdamW state for ``cfg`` (fresh init).

    ``abstract=True`` allocates nothing: params and optimizer state are
    ``jax.ShapeDtypeStruct``\\ s carrying their shardings (a checkpoint restore target).
    """
    mesh = build_mesh(cfg.mesh) if mesh is None else mesh
    rules = _phase_rules(cfg, cfg.precision_rules())

    def make():
        return Transformer(cfg.model, rngs=nnx.Rngs(cfg.seed), rules=rules["main"])

    abs_model = nnx.eval_shape(make)
    _, abs_params, abs_rest = nnx.split(abs_model, nnx.Param, ...)  # type: ignore[misc]
    graphdefs = _graphdefs(abs_model, rules)
    unsharded: list = []
    p_sh = _param_shardings(abs_params, mesh, unsharded)
    replicated = NamedSharding(mesh, PartitionSpec())
    rest_sh = jax.tree.map(lambda _: replicated, nnx.to_pure_dict(abs_rest))

    def init():
        m = make()
        _, p, r = nnx.split(m, nnx.Param, ...)
        return nnx.to_pure_dict(p), nnx.to_pure_dict(r)

    init_fn = jax.jit(init, out_shardings=(p_sh, rest_sh))
    tx = make_optimizer(cfg.optim)
    params_abs, _ = jax.eval_shape(init_fn)
    abs_opt = jax.eval_shape(tx.init, params_abs)
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, abs_opt, p_sh, transform_non_params=lambda _: replicated
    )
    if abstract:
        with_sh = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        params = jax.tree.map(with_sh, params_abs, p_sh)
        opt_state = jax.tree.map(with_sh, abs_opt, opt_sh)
        rest = init_fn()[1] if jax.tree.leaves(rest_sh) else nnx.to_pure_dict(abs_rest)
    else:
        params, rest = init_fn()
        opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    return _State(
        cfg=cfg,
        mesh=mesh,
        graphdefs=graphdefs,
        rules=rules,
        rest=nnx.State(rest),
        params=params,
        opt_state=opt_state,
        tx=tx,
        param_shardings=p_sh,
        opt_shardings=opt_sh,
        replicated=unsharded,
        abs_model=abs_model,
    )


def load_checkpoint(
    run_dir: str | os.PathLike, step: int | None = None, *, phase: str | None = None
):
    """``(model, cfg, meta)`` from a run folder's checkpoint (latest by default).

    The model is a :class:`~microscale.model.Transformer` with the restored float32
    weights and the precision rules of ``phase`` (default: the phase the checkpoint was
    in). Useful for evaluation, PTQ, export and generation.
    """
    run_dir = Path(run_dir)
    config = run_dir / TrainingRun.CONFIG
    cfg = load_yaml(TrainConfig, config)
    mesh = build_mesh(dataclasses.replace(cfg.mesh, data=-1, fsdp=1, tensor=1, device_ids=()))
    st = build_state(cfg, mesh, abstract=True)
    ck = Checkpointer(run_dir / TrainingRun.CHECKPOINTS, async_save=False)
    try:
        _check_stored_model(ck, step, cfg, config)
        state, meta = ck.restore(step, {"params": st.params, "opt_state": st.opt_state})
    finally:
        ck.close()
    if meta.get("bf16_allocation"):
        st.set_main_rules(bf16_rules(cfg.recipe, meta["bf16_allocation"]["bf16_layers"]))
    phase = phase or meta.get("phase", "main")
    model = nnx.merge(st.graphdefs[phase], nnx.State(state["params"]), st.rest)
    return model, cfg, meta


def _check_stored_model(ck: Checkpointer, step: int | None, cfg: TrainConfig, path: Path) -> None:
    """Raise :class:`CheckpointMismatchError` naming each ``model.*`` key on which the
    config a checkpoint was saved with (its metadata) and ``path`` disagree. Settings the
    checkpoint predates (absent from its metadata) are not compared."""
    try:
        stored = ck.restore_meta(step).get("config") or {}
    except (FileNotFoundError, CorruptDataError):
        return  # restore() reports it
    now = json.loads(json.dumps(to_dict(cfg)["model"]))
    raw = stored.get("model")
    if isinstance(raw, dict):  # read as a config today reads it (remat: true -> "full")
        with contextlib.suppress(TypeError, ValueError):
            raw = {k: v for k, v in ModelConfig.from_dict(raw).to_dict().items() if k in raw}
    diff = [(k, a, b) for k, a, b in _leaf_diff("model", raw, now) if a is not None]
    if diff:
        shown = ", ".join(f"{k}={b!r} (the checkpoint has {a!r})" for k, a, b in diff)
        raise CheckpointMismatchError(
            f"{path} does not describe the model in its checkpoint: {shown}. Was it edited "
            "after training? Restore the checkpoint's values"
        )


def _leaf_diff(key: str, a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` for every differing leaf of two plain-data values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d for k in dict.fromkeys([*a, *b]) for d in _leaf_diff(f"{key}.{k}", a.get(k), b.get(k))
        ]
    return [] if a == b else [(key, a, b)]
