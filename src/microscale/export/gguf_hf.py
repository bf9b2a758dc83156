"""A llama.cpp Llama GGUF file -> an HF Llama folder (the inverse of ``write_gguf``'s layout).

``gguf_to_hf(GGUF, OUT)`` writes ``config.json`` (``LlamaForCausalLM`` from the GGUF
metadata), ``model.safetensors`` (float32, every tensor decoded with ``gguf.quants``), and
the tokenizer: ``tokenizer.json`` rebuilt from the GGUF vocabulary and merges (byte-level
BPE, ggml ``gpt2`` model) with the pre-tokenizer its ``tokenizer.ggml.pre`` names,
``tokenizer_config.json`` with the bos / eos / pad / unk tokens and the chat template.
``microscale import OUT`` then reads it as any HF folder.

llama.cpp's Llama graph applies RoPE to adjacent pairs; HF to halves, so
``convert_hf_to_gguf.py`` permutes the rows of q/k per head (heads of q: ``n_heads``, of
k: ``n_kv_heads``) to ``0, hd/2, 1, hd/2 + 1, ...`` (microscale's GGUF writer does the same,
:func:`~microscale.export.gguf.write_gguf`); here the rows go back.

The decoded weights are what llama.cpp computes with: a quantized GGUF (e.g. Q4_1) gives a
float model whose weights lie on that format's grid, a fine reference for comparing
quantizers against each other but not the original training-precision model.

Supported: ``general.architecture == "llama"`` with the ``gpt2`` (byte-level BPE)
tokenizer and a pre-tokenizer among ``gpt-2`` / ``smollm`` / ``llama-bpe`` (what
:mod:`~microscale.export.gguf` writes); anything else is refused, naming the key. RoPE
scaling (linear, yarn, llama3's ``rope_freqs.weight``) is read back by
:func:`~microscale.export.gguf_rope.read_gguf_rope` into ``config.json``'s RoPE keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from microscale.export.gguf import (
    _LINEAR_NAMES,
    _LLAMA3_SPLIT,
    _OTHER_NAMES,
    _ROPE_PERMUTED,
    _gguf,
    _rope_rows,
)
from microscale.export.gguf_rope import read_gguf_rope
from microscale.export.hf import hf_config, hf_module, hf_param_name, ms_param_name
from microscale.files import atomic_write_bytes
from microscale.model import ModelConfig

__all__ = ["gguf_model_config", "gguf_to_hf", "read_gguf_params"]

# GGUF token_type values (gguf.TokenType): CONTROL tokens are HF special tokens.
_CONTROL = 3


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return f.contents()


def gguf_model_config(reader: Any) -> ModelConfig:
    """The ``ModelConfig`` of a Llama GGUF (a ``gguf.GGUFReader``) from its metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture={arch!r}: expected 'llama'")
    a = "llama."
    n_vocab = _field(reader, a + "vocab_size", None)
    if n_vocab is None:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    d = int(_field(reader, a + "embedding_length"))
    n_heads = int(_field(reader, a + "attention.head_count"))
    rot = _field(reader, a + "rope.dimension_count", d // n_heads)
    if rot != d // n_heads:
        raise ValueError(
            f"GGUF {a}rope.dimension_count={rot}: partial RoPE is not supported "
            f"(expected head_dim {d // n_heads})"
        )
    cfg = ModelConfig(
        vocab_size=int(n_vocab),
        d_model=d,
        n_layers=int(_field(reader, a + "block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, a + "attention.head_count_kv", n_heads)),
        d_ff=int(_field(reader, a + "feed_forward_length")),
        max_seq_len=int(_field(reader, a + "context_length")),
        rope_theta=float(_field(reader, a + "rope.freq_base", 10000.0)),
        norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in {t.name for t in reader.tensors},
        dim_multiple=16,
    )
    rope = read_gguf_rope(reader, lambda key, default=...: _field(reader, key, default), cfg)
    return cfg if rope is None else cfg.replace(rope_scaling=rope)


def _decoded(reader: Any) -> dict[str, np.ndarray]:
    """Every tensor decoded to float32 in numpy (row-major, GGUF ``ne`` reversed)."""
    gguf = _gguf()
    out = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        vals = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = np.asarray(vals, np.float32).reshape(shape)
    return out


def _hf_tensors(reader: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    src = _decoded(reader)
    hd = cfg.head_dim
    out = {
        hf_param_name("embed.embedding"): src["token_embd.weight"],
        hf_param_name("final_norm.scale"): src["output_norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = src["output.weight"]
    for i in range(cfg.n_layers):
        for sub, gname in _OTHER_NAMES.items():
            out[hf_param_name(f"layers.{i}.{sub}")] = src[f"blk.{i}.{gname}"]
        for kind, gname in _LINEAR_NAMES.items():
            w = src[f"blk.{i}.{gname}.weight"]
            if kind in _ROPE_PERMUTED:
                back = np.empty_like(w)
                back[_rope_rows(w.shape[0], hd)] = w  # the writer's rows, undone
                w = back
            out[hf_module(f"layers.{i}.{kind}") + ".weight"] = w
    return out


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt-2", "default"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(
        f"GGUF tokenizer.ggml.pre={pre!r}: expected 'gpt-2', 'smollm' or "
        "'llama-bpe' (the byte-level pre-tokenizers microscale implements)"
    )


def _tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config.json dict)`` from the GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model={model!r}: expected 'gpt2' (byte-level BPE)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "gpt-2"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL
        ]
    )
    conf: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(_field(reader, "llama.context_length")),
    }
    for name in ("bos", "eos", "unk", "pad"):
        tid = _field(reader, f"tokenizer.ggml.{name}_token_id", None)
        if tid is not None:
            conf[f"{name}_token"] = tokens[int(tid)]
    template = _field(reader, "tokenizer.chat_template", None)
    if template is not None:
        conf["chat_template"] = template
    return tok, conf


def read_gguf_params(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], ModelConfig]:
    """``({parameter path: float32 array}, ModelConfig)`` of the GGUF file ``path``: every
    tensor decoded to float32, kernels ``[in, out]`` (RoPE rows in microscale's order)."""
    reader = _gguf().GGUFReader(Path(path))
    cfg = gguf_model_config(reader)
    flat = {}
    for name, arr in _hf_tensors(reader, cfg).items():
        p = ms_param_name(name)
        flat[p] = np.ascontiguousarray(arr.T) if p.endswith(".kernel") else arr
    return flat, cfg


def gguf_to_hf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the HF Llama folder of the GGUF file ``path`` into ``out_dir`` (created; an
    existing non-empty folder is refused). Returns ``out_dir``."""
    from safetensors.numpy import save

    gguf = _gguf()
    path, out = Path(path), Path(out_dir)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {str(out)!r} exists and is not an empty folder")
    reader = gguf.GGUFReader(path)
    cfg = gguf_model_config(reader)
    tok, tok_conf = _tokenizer(reader)
    tensors = _hf_tensors(reader, cfg)
    ids = {k: _field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("bos", "eos")}
    config = hf_config(cfg, dtype="float32", eos_token_id=ids["eos"], bos_token_id=ids["bos"])
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_conf, indent=2) + "\n")
    return out
