"""Next-token cross-entropy: the one loss microscale trains on and evaluates with.

Training (`microscale.train.step`), PTQ's scores and KL (`microscale.ptq.engine`) and
perplexity of exported checkpoints (`microscale.inference.model`) all call `token_nll`, so
a perplexity means the same number everywhere. The logits are cast to float32 first; the
per-token value is ``logsumexp(logits) - logits[target]`` (optax's formula: the normalizer
is subtracted from the target's logit only, not from every logit as ``log_softmax`` does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

__all__ = ["cross_entropy", "token_nll"]


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Negative log-likelihood (nats) of each integer target under float32 ``logits``
    ``[..., vocab]``: shape ``targets.shape``."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets.astype(jnp.int32)
    )


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of ``logits`` against ``targets``, in float32."""
    return token_nll(logits, targets).mean()
