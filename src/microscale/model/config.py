"""Model configuration: the shape of a Llama-style decoder and its named presets.

A `ModelConfig` is a frozen, keyword-only dataclass. It says nothing about numerics of the
linear layers (which recipe quantizes which GEMM): that is per-layer data held by
`microscale.model.rules.PrecisionRules`. It does fix the high-precision dtypes: master
weights in `param_dtype` (float32) and activations/matmul operands in `compute_dtype`
(bfloat16), with softmax, norm statistics and logits in float32.

Block-size constraint. Every quantized GEMM contracts over the input dimension of a linear
layer in forward (blocks of 16 for NVFP4, 32 for MX formats) and over its output dimension in
dgrad (`dX = dY W^T`). So every linear in/out dimension — `d_model`, `d_ff`,
`n_heads * head_dim` and `n_kv_heads * head_dim` — must be a multiple of `dim_multiple`,
which defaults to **32** so that every recipe (NVFP4's 16 and MX's 32) runs on every preset.
Set `dim_multiple=16` to allow NVFP4-only shapes. (The wgrad GEMM contracts over tokens,
`batch * seq`; that constraint belongs to the batch, not the model.)

Presets (`ModelConfig.preset(name)`, `list_presets()`): parameter counts are for the default
vocabulary of each preset and include embeddings (counted once when tied).

| preset      | d_model | layers | heads/kv | d_ff  | vocab  | params  |
|-------------|---------|--------|----------|-------|--------|---------|
| tiny        | 192     | 4      | 4/2      | 512   | 257    | ~1.67M  |
| small       | 512     | 8      | 8/4      | 1536  | 257    | ~25.3M  |
| gpt2-124m   | 768     | 12     | 12/12    | 2048  | 50304  | ~124M   |
| llama-1b    | 2048    | 16     | 32/8     | 8192  | 128256 | ~1.24B  |
| llama-8b    | 4096    | 32     | 32/8     | 14336 | 128256 | ~8.03B  |
| llama-70b   | 8192    | 80     | 64/8     | 28672 | 128256 | ~70.6B  |

`gpt2-124m` is GPT-2 small's size with a Llama block (SwiGLU with d_ff = 8/3 d_model keeps
the MLP parameter count of GPT-2's 4x GELU MLP); `llama-1b`/`llama-8b`/`llama-70b` follow Llama 3.2 1B,
Llama 3.1 8B and Llama 3.1 70B (its published config.json: hidden 8192, 80 layers, 64
heads, 8 kv heads, intermediate 28672, rope theta 500000, untied; context 8192 here), each
with its RoPE: Llama 3's ``llama3`` scaling (factor 32 for 3.2 1B, 8 for 3.1 8B and 70B;
low/high frequency factors 1 and 4 over the original 8192 positions), which changes the
low frequencies at every position, not only past 8192.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from microscale.model.family import FAMILIES, Family, get_family
from microscale.model.rope import RopeScaling

__all__ = ["ModelConfig", "list_presets"]

_DTYPES = ("float32", "bfloat16", "float16")

# Upper bounds, checked before anything is built: a size past these is a typo (an extra
# zero, a unit slip), and building it would exhaust memory with no message. Each is
# far beyond any published model (Llama 3.1 405B: d_model 16384, 126 layers, d_ff 53248,
# 128 heads, vocab 128256, context 131072; the largest vocabularies ~262k tokens).
_MAX_SIZE = {
    "vocab_size": 2**22,
    "d_model": 2**17,
    "n_layers": 2**12,
    "n_heads": 2**12,
    "n_kv_heads": 2**12,
    "d_ff": 2**19,
    "max_seq_len": 2**24,
    "dim_multiple": 2**12,
}
_MAX_PARAMS = 10**13  # 10T parameters: 5x the largest models trained

# Remat policies by name (the policies themselves: microscale.model.transformer).
REMAT_POLICIES = ("none", "full", "save_dots", "minimal")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and high-precision dtypes of a Llama-style decoder-only transformer."""

    # The architecture (microscale.model.family: llama, mistral, qwen2, qwen3, gemma3):
    # its block's switches (biases, norms, activation), and its names in config.json and
    # GGUF.
    family: str = "llama"
    vocab_size: int = 257  # tokens in the vocabulary (byte-level default: 256 bytes + EOS)
    d_model: int = 192  # residual stream width; multiple of n_heads and of dim_multiple
    n_layers: int = 4  # number of transformer blocks ("layers.<i>")
    n_heads: int = 4  # query heads; head_dim = d_model // n_heads unless attn_head_dim
    n_kv_heads: int = 2  # key/value heads (grouped-query attention); divides n_heads
    d_ff: int = 512  # hidden width of the SwiGLU MLP; multiple of dim_multiple
    # Width of one attention head when it is not d_model // n_heads (Qwen3, Mistral
    # Nemo); even, for RoPE. None: d_model // n_heads.
    attn_head_dim: int | None = None
    # Keys a query sees: positions i - window < j <= i (Mistral v0.1's 4096); only for a
    # family that admits one. None: every earlier position.
    sliding_window: int | None = None
    # Local and global layers (Gemma 3's 6): layer i is global (every earlier key;
    # rope_theta and rope_scaling) iff (i + 1) % pattern == 0, the rest local
    # (sliding_window; RoPE base rope_local_theta, unscaled). 0: every layer alike (local
    # where there is a sliding window).
    sliding_window_pattern: int = 0
    rope_local_theta: float | None = None  # local layers' RoPE base (Gemma 3: 10000)
    # Attention scores QK^T * query_pre_attn_scalar ** -0.5 (Gemma 3); None: head_dim.
    query_pre_attn_scalar: float | None = None
    max_seq_len: int = 256  # longest sequence the model accepts (training context length)
    rope_theta: float = 10000.0  # RoPE base frequency
    # RoPE's context extension (microscale.model.rope: linear, dynamic, llama3, yarn);
    # none: the default RoPE.
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5  # epsilon inside RMSNorm's rsqrt
    tie_embeddings: bool = True  # LM head reuses the token embedding (no `lm_head` param)
    param_dtype: str = "float32"  # master weights (and so optimizer state) dtype
    compute_dtype: str = "bfloat16"  # activations / matmul operand dtype
    init_std: float = 0.02  # std of normal init for embeddings and projections
    scale_residual_init: bool = True  # o_proj/down_proj init std /= sqrt(2 * n_layers)
    # What each block keeps for the backward pass (microscale.model.transformer's
    # REMAT_POLICIES): "none" (everything), "full" (its input only; the forward is
    # recomputed), "save_dots" (the seven projections' outputs), "minimal" (the attention
    # output and the MLP hidden). true/false are read as "full"/"none".
    remat: str | bool = "none"
    # Training loss in chunks of this many sequence positions: the LM head and the
    # cross-entropy run per chunk (recomputed in the backward), so the float32 logits of
    # the whole microbatch [tokens, vocab] never exist at once. 0: all positions at once.
    loss_chunk: int = 0
    # Attention in chunks of this many query positions (each chunk's scores recomputed in
    # the backward), so a block holds [chunk, T] float32 scores per head, not [T, T]:
    # memory linear in T. 0: all queries at once.
    attention_chunk: int = 0
    # Run each contiguous run of blocks with equal recipes as one lax.scan over their
    # stacked parameters (one block body in the program: compile time nearly independent
    # of depth). Parameters stay per block ("layers.<i>") outside the forward pass.
    scan_layers: bool = False
    dim_multiple: int = 32  # linear in/out dims must be multiples of this (32: MX; 16: NVFP4)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "d_ff",
            "max_seq_len",
            "dim_multiple",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name}={v!r}: expected a positive int")
            if v > _MAX_SIZE[name]:
                raise ValueError(
                    f"ModelConfig.{name}={v:,} is larger than any model (at "
                    f"most {_MAX_SIZE[name]:,}); a typo?"
                )
        if self.family not in FAMILIES:
            raise ValueError(
                f"ModelConfig.family={self.family!r}: expected one of {sorted(FAMILIES)}"
            )
        for name in ("attn_head_dim", "sliding_window"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= _MAX_SIZE["d_ff"]
            ):
                raise ValueError(f"ModelConfig.{name}={v!r}: expected a positive int or none")
        remat = self.remat
        if isinstance(remat, bool) or str(remat).lower() in ("true", "false"):
            remat = "full" if str(remat).lower() == "true" else "none"
        if remat not in REMAT_POLICIES:
            raise ValueError(
                f"ModelConfig.remat={self.remat!r}: expected one of "
                f"{list(REMAT_POLICIES)} (or true/false for full/none)"
            )
        object.__setattr__(self, "remat", remat)
        for name in ("loss_chunk", "attention_chunk"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int)
                or not (0 <= v <= _MAX_SIZE["max_seq_len"])
            ):
                raise ValueError(
                    f"ModelConfig.{name}={v!r}: expected an int from 0 (no "
                    "chunks) to a sequence length"
                )
        for name in ("rope_theta", "norm_eps", "init_std"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"ModelConfig.{name}={v!r}: expected a positive float")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"ModelConfig.rope_scaling={self.rope_scaling!r}: expected a RopeScaling or none"
            )
        if self.rope_scaling is not None and self.rope_scaling.kind == "default":
            object.__setattr__(self, "rope_scaling", None)  # one spelling of the default RoPE
        for name in ("param_dtype", "compute_dtype"):
            v = getattr(self, name)
            if v not in _DTYPES:
                raise ValueError(f"ModelConfig.{name}={v!r}: expected one of {_DTYPES}")
        self._check_family()
        self._check_shapes()

    def _check_family(self) -> None:
        """The window and the local/global layers only where the family has them."""
        fam = self.arch
        windowed = sorted(f.name for f in FAMILIES.values() if f.sliding_window or f.local_global)
        if self.sliding_window is not None and not (fam.sliding_window or fam.local_global):
            raise ValueError(
                f"ModelConfig.sliding_window={self.sliding_window}: family "
                f"{self.family!r} has no sliding-window attention (families that do: "
                f"{windowed})"
            )
        p = self.sliding_window_pattern
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= _MAX_SIZE["n_layers"]:
            raise ValueError(
                f"ModelConfig.sliding_window_pattern={p!r}: expected an int >= 0 (0: every "
                "layer alike)"
            )
        local = sorted(f.name for f in FAMILIES.values() if f.local_global)
        for name in ("sliding_window_pattern", "rope_local_theta"):
            if getattr(self, name) and not fam.local_global:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r}: family {self.family!r} "
                    f"has no local and global layers (families that do: {local})"
                )
        for name in ("rope_local_theta", "query_pre_attn_scalar"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"ModelConfig.{name}={v!r}: expected a positive float or none")
        # one spelling of each: a value that changes nothing is none
        if self.query_pre_attn_scalar is not None:
            v = float(self.query_pre_attn_scalar)
            object.__setattr__(self, "query_pre_attn_scalar", None if v == self.head_dim else v)
        if self.rope_local_theta is not None:
            v = float(self.rope_local_theta)
            same = v == self.rope_theta and self.rope_scaling is None
            object.__setattr__(self, "rope_local_theta", None if same else v)

    def _check_shapes(self) -> None:
        """Heads divide the width, kv heads divide heads, RoPE pairs, whole scale blocks,
        and a parameter count some model could have."""
        if self.attn_head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig.d_model={self.d_model} is not divisible by "
                f"n_heads={self.n_heads}: expected d_model % n_heads == 0"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads}: expected n_heads % n_kv_heads == 0 "
                "(each kv head serves a whole group of query heads)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig head_dim = {'' if self.attn_head_dim else 'd_model // n_heads = '}"
                f"{self.head_dim} is odd: "
                "RoPE rotates pairs of dimensions, expected an even head_dim"
            )
        m = self.dim_multiple
        dims = {
            "d_model": self.d_model,
            "d_ff": self.d_ff,
            "n_kv_heads * head_dim": self.n_kv_heads * self.head_dim,
            "n_heads * head_dim": self.n_heads * self.head_dim,
        }
        for name, v in dims.items():
            if v % m:
                raise ValueError(
                    f"ModelConfig {name}={v} is not a multiple of dim_multiple={m}: every "
                    "quantized linear's in/out dims must be whole scale blocks (16 for "
                    "NVFP4, 32 for MX formats); pick a multiple of "
                    f"{m} (e.g. {_round_up(v, m)}) or set dim_multiple=16 for NVFP4-only"
                )
        if self.num_params() > _MAX_PARAMS:
            raise ValueError(
                f"ModelConfig: {self.num_params():,} parameters (d_model "
                f"{self.d_model}, {self.n_layers} layers, d_ff {self.d_ff}, vocab "
                f"{self.vocab_size}) is larger than any model (at most "
                f"{_MAX_PARAMS:.0e}); a typo?"
            )

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        """Width of one attention head: attn_head_dim, else d_model // n_heads."""
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def arch(self) -> Family:
        """The family's row (`microscale.model.family`)."""
        return get_family(self.family)

    def layer_is_local(self, i: int) -> bool:
        """Whether layer ``i`` is local: by `sliding_window_pattern` where there is one,
        else every layer where there is a sliding window."""
        p = self.sliding_window_pattern
        return (i + 1) % p != 0 if p else self.sliding_window is not None

    def layer_window(self, i: int) -> int | None:
        """The keys layer ``i`` sees: its sliding window, or None (every earlier key)."""
        return self.sliding_window if self.layer_is_local(i) else None

    def layer_rope(self, i: int) -> tuple[float, RopeScaling | None]:
        """(RoPE base, scaling) of layer ``i``: a local layer's own unscaled base where
        ``rope_local_theta`` is set, otherwise ``rope_theta`` and ``rope_scaling``."""
        if self.rope_local_theta is not None and self.layer_is_local(i):
            return float(self.rope_local_theta), None
        return self.rope_theta, self.rope_scaling

    @property
    def attn_scale(self) -> float:
        """The attention scores' factor: ``query_pre_attn_scalar ** -0.5``, else
        ``head_dim ** -0.5``."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def num_params(self) -> int:
        """Exact trainable parameter count (arithmetic; allocates nothing)."""
        d, hd = self.d_model, self.head_dim
        norms = self.n_layers * (4 if self.arch.post_norms else 2) * d + d  # block + final
        if self.arch.qk_norm:
            norms += self.n_layers * 2 * hd
        biases = self.n_layers * (self.n_heads + 2 * self.n_kv_heads) * hd * self.arch.qkv_bias
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.num_linear_params() + norms + biases + embed + head

    def num_linear_params(self) -> int:
        """Parameters in the (quantizable) linear projections only."""
        d, f, hd = self.d_model, self.d_ff, self.head_dim
        attn = d * (self.n_heads * hd) * 2 + d * (self.n_kv_heads * hd) * 2  # q,o + k,v
        return self.n_layers * (attn + 3 * d * f)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (6N for the matmul params + attention), PaLM convention."""
        t = self.max_seq_len if seq_len is None else seq_len
        n = self.num_linear_params() + self.d_model * self.vocab_size
        attn = 12 * self.n_layers * self.d_model * t  # QK^T and PV, fwd+bwd, causal not halved
        return 6 * n + attn

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (JSON/YAML friendly)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a dict; unknown keys and wrong types raise with the expectation."""
        return _from_dict(cls, d)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated, like from_dict)."""
        return type(self).from_dict({**self.to_dict(), **changes})

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny(cls) -> ModelConfig:
        """~1.67M params; trains to a meaningful byte-level loss on a CPU."""
        return cls(
            vocab_size=257,
            d_model=192,
            n_layers=4,
            n_heads=4,
            n_kv_heads=2,
            d_ff=512,
            max_seq_len=256,
            tie_embeddings=True,
        )

    @classmethod
    def small(cls) -> ModelConfig:
        """~25M params; a CPU-feasible model with enough depth for per-layer rules."""
        return cls(
            vocab_size=257,
            d_model=512,
            n_layers=8,
            n_heads=8,
            n_kv_heads=4,
            d_ff=1536,
            max_seq_len=512,
            tie_embeddings=True,
        )

    @classmethod
    def gpt2_124m(cls) -> ModelConfig:
        """GPT-2 small's size (124M) with a Llama block; GPT-2 vocab padded to 50304."""
        return cls(
            vocab_size=50304,
            d_model=768,
            n_layers=12,
            n_heads=12,
            n_kv_heads=12,
            d_ff=2048,
            max_seq_len=1024,
            tie_embeddings=True,
        )

    @classmethod
    def llama_1b(cls) -> ModelConfig:
        """Llama 3.2 1B shape (1.24B params, tied embeddings); remat on, loss and
        attention in 512-position chunks, scanned layers."""
        return cls(
            vocab_size=128256,
            d_model=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            d_ff=8192,
            max_seq_len=2048,
            rope_theta=500000.0,
            rope_scaling=_llama3_rope(32.0),
            tie_embeddings=True,
            remat="full",
            loss_chunk=512,
            attention_chunk=512,
            scan_layers=True,
        )

    @classmethod
    def llama_8b(cls) -> ModelConfig:
        """Llama 3.1 8B shape (8.03B params, untied embeddings); remat on, loss and
        attention in 512-position chunks, scanned layers."""
        return cls(
            vocab_size=128256,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            d_ff=14336,
            max_seq_len=4096,
            rope_theta=500000.0,
            rope_scaling=_llama3_rope(8.0),
            tie_embeddings=False,
            remat="full",
            loss_chunk=512,
            attention_chunk=512,
            scan_layers=True,
        )

    @classmethod
    def llama_70b(cls) -> ModelConfig:
        """Llama 3.1 70B shape (70.6B params, untied embeddings); remat on, loss and
        attention in 512-position chunks, scanned layers."""
        return cls(
            vocab_size=128256,
            d_model=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            d_ff=28672,
            max_seq_len=8192,
            rope_theta=500000.0,
            rope_scaling=_llama3_rope(8.0),
            tie_embeddings=False,
            remat="full",
            loss_chunk=512,
            attention_chunk=512,
            scan_layers=True,
        )

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """A preset by name; '-' and '_' are interchangeable ('gpt2-124m' == 'gpt2_124m')."""
        key = name.strip().lower().replace("-", "_")
        if key not in _PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {list_presets()}")
        return getattr(cls, key)()


def _llama3_rope(factor: float) -> RopeScaling:
    """Llama 3.x's RoPE as its config.json files have it: ``rope_scaling: {rope_type:
    llama3, factor: 32.0 (3.2 1B/3B) or 8.0 (3.1 8B/70B/405B, 3.3 70B), low_freq_factor:
    1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192}``, theta 500000."""
    return RopeScaling(
        kind="llama3",
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


_PRESETS = ("tiny", "small", "gpt2_124m", "llama_1b", "llama_8b", "llama_70b")


def list_presets() -> list[str]:
    """Preset names in the canonical spelling ('tiny', 'small', 'gpt2-124m', ...)."""
    return [p.replace("_", "-") for p in _PRESETS]


def _round_up(v: int, m: int) -> int:
    return int(math.ceil(v / m) * m)


def _from_dict(cls: type, d: Any) -> Any:
    """``cls(**d)`` (ModelConfig, RopeScaling), each value checked against its field's
    annotation; unknown keys and wrong types raise naming ``cls.<key>``."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__}.from_dict expected a dict, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(
            f"{cls.__name__}: unknown key(s) {unknown}; expected some of {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    return cls(**{k: _coerce(k, v, hints[k], cls.__name__) for k, v in d.items()})


def _coerce(key: str, value: Any, hint: Any, owner: str = "ModelConfig") -> Any:
    """Check `value` against the field's annotation; ints are accepted for floats, a dict
    for a nested config (RopeScaling)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        allowed = typing.get_args(hint)
    else:
        allowed = (hint,)
    for t in allowed:
        if t is type(None) and value is None:
            return None
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, str):
            return value
        if isinstance(t, type) and dataclasses.is_dataclass(t) and isinstance(value, (t, dict)):
            return value if isinstance(value, t) else _from_dict(t, value)
    names = " | ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise TypeError(f"{owner}.{key}={value!r} ({type(value).__name__}): expected {names}")
