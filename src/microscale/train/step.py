"""The jitted training and evaluation steps.

One optimizer step on a global batch ``[grad_accum, micro_batch, seq_len + 1]`` of
token windows (inputs ``[:, :-1]``, targets ``[:, 1:]``):

1. per-step key ``k_t = fold_in(key(seed), t)`` (and ``fold_in(k_t, i)`` for microbatch
   ``i``): the model folds in each layer's id, so stochastic rounding and the recipes'
   other randomness never repeat across steps, microbatches or layers, and a resumed run
   draws exactly the bits the uninterrupted one would have;
2. loss = mean token cross-entropy of float32 logits (``log_softmax`` in float32; in
   chunks of ``model.loss_chunk`` positions when set, see `lm_loss`);
   gradients w.r.t. the float32 master weights, through the quantized GEMMs' custom VJP;
   microbatch gradients are summed in float32 (``lax.scan``) and averaged;
3. ``grad_norm`` = global L2 norm before clipping; the step is *finite* when the loss and
   ``grad_norm`` are;
4. AdamW update (``optim.py``) scaled by ``-lr(t)``; for a non-finite step the new params
   and optimizer state are discarded with ``jnp.where`` inside the compiled step (no
   host round trip, no recompile), so one bad batch cannot poison the weights.

The step is compiled with explicit input/output shardings on the mesh (parameters and
optimizer state FSDP/TP-sharded, the batch split over ``data`` x ``fsdp``); XLA's SPMD
partitioner inserts the all-gathers and reduce-scatters. Parameters and optimizer state
are donated (updated in place).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from microscale.model.sharding import activation_sharding, batch_axes
from microscale.ops.loss import cross_entropy, token_nll

__all__ = [
    "eval_step_fn",
    "lm_loss",
    "make_eval_step",
    "make_train_step",
    "step_key",
    "train_step_fn",
]


def step_key(seed: int, step) -> jax.Array:
    """The PRNG key of training step ``step`` (jit-safe)."""
    return jax.random.fold_in(jax.random.key(seed), step)


def lm_loss(model, tokens: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy of ``model`` on token windows ``[B, T + 1]``.

    With ``model.config.loss_chunk = c > 0`` (and ``c < T``) the LM head and the loss run
    on ``c`` positions at a time: a ``lax.scan`` over chunks of the final hidden states, each
    chunk's logits recomputed in the backward pass (``jax.checkpoint``), so the float32
    ``[B, T, vocab]`` logits and their gradient never exist at once; per chunk they are
    ``[B, c, vocab]``. The batch dimension stays whole in every chunk (it is the sharded
    one). Per-token losses are those of the unchunked head; only the order of the final sum
    differs (float rounding). A last partial chunk is zero-padded and masked out.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    c = model.config.loss_chunk
    t = inputs.shape[1]
    if not c or c >= t:
        return cross_entropy(model(inputs, key=key), targets)
    x = model.features(inputs, key=key)
    head = model.gathered_head()  # gathered once, not once a chunk

    def summed(x, targets, head):
        """The summed loss of these rows, chunk by chunk."""
        b, _, d = x.shape
        n = -(-t // c)
        pad = n * c - t
        xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
        tg = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)
        valid = (jnp.arange(n * c) < t).reshape(n, 1, c)

        @jax.checkpoint
        def chunk_loss(xc, tc, vc):
            ce = token_nll(model.logits(xc, head), tc)
            return jnp.sum(jnp.where(vc, ce, 0.0))

        def body(total, chunk):
            return total + chunk_loss(*chunk), None

        return jax.lax.scan(body, jnp.float32(0.0), (xs, tg, valid))[0]

    mesh, axes = batch_axes()
    if not axes:
        return summed(x, targets, head) / (x.shape[0] * t)
    # Data-parallel devices each sum their own rows (shard_map over the batch axes): the
    # head's gradient then accumulates locally over the chunks and is reduced once,
    # where under the partitioner a loop reduces it once per chunk.
    spec = PartitionSpec(axes)

    def local(x, targets, head):
        with activation_sharding(None):  # the batch axes are manual here
            return jax.lax.psum(summed(x, targets, head), axes)

    total = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, spec, PartitionSpec()),
        out_specs=PartitionSpec(),
        axis_names=set(axes),
        check_vma=False,
    )(x, targets, head)
    return total / (x.shape[0] * t)


def _loss_fn(graphdef, params, rest, tokens, key, *, mesh=None):
    model = nnx.merge(graphdef, nnx.State(params), rest)
    with activation_sharding(mesh):  # activations pinned by their logical axes
        return lm_loss(model, tokens, key)


def _mesh(sharding):
    return None if sharding is None else getattr(sharding, "mesh", None)


def train_step_fn(graphdef, tx: optax.GradientTransformation, schedule, *, mesh=None):
    """The train step, not compiled: ``step(params, opt_state, rest, batch, step, seed,
    poison=None) -> (params, opt_state, metrics)``, with the run's ``seed`` an argument
    (a Python int or a traced int32 scalar give the same keys), so that
    :mod:`~microscale.train.seeds` can ``jax.vmap`` it over a seed axis. ``mesh``: the mesh
    the batch is sharded on (None: one device). Arguments as in :func:`make_train_step`."""

    def step_fn(params, opt_state, rest, batch, step, seed, poison=None):
        key = step_key(seed, step)
        grad_fn = jax.value_and_grad(functools.partial(_loss_fn, graphdef, mesh=mesh))
        n_micro = batch.shape[0]
        if n_micro == 1:
            loss, grads = grad_fn(params, rest, batch[0], key)
        else:

            def micro(carry, xs):
                g_acc, l_acc = carry
                tokens, i = xs
                loss_i, g_i = grad_fn(params, rest, tokens, jax.random.fold_in(key, i))
                g_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), g_acc, g_i)
                return (g_acc, l_acc + loss_i), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            (grads, loss), _ = jax.lax.scan(
                micro, (zeros, jnp.float32(0.0)), (batch, jnp.arange(n_micro))
            )
            grads = jax.tree.map(lambda g: g / n_micro, grads)
            loss = loss / n_micro
        if poison is not None:
            grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        lr = schedule(step)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
        keep = lambda new, old: jnp.where(finite, new, old)
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt, opt_state)
        metrics = {
            "loss": loss.astype(jnp.float32),
            "grad_norm": grad_norm.astype(jnp.float32),
            "lr": lr,
            "finite": finite,
        }
        return params, opt_state, metrics

    return step_fn


def make_train_step(
    graphdef,
    tx: optax.GradientTransformation,
    schedule,
    *,
    seed: int,
    inject: bool = False,
    param_shardings=None,
    opt_shardings=None,
    batch_sharding=None,
):
    """``step(params, opt_state, rest, batch, step[, poison]) -> (params, opt_state, metrics)``.

    ``batch``: int32 ``[grad_accum, micro, seq_len + 1]``; ``step``: int32 scalar (0-based
    index of the batch); ``poison`` (only when ``inject``): a bool scalar that replaces the
    gradient by NaN (tests of the non-finite path). ``metrics``: float32 ``loss``,
    ``grad_norm``, ``lr`` and bool ``finite``.
    """
    fn = train_step_fn(graphdef, tx, schedule, mesh=_mesh(batch_sharding))

    def step_fn(params, opt_state, rest, batch, step, poison=None):
        return fn(params, opt_state, rest, batch, step, seed, poison)

    in_sh: tuple | None = None
    out_sh: tuple | None = None
    if param_shardings is not None:
        in_sh = (param_shardings, opt_shardings, None, batch_sharding, None)
        if inject:
            in_sh = in_sh + (None,)
        out_sh = (param_shardings, opt_shardings, None)
    return jax.jit(step_fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=(0, 1))


# The step index whose key feeds the evaluations' randomness (no training step has it).
EVAL_KEY_ID = 2**31 - 1


def eval_step_fn(graphdef, *, mesh=None):
    """The eval step, not compiled: ``eval(params, rest, batch, seed) -> mean loss``; a
    fixed key of ``seed`` (never a training step's) feeds any randomness of the forward
    pass, so evaluations are deterministic and comparable across steps."""

    def eval_fn(params, rest, batch, seed):
        return _loss_fn(graphdef, params, rest, batch, step_key(seed, EVAL_KEY_ID), mesh=mesh)

    return eval_fn


def make_eval_step(graphdef, *, seed: int, param_shardings=None, batch_sharding=None):
    """``eval(params, rest, batch [rows, seq_len + 1]) -> mean loss`` (float32), the
    compiled :func:`eval_step_fn` of ``seed``."""
    fn = eval_step_fn(graphdef, mesh=_mesh(batch_sharding))

    def eval_fn(params, rest, batch):
        return fn(params, rest, batch, seed)

    in_sh = None
    if param_shardings is not None:
        in_sh = (param_shardings, None, batch_sharding)
    return jax.jit(eval_fn, in_shardings=in_sh)
