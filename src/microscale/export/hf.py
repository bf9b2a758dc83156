"""Hugging Face Llama naming and ``config.json``: microscale <-> ``LlamaForCausalLM``.

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
    final_norm.scale                 [D]      model.norm.weight                        [D]
    lm_head.kernel                   [D, V]   lm_head.weight                           [V, D]
                                              (absent when tie_word_embeddings)

RoPE needs no permutation: microscale's ``apply_rope`` uses HF's "rotate half" layout
(dimension ``i`` pairs with ``i + head_dim/2``), and head ``h`` of q_proj's output is
columns ``h*hd:(h+1)*hd`` in both. RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``), SwiGLU,
grouped-query attention (query head ``h`` reads kv head ``h // (H/KV)``) and the
``1/sqrt(hd)`` score scale are the same functions.

Config: ``ModelConfig`` fields map one-to-one onto ``LlamaConfig``
(``d_model`` -> ``hidden_size``, ``d_ff`` -> ``intermediate_size``, ``n_layers`` ->
``num_hidden_layers``, ``n_heads``/``n_kv_heads`` -> ``num_attention_heads`` /
``num_key_value_heads``, ``max_seq_len`` -> ``max_position_embeddings``, ``norm_eps`` ->
``rms_norm_eps``, ``rope_theta``, ``tie_embeddings`` -> ``tie_word_embeddings``). HF
features microscale's model does not have (attention/MLP biases, RoPE scaling such as
Llama 3's ``rope_type: "llama3"``, interleaved RoPE, an activation other than SiLU, a ``head_dim`` other
than ``hidden_size / num_attention_heads``) are rejected with the field named rather
than silently ignored.
"""

from __future__ import annotations

import re
from typing import Any

from microscale.model import BLOCK_LINEARS, ModelConfig, fused_groups, linear_paths

__all__ = [
    "LINEAR_KINDS",
    "fused_groups",
    "hf_config",
    "hf_module",
    "hf_param_name",
    "linear_paths",
    "model_config_from_hf",
    "ms_module",
    "ms_param_name",
    "param_shapes",
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
_BLOCK_NORMS = {
    "attn_norm.scale": "input_layernorm.weight",
    "mlp_norm.scale": "post_attention_layernorm.weight",
}


def hf_param_name(path: str) -> str:
    """microscale parameter path (``...q_proj.kernel``) -> HF tensor name (``...weight``)."""
    if path in _NON_LINEAR:
        return _NON_LINEAR[path]
    m = _MS_LAYER.fullmatch(path)
    if m and m.group(2) in _BLOCK_NORMS:
        return f"model.layers.{m.group(1)}.{_BLOCK_NORMS[m.group(2)]}"
    if path.endswith(".kernel"):
        return hf_module(path[: -len(".kernel")]) + ".weight"
    raise ValueError(f"{path!r} is not a parameter path of microscale's Transformer")


def ms_param_name(name: str) -> str:
    """Inverse of :func:`hf_param_name`."""
    for k, v in _NON_LINEAR.items():
        if v == name:
            return k
    m = _HF_LAYER.fullmatch(name)
    if m:
        for k, v in _BLOCK_NORMS.items():
            if m.group(2) == v:
                return f"layers.{m.group(1)}.{k}"
    if name.endswith(".weight"):
        return ms_module(name[: -len(".weight")]) + ".kernel"
    raise ValueError(f"{name!r} is not a Llama parameter name")


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{microscale parameter path: shape} of every parameter of ``Transformer(cfg)``."""
    d, f, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    qd, kvd = cfg.n_heads * hd, cfg.n_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {
        "embed.embedding": (cfg.vocab_size, d),
        "final_norm.scale": (d,),
    }
    if not cfg.tie_embeddings:
        out["lm_head.kernel"] = (d, cfg.vocab_size)
    lin = {
        "attn.q_proj": (d, qd),
        "attn.k_proj": (d, kvd),
        "attn.v_proj": (d, kvd),
        "attn.o_proj": (qd, d),
        "mlp.gate_proj": (d, f),
        "mlp.up_proj": (d, f),
        "mlp.down_proj": (f, d),
    }
    for i in range(cfg.n_layers):
        out[f"layers.{i}.attn_norm.scale"] = (d,)
        out[f"layers.{i}.mlp_norm.scale"] = (d,)
        for k, shp in lin.items():
            out[f"layers.{i}.{k}.kernel"] = shp
    return out


# ---------------------------------------------------------------------- config.json


def hf_config(
    cfg: ModelConfig,
    *,
    dtype: str = "bfloat16",
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with ``cfg``'s shape."""
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
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


def _get(d: dict, key: str, types, default=...):
    if key not in d or d[key] is None:
        if default is ...:
            raise ValueError(f"config.json: missing required field {key!r}")
        return default
    v = d[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ValueError(f"config.json: {key}={v!r}: expected {types}")
    if not isinstance(v, types):
        raise ValueError(
            f"config.json: {key}={v!r} ({type(v).__name__}): expected "
            f"{getattr(types, '__name__', types)}"
        )
    return v


def _dim_multiple(*dims: int) -> int:
    """Largest of 32, 16, ..., 1 dividing every dim (ModelConfig checks dim_multiple)."""
    for m in (32, 16, 8, 4, 2, 1):
        if all(v % m == 0 for v in dims):
            return m
    return 1


def model_config_from_hf(
    d: dict[str, Any], *, param_dtype: str = "float32", compute_dtype: str = "bfloat16"
) -> ModelConfig:
    """A ``ModelConfig`` from a Llama ``config.json`` dict; unsupported features raise."""
    if not isinstance(d, dict):
        raise ValueError(f"config.json: expected a JSON object, got {type(d).__name__}")
    arch = d.get("architectures") or []
    mtype = d.get("model_type")
    if mtype != "llama" and "LlamaForCausalLM" not in arch:
        raise ValueError(
            f"config.json: model_type={mtype!r}, architectures={arch!r}: only "
            "Llama-architecture models (model_type 'llama' / "
            "LlamaForCausalLM) can be imported"
        )
    hidden = _get(d, "hidden_size", int)
    heads = _get(d, "num_attention_heads", int)
    kv = _get(d, "num_key_value_heads", int, heads)
    if heads <= 0 or hidden % heads:
        raise ValueError(
            f"config.json: hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
        )
    hd = _get(d, "head_dim", int, hidden // heads)
    if hd != hidden // heads:
        raise ValueError(
            f"config.json: head_dim={hd} differs from hidden_size / "
            f"num_attention_heads = {hidden // heads}; microscale's model "
            "derives head_dim and cannot represent this model"
        )
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act={act!r}: expected 'silu' (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ValueError(f"config.json: {key}=true: microscale's Llama has no biases")
    if d.get("rope_interleaved"):
        raise ValueError(
            "config.json: rope_interleaved=true: microscale's RoPE rotates "
            "halves (i with i + head_dim/2), not interleaved pairs"
        )
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling")
    theta = d.get(
        "rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0
    )
    for src, r in (("rope_scaling", scaling), ("rope_parameters", rope)):
        if r and (
            not isinstance(r, dict) or r.get("rope_type", r.get("type", "default")) != "default"
        ):
            raise ValueError(
                f"config.json: {src}={r!r}: RoPE scaling is not supported by "
                "microscale's model (expected none / rope_type 'default')"
            )
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"config.json: rope_theta={theta!r}: expected a positive number")
    d_ff = _get(d, "intermediate_size", int)
    dims = (hidden, d_ff, kv * hd, heads * hd)
    try:
        return ModelConfig(
            vocab_size=_get(d, "vocab_size", int),
            d_model=hidden,
            n_layers=_get(d, "num_hidden_layers", int),
            n_heads=heads,
            n_kv_heads=kv,
            d_ff=d_ff,
            max_seq_len=_get(d, "max_position_embeddings", int, 2048),
            rope_theta=float(theta),
            norm_eps=float(_get(d, "rms_norm_eps", (int, float), 1e-6)),
            tie_embeddings=bool(_get(d, "tie_word_embeddings", bool, False)),
            init_std=float(_get(d, "initializer_range", (int, float), 0.02)),
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            dim_multiple=_dim_multiple(*dims),
        )
    except ValueError as e:  # ModelConfig's own checks, told in config.json's keys
        msg = str(e)
        if not msg.startswith("ModelConfig"):
            raise
        for field, key in _HF_KEYS.items():
            msg = msg.replace(f"ModelConfig.{field}=", f"{key}=")
        raise ValueError(f"config.json: {msg.removeprefix('ModelConfig').lstrip(': ')}") from None


# ModelConfig field -> config.json key, for errors.
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
}
