"""``train(cfg)``: the training loop as a library function.

What one call does, in order:

1. multi-host start-up if configured (``mesh.py``), the (data, fsdp, tensor) mesh;
2. the output folder: ``config.yaml`` (the resolved :class:`TrainConfig`),
   ``precision_rules.json`` (the per-layer rules of the main phase, and of the late phase
   when there is one), ``tokenizer.json``;
3. data (:func:`microscale.data.load_data`): the train batcher, the fixed validation
   batches of every held-out set, the unigram entropy of the val split;
4. the model: parameters initialized directly sharded (``jax.jit`` with output
   shardings from the model's logical axes), float32 master weights, AdamW state --
   or all of it restored from the latest checkpoint when ``resume=true``;
5. the loop over steps (``step.py``): the batch for step ``t`` is ``batch_at(t)`` (a pure
   function of the data seed and ``t``), the key is ``fold_in(seed, t)``; at
   ``switch_step`` the late precision switch re-applies the rules (one recompile);
   metrics are read back one step late so the host never stalls the device;
6. evaluations, checkpoints, ``metrics.jsonl`` / TensorBoard / progress (``metrics.py``);
7. ``summary.json`` (written atomically) and the summary dict returned.

Non-finite steps are skipped on device (``step.py``) and counted here; after
``max_nonfinite_in_a_row`` in a row :class:`TrainingAborted` is raised (a
``summary.json`` with ``"status": "aborted"`` is written first) and no checkpoint is
saved, so the last good one is intact and ``resume=true`` continues from it.

Exact resume: params, optimizer state, the step, the non-finite counters and the phase
are checkpointed; batches and keys are functions of the step. 20 steps straight and 10 +
resume + 10 give identical losses (``tests/train/test_train_loop.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from microscale import __version__
from microscale.config import dump_yaml, load_yaml, to_dict
from microscale.data import check_vocab_fits, load_data
from microscale.files import atomic_write_json, check_output_dir, lock_folder, read_json
from microscale.integrity import CorruptDataError
from microscale.model import (
    ModelConfig,
    PrecisionRules,
    Transformer,
    assignments,
    iter_linears,
    late_switch,
    partition_specs,
    quantized_blocks,
)
from microscale.ops import get_recipe
from microscale.train.adaptive import bf16_rules, choose_bf16_layers
from microscale.train.checkpoint import Checkpointer, CheckpointMismatchError
from microscale.train.config import TrainConfig
from microscale.train.mesh import (
    BATCH_AXES,
    build_mesh,
    maybe_initialize_distributed,
    shard_batch,
)
from microscale.train.metrics import MetricsLogger, format_duration, weight_quant_stats
from microscale.train.optim import lr_schedule, make_optimizer
from microscale.train.step import make_eval_step, make_train_step

__all__ = ["TrainingAborted", "build_state", "default_out", "enable_compilation_cache",
           "load_checkpoint", "train"]

# Config fields that must not change when resuming (they define the run).
_RUN_DEFINING = ("model", "data", "optim", "recipe", "bf16_first", "bf16_last", "bf16_layout",
                 "rules", "rules_mode", "bf16_policy", "adaptive", "init_from", "init_step",
                 "late_switch", "seed", "steps")


class TrainingAborted(RuntimeError):
    """Raised after too many consecutive non-finite steps; ``.summary`` holds the partial
    summary (also written to ``OUT/summary.json`` with ``"status": "aborted"``)."""

    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache (default ``<microscale cache>/jax``).

    A second run of the same model/recipe/shapes then skips XLA compilation (20-30 s per
    quantized recipe on a laptop CPU). ``MICROSCALE_JAX_CACHE=0`` disables it; a cache dir
    configured elsewhere is left alone. Returns the directory in use (None if disabled).
    """
    env = os.environ.get("MICROSCALE_JAX_CACHE")
    if env is not None and env.strip().lower() in ("0", "off", "false", "no", ""):
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    from microscale.data import cache_root

    d = Path(path or env or cache_root() / "jax").expanduser()
    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return str(d)


def default_out(cfg: TrainConfig) -> str:
    """``runs/<d_model>x<n_layers>-<recipe>-<YYYYmmdd-HHMMSS>``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    m = cfg.model
    return os.path.join("runs", f"d{m.d_model}x{m.n_layers}-{cfg.recipe}-{stamp}")


# ----------------------------------------------------------------------------- state


def _param_shardings(abs_params: nnx.State, mesh, replicated: list | None = None) -> dict:
    """Pure-dict tree of NamedShardings from the parameters' logical axes; dimensions
    left replicated (not divisible, no rule) are appended to ``replicated``."""
    specs = partition_specs(abs_params, mesh=mesh, replicated=replicated)
    return nnx.to_pure_dict(jax.tree.map(lambda v: v.replace(NamedSharding(mesh, v.get_value())),
                                         specs, is_leaf=lambda x: isinstance(x, nnx.Variable)))


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
    if cfg.late_switch.fraction > 0:
        mode = "bf16" if cfg.late_switch.mode == "full" else "forward"
        rules["late"] = late_switch(main, mode)
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
    _, abs_params, abs_rest = nnx.split(abs_model, nnx.Param, ...)
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
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, abs_opt, p_sh,
                                   transform_non_params=lambda _: replicated)
    if abstract:
        with_sh = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        params = jax.tree.map(with_sh, params_abs, p_sh)
        opt_state = jax.tree.map(with_sh, abs_opt, opt_sh)
        rest = init_fn()[1] if jax.tree.leaves(rest_sh) else nnx.to_pure_dict(abs_rest)
    else:
        params, rest = init_fn()
        opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    return _State(cfg=cfg, mesh=mesh, graphdefs=graphdefs, rules=rules,
                  rest=nnx.State(rest), params=params, opt_state=opt_state, tx=tx,
                  param_shardings=p_sh, opt_shardings=opt_sh, replicated=unsharded,
                  abs_model=abs_model)


def load_checkpoint(run_dir: str | os.PathLike, step: int | None = None, *,
                    phase: str | None = None):
    """``(model, cfg, meta)`` from a run folder's checkpoint (latest by default).

    The model is a :class:`~microscale.model.Transformer` with the restored float32
    weights and the precision rules of ``phase`` (default: the phase the checkpoint was
    in). Useful for evaluation, PTQ, export and generation.
    """
    run_dir = Path(run_dir)
    cfg = load_yaml(TrainConfig, run_dir / "config.yaml")
    mesh = build_mesh(dataclasses.replace(cfg.mesh, data=-1, fsdp=1, tensor=1, device_ids=()))
    st = build_state(cfg, mesh, abstract=True)
    ck = Checkpointer(run_dir / "checkpoints", async_save=False)
    try:
        _check_stored_model(ck, step, cfg, run_dir / "config.yaml")
        state, meta = ck.restore(step, {"params": st.params, "opt_state": st.opt_state})
    finally:
        ck.close()
    if meta.get("bf16_allocation"):
        st.set_main_rules(bf16_rules(cfg.recipe, meta["bf16_allocation"]["bf16_layers"]))
    phase = phase or meta.get("phase", "main")
    model = nnx.merge(st.graphdefs[phase], nnx.State(state["params"]), st.rest)
    return model, cfg, meta


# ----------------------------------------------------------------------------- helpers


def _check_resume_compatible(out: Path, cfg: TrainConfig) -> None:
    path = out / "config.yaml"
    if not path.exists():
        return
    old = load_yaml(TrainConfig, path)
    diff = [(k, a, b) for k in _RUN_DEFINING
            for k, a, b in _leaf_diff(k, to_dict(old).get(k), to_dict(cfg).get(k))]
    if diff:
        shown = ", ".join(f"{k}={b!r} (the run has {a!r})" for k, a, b in diff[:8])
        more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
        raise ValueError(
            f"resume=true but {len(diff)} run-defining setting(s) differ from {path}: "
            f"{shown}{more}. A resumed run must keep them (only cadence, mesh and output "
            "options may change); use a new out= for a different run")


def _check_stored_model(ck: Checkpointer, step: int | None, cfg: TrainConfig,
                        path: Path) -> None:
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
            "after training? Restore the checkpoint's values")


def _leaf_diff(key: str, a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` for every differing leaf of two plain-data values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in dict.fromkeys([*a, *b])
                for d in _leaf_diff(f"{key}.{k}", a.get(k), b.get(k))]
    return [] if a == b else [(key, a, b)]


def _init_params(cfg: TrainConfig, st: _State, weights: dict, src):
    """``weights`` (of ``init_from``) checked against the model, sharded like ``st.params``."""
    from microscale.train.init import check_init_shapes

    def name(path) -> str:
        return ".".join(str(getattr(k, "key", k)) for k in path)

    leaves = jax.tree_util.tree_flatten_with_path(st.params)[0]
    check_init_shapes(weights, {name(p): x.shape for p, x in leaves}, src, cfg.model)

    def put(path, x, sharding):
        arr = np.asarray(weights[name(path)], dtype=x.dtype)
        return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])

    return jax.tree_util.tree_map_with_path(put, st.params, st.param_shardings)


def _quant_stats(model) -> dict[str, dict[str, float]]:
    out = {}
    for path, node in iter_linears(model):
        recipe = getattr(node, "recipe", None)
        if recipe is None or not hasattr(node, "kernel"):
            continue
        stats = weight_quant_stats(node.kernel[...], get_recipe(recipe).fprop_w)
        if stats is not None:
            out[path] = stats
    return out


# ----------------------------------------------------------------------------- train


def train(cfg: TrainConfig, *, progress: bool = True,
          callbacks: Sequence[Callable[[dict], None]] | None = None,
          label: str | None = None) -> dict[str, Any]:
    """Train ``cfg`` to completion (or resume it); return the summary dict.

    ``progress``: a tqdm bar on a terminal, plain periodic lines otherwise (False: quiet).
    ``callbacks``: called with every metrics record (dicts with ``kind`` "train", "eval" or
    "event", as written to ``metrics.jsonl``) -- e.g. ``microscale compare``'s display.
    ``label``: the progress display's name for this run (default: the recipe).

    With ``resume=true`` a run whose ``summary.json`` says ``"completed"`` at
    ``steps`` is not recomputed: its summary is returned as is. Raises
    :class:`TrainingAborted` after ``max_nonfinite_in_a_row`` non-finite steps,
    ``FileExistsError`` when ``out`` holds checkpoints and ``resume`` is false.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"train expects a TrainConfig, got {type(cfg).__name__}")
    t_start = time.perf_counter()
    maybe_initialize_distributed(cfg.mesh)
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=default_out(cfg))
    out = check_output_dir(cfg.out, what="out=")
    # One writer per run folder (on multi-host runs, process 0 speaks for all).
    lock = lock_folder(out) if jax.process_index() == 0 else contextlib.nullcontext()
    with lock:
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            return _train_locked(cfg, out, t_start=t_start, progress=progress,
                                 callbacks=callbacks, label=label)
        except BaseException:
            if created and jax.process_index() == 0:
                _remove_unstarted(out)
            raise


# What a run writes before it starts logging: a folder holding only these was never a run.
_STARTUP_FILES = frozenset({"config.yaml", "precision_rules.json", "tokenizer.json",
                            "checkpoints"})


def _remove_unstarted(out: Path) -> None:
    """Remove ``out`` (created by this call) when the run failed before it logged or saved
    anything (a bad ``init_from``, data or mesh): no half-made run folder is left behind. A
    run that has written metrics or a checkpoint keeps its folder."""
    names = {p.name for p in out.iterdir()}
    ckpts = out / "checkpoints"
    if names <= _STARTUP_FILES and not (ckpts.is_dir() and any(ckpts.iterdir())):
        shutil.rmtree(out, ignore_errors=True)


def _train_locked(cfg: TrainConfig, out: Path, *, t_start: float, progress: bool, callbacks,
                  label) -> dict[str, Any]:
    ckpt = Checkpointer(out / "checkpoints", keep=cfg.keep_checkpoints)
    try:
        latest = ckpt.latest_step()
        if latest is not None and not cfg.resume:
            raise FileExistsError(
                f"{out} already holds checkpoints (latest step {latest}); pass resume=true "
                "to continue that run, or choose another out=")
        if cfg.resume:
            _check_resume_compatible(out, cfg)
        if cfg.resume and latest is not None:
            done = out / "summary.json"
            if latest >= cfg.steps and done.exists():
                summary = read_json(done, what="run summary")
                if summary.get("status") == "completed":
                    return summary
        return _train(cfg, out, ckpt, latest if cfg.resume else None, t_start=t_start,
                      progress=progress, callbacks=callbacks, label=label or cfg.recipe)
    finally:
        ckpt.close()


def _train(cfg: TrainConfig, out: Path, ckpt: Checkpointer, resume_from: int | None, *,
           t_start: float, progress: bool, callbacks, label: str) -> dict[str, Any]:
    main = jax.process_index() == 0
    if main:
        dump_yaml(cfg, out / "config.yaml")
    init = None  # read first: a bad init_from fails before data and model are built
    if cfg.init_from is not None and resume_from is None:
        from microscale.train.init import load_init_weights

        init = load_init_weights(cfg.init_from, step=cfg.init_step)

    # ---- data
    data = load_data(cfg.data)
    check_vocab_fits(data.vocab_size, cfg.model.vocab_size,
                     what=f"data.tokenizer={cfg.data.tokenizer!r}" if data.tokenizer else
                     f"data.corpus={cfg.data.corpus!r}")
    pi, pc = jax.process_index(), jax.process_count()
    batcher = data.train_batcher(process_index=pi, process_count=pc)
    if main and data.tokenizer is not None:
        data.save_tokenizer(out / "tokenizer.json")

    # ---- mesh, model, optimizer
    mesh = build_mesh(cfg.mesh)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.data.batch_size // cfg.data.grad_accum
    eval_rows = cfg.data.eval_batch_size or cfg.data.batch_size
    for what, rows in (("data.batch_size / data.grad_accum", micro),
                       ("data.eval_batch_size (or batch_size)", eval_rows)):
        if rows % dp:
            raise ValueError(f"{what} = {rows} is not divisible by the data-parallel ways "
                             f"mesh.data * mesh.fsdp = {dp}")
    st = build_state(cfg, mesh)
    adaptive = cfg.bf16_policy == "sensitivity"
    warm_step = cfg.warmup_steps

    def save_rules() -> None:
        if main:
            st.rules["main"].save(out / "precision_rules.json")
            if "late" in st.rules:
                st.rules["late"].save(out / "precision_rules_late.json")

    if not adaptive:
        save_rules()  # a sensitivity-chosen allocation is saved once chosen
    schedule = lr_schedule(cfg.optim, cfg.steps)
    inject = bool(cfg.inject_nonfinite_steps)
    batch_spec = PartitionSpec(None, BATCH_AXES, None)
    eval_spec = PartitionSpec(BATCH_AXES, None)
    steps_fn: dict[str, Any] = {}
    evals_fn: dict[str, Any] = {}

    def compile_phases() -> None:
        """(Re)build the per-phase train / eval steps from ``st.graphdefs``."""
        for ph, g in st.graphdefs.items():
            steps_fn[ph] = make_train_step(g, st.tx, schedule, seed=cfg.seed, inject=inject,
                                           param_shardings=st.param_shardings,
                                           opt_shardings=st.opt_shardings,
                                           batch_sharding=NamedSharding(mesh, batch_spec))
            evals_fn[ph] = make_eval_step(g, seed=cfg.seed, param_shardings=st.param_shardings,
                                          batch_sharding=NamedSharding(mesh, eval_spec))

    compile_phases()
    allocation: dict | None = None  # the bf16_allocation record (bf16_policy=sensitivity)

    def choose_allocation(step: int) -> None:
        nonlocal allocation
        model = nnx.merge(st.graphdefs["warmup"], nnx.State(params), st.rest)
        rules, allocation = choose_bf16_layers(model, cfg, data.corpus.train)
        allocation["step"] = step
        st.set_main_rules(rules)
        compile_phases()
        save_rules()
        logger.log({"kind": "event", "event": "bf16_allocation", "tokens": step * tps,
                    **allocation})
        logger.message(f"step {step}: {allocation['method']} sensitivity keeps "
                       f"{len(allocation['bf16_layers'])} layers in bf16 "
                       f"({allocation['bf16_flops']:.1%} of linear FLOPs, budget "
                       f"{allocation['budget_bf16_flops']:.1%}): "
                       + (", ".join(allocation["bf16_layers"]) or "none"))

    # ---- resume, or the initial weights of init_from
    params, opt_state = st.params, st.opt_state
    start, nonfinite_total, streak, train_time = 0, 0, 0, 0.0
    init_source: dict | None = None
    restored = None
    if resume_from is not None:
        restored = ckpt.restore_newest_intact(
            {"params": params, "opt_state": opt_state}, upto=resume_from,
            say=lambda m: print(f"[microscale train] {m}", file=sys.stderr, flush=True))
        if restored is None:
            print(f"[microscale train] no intact checkpoint left in {out / 'checkpoints'}; "
                  "starting from step 0", file=sys.stderr, flush=True)
    if restored is not None:
        state, meta, _ = restored
        params, opt_state = state["params"], state["opt_state"]
        start = int(meta["step"])
        nonfinite_total = int(meta.get("nonfinite_total", 0))
        streak = int(meta.get("nonfinite_streak", 0))
        train_time = float(meta.get("train_time_s", 0.0))
        init_source = meta.get("init_from")
        allocation = meta.get("bf16_allocation")
        if allocation:
            st.set_main_rules(bf16_rules(cfg.recipe, allocation["bf16_layers"]))
            compile_phases()
    elif init is not None:
        params = _init_params(cfg, st, *init)
        init_source = init[1].to_dict()

    logger = MetricsLogger(out, total_steps=cfg.steps, start_step=start, progress=progress,
                           tensorboard=cfg.tensorboard, main=main, callbacks=callbacks,
                           description=label)
    if init_source is not None and not start:
        logger.log({"kind": "event", "event": "init_from", "step": 0, "source": init_source})
        logger.message(f"init_from: {init_source['note']}")
    # recipes, not names: a rules file may hold custom recipes (QAT on a quantize output)
    start_rules = st.rules["warmup" if start < warm_step else "main"]
    q_blocks, hp_blocks = quantized_blocks({
        p: start_rules.resolve(p) for p, _ in iter_linears(
            nnx.merge(st.graphdefs["main"], nnx.State(params), st.rest))})
    logger.log({"kind": "event", "event": "precision", "step": start,
                "quantized_blocks": q_blocks, "high_precision_blocks": hp_blocks})
    what = cfg.recipe if cfg.rules is None else f"rules {cfg.rules}"
    if start < warm_step:
        what = f"{cfg.recipe} after a {warm_step}-step bf16 warm-up; warm-up"
    logger.message(f"{what}: {len(q_blocks)} of {len(q_blocks) + len(hp_blocks)} "
                   f"blocks quantized" + (f"; blocks {hp_blocks} in high precision"
                                          if hp_blocks else ""))
    if start:
        logger.log({"kind": "event", "event": "resume", "step": start,
                    "tokens": start * cfg.tokens_per_step})
        logger.message(f"resumed from {out / 'checkpoints'} at step {start}")

    val_sets = {name: data.val_batches(name, process_index=pi, process_count=pc)
                for name in data.eval_sets()}
    val_dev = {name: [shard_batch(mesh, b, eval_spec) for b in arr]
               for name, arr in val_sets.items()}
    entropy = {name: data.unigram_entropy(name) for name in val_sets}
    n_params = cfg.model.num_params()
    tps = cfg.tokens_per_step
    switch = cfg.switch_step

    def phase_of(step: int) -> str:
        if step < warm_step:
            return "warmup"
        return "late" if ("late" in st.graphdefs and step >= switch) else "main"

    def evaluate(step: int, phase: str) -> dict:
        t0 = time.perf_counter()
        fn = evals_fn[phase]
        losses, per_batch = {}, {}
        for name, batches in val_dev.items():
            vals = [float(v) for v in jax.device_get([fn(params, st.rest, b) for b in batches])]
            losses[name] = float(np.mean(vals))
            per_batch[name] = vals
        model = nnx.merge(st.graphdefs[phase], nnx.State(params), st.rest)
        rec = {"kind": "eval", "step": step, "tokens": step * tps, "phase": phase,
               "val_loss": losses["val"], "val_ppl": math.exp(min(losses["val"], 50.0)),
               "val_losses": losses, "val_batch_losses": per_batch,
               "quant": _quant_stats(model),
               "eval_time_s": time.perf_counter() - t0}
        logger.log(rec)
        logger.progress(step, val_loss=losses["val"], force=True)
        return rec

    def meta_for(step: int) -> dict:
        return {"step": step, "data_step": step, "tokens": step * tps,
                "nonfinite_total": nonfinite_total, "nonfinite_streak": streak,
                "phase": phase_of(step), "train_time_s": train_time,
                "recipe": cfg.recipe, "microscale_version": __version__,
                "init_from": init_source, "bf16_allocation": allocation,
                "config": to_dict(cfg)}

    def summary_for(status: str, last_eval: dict | None, **extra) -> dict:
        val = last_eval["val_loss"] if last_eval else None
        s = {
            "status": status,
            "recipe": cfg.recipe,
            "final_val_loss": val,
            "val_ppl": last_eval["val_ppl"] if last_eval else None,
            "final_val_losses": last_eval["val_losses"] if last_eval else None,
            # per fixed validation batch, so paired comparisons can measure eval noise
            "final_val_batch_losses": last_eval["val_batch_losses"] if last_eval else None,
            "final_train_loss": float(np.mean(recent)) if recent else None,
            "steps": last_step,
            "tokens": last_step * tps,
            "tokens_per_s": (timed_tokens / timed_s) if timed_s > 0 else None,
            "params": n_params,
            "corpus_hash": data.corpus.content_hash,
            "unigram_entropy": entropy["val"],
            "unigram_entropies": entropy,
            "nonfinite_steps": nonfinite_total,
            "late_switch_step": switch if "late" in st.graphdefs else None,
            "init_from": init_source,
            "bf16_allocation": allocation,
            "wall_time_s": time.perf_counter() - t_start,
            "train_time_s": train_time,
            "compile_time_s": compile_s,
            "precision": assignments(nnx.merge(st.graphdefs["main"], nnx.State(params),
                                               st.rest)),
            "mesh": dict(mesh.shape),
            "devices": jax.device_count(),
            "backend": jax.default_backend(),
            "out": str(out),
            "data": {k: v for k, v in data.describe().items() if k != "config"},
            "config": to_dict(cfg),
            "microscale_version": __version__,
        }
        s.update(extra)
        return s

    # ---- loop
    recent: list[float] = []
    last_eval: dict | None = None
    last_step = start
    timed_tokens, timed_s, compile_s = 0, 0.0, 0.0
    win_loss: list[float] = []
    win_t0, win_tokens = time.perf_counter(), 0
    phase = phase_of(start)
    if adaptive and allocation is None and start >= warm_step:
        choose_allocation(start)  # resumed from the checkpoint taken just before the choice
    if start == 0 and cfg.eval_every:
        last_eval = evaluate(0, phase)
    pending: tuple[int, dict] | None = None  # (batch index, metrics) read back one step late
    t_prev = time.perf_counter()
    warm = {start, switch, warm_step}  # first step of a compiled program: compile time, not throughput

    def process(item) -> None:
        nonlocal streak, nonfinite_total, last_step, t_prev, timed_tokens, timed_s
        nonlocal compile_s, win_t0, win_tokens, train_time
        idx, m = item
        m = jax.device_get(m)
        now = time.perf_counter()
        dt = now - t_prev
        t_prev = now
        train_time += dt
        if idx in warm:
            compile_s += dt
        else:
            timed_tokens += tps
            timed_s += dt
        step = idx + 1
        last_step = step
        loss, gnorm, lr = float(m["loss"]), float(m["grad_norm"]), float(m["lr"])
        if not bool(m["finite"]):
            streak += 1
            nonfinite_total += 1
            logger.log({"kind": "event", "event": "nonfinite", "step": step, "loss": loss,
                        "grad_norm": gnorm, "streak": streak, "total": nonfinite_total})
            logger.message(f"step {step}: non-finite loss/gradient (loss={loss}, "
                           f"grad_norm={gnorm}); update skipped ({streak} in a row)")
            if streak >= cfg.max_nonfinite_in_a_row:
                raise _Abort(step)
        else:
            streak = 0
            recent.append(loss)
            del recent[:-max(cfg.log_every, 10)]
            win_loss.append(loss)
        win_tokens += tps
        logger.progress(step)
        if step % cfg.log_every == 0 or step == cfg.steps:
            wdt = now - win_t0
            rec = {"kind": "train", "step": step, "loss": loss,
                   "loss_avg": float(np.mean(win_loss)) if win_loss else None,
                   "lr": lr, "grad_norm": gnorm, "tokens": step * tps,
                   "tokens_per_s": win_tokens / wdt if wdt > 0 else None,
                   "nonfinite": nonfinite_total, "phase": phase_of(idx),
                   "time": now - t_start}
            logger.log(rec)
            logger.progress(step, loss=loss, tokens_per_s=rec["tokens_per_s"], lr=lr)
            win_loss.clear()
            win_t0, win_tokens = now, 0

    def pause_end(t0: float) -> None:
        """Exclude eval/checkpoint time (since ``t0``) from the throughput clocks."""
        nonlocal t_prev, win_t0
        d = time.perf_counter() - t0
        t_prev += d
        win_t0 += d

    try:
        with batcher.iterate(start, cfg.steps - start, prefetch=cfg.data.prefetch,
                             microbatches=True) as it:
            for idx, batch in it:
                ph = phase_of(idx)
                if ph != phase:
                    if pending is not None:
                        process(pending)
                        pending = None
                    if phase == "warmup" and adaptive:
                        t0 = time.perf_counter()
                        choose_allocation(idx)
                        pause_end(t0)
                    elif phase == "warmup":  # position_warmup: the positional rules from here
                        logger.log({"kind": "event", "event": "warmup_end", "step": idx,
                                    "tokens": idx * tps})
                        logger.message(f"step {idx}: bf16 warm-up over; {cfg.recipe} with "
                                       "the positional bf16 blocks")
                    phase = ph
                    if ph == "late":
                        logger.log({"kind": "event", "event": "late_switch", "step": idx,
                                    "tokens": idx * tps, "mode": cfg.late_switch.mode})
                        logger.message(f"step {idx}: late switch to high precision "
                                       f"({cfg.late_switch.mode}) for the last "
                                       f"{cfg.steps - idx} steps")
                args = [params, opt_state, st.rest, shard_batch(mesh, batch, batch_spec),
                        jnp.int32(idx)]
                if inject:
                    args.append(jnp.bool_(idx + 1 in cfg.inject_nonfinite_steps))
                params, opt_state, m = steps_fn[phase](*args)
                if pending is not None:
                    process(pending)
                pending = (idx, m)
                step = idx + 1
                do_eval = cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps
                do_ckpt = (cfg.checkpoint_every and step % cfg.checkpoint_every == 0
                           ) or step == cfg.steps
                if do_eval or do_ckpt:
                    process(pending)
                    pending = None
                    t0 = time.perf_counter()
                    if do_eval:
                        last_eval = evaluate(step, phase)
                    if do_ckpt:
                        ckpt.save(step, {"params": params, "opt_state": opt_state},
                                  meta_for(step))
                    pause_end(t0)
            if pending is not None:
                process(pending)
                pending = None
    except _Abort as a:
        ckpt.wait()  # an asynchronous save of the last good step finishes first
        good = ckpt.latest_step()
        msg = (f"training aborted at step {a.step}: {cfg.max_nonfinite_in_a_row} non-finite "
               f"losses/gradients in a row (max_nonfinite_in_a_row="
               f"{cfg.max_nonfinite_in_a_row}); their updates were skipped. "
               + (f"The last good checkpoint is step {good} in {out / 'checkpoints'} "
                  "(resume=true continues from it). " if good is not None else
                  "No checkpoint was saved before the failure. ")
               + "Try a lower optim.lr, more bf16 blocks (bf16_last=...) or another recipe.")
        logger.log({"kind": "event", "event": "abort", "step": a.step, "message": msg})
        logger.message(msg)
        logger.close()
        summary = summary_for("aborted", last_eval, error=msg, last_good_checkpoint=good)
        if main:
            atomic_write_json(out / "summary.json", summary)
        raise TrainingAborted(msg, summary) from None
    except BaseException:
        logger.close()
        raise

    try:
        if last_eval is None or last_eval["step"] != last_step:
            last_eval = evaluate(last_step, phase)
        ckpt.wait()
    finally:
        logger.close()
    summary = summary_for("completed", last_eval)
    if main:
        atomic_write_json(out / "summary.json", summary)
        if progress:
            ent = entropy["val"]
            val = summary["final_val_loss"]
            print(f"done: {cfg.recipe} val_loss {val:.4f} (unigram entropy {ent:.4f}), "
                  f"{summary['tokens']:,} tokens, {summary['tokens_per_s'] or 0:,.0f} tok/s, "
                  f"{format_duration(summary['wall_time_s'])} -> {out}", flush=True)
    return summary


class _Abort(Exception):
    def __init__(self, step: int):
        super().__init__(step)
        self.step = step

