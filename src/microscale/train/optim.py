"""AdamW with a step-indexed learning-rate schedule, global-norm clipping and weight decay.

Update rule (per optimizer step ``t``, float32 master weights ``p`` and moments):

    g      <- g * min(1, grad_clip / |g|)                     (skipped when grad_clip <= 0)
    m, v   <- b1 m + (1 - b1) g,  b2 v + (1 - b2) g^2         (n: updates applied so far)
    u      <- m r1 / (sqrt(v r2) + eps) + weight_decay * p     (decay on >= 2-D params only)
              r1 = 1 / (1 - b1^n), r2 = 1 / (1 - b2^n)            (the bias corrections)
    p      <- p - lr(t) * u

``|g|`` is :func:`global_norm`: the L2 norm over all leaves with its summation order fixed
by the program (a pairwise tree of elementwise adds per leaf, then the leaves in order), not
left to the backend's reduction kernel. XLA:CPU picks a reduction's order by the array's
shape, so the norm of one run and of the same run inside a seed batch (a leading seed axis,
``experiments/seeds.py``) differed in the last bit, and the clip scale passed it on to ~1%
of the weights; with the order fixed they are bit-identical. For the same reason the bias
corrections are reciprocals the program computes once and multiplies by (:func:`scale_by_adam`,
optax's rule and state): XLA:CPU turned optax's division by the broadcast correction into
a multiplication by its reciprocal for a scalar count but not for a seed batch's vector of
counts, which moved ``u`` by an ulp.

The learning rate is a function of the *training step* ``t`` (not of optax's update
count), so a step whose update is skipped because of a non-finite gradient does not shift
the schedule; the Adam bias correction, which counts applied updates, is left to optax.

Schedules (``warmup_steps`` linear ramp from 0 to ``lr`` first):

* ``"cosine"``: cosine decay from ``lr`` to ``min_lr_ratio * lr`` at the last step;
* ``"wsd"`` (warmup-stable-decay, the NVFP4 paper's schedule): hold ``lr``, then decay
  linearly to ``min_lr_ratio * lr`` over the final ``decay_fraction`` of the steps.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "clip_by_global_norm",
    "global_norm",
    "lr_schedule",
    "make_optimizer",
    "scale_by_adam",
    "weight_decay_mask",
]


def lr_schedule(optim, total_steps: int) -> Callable[[jax.Array | int], jax.Array]:
    """``step -> lr`` for an :class:`~microscale.train.config.OptimConfig` (jit-safe)."""
    peak = float(optim.lr)
    floor = peak * float(optim.min_lr_ratio)
    warm = int(optim.warmup_steps)
    total = max(int(total_steps), 1)
    kind = optim.schedule
    decay_start = (
        warm if kind == "cosine" else max(warm, int(round(total * (1 - optim.decay_fraction))))
    )

    def fn(step):
        s = jnp.asarray(step, jnp.float32)
        warm_lr = peak * jnp.minimum(1.0, (s + 1.0) / max(warm, 1))
        frac = jnp.clip((s - decay_start) / max(total - 1 - decay_start, 1), 0.0, 1.0)
        if kind == "cosine":
            decayed = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        else:  # wsd: stable then linear decay
            decayed = peak - (peak - floor) * frac
        return jnp.where(s < warm, warm_lr, decayed).astype(jnp.float32)

    return fn


def _pairwise_sum(x: jax.Array) -> jax.Array:
    """The sum of ``x``'s elements as a balanced tree of float32 adds whose order the program
    fixes: zero-padded to a power of two, then halves added elementwise until one is left
    (``log2(n)`` adds deep; error ``<= log2(n) * 2**-24`` of the sum of magnitudes)."""
    x = x.reshape(-1).astype(jnp.float32)
    n = x.shape[0]
    x = jnp.pad(x, (0, (1 << max(0, (n - 1).bit_length())) - n))
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


def global_norm(tree) -> jax.Array:
    """L2 norm of all leaves of ``tree`` (float32), summed in a fixed order (module doc):
    the same bits alone and under ``jax.vmap``, on any backend."""
    total = jnp.float32(0.0)
    for leaf in jax.tree.leaves(tree):
        total = total + _pairwise_sum(jnp.square(leaf.astype(jnp.float32)))
    return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scale the updates by ``min(1, max_norm / global_norm(updates))`` (optax's rule, with
    :func:`global_norm`'s fixed order)."""

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def scale_by_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam's scaling (optax's ``scale_by_adam`` rule and its ``ScaleByAdamState``, so
    checkpoints are interchangeable) with the bias corrections as reciprocals computed once
    per step and multiplied by (module doc)."""
    reference = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * jnp.square(g) + b2 * v, updates, state.nu)
        count = optax.safe_increment(state.count)
        n = count.astype(jnp.float32)
        r1, r2 = 1 / (1 - jnp.float32(b1) ** n), 1 / (1 - jnp.float32(b2) ** n)
        out = jax.tree.map(lambda m, v: (m * r1) / (jnp.sqrt(v * r2) + eps), mu, nu)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(reference.init, update)


def weight_decay_mask(params):
    """True for matrices (>= 2-D: projections, embeddings), False for norms and biases."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(optim) -> optax.GradientTransformation:
    """Clip + Adam + decoupled weight decay, *without* the learning rate.

    The training step multiplies the result by ``-lr(step)`` itself (see module doc).
    """
    parts = []
    if optim.grad_clip and optim.grad_clip > 0:
        parts.append(clip_by_global_norm(float(optim.grad_clip)))
    parts.append(
        scale_by_adam(b1=float(optim.betas[0]), b2=float(optim.betas[1]), eps=float(optim.eps))
    )
    if optim.weight_decay:
        parts.append(optax.add_decayed_weights(float(optim.weight_decay), mask=weight_decay_mask))
    return optax.chain(*parts)
