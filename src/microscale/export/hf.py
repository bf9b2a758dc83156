"""Hugging Face naming and ``config.json``: microscale <-> ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and
``Gemma3ForCausalLM`` (the families of `microscale.model.family`, which share these
tensor names but for Gemma 3's norms: its ``post_attention_layernorm`` is
``attn_post_norm``, ``pre_feedforward_layernorm`` ``mlp_norm`` and
``post_feedforward_layernorm`` ``mlp_post_norm``; pass the family to `hf_param_name`).

Parameter names (microscale path -> HF tensor name; linear kernels are transposed because
microscale stores ``[in, out]`` and ``torch.nn.Linear`` stores ``[out, in]``)::

    embed.embedding                  [V, D]   model.embed_tokens.weight                [V, D]
    layers.i.attn_norm.scale         [D]      model.layers.i.input_layernorm.weight    [D]
    layers.i.attn.q_proj.kernel      [D, H*hd] model.layers.i.self_attn.q_proj.weight  [H*hd, D]
    layers.i.attn.{k,v}_proj.kernel  [D, KV*hd] model.layers.i.self_attn.{k,v}_proj.weight
    layers.i.attn.o_proj.kernel      [H*hd, D] model.layers.i.self_attn.o_proj.weight  [D, H*hd]
    layers.i.mlp_norm.scale          [D]      model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.{gate,up}_proj.kernel [D, F] model.layers.i.mlp.{gate,up}_proj.weight [F, D]
    layers.i.mlp.down_proj.kernel    [F, D]   model.layers.i.mlp.down_proj.weight      [D, F]
    layers.i.attn.{q,k,v}_proj.bias  [H*hd]   model.layers.i.self_attn.{q,k,v}_proj.bias (qwen2)
    layers.i.attn.{q,k}_norm.scale   [hd]     model.layers.i.self_attn.{q,k}_norm.weight (qwen3)
    final_norm.scale                 [D]      model.norm.weight                        [D]
    lm_head.kernel                   [D, V]   lm_head.weight                           [V, D]
                                              (absent when tie_word_embeddings)

RoPE needs no permutation: microscale's ``apply_rope`` uses HF's "rotate half" layout
(dimension ``i`` pairs with ``i + head_dim/2``), and head ``h`` of q_proj's output is
columns ``h*hd:(h+1)*hd`` in both. RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``), SwiGLU,
grouped-query attention (query head ``h`` reads kv head ``h // (H/KV)``) and the
``1/sqrt(hd)`` score scale are the same functions.

Config: ``ModelConfig`` fields map one-to-one onto the family's config class
(``d_model`` -> ``hidden_size``, ``d_ff`` -> ``intermediate_size``, ``n_layers`` ->
``num_hidden_layers``, ``n_heads``/``n_kv_heads`` -> ``num_attention_heads`` /
``num_key_value_heads``, ``attn_head_dim`` -> ``head_dim`` where it is not hidden /
heads, ``max_seq_len`` -> ``max_position_embeddings``, ``norm_eps`` -> ``rms_norm_eps``,
``rope_theta``, ``tie_embeddings`` -> ``tie_word_embeddings``, Mistral's
``sliding_window``). The family comes from ``model_type`` (``architectures`` when it is
absent). A key config.json leaves out means what the family's config class defaults it
to (`_ABSENT`: Mistral's 8 kv heads and 4096-token window, Qwen's 32 kv heads, Qwen3's
head_dim 128, each family's context), so that microscale reads the model transformers
builds; a key written as null is derived as the config classes do (kv heads = heads,
head_dim = hidden / heads, no window).

RoPE (`rope_from_hf` / `rope_to_hf`): ``rope_scaling`` with a top-level ``rope_theta``
(transformers 4.x; the kind as ``rope_type`` or the older ``type``) and ``rope_parameters``
with ``rope_theta`` inside (5.x) are both read, and both are written. The kinds of
`microscale.model.rope` come in (``default``, ``linear``, ``dynamic``, ``llama3`` --
every Llama 3.1/3.2/3.3 --, ``yarn``) as ``ModelConfig.rope_scaling``, with the dict's keys
as `RopeScaling`'s fields of the same names; dynamic NTK's ``L`` is config.json's
``max_position_embeddings``, and microscale's context for it is ``factor * L``. Refused,
naming the key and its value: another ``rope_type`` (``longrope``, ...), a key the kind
does not read, ``partial_rotary_factor`` other than 1, two forms that disagree.

Keys that change the math are refused unless they hold the one value the family's
block computes (`_MUST`: an activation other than SiLU, MLP biases, attention biases on
a family without them, interleaved RoPE, Qwen's ``use_sliding_window``, ``layer_types``
that mix attention kinds), naming the key and its value; another ``model_type`` is
refused naming it and the supported ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from microscale.model import (
    BLOCK_LINEARS,
    FAMILIES,
    ROPE_KINDS,
    ModelConfig,
    RopeScaling,
    fused_groups,
    linear_paths,
    param_shapes,
)
from microscale.model.family import Family
from microscale.model.rope import RopeKind

__all__ = [
    "LINEAR_KINDS",
    "fused_groups",
    "hf_config",
    "hf_module",
    "hf_param_name",
    "linear_paths",
    "model_config_from_hf",
    "ms_module",
    "text_model_prefix",
    "ms_param_name",
    "param_shapes",
    "rope_from_hf",
    "rope_to_hf",
]

# Linear sub-paths inside a block: microscale -> HF (HF names the attention "self_attn").
LINEAR_KINDS: dict[str, str] = {
    k: "self_" + k if k.startswith("attn.") else k for k in BLOCK_LINEARS
}
_HF_KINDS = {v: k for k, v in LINEAR_KINDS.items()}

_MS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_module(path: str) -> str:
    """Linear module path: ``layers.3.attn.q_proj`` -> ``model.layers.3.self_attn.q_proj``
    (``lm_head`` -> ``lm_head``)."""
    if path == "lm_head":
        return "lm_head"
    m = _MS_LAYER.fullmatch(path)
    if not m or m.group(2) not in LINEAR_KINDS:
        raise ValueError(
            f"{path!r} is not a linear layer path of microscale's Transformer "
            "(expected 'layers.<i>.attn.{q,k,v,o}_proj' or "
            "'layers.<i>.mlp.{gate,up,down}_proj')"
        )
    return f"model.layers.{m.group(1)}.{LINEAR_KINDS[m.group(2)]}"


def ms_module(name: str) -> str:
    """Inverse of :func:`hf_module`."""
    if name == "lm_head":
        return "lm_head"
    m = _HF_LAYER.fullmatch(name)
    if not m or m.group(2) not in _HF_KINDS:
        raise ValueError(f"{name!r} is not a Llama linear module name")
    return f"layers.{m.group(1)}.{_HF_KINDS[m.group(2)]}"


_NON_LINEAR = {
    "embed.embedding": "model.embed_tokens.weight",
    "final_norm.scale": "model.norm.weight",
    "lm_head.kernel": "lm_head.weight",
}
# Block parameters other than kernels: path inside a microscale block -> inside HF's.
_BLOCK_OTHER = {
    "attn_norm.scale": "input_layernorm.weight",
    "mlp_norm.scale": "post_attention_layernorm.weight",
    "attn.q_norm.scale": "self_attn.q_norm.weight",
    "attn.k_norm.scale": "self_attn.k_norm.weight",
    **{f"{k}.bias": f"{v}.bias" for k, v in LINEAR_KINDS.items()},
}
# Gemma 3 names its four block norms by place: its post_attention_layernorm is the norm
# of the attention's output (Llama's is the MLP's input norm).
_FAMILY_BLOCK_OTHER = {
    "gemma3": {
        **_BLOCK_OTHER,
        "attn_post_norm.scale": "post_attention_layernorm.weight",
        "mlp_norm.scale": "pre_feedforward_layernorm.weight",
        "mlp_post_norm.scale": "post_feedforward_layernorm.weight",
    }
}


def _block_other(family: str) -> dict[str, str]:
    return _FAMILY_BLOCK_OTHER.get(family, _BLOCK_OTHER)


def hf_param_name(path: str, family: str = "llama") -> str:
    """microscale parameter path (``...q_proj.kernel``) -> HF tensor name (``...weight``)
    in ``family``'s checkpoints."""
    if path in _NON_LINEAR:
        return _NON_LINEAR[path]
    m = _MS_LAYER.fullmatch(path)
    other = _block_other(family)
    if m and m.group(2) in other:
        return f"model.layers.{m.group(1)}.{other[m.group(2)]}"
    if path.endswith(".kernel"):
        return hf_module(path[: -len(".kernel")]) + ".weight"
    raise ValueError(f"{path!r} is not a parameter path of microscale's Transformer")


def ms_param_name(name: str, family: str = "llama") -> str:
    """Inverse of :func:`hf_param_name`."""
    for k, v in _NON_LINEAR.items():
        if v == name:
            return k
    m = _HF_LAYER.fullmatch(name)
    other = {v: k for k, v in _block_other(family).items()}
    if m and m.group(2) in other:
        return f"layers.{m.group(1)}.{other[m.group(2)]}"
    if name.endswith(".weight"):
        return ms_module(name[: -len(".weight")]) + ".kernel"
    raise ValueError(f"{name!r} is not a parameter name of a supported family")


# ---------------------------------------------------------------------- config.json


def hf_config(
    cfg: ModelConfig,
    *,
    dtype: str = "bfloat16",
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> dict[str, Any]:
    """``config.json`` of ``cfg``'s family (``LlamaForCausalLM``, ``MistralForCausalLM``,
    ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``) with ``cfg``'s
    shape."""
    fam = cfg.arch
    out: dict[str, Any] = {
        "architectures": [fam.hf_architecture],
        "model_type": fam.hf_model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        **({"hidden_act": "silu"} if fam.mlp_act == "silu" else {}),  # GeGLU: its own key
        "max_position_embeddings": _hf_context(cfg),
        "rms_norm_eps": cfg.norm_eps,
        **rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
        **_FAMILY_KEYS[fam.name](cfg),
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if eos_token_id is not None:
        out["eos_token_id"] = int(eos_token_id)
    if bos_token_id is not None:
        out["bos_token_id"] = int(bos_token_id)
    return out


# The keys each family's config class reads beside the shared ones, as `hf_config`
# writes them (transformers' LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config).
_NO_WINDOW = {"use_sliding_window": False, "sliding_window": None}
_FAMILY_KEYS = {
    "llama": lambda cfg: {"attention_bias": False, "mlp_bias": False},
    "mistral": lambda cfg: {"sliding_window": cfg.sliding_window},
    "qwen2": lambda cfg: {**_NO_WINDOW, "max_window_layers": cfg.n_layers},
    "qwen3": lambda cfg: {
        **_NO_WINDOW,
        "max_window_layers": cfg.n_layers,
        "attention_bias": False,
    },
    "gemma3": lambda cfg: _gemma3_keys(cfg),
}


def _gemma3_keys(cfg: ModelConfig) -> dict[str, Any]:
    """Gemma3TextConfig's own keys: the activation, the scores' scale, the window and the
    layer kinds (both as the pattern, 4.x, and as layer_types, 5.x), and RoPE per kind
    (4.x: rope_theta and rope_scaling for the global layers, rope_local_base_freq; 5.x:
    rope_parameters per layer kind), in place of the flat RoPE keys."""
    local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    glob = rope_to_hf(cfg.rope_theta, cfg.rope_scaling)
    local = rope_to_hf(local_theta, None)["rope_parameters"]
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    return {
        **glob,
        "hidden_activation": "gelu_pytorch_tanh",
        # an int where it is whole (Gemma3TextConfig types it int)
        "query_pre_attn_scalar": int(scalar) if scalar == int(scalar) else scalar,
        "sliding_window": cfg.sliding_window,
        # (transformers divides by it: every layer local is a pattern past the last layer)
        "sliding_window_pattern": cfg.sliding_window_pattern
        or (cfg.n_layers + 1 if cfg.sliding_window is not None else 1),
        "layer_types": [
            "sliding_attention" if cfg.layer_is_local(i) else "full_attention"
            for i in range(cfg.n_layers)
        ],
        "rope_local_base_freq": local_theta,
        "rope_parameters": {
            "full_attention": glob["rope_parameters"],
            "sliding_attention": local,
        },
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }


def _get(d: dict, key: str, types, default=...):
    if key not in d or d[key] is None:
        if default is ...:
            raise ValueError(f"config.json: missing required field {key!r}")
        return default
    v = d[key]
    kinds = types if isinstance(types, tuple) else (types,)
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in kinds):
        want = " or ".join(t.__name__ for t in kinds)  # (int, float): "int or float"
        raise ValueError(f"config.json: {key}={v!r} ({type(v).__name__}): expected {want}")
    return v


def _dim_multiple(*dims: int) -> int:
    """Largest of 32, 16, ..., 1 dividing every dim (ModelConfig checks dim_multiple)."""
    for m in (32, 16, 8, 4, 2, 1):
        if all(v % m == 0 for v in dims):
            return m
    return 1


def _family_from_hf(d: dict[str, Any]) -> str:
    """The family of a config.json: its ``model_type``, or failing that its
    ``architectures``; anything else is refused, naming both."""
    mtype, arch = d.get("model_type"), d.get("architectures") or []
    for fam in FAMILIES.values():
        if mtype == fam.hf_model_type or (mtype is None and fam.hf_architecture in arch):
            return fam.name
    known = ", ".join(f"{f.hf_model_type} ({f.hf_architecture})" for f in FAMILIES.values())
    hint = " without a text_config" if str(mtype) in _MULTIMODAL else ""
    raise ValueError(
        f"config.json: model_type={mtype!r}, architectures={arch!r}: not a family "
        f"microscale runs{hint}; expected one of {known}"
    )


# Multimodal wrappers of a text family: model_type -> (the text model's model_type, the
# prefix of its tensors). microscale reads the text model (config.json's text_config, the
# tensors under the prefix) and leaves the vision tower and its projector out.
_MULTIMODAL = {"gemma3": ("gemma3_text", "language_model.")}


def text_model_prefix(d: dict[str, Any]) -> str:
    """The prefix of the text model's tensor names in the checkpoint of config.json ``d``:
    ``language_model.`` for a multimodal wrapper (Gemma 3's image-text model), else ``""``."""
    wrapper = _MULTIMODAL.get(str(d.get("model_type")))
    return wrapper[1] if wrapper and isinstance(d.get("text_config"), dict) else ""


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The text model's config.json keys: ``d`` itself, or a multimodal wrapper's
    ``text_config`` (its ``model_type`` the text family's; the wrapper's
    ``tie_word_embeddings`` where the text config has none)."""
    wrapper = _MULTIMODAL.get(str(d.get("model_type")))
    text = d.get("text_config")
    if wrapper is None or not isinstance(text, dict):
        return d
    out = {**text, "model_type": wrapper[0]}
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in d:
        out["tie_word_embeddings"] = d["tie_word_embeddings"]
    return out


# Keys that change the math, with the one value microscale's block computes, and which
# families' rows the key applies to (a predicate of the row). A config.json that sets one
# otherwise is refused, naming it.
def _silu(f: Family) -> bool:
    return f.mlp_act == "silu"


def _geglu(f: Family) -> bool:
    return f.mlp_act == "gelu_tanh"


_MUST: dict[str, tuple[Any, Callable[[Family], bool]]] = {
    "hidden_act": ("silu", _silu),
    "hidden_activation": ("gelu_pytorch_tanh", _geglu),
    # Gemma's config class is the one that has these keys (Gemma 2's values are refused).
    "attn_logit_softcapping": (None, _geglu),
    "final_logit_softcapping": (None, _geglu),
    "use_bidirectional_attention": (False, _geglu),
    "mlp_bias": (False, lambda f: True),
    "rope_interleaved": (False, lambda f: True),
    "attention_bias": (False, lambda f: not f.qkv_bias),
    # Qwen's configs carry a window switch that their block (no window) must leave off.
    "use_sliding_window": (False, lambda f: not (f.sliding_window or f.local_global)),
    "pretraining_tp": (1, lambda f: True),
}


def _check_math_keys(d: dict[str, Any], family: str) -> None:
    row = FAMILIES[family]
    for key, (want, applies_to) in _MUST.items():
        if applies_to(row) and d.get(key) is not None and d[key] != want:
            raise ValueError(
                f"config.json: {key}={d[key]!r}: microscale's {family} block computes "
                f"only {key}={want!r}"
            )
    types = d.get("layer_types")
    if types is not None and not row.local_global:  # local/global: `_gemma3_layers`
        kinds = sorted(set(types)) if isinstance(types, list) else [repr(types)]
        if kinds != ["full_attention"] and not (
            row.sliding_window and kinds == ["sliding_attention"]
        ):
            one = "full attention" + (", or the sliding window" if row.sliding_window else "")
            raise ValueError(
                f"config.json: layer_types={kinds}: microscale's {family} block runs one "
                f"attention kind on every layer ({one})"
            )


def model_config_from_hf(
    d: dict[str, Any], *, param_dtype: str = "float32", compute_dtype: str = "bfloat16"
) -> ModelConfig:
    """A ``ModelConfig`` from a ``config.json`` dict of a supported family (Llama,
    Mistral, Qwen2/2.5, Qwen3); a feature the block does not compute is refused by name."""
    if not isinstance(d, dict):
        raise ValueError(f"config.json: expected a JSON object, got {type(d).__name__}")
    d = _text_config(d)
    family = _family_from_hf(d)
    _check_math_keys(d, family)
    hidden = _get(d, "hidden_size", int, _unset(d, family, "hidden_size", ...))
    heads = _get(d, "num_attention_heads", int, _unset(d, family, "num_attention_heads", ...))
    kv = _get(d, "num_key_value_heads", int, _unset(d, family, "num_key_value_heads", heads))
    if heads <= 0:
        raise ValueError(f"config.json: num_attention_heads={heads}: expected a positive int")
    hd = _get(d, "head_dim", int, _unset(d, family, "head_dim", None))
    if hd is None and hidden % heads:
        raise ValueError(
            f"config.json: hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
        )
    derived = hd is None or (hidden % heads == 0 and hd == hidden // heads)
    hd = hidden // heads if hd is None else hd
    window = None
    row = FAMILIES[family]
    if row.sliding_window or row.local_global:
        window = _get(d, "sliding_window", int, _unset(d, family, "sliding_window", None))
    context = _get(d, "max_position_embeddings", int, _ABSENT[family]["max_position_embeddings"])
    extra: dict[str, Any] = {}
    if row.local_global:
        theta, rope, extra = _gemma3_from_hf(d, context)
    else:
        theta, rope = rope_from_hf(d, context)
    d_ff = _get(d, "intermediate_size", int, _unset(d, family, "intermediate_size", ...))
    dims = (hidden, d_ff, kv * hd, heads * hd)
    try:
        return ModelConfig(
            family=family,
            vocab_size=_get(d, "vocab_size", int, _unset(d, family, "vocab_size", ...)),
            d_model=hidden,
            n_layers=_get(d, "num_hidden_layers", int, _unset(d, family, "num_hidden_layers", ...)),
            n_heads=heads,
            n_kv_heads=kv,
            d_ff=d_ff,
            attn_head_dim=None if derived else hd,
            sliding_window=window,
            max_seq_len=_context(rope, context),
            rope_theta=theta,
            rope_scaling=rope,
            norm_eps=float(_get(d, "rms_norm_eps", (int, float), 1e-6)),
            tie_embeddings=bool(
                _get(
                    d, "tie_word_embeddings", bool, _unset(d, family, "tie_word_embeddings", False)
                )
            ),
            init_std=float(_get(d, "initializer_range", (int, float), 0.02)),
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            dim_multiple=_dim_multiple(*dims),
            **extra,
        )
    except ValueError as e:  # ModelConfig's own checks, told in config.json's keys
        msg = str(e)
        if not msg.startswith("ModelConfig"):
            raise
        # every field it names (``ModelConfig.n_heads=4 ... n_kv_heads=32``), in one pass
        msg = _FIELD.sub(lambda m: _HF_KEYS[m.group(1)], msg)
        raise ValueError(f"config.json: {msg.removeprefix('ModelConfig').lstrip('.: ')}") from None


# What transformers' config class of each family takes for a key config.json leaves out
# (its dataclass defaults, transformers 4.x and 5.x alike), where that is not derived from
# the other keys. A key written as null is derived instead, as the config classes do:
# num_key_value_heads = num_attention_heads, head_dim = hidden_size / num_attention_heads,
# sliding_window = none.
_ABSENT: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
    "gemma3": {  # (Gemma3TextConfig defaults every key: the hub's text_configs are sparse)
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
    },
}


def _gemma3_layers(d: dict[str, Any], n_layers: int) -> int:
    """ModelConfig.sliding_window_pattern of a Gemma 3 config.json: its
    ``sliding_window_pattern`` (default 6), checked against ``layer_types`` where both are
    given; ``layer_types`` alone must be that pattern for some period (refused otherwise,
    naming the first layer that breaks it)."""
    pattern = _get(d, "sliding_window_pattern", int, None)
    if pattern is not None and pattern <= 0:  # transformers divides by it (or reads -1 as 1)
        raise ValueError(
            f"config.json: sliding_window_pattern={pattern}: expected an int >= 1, one global "
            "layer in every that many (a pattern past the last layer: every layer local)"
        )
    types = d.get("layer_types")
    if types is None:
        pattern = 6 if pattern is None else pattern
        return pattern if pattern <= n_layers else 0  # one spelling of "all local"
    if not isinstance(types, list) or len(types) != n_layers:
        raise ValueError(
            f"config.json: layer_types={types!r}: expected a list of {n_layers} layer kinds"
        )
    bad = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if bad:
        raise ValueError(
            f"config.json: layer_types has {bad[0]!r}: expected sliding_attention or full_attention"
        )
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    found = 0 if not full else full[0] + 1
    want = [
        "sliding_attention" if found == 0 or (i + 1) % found else "full_attention"
        for i in range(n_layers)
    ]
    if types != want or (pattern is not None and pattern <= n_layers and pattern != found):
        first = next((i for i, (a, b) in enumerate(zip(types, want, strict=True)) if a != b), 0)
        raise ValueError(
            f"config.json: layer_types (layer {first}: {types[first]!r}) and "
            f"sliding_window_pattern={pattern!r}: microscale's gemma3 block runs one global "
            "layer in every sliding_window_pattern layers, the last of each period"
        )
    return found


def _gemma3_from_hf(
    d: dict[str, Any], context: int
) -> tuple[float, RopeScaling | None, dict[str, Any]]:
    """``(rope_theta, rope_scaling, other ModelConfig fields)`` of a Gemma 3 config.json:
    global RoPE from ``rope_parameters.full_attention`` (5.x) or ``rope_theta`` /
    ``rope_scaling`` (4.x), the local layers' base from ``rope_parameters.
    sliding_attention`` or ``rope_local_base_freq`` (unscaled; a scaled one is refused),
    the layer pattern and ``query_pre_attn_scalar``."""
    params = d.get("rope_parameters")
    flat: dict[str, Any] = {k: d[k] for k in ("rope_theta", "rope_scaling") if k in d}
    local_thetas = {}
    if d.get("rope_local_base_freq") is not None:
        local_thetas["rope_local_base_freq"] = d["rope_local_base_freq"]
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        glob = params.get("full_attention") or {}
        theta, rope = rope_from_hf({**flat, "rope_parameters": glob}, context)
        sliding = params.get("sliding_attention") or {}
        lt, lrope = _rope_dict("rope_parameters.sliding_attention", sliding, context)
        if lrope is not None:
            raise ValueError(
                f"config.json: rope_parameters.sliding_attention={sliding!r}: microscale's "
                "gemma3 local layers run the default RoPE"
            )
        if lt is not None:
            local_thetas["rope_parameters.sliding_attention.rope_theta"] = lt
    else:
        theta, rope = rope_from_hf(d, context)
    if "rope_theta" not in flat and not (isinstance(params, dict) and params):
        theta = 1_000_000.0  # Gemma3TextConfig's global default
    if len(set(local_thetas.values())) > 1:
        shown = ", ".join(f"{k}={v!r}" for k, v in local_thetas.items())
        raise ValueError(f"config.json: {shown}: two different local RoPE bases")
    local = float(next(iter(local_thetas.values()), 10_000.0))
    scalar = _get(d, "query_pre_attn_scalar", (int, float), 256)
    return (
        theta,
        rope,
        {
            "sliding_window_pattern": _gemma3_layers(
                d, _get(d, "num_hidden_layers", int, _unset(d, "gemma3", "num_hidden_layers", ...))
            ),
            "rope_local_theta": local,
            "query_pre_attn_scalar": float(scalar),
        },
    )


def _unset(d: dict[str, Any], family: str, key: str, derived: Any) -> Any:
    """``key``'s value where config.json does not give one: the family's default where the
    key is absent (`_ABSENT`), ``derived`` where it is null or the family has none."""
    return _ABSENT[family].get(key, derived) if key not in d else derived


# ModelConfig field -> config.json key, for errors: every field model_config_from_hf sets
# from a key (ModelConfig's own checks then name the key, never the field).
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "attn_head_dim": "head_dim",
    "sliding_window": "sliding_window",
    "sliding_window_pattern": "sliding_window_pattern",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "rope_local_theta": "rope_local_base_freq",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "init_std": "initializer_range",
}
_FIELD = re.compile(r"(?:ModelConfig\.)?\b(" + "|".join(_HF_KEYS) + r")\b")


# ---------------------------------------------------------------------- RoPE in config.json

# Where config.json keeps RoPE's kind and parameters: transformers 4.x writes
# "rope_scaling" (the kind as "rope_type", before 4.43 as "type") beside a top-level
# "rope_theta"; 5.x writes "rope_parameters" with "rope_type" and "rope_theta" inside.
_ROPE_DICTS = ("rope_scaling", "rope_parameters")
# Keys any rope dict may hold besides its kind's parameters.
_ROPE_COMMON = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# Parameters transformers requires (the others have defaults there, RopeScaling's own).
_ROPE_REQUIRED = ("factor", "low_freq_factor", "high_freq_factor")


def _rope_keys(row: RopeKind) -> tuple[str, ...]:
    """The rope-dict keys of a kind: its RopeScaling fields (the same names), less L where
    config.json holds it as max_position_embeddings."""
    skip = ("original_max_position_embeddings",) if row.original_is_context else ()
    return tuple(f for f in row.fields if f not in skip)


def _context(rope: RopeScaling | None, context: int) -> int:
    """microscale's max_seq_len for config.json's max_position_embeddings: the same, but
    s·L where that is L (dynamic NTK is meant to run past it)."""
    if rope is None or not ROPE_KINDS[rope.kind].original_is_context:
        return context
    return int(rope.factor * context)


def _hf_context(cfg: ModelConfig) -> int:
    """config.json's max_position_embeddings: the inverse of `_context`."""
    rope = cfg.rope_scaling
    if rope is None or not ROPE_KINDS[rope.kind].original_is_context:
        return cfg.max_seq_len
    assert rope.original_max_position_embeddings is not None  # RopeScaling checks it
    return rope.original_max_position_embeddings


def _rope_kind(src: str, r: Any) -> str:
    """The kind a rope dict names (``rope_type``, or the older ``type``), refused unless
    microscale has it."""
    if not isinstance(r, dict):
        raise ValueError(f"config.json: {src}={r!r}: expected an object with a rope_type")
    named = {k: r[k] for k in ("rope_type", "type") if r.get(k) is not None}
    if len(set(named.values())) > 1:
        raise ValueError(
            f"config.json: {src}.rope_type={r['rope_type']!r} and {src}.type={r['type']!r}: "
            "two different RoPE kinds"
        )
    kind = next(iter(named.values()), "default")
    if kind not in ROPE_KINDS:
        key = next(iter(named), "rope_type")
        raise ValueError(
            f"config.json: {src}.{key}={kind!r}: not supported by microscale's RoPE "
            f"(supported: {', '.join(sorted(ROPE_KINDS))})"
        )
    return kind


def _rope_dict(src: str, r: Any, context: int) -> tuple[Any, RopeScaling | None]:
    """``(its rope_theta or None, its RopeScaling)`` of one rope dict; a key the kind
    does not read is refused (it would change the math, or it is a typo)."""
    kind = _rope_kind(src, r)
    keys = _rope_keys(ROPE_KINDS[kind])
    for k, v in r.items():
        if k not in keys and k not in _ROPE_COMMON:
            raise ValueError(
                f"config.json: {src}.{k}={v!r}: not a parameter of rope_type {kind!r} "
                f"(it takes {list(keys) or 'none'}); refused rather than ignored"
            )
    partial = r.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise ValueError(
            f"config.json: {src}.partial_rotary_factor={partial!r}: microscale's RoPE "
            "rotates the whole head (expected 1.0)"
        )
    params = {k: r[k] for k in keys if r.get(k) is not None}
    missing = [k for k in keys if k in _ROPE_REQUIRED and k not in params]
    if missing:
        raise ValueError(f"config.json: {src} has no {missing[0]!r} (rope_type {kind!r} needs it)")
    if "original_max_position_embeddings" in ROPE_KINDS[kind].fields:
        params.setdefault("original_max_position_embeddings", context)  # transformers' default
    try:
        rope = RopeScaling(kind=kind, **params)
    except ValueError as e:
        raise ValueError(f"config.json: {str(e).replace('RopeScaling.', src + '.')}") from None
    return r.get("rope_theta"), None if kind == "default" else rope


def rope_from_hf(d: dict[str, Any], context: int) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, RopeScaling or None)`` of a config.json dict, as transformers 4.x and
    5.x write it (``rope_scaling`` and top-level ``rope_theta``; ``rope_parameters``).
    ``context``: its max_position_embeddings (L where a kind needs one and names none).
    Where both forms are present they must say the same; anything microscale's RoPE
    does not compute is refused naming the key and its value."""
    thetas = {"rope_theta": d["rope_theta"]} if d.get("rope_theta") is not None else {}
    found: dict[str, RopeScaling | None] = {}
    for src in _ROPE_DICTS:
        if d.get(src) in (None, {}):
            continue
        theta, found[src] = _rope_dict(src, d[src], context)
        if theta is not None:
            thetas[f"{src}.rope_theta"] = theta
    if len(set(found.values())) > 1:
        shown = ", ".join(f"{k}={d[k]!r}" for k in found)
        raise ValueError(f"config.json: {shown}: two different RoPE scalings")
    if len(set(thetas.values())) > 1:
        shown = ", ".join(f"{k}={v!r}" for k, v in thetas.items())
        raise ValueError(f"config.json: {shown}: two different RoPE bases")
    theta = next(iter(thetas.values()), 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        key = next(iter(thetas), "rope_theta")
        raise ValueError(f"config.json: {key}={theta!r}: expected a positive number")
    return float(theta), next(iter(found.values()), None)


def rope_to_hf(theta: float, rope: RopeScaling | None) -> dict[str, Any]:
    """config.json's RoPE keys, in both forms (`rope_from_hf` reads either back):
    ``rope_theta``, ``rope_scaling`` (transformers 4.x; null for the default RoPE) and
    ``rope_parameters`` (5.x)."""
    params: dict[str, Any] = {"rope_type": "default"}
    if rope is not None:
        row = ROPE_KINDS[rope.kind]
        given = {k: getattr(rope, k) for k in _rope_keys(row) if getattr(rope, k) is not None}
        params = {"rope_type": rope.kind, **given}
    return {
        "rope_theta": theta,
        "rope_scaling": None if rope is None else dict(params),
        "rope_parameters": {**params, "rope_theta": theta},
    }
