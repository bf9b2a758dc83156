"""Delayed scaling for ``flax.nnx`` models: the amax history as model state.

Per-tensor FP8 needs ``amax(|t|)`` before it can scale ``t``. *Current* scaling (the
``fp8`` recipe) reads the tensor twice: once for the amax, once to quantize. *Delayed*
scaling (Transformer Engine's ``DelayedScaling``; the ``fp8_delayed`` recipe) uses the
amax of the last ``L`` steps instead, so the scale is known before the tensor is read,
and pushes this step's amax into the history. The price: a tensor that grows faster
than its history saturates for a step.

Each layer therefore owns state, a float32 ``[6, L]`` history (one row per GEMM operand
slot, newest first). The dY rows are only known in the backward pass, and the only way
out of a ``jax.custom_vjp`` backward pass is a cotangent, so the history's *gradient* is
its next value ("overwrite with gradient", as Flax's FP8 ops do). A training step:

    import optax
    from flax import nnx
    from microscale.ops.delayed import AmaxHistory, DelayedScalingDot, overwrite_amax_histories

    layer = nnx.Linear(64, 32, dot_general=DelayedScalingDot("fp8_delayed"),
                       rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(layer, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(layer, opt, x, y):
        diff = nnx.DiffState(0, nnx.Any(nnx.Param, AmaxHistory))
        loss, grads = nnx.value_and_grad(
            lambda m: ((m(x) - y) ** 2).mean(), argnums=diff)(layer)
        opt.update(layer, nnx.filter_state(grads, nnx.Param))
        overwrite_amax_histories(layer, grads)
        return loss

Inference needs no gradient: the history is read, never updated.
"""

from __future__ import annotations

from flax import nnx

from microscale.ops.dot import init_amax_history, quantized_dot_general
from microscale.ops.recipe import Recipe, get_recipe


class AmaxHistory(nnx.Variable):
    """A layer's ``[6, L]`` amax history (delayed scaling). Not a parameter: its
    gradient is its next value (:func:`overwrite_amax_histories`)."""


class DelayedScalingDot(nnx.Module):
    """A ``dot_general`` with delayed scaling that carries its own amax history.

    Pass an instance as ``nnx.Linear(dot_general=...)`` (one per layer: a history
    belongs to one pair of operands). ``key`` feeds stochastic rounding, if the recipe
    uses it.
    """

    def __init__(self, recipe: Recipe | str = "fp8_delayed", *, key=None, backend: str = "auto"):
        recipe = get_recipe(recipe)
        if not recipe.delayed:
            raise ValueError(
                f"DelayedScalingDot needs a delayed-scaling recipe "
                f"(scaling='delayed', e.g. 'fp8_delayed'); {recipe.name!r} "
                f"uses scaling={recipe.scaling!r}"
            )
        self.recipe = recipe
        self.key = key
        self.backend = backend
        self.amax_history = AmaxHistory(init_amax_history(recipe))

    def __call__(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_ignored
    ):
        del precision
        return quantized_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            self.recipe,
            key=self.key,
            preferred_element_type=preferred_element_type,
            backend=self.backend,
            amax_history=self.amax_history[...],
        )


def overwrite_amax_histories(model, grads) -> None:
    """Set every :class:`AmaxHistory` of ``model`` to its entry in ``grads`` (an
    ``nnx.State`` from a gradient taken with respect to ``AmaxHistory``, too)."""
    nnx.update(model, nnx.filter_state(grads, AmaxHistory))
