"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), with an explicit key.

From float32 logits ``z`` of one step (``[B, V]``):

* ``temperature == 0``: greedy, ``argmax z`` (no randomness, the key is unused);
* otherwise ``z / temperature``, then
* ``top_k > 0``: keep the ``k`` largest logits (ties with the k-th are kept too);
* ``top_p < 1``: keep the smallest set of most likely tokens whose probability sums to at
  least ``top_p`` (the most likely token is always kept);
* sample from ``softmax`` of what is kept (``jax.random.categorical``).

The same key gives the same tokens; the generation loop folds the step index into the
caller's key, so a run is reproducible from ``(key, prompts, config)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["GenerationConfig", "sample_logits"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """How ``generate`` continues a prompt. Frozen and hashable (static under ``jit``)."""

    # Tokens generated per prompt at most (stop tokens end a row earlier).
    max_new_tokens: int = 64
    # 0 = greedy (argmax); > 0 divides the logits before sampling.
    temperature: float = 0.0
    # Keep only the k most likely tokens (0 = no limit).
    top_k: int = 0
    # Nucleus sampling: keep the most likely tokens up to this cumulative probability (1 = all).
    top_p: float = 1.0
    # Token ids that end a row; the stop token itself is part of the output.
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: expected an int >= 1")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(
                f"temperature={self.temperature!r}: expected a number >= 0 (0 = greedy)"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: expected an int >= 0 (0 = off)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}: expected a number in (0, 1] (1 = off)")
        stops = tuple(int(t) for t in self.stop_tokens)
        if any(t < 0 for t in stops):
            raise ValueError(f"stop_tokens={self.stop_tokens!r}: expected token ids >= 0")
        object.__setattr__(self, "stop_tokens", stops)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_logits(
    logits: jax.Array, key: jax.Array | None, *, temperature=0.0, top_k: int = 0, top_p=1.0
) -> jax.Array:
    """Token ids ``[B]`` (int32) from logits ``[B, V]`` (see the module docstring).

    ``top_k`` is static (a Python int); ``temperature`` and ``top_p`` may be traced
    arrays, in which case they are always applied (pass a Python 0 / 1 to skip them)."""
    logits = logits.astype(jnp.float32)
    if isinstance(temperature, (int, float)) and temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ValueError(
            "sampling with temperature > 0 needs an explicit key (jax.random.key(seed))"
        )
    z = logits / jnp.asarray(temperature, jnp.float32)
    neg = jnp.float32(-jnp.inf)
    vocab = z.shape[-1]
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]
        z = jnp.where(z < kth, neg, z)
    if not isinstance(top_p, (int, float)) or top_p < 1.0:
        srt = jnp.sort(z, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        keep = before < jnp.asarray(top_p, jnp.float32)
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(z < cutoff, neg, z)
    return jax.random.categorical(key, z, axis=-1).astype(jnp.int32)
