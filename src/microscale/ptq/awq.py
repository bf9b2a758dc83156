"""Activation-aware per-channel weight scales folded into the model (AWQ-style).

A few input channels of a linear layer carry most of the activation magnitude; their
weights matter most for the output, and a block-scaled 4-bit format spends the same grid
on them as on every other channel. Activation-aware weight quantization (Lin et al.,
2023) scales input channel ``c`` of the kernel by ``s_c`` before quantizing and divides
the input by ``s_c`` (``Y = (X / s) (diag(s) W)``): a large ``s_c`` gives the important
channels a finer share of each block's range. Here the division is **folded** into the
layer that produces ``X``, so the result is an ordinary model with the same structure:

* ``q/k/v_proj`` read ``attn_norm(x)``: the RMSNorm's weight is divided by ``s`` (its
  ``1 + w`` for Gemma's norms: ``w' = (1 + w) / s - 1``);
* ``gate/up_proj`` read ``mlp_norm(h)``: likewise the MLP norm's weight;
* ``down_proj`` reads ``silu(gate) * up``: ``up_proj``'s output columns are divided by ``s``;
* ``o_proj`` reads the attention output, whose channel ``(h, d)`` is value channel
  ``(h // g, d)`` of ``v_proj`` (``g`` query heads per kv head, softmax weights summing
  per head): ``v_proj``'s output columns (and its bias, Qwen2's) are divided by the kv
  channel's scale and
  ``o_proj``'s rows multiplied by it, the scale repeated over the ``g`` query heads of
  each group (chosen from the group's mean ``|X|``), so GQA folds exactly too.

In exact arithmetic the folded model computes the same function (every kernel row is
multiplied by ``s``, the matching input divided by it), so every export (HF /
compressed-tensors, ModelOpt, GGUF) carries it and every runtime loads it unchanged; in
bf16 the reference changes by rounding only.

The scale of a group of layers reading one input ``X`` is ``s = m^alpha`` with ``m`` the
mean ``|X_c|`` over the calibration tokens, normalized by ``sqrt(max(s) min(s))``;
``alpha`` is chosen per group on a grid (``alpha = 0``: ``s = 1``, no change) for the least
calibration output error of the group's layers in the target format,
``sum_l ||X W_l - (X / s) Q(diag(s) W_l)||^2 = sum_l tr(D_l^T X^T X D_l)`` with
``D_l = diag(1/s) Q(diag(s) W_l) - W_l`` (one Gram matrix per group from one calibration
pass, so the grid costs no further passes). ``Q`` is :func:`~microscale.ptq.weights.
quantize_group` with the run's PTQ choices (one shared tensor scale per fused group; GPTQ
is replaced by round-to-nearest in the search, and then runs on the folded model). The
groups' scales are chosen from the unscaled model's inputs, per block the column folds
first (``o_proj``, ``down_proj``), so the ``q/k/v`` and ``gate/up`` searches quantize
``v_proj`` and ``up_proj`` with their columns already divided, as they will be stored.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from microscale.formats import get_format
from microscale.ptq.engine import Engine, LossFn
from microscale.ptq.tap import intercept_linears, tappable_paths
from microscale.ptq.weights import WeightPTQ, quantize_group

__all__ = ["DEFAULT_ALPHAS", "AWQGroup", "awq_fold", "awq_plan", "awq_scales", "fold_scales"]

# The alpha grid of the search (0: no scaling, always a candidate).
DEFAULT_ALPHAS = tuple(round(0.1 * i, 1) for i in range(11))

_PATTERNS = (
    (re.compile(r"(?P<b>.*)\.attn\.(q|k|v)_proj"), "attn"),
    (re.compile(r"(?P<b>.*)\.attn\.o_proj"), "o"),
    (re.compile(r"(?P<b>.*)\.mlp\.(gate|up)_proj"), "mlp"),
    (re.compile(r"(?P<b>.*)\.mlp\.down_proj"), "down"),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AWQGroup:
    """Linear layers reading one input, and where that input's ``1/s`` folds."""

    # The group's name: "<block>.attn.qkv", "<block>.attn.o", "<block>.mlp.gate_up",
    # "<block>.mlp.down".
    name: str
    # The linear layers whose kernel rows are multiplied by s (in model order).
    layers: tuple[str, ...]
    # Where 1/s goes: the RMSNorm ("<block>.attn_norm"; its weight divided by s) or the
    # linear layer whose output columns are divided by s ("<block>.mlp.up_proj").
    into: str
    # "norm" or "columns".
    kind: str
    # o_proj: query heads per kv head (its scale is the kv channel's, repeated) and the
    # head dim; else 1 and 0.
    repeat: int = 1
    head_dim: int = 0


def _module(model: Any, path: str) -> Any:
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part, None)
        if node is None:
            return None
    return node


def _param(module: Any, name: str) -> Any:
    p = getattr(module, name, None)
    return p if isinstance(p, nnx.Param) else None


def awq_plan(model: Any) -> list[AWQGroup]:
    """The groups of ``model`` (a Llama-style model: microscale's ``Transformer`` or an
    imported HF checkpoint) whose input scales fold; refuses, naming the layer, a model
    with a linear layer outside them (its input's producer is not known to be foldable)."""
    paths = tappable_paths(model)
    found: dict[str, dict[str, Any]] = {}
    for path in paths:
        for pattern, role in _PATTERNS:
            m = pattern.fullmatch(path)
            if m:
                found.setdefault(f"{m['b']}|{role}", {"block": m["b"], "role": role, "l": []})
                found[f"{m['b']}|{role}"]["l"].append(path)
                break
        else:
            raise ValueError(
                f"AWQ cannot fold a scale into the input of linear layer {path!r}: only "
                "Llama-style blocks (attn_norm -> attn.q/k/v_proj -> attn.o_proj, mlp_norm "
                "-> mlp.gate/up_proj -> mlp.down_proj) are known; quantize without awq"
            )
    # per block, the column folds (o_proj, down_proj) first: the q/k/v and gate/up groups'
    # searches then see v_proj's and up_proj's kernels as they will be quantized
    order = {"o": 0, "down": 1, "attn": 2, "mlp": 3}
    blocks = list(dict.fromkeys(e["block"] for e in found.values()))  # in model order
    entries = sorted(found.values(), key=lambda e: (blocks.index(e["block"]), order[e["role"]]))
    return [_group(model, e["block"], e["role"], tuple(e["l"])) for e in entries]


def _refuse(layer: str, why: str) -> ValueError:
    return ValueError(f"AWQ cannot fold a scale into the input of linear layer {layer!r}: {why}")


def _group(model: Any, b: str, role: str, layers: tuple[str, ...]) -> AWQGroup:
    want = {
        "attn": (f"{b}.attn.q_proj", f"{b}.attn.k_proj", f"{b}.attn.v_proj"),
        "o": (f"{b}.attn.o_proj",),
        "mlp": (f"{b}.mlp.gate_proj", f"{b}.mlp.up_proj"),
        "down": (f"{b}.mlp.down_proj",),
    }[role]
    if set(layers) != set(want):
        missing = sorted(set(want) - set(layers))
        raise _refuse(layers[0], f"its block lacks the linear layer(s) {missing}")
    d_in = _module(model, want[0]).kernel.shape[0]
    if role in ("attn", "mlp"):
        norm = f"{b}.{'attn' if role == 'attn' else 'mlp'}_norm"
        scale = _param(_module(model, norm) or object(), "scale")
        if scale is None or tuple(scale.shape) != (d_in,):
            raise _refuse(want[0], f"no RMSNorm {norm!r} with a weight of shape ({d_in},)")
        name = f"{b}.attn.qkv" if role == "attn" else f"{b}.mlp.gate_up"
        return AWQGroup(name=name, layers=want, into=norm, kind="norm")
    if role == "down":
        up = f"{b}.mlp.up_proj"
        up_k = _param(_module(model, up) or object(), "kernel")
        if up_k is None or tuple(up_k.shape)[-1:] != (d_in,):
            raise _refuse(want[0], f"{up!r} has no kernel with {d_in} output columns")
        return AWQGroup(name=f"{b}.mlp.down", layers=want, into=up, kind="columns")
    attn = _module(model, f"{b}.attn")
    heads, kv, hd = (getattr(attn, a, None) for a in ("n_heads", "n_kv_heads", "head_dim"))
    v = _param(_module(model, f"{b}.attn.v_proj") or object(), "kernel")
    if not (
        isinstance(heads, int)
        and isinstance(kv, int)
        and isinstance(hd, int)
        and kv > 0
        and heads % kv == 0
        and d_in == heads * hd
        and v is not None
        and tuple(v.shape)[-1] == kv * hd
    ):
        raise _refuse(
            want[0],
            "its input is not a grouped-query attention output of v_proj "
            "(n_heads, n_kv_heads, head_dim and v_proj's columns do not match)",
        )
    return AWQGroup(
        name=f"{b}.attn.o",
        layers=want,
        into=f"{b}.attn.v_proj",
        kind="columns",
        repeat=heads // kv,
        head_dim=hd,
    )


def _input_stats(
    engine: Engine,
    batches: Sequence[np.ndarray],
    leaders: Sequence[str],
    progress: Callable[[], None] | None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """({leader: sum |X|}, {leader: X^T X} float64, tokens) over ``batches``."""

    def f(params, tokens):
        model = nnx.merge(engine.graphdef, nnx.State(params), engine.rest)
        seen = {}

        def hook(path, call, x):
            x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
            seen[path] = (jnp.sum(jnp.abs(x2), axis=0), x2.T @ x2)
            return call(x)

        with intercept_linears(model, hook, paths=set(leaders)):
            engine.loss_fn(model, tokens)
        return seen

    fn = jax.jit(f)
    acc: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
    n = 0
    for batch in batches:
        b = jnp.asarray(batch)
        got = jax.tree.map(lambda v: np.asarray(v, np.float64), fn(engine.params, b))
        acc = got if acc is None else jax.tree.map(np.add, acc, got)
        n += int(np.prod(b.shape[:-1])) * (b.shape[-1] - 1)
        if progress is not None:
            progress()
    if acc is None or not n:
        raise ValueError("AWQ: no calibration batches")
    sums = {p: v[0] for p, v in acc.items()}
    grams = {p: v[1] for p, v in acc.items()}
    return sums, grams, n


def _scale(mean_abs: np.ndarray, alpha: float, repeat: int, kv_dim: int) -> np.ndarray:
    """``s = m^alpha / sqrt(max * min)`` (float32 ``[in]``); with ``repeat`` > 1 (o_proj)
    ``m`` is averaged over each kv group's query heads and ``s`` repeated over them."""
    m = np.maximum(np.asarray(mean_abs, np.float64), 1e-8)
    if repeat > 1:
        heads = m.shape[0] // kv_dim
        m = m.reshape(heads // repeat, repeat, kv_dim).mean(axis=1).reshape(-1)
    if alpha == 0:
        s = np.ones_like(m)
    else:
        s = m**alpha
        s = s / np.sqrt(s.max() * s.min())
    if repeat > 1:
        s = np.repeat(s.reshape(-1, 1, kv_dim), repeat, axis=1).reshape(-1)
    return s.astype(np.float32)


@jax.jit
def _output_error(dw: jax.Array, gram: jax.Array) -> jax.Array:
    """``tr(D^T G D)``: ``||X D||^2`` summed over the tokens of ``G = X^T X``."""
    return jnp.sum(dw * (gram @ dw))


def awq_scales(
    kernels: Sequence[Any],
    mean_abs: np.ndarray,
    gram: np.ndarray,
    *,
    fmt: str = "nvfp4",
    ptq: WeightPTQ | None = None,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    repeat: int = 1,
    kv_dim: int = 0,
) -> tuple[float, np.ndarray, dict[float, float]]:
    """The alpha of least output error for one group (``kernels`` ``[in, out]`` reading
    one input with per-channel mean ``|X|`` ``mean_abs`` and Gram matrix ``gram``), its
    scales ``s`` and ``{alpha: error}``. Ties keep the smaller alpha."""
    ptq = WeightPTQ() if ptq is None else dataclasses.replace(ptq, method="rtn")
    ws = [jnp.asarray(k, jnp.float32) for k in kernels]
    g = jnp.asarray(gram, jnp.float32)
    errors: dict[float, float] = {}
    best: tuple[float, float, np.ndarray] | None = None
    for a in sorted({0.0, *(float(a) for a in alphas)}):
        s = _scale(mean_abs, a, repeat, kv_dim)
        sj = jnp.asarray(s)[:, None]
        qs = quantize_group([w * sj for w in ws], fmt, ptq)
        err = sum(float(_output_error(q.values / sj - w, g)) for q, w in zip(qs, ws, strict=True))
        errors[a] = err
        if best is None or err < best[1]:
            best = (a, err, s)
    assert best is not None
    return best[0], best[2], errors


def fold_scales(model: Any, group: AWQGroup, s: np.ndarray) -> None:
    """Fold ``s`` into ``model`` in place: ``group.layers``' kernel rows times ``s``, the
    producer of their input (``group.into``) divided by it."""
    sj = jnp.asarray(s, jnp.float32)
    for path in group.layers:
        k = _module(model, path).kernel
        k[...] = (k[...].astype(jnp.float32) * sj[:, None]).astype(k.dtype)
    if group.kind == "norm":  # the norm multiplies by (offset + w): Gemma's 1 + w
        norm = _module(model, group.into)
        off, w = float(getattr(norm, "offset", 0.0)), norm.scale
        w[...] = ((off + w[...].astype(jnp.float32)) / sj - off).astype(w.dtype)
        return
    into = _module(model, group.into)
    cols = sj
    if group.repeat > 1:  # the kv channel's scale: one of each group's repeated copies
        cols = sj.reshape(-1, group.repeat, group.head_dim)[:, 0, :].reshape(-1)
    into.kernel[...] = (into.kernel[...].astype(jnp.float32) / cols[None, :]).astype(
        into.kernel.dtype
    )
    bias = _param(into, "bias")  # Qwen2's v_proj: its output columns include the bias
    if bias is not None:
        bias[...] = (bias[...].astype(jnp.float32) / cols).astype(bias.dtype)


def awq_fold(
    model: Any,
    calib_batches: Sequence[np.ndarray],
    *,
    fmt: str = "nvfp4",
    ptq: WeightPTQ | None = None,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    loss_fn: LossFn | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """A copy of ``model`` with AWQ scales chosen on ``calib_batches`` and folded (the
    model is left untouched), and what was chosen: ``{"format", "alphas", "tokens",
    "batches", "groups": {name: {"alpha", "layers", "into", "error", "error_alpha0",
    "s_min", "s_max"}}}`` (errors: the calibration output error summed over the group).
    ``progress(n)`` advances by one per calibration batch and per group."""
    if not get_format(fmt).quantized:
        raise ValueError(f"AWQ: format {fmt!r} is not quantized (nothing to protect)")
    if not alphas or any(not (0.0 <= float(a) <= 1.0) for a in alphas):
        raise ValueError(f"AWQ: alphas={tuple(alphas)!r}: expected values in [0, 1]")
    work = nnx.clone(model)  # a private copy: new Variables (folding replaces their values)
    plan = awq_plan(work)
    tick = (lambda: progress(1)) if progress is not None else None
    engine = Engine(work, loss_fn=loss_fn)
    sums, grams, n = _input_stats(engine, calib_batches, [g.layers[0] for g in plan], tick)
    del engine
    out: dict[str, Any] = {
        "format": get_format(fmt).name,
        "alphas": [float(a) for a in alphas],
        "tokens": n,
        "batches": len(calib_batches),
        "groups": {},
    }
    for group in plan:
        lead = group.layers[0]
        kernels = [_module(work, p).kernel[...] for p in group.layers]
        alpha, s, errors = awq_scales(
            kernels,
            sums[lead] / n,
            grams[lead],
            fmt=fmt,
            ptq=ptq,
            alphas=alphas,
            repeat=group.repeat,
            kv_dim=group.head_dim,
        )
        if alpha != 0:
            fold_scales(work, group, s)
        out["groups"][group.name] = {
            "alpha": alpha,
            "layers": list(group.layers),
            "into": group.into,
            "error": errors[alpha],
            "error_alpha0": errors[0.0],
            "s_min": float(s.min()),
            "s_max": float(s.max()),
        }
        if progress is not None:
            progress(1)
    return work, out
