"""AdamW with a step-indexed learning-rate schedule, global-norm clipping and weight decay.

Update rule (per optimizer step ``t``, float32 master weights ``p`` and moments):

    g      <- clip_by_global_norm(g, grad_clip)               (skipped when grad_clip <= 0)
    m, v   <- b1 m + (1 - b1) g,  b2 v + (1 - b2) g^2         (n: updates applied so far)
    u      <- m r1 / (sqrt(v r2) + eps) + weight_decay * p     (decay on >= 2-D params only)
              r1 = 1 / (1 - b1^n), r2 = 1 / (1 - b2^n)            (the bias corrections)
    p      <- p - lr(t) * u

``|g|`` is the L2 norm over all leaves (``optax.tree.norm``), a reduction whose summation
order is the backend's: XLA:CPU picks it by the array's shape, so one run and the same run
inside a seed batch (a leading seed axis, ``experiments/seeds.py``) can get norms an ulp
apart and, while the clip is active, weights an ulp apart. A fixed-order (pairwise) sum
would remove that on one device but moves shards between devices when the gradients are
sharded, so the norm stays XLA's. The bias corrections are reciprocals the program computes
once and multiplies by (:func:`scale_by_adam`, optax's rule and state): XLA:CPU turned
optax's division by the broadcast correction into a multiplication by its reciprocal for a
scalar count but not for a seed batch's vector of counts, which moved ``u`` by an ulp.

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
        parts.append(optax.clip_by_global_norm(float(optim.grad_clip)))
    parts.append(
        scale_by_adam(b1=float(optim.betas[0]), b2=float(optim.betas[1]), eps=float(optim.eps))
    )
    if optim.weight_decay:
        parts.append(optax.add_decayed_weights(float(optim.weight_decay), mask=weight_decay_mask))
    return optax.chain(*parts)
