"""``read_checkpoint``: HF folders of the supported families (plain, compressed-tensors, ModelOpt) -> microscale.

What is read (JSON and safetensors only; nothing is executed):

* ``config.json`` -> :class:`~microscale.model.ModelConfig` (``export.hf`` lists what maps
  and what is rejected);
* its ``quantization_config`` (or ModelOpt's ``hf_quant_config.json``) -> one
  :class:`~microscale.export.LayerQuant` per linear layer: compressed-tensors config groups
  are matched against module names (``"Linear"``, exact names, ``"re:"`` regexes; ``ignore``
  wins), ModelOpt's ``quant_algo`` / ``quantized_layers`` / ``exclude_modules`` likewise;
* the tensors, checked against that plan *before* use: every expected tensor present
  with its exact dtype and shape, no unexpected tensor, finite positive tensor scales. A
  failure names the tensor and what was expected.

Result: a :class:`Checkpoint` whose ``params`` are microscale's flat parameter dict —
float arrays (``[in, out]`` kernels) for unquantized tensors and, for quantized linears,
``QArray``\\ s in kernel orientation ``(K, N)`` with blocks along axis 0, holding the
file's packed bytes and scales unchanged (``dequantize=True`` decodes them to floats).
Global scales come back in microscale's decode direction: compressed-tensors stores
``s_enc = 2688/amax`` and ``1/s_enc`` is exactly what ``formats.quantize`` computes as
``s_dec``; ModelOpt's ``weight_scale_2`` is ``s_dec`` itself.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from microscale.export import layouts as L
from microscale.export.hf import (
    hf_module,
    hf_param_name,
    linear_paths,
    model_config_from_hf,
    param_shapes,
    text_model_prefix,
)
from microscale.export.hflayouts import HF_QUANT, hf_quant
from microscale.export.hfquant import CheckpointError, load_json, quant_method
from microscale.export.tensorfile import DTYPE_NAMES, SafetensorsError, TensorStore
from microscale.formats import QArray, dequantize
from microscale.model import ModelConfig, Transformer, filled

__all__ = ["Checkpoint", "CheckpointError", "hf_head_config", "import_model", "read_checkpoint"]

_FLOAT_DTYPES = ("F32", "F16", "BF16")
# Tensors some HF checkpoints carry that a Llama forward pass does not use.
_HARMLESS = re.compile(r".*\.rotary_emb\.inv_freq")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Checkpoint:
    """An HF-style model folder read into microscale's terms."""

    # The folder.
    path: Path
    # "hf" (no quantization), "compressed-tensors" or "modelopt".
    layout: str
    # The model shape.
    config: ModelConfig
    # Flat {parameter path: float array | QArray (quantized linear kernels, (K, N))}.
    params: dict[str, Any]
    # {linear path: LayerQuant} (bf16 = stored unquantized).
    layers: dict[str, L.LayerQuant]
    # {linear path: static input decode scale (float32)} of W4A4 / W8A8 layers.
    input_scales: dict[str, np.float32]
    # The parsed config.json.
    hf_config: dict[str, Any]
    # tokenizer.json next to the weights, if any.
    tokenizer_file: Path | None

    def tokenizer(self):
        """The folder's tokenizer (``microscale.data`` object) or None."""
        if self.tokenizer_file is None:
            return None
        from microscale.data import load_tokenizer

        return load_tokenizer(self.tokenizer_file)

    def dequantized_params(self, dtype: Any = jnp.float32) -> dict[str, Any]:
        """``params`` with every QArray decoded to a float kernel ``[in, out]``."""
        return {
            k: (np.asarray(dequantize(v, dtype)) if isinstance(v, QArray) else v)
            for k, v in self.params.items()
        }

    def to_model(self, *, param_dtype: str | None = None) -> Transformer:
        """A microscale ``Transformer`` with these weights (quantized ones dequantized)."""
        cfg = self.config if param_dtype is None else self.config.replace(param_dtype=param_dtype)
        return build_model(cfg, self.dequantized_params())


def build_model(cfg: ModelConfig, params: Mapping[str, Any]) -> Transformer:
    """A ``Transformer(cfg)`` holding ``params`` (flat float dict), without a random init."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    try:
        return filled(abstract, params, cfg.param_dtype)
    except (KeyError, ValueError) as e:
        raise CheckpointError(e.args[0]) from None


# ---------------------------------------------------------------------- config parsing

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _check_sizes(path: Path, cfg: ModelConfig, store: TensorStore) -> None:
    """config.json's layer count and embedding size against the tensors present (a
    ``num_hidden_layers`` of 10^9 must fail here, not allocate)."""
    by_layer: dict[int, str] = {}
    for n in store.names():
        if m := _LAYER.match(n):
            by_layer.setdefault(int(m.group(1)), n)
    extra = sorted(i for i in by_layer if i >= cfg.n_layers)
    if extra:
        raise CheckpointError(
            f"tensor {by_layer[extra[0]]!r} is not expected: "
            f"{path / 'config.json'} says num_hidden_layers={cfg.n_layers}; "
            "config and tensors disagree"
        )
    if len(by_layer) != cfg.n_layers:
        raise CheckpointError(
            f"{path / 'config.json'}: num_hidden_layers={cfg.n_layers} but "
            f"the tensors hold {len(by_layer)} layers; config and tensors "
            "disagree"
        )
    # The attention's output rows (dim 0 in every layout, packed or not) are heads x
    # head_dim: a head count or head_dim config.json gets wrong is named by its keys.
    hd_key = f"head_dim={cfg.head_dim}" + (
        "" if cfg.attn_head_dim is not None else " (hidden_size / num_attention_heads)"
    )
    for proj, heads, key in (
        ("q_proj", cfg.n_heads, "num_attention_heads"),
        ("k_proj", cfg.n_kv_heads, "num_key_value_heads"),
    ):
        for suffix in dict.fromkeys(("weight", *(q.packed_data for q in HF_QUANT.values()))):
            name = f"model.layers.0.self_attn.{proj}.{suffix}"
            info = store.infos.get(name)
            if info is not None and info.shape and info.shape[0] != heads * cfg.head_dim:
                raise CheckpointError(
                    f"tensor {name!r} has shape {list(info.shape)}; expected "
                    f"{heads * cfg.head_dim} rows: {path / 'config.json'} says {key}={heads} "
                    f"x {hd_key}; config and tensors disagree"
                )
    emb = store.infos.get("model.embed_tokens.weight")
    want = (cfg.vocab_size, cfg.d_model)
    if emb is not None and tuple(emb.shape) != want:
        raise CheckpointError(
            f"{path / 'config.json'}: vocab_size={cfg.vocab_size}, "
            f"hidden_size={cfg.d_model} but model.embed_tokens.weight has "
            f"shape {list(emb.shape)}; config and tensors disagree"
        )


def _own_head(path: Path, cfg: ModelConfig, store: TensorStore) -> ModelConfig:
    """``cfg``, untied where config.json says ``tie_word_embeddings`` but the tensors hold
    an ``lm_head.weight`` other than the embedding (a warning says so): transformers
    keeps such a file's head, and microscale reads the model transformers builds. A
    head equal to the embedding bit for bit is the tied model (no warning)."""
    name = "lm_head.weight"
    if not cfg.tie_embeddings or name not in store:
        return cfg
    shape = ((cfg.vocab_size, cfg.d_model),)
    emb = _expect(store, "model.embed_tokens.weight", _FLOAT_DTYPES, shape, "the embedding")
    head = _expect(store, name, _FLOAT_DTYPES, shape, "the LM head beside a tied embedding")
    bits = f"u{emb.dtype.itemsize}"
    if head.dtype == emb.dtype and np.array_equal(head.view(bits), emb.view(bits)):
        return cfg  # the tied model, stored twice
    # (one place warns: a folder read twice in one process, config then weights, says it once)
    warnings.warn(
        f"{path}: config.json says tie_word_embeddings=true but {name} differs from "
        "model.embed_tokens.weight; keeping the file's head (an untied model, as "
        "transformers builds it)",
        UserWarning,
        stacklevel=1,
    )
    return cfg.replace(tie_embeddings=False)


def hf_head_config(path: str | os.PathLike, cfg: ModelConfig) -> ModelConfig:
    """``cfg`` (config.json's model of HF folder ``path``) as :func:`read_checkpoint` builds
    it: untied, with a warning, where config.json ties the head but the tensors hold an
    ``lm_head.weight`` of their own (for callers that read the config before the weights)."""
    path = Path(path)
    try:
        store = TensorStore(path, prefix=text_model_prefix(load_json(path / "config.json")))
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    return _own_head(path, cfg, store)


# ---------------------------------------------------------------------- tensors


def _expect(
    store: TensorStore, name: str, dtypes: tuple[str, ...], shapes: tuple, why: str
) -> np.ndarray:
    if name not in store:
        raise CheckpointError(
            f"tensor {name!r} is missing ({why}; expected dtype "
            f"{dtypes[0]} shape {list(shapes[0])})"
        )
    info = store.info(name)
    if info.dtype not in dtypes:
        raise CheckpointError(
            f"tensor {name!r} has dtype {info.dtype}; expected {' or '.join(dtypes)} ({why})"
        )
    if info.shape not in shapes:
        raise CheckpointError(
            f"tensor {name!r} has shape {list(info.shape)}; expected "
            f"{' or '.join(str(list(s)) for s in shapes)} ({why})"
        )
    try:
        return store.get(name)  # checksum and finiteness verified on first read
    except SafetensorsError as e:
        raise CheckpointError(f"{e} ({why})") from None


def _scale(store: TensorStore, name: str, why: str, *, encode: bool) -> np.float32:
    v = np.float32(_expect(store, name, ("F32",), ((), (1,)), why).reshape(()))
    if not (np.isfinite(v) and v > 0):
        raise CheckpointError(f"tensor {name!r} = {v}: expected a finite scale > 0 ({why})")
    return np.float32(np.float32(1.0) / v) if encode else v


def _read_linear(
    store: TensorStore,
    layout: str,
    mod: str,
    lq: L.LayerQuant,
    static_input: bool,
    kn: tuple[int, ...],
) -> tuple[QArray, np.float32 | None]:
    spec = lq.weight_spec
    k, n = kn
    why = f"{mod} is {lq} in the {layout} layout"
    row = hf_quant(layout)
    if spec.block_size is not None and k % spec.block_size:
        raise CheckpointError(
            f"{mod}: input dimension {k} is not a multiple of the "
            f"{spec.name} block size {spec.block_size}"
        )
    data_name = f"{mod}.{row.packed_data if spec.packed else 'weight'}"
    if spec.packed:
        data = _expect(store, data_name, ("U8",), ((n, k // 2),), why)
    else:
        data = _expect(store, data_name, (DTYPE_NAMES[np.dtype(spec.elem_dtype)],), ((n, k),), why)
    if spec.block_size is None:
        scales = np.asarray(_scale(store, f"{mod}.weight_scale", why, encode=False))
        block_shape = None
    else:
        sdt = DTYPE_NAMES[np.dtype(spec.scale_dtype)]
        storage = row.scale_storage(spec.name)
        names = (storage, sdt) if storage else (sdt,)
        sc = _expect(store, f"{mod}.weight_scale", names, ((n, k // spec.block_size),), why)
        scales = sc.view(np.dtype(spec.scale_dtype)).T
        block_shape = (spec.block_size, 1)
    gs = None
    if spec.has_global_scale:
        gs = np.asarray(_scale(store, f"{mod}.{row.global_scale}", why, encode=row.global_encode))
    q = QArray(data.T, scales, gs, spec, 0, (k, n), block_shape)  # type: ignore[arg-type]
    in_scale = None
    ispec = lq.input_spec
    if ispec is not None and static_input and ispec.has_tensor_scale:
        name, enc = (
            (row.input_global_scale, row.input_global_encode)
            if ispec.has_global_scale
            else ("input_scale", False)
        )
        in_scale = _scale(store, f"{mod}.{name}", why + " with static input scales", encode=enc)
    return q, in_scale


def _read_params(store, cfg, layout: str, layers, static, dt) -> tuple[dict, dict]:
    """Every parameter of ``cfg`` from ``store`` (float ones as ``dt``, quantized kernels
    as packed QArrays) and the static input scales of the quantized linears."""
    shapes = param_shapes(cfg)
    params: dict[str, Any] = {}
    input_scales: dict[str, np.float32] = {}
    for pname, shape in shapes.items():
        if pname.endswith(".kernel") and pname != "lm_head.kernel":
            continue
        hf = hf_param_name(pname, cfg.family)
        hshape = shape[::-1] if pname == "lm_head.kernel" else shape
        arr = _expect(store, hf, _FLOAT_DTYPES, (hshape,), "unquantized")
        params[pname] = np.asarray(arr, dt).T if pname == "lm_head.kernel" else np.asarray(arr, dt)
    for p in linear_paths(cfg):
        mod, lq = hf_module(p), layers[p]
        kn = shapes[f"{p}.kernel"]
        if not lq.quantized:
            arr = _expect(
                store, f"{mod}.weight", _FLOAT_DTYPES, (kn[::-1],), f"{mod} is unquantized"
            )
            params[f"{p}.kernel"] = np.asarray(arr, dt).T
            continue
        q, s = _read_linear(store, layout, mod, lq, static[p], kn)
        params[f"{p}.kernel"] = q
        if s is not None:
            input_scales[p] = s
    return params, input_scales


def read_checkpoint(
    path: str | os.PathLike, *, dequantize: bool = False, param_dtype: str = "float32"
) -> Checkpoint:
    """Read an HF-style folder of a supported family (plain, compressed-tensors or ModelOpt).

    ``dequantize``: decode quantized kernels to float (else they stay packed QArrays).
    ``param_dtype``: dtype of the float parameters (and of ``config.param_dtype``).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
    cfg_json = load_json(path / "config.json")
    try:
        cfg = model_config_from_hf(cfg_json, param_dtype=param_dtype)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    method = quant_method(cfg_json, path)
    if method is not None and method not in HF_QUANT:
        raise CheckpointError(
            f"quantization_config.quant_method={method!r}: expected "
            + " or ".join(repr(m) for m in HF_QUANT)
        )
    try:
        # a multimodal checkpoint: its text model (the vision tower stays out)
        store = TensorStore(path, prefix=text_model_prefix(cfg_json))
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    _check_sizes(path, cfg, store)  # before anything of config.json's size is built
    cfg = _own_head(path, cfg, store)
    if method is None:
        layout = "hf"
        layers = {p: L.LayerQuant() for p in linear_paths(cfg)}
        static = dict.fromkeys(layers, False)
    else:
        layout = method
        try:
            layers, static = HF_QUANT[method].parse(path, cfg_json, cfg)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None

    dt = np.dtype(jnp.dtype(param_dtype))
    params, input_scales = _read_params(store, cfg, layout, layers, static, dt)
    for name in store.names():
        if name not in store.accessed and not _HARMLESS.fullmatch(name):
            raise CheckpointError(
                f"tensor {name!r} is not expected in this checkpoint "
                f"({layout} layout; config and tensors disagree)"
            )
    ck = Checkpoint(
        path=path,
        layout=layout,
        config=cfg,
        params=params,
        layers=layers,
        input_scales=input_scales,
        hf_config=cfg_json,
        tokenizer_file=(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else None,
    )
    if dequantize:
        ck = dataclasses.replace(ck, params=ck.dequantized_params(dt))
    return ck


def import_model(
    path: str | Path, *, param_dtype: str = "float32"
) -> tuple[Transformer, ModelConfig]:
    """``(Transformer, ModelConfig)`` from an HF-style folder; quantized weights are
    dequantized into the float kernels (keep them packed with :func:`read_checkpoint`)."""
    ck = read_checkpoint(path, param_dtype=param_dtype)
    return ck.to_model(), ck.config
