"""A llama.cpp GGUF file -> an HF folder of its family (the inverse of ``write_gguf``'s layout).

``gguf_to_hf(GGUF, OUT)`` writes ``config.json`` (the family's, from the GGUF metadata:
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or
``Gemma3ForCausalLM``),
``model.safetensors`` (float32, every tensor decoded with ``gguf.quants``; a weight with a
``<name>.scale`` tensor, NVFP4's FP32 tensor scale, times it, as llama.cpp multiplies it
onto the matmul), and the tokenizer: ``tokenizer.json`` rebuilt from the GGUF vocabulary
and merges (byte-level BPE, ggml ``gpt2`` model) with the pre-tokenizer its
``tokenizer.ggml.pre`` names, ``tokenizer_config.json`` with the bos / eos / pad / unk
tokens and the chat template. ``microscale import OUT`` then reads it as any HF folder.

The family: ``microscale.family`` when the file has it (microscale's writer records it;
it must be a family of the file's architecture), else the one of
``general.architecture``: ``llama`` -> Llama (llama.cpp's converter writes Mistral as
llama too), ``qwen2`` -> Qwen2 (``blk.N.attn_{q,k,v}.bias``), ``qwen3`` -> Qwen3
(``blk.N.attn_{q,k}_norm.weight``), ``gemma3`` -> Gemma 3 (its four norms per block).
``{arch}.attention.key_length`` sets ``head_dim`` when it is not ``embedding_length /
head_count``. Norm weights are stored as the factor the norm multiplies by: Gemma 3's
offset of 1 is taken off again (``w = stored - 1``, exact in float32 for stored factors in
[0.5, 2], so ``1 + w`` gives the stored factor back).

``gemma3``'s layers are read as llama.cpp runs them: ``{arch}.attention.sliding_window``
(none when absent or as long as the context), one global layer in
``{arch}.attention.sliding_window_pattern`` (default 6), local RoPE base
``{arch}.rope.freq_base_swa`` (default 10000), ``query_pre_attn_scalar`` ``head_dim``
(``d_model // n_heads`` at 62 layers, llama.cpp's 27B); a final logit softcapping is
refused (microscale's block has none).

llama.cpp's ``llama`` graph applies RoPE to adjacent pairs; HF to halves, so
``convert_hf_to_gguf.py`` permutes the rows of q/k (and of their biases) per head (heads of
q: ``n_heads``, of k: ``n_kv_heads``) to ``0, hd/2, 1, hd/2 + 1, ...`` (microscale's GGUF
writer does the same, :func:`~microscale.export.gguf.write_gguf`); here the rows go back.
``qwen2`` / ``qwen3`` rotate halves, as HF: their rows are read as they are.

The decoded weights are what llama.cpp computes with: a quantized GGUF (e.g. Q4_1) gives a
float model whose weights lie on that format's grid, a fine reference for comparing
quantizers against each other but not the original training-precision model.

Supported: ``general.architecture`` ``llama``, ``qwen2``, ``qwen3`` or ``gemma3`` with the ``gpt2``
(byte-level BPE) tokenizer and a pre-tokenizer among ``gpt-2`` / ``smollm`` / ``llama-bpe``
(what :mod:`~microscale.export.gguf` writes); anything else is refused, naming the key, as
is a tensor the family's model has no place for. RoPE scaling (linear, yarn, llama3's
``rope_freqs.weight``) is read back by :func:`~microscale.export.gguf_rope.read_gguf_rope`
into ``config.json``'s RoPE keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from microscale.export.gguf import (
    _ARCHS,
    _LLAMA3_SPLIT,
    MS_FAMILY_KEY,
    _Arch,
    _gguf,
    _is_norm,
    _param_tensor,
    _stored_rows,
)
from microscale.export.gguf_rope import ROPE_FREQS, read_gguf_rope
from microscale.export.hf import hf_config, hf_param_name, ms_param_name
from microscale.files import atomic_write_bytes
from microscale.model import FAMILIES, ModelConfig, param_shapes

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


def _file_arch(reader: Any) -> _Arch:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF general.architecture={arch!r}: expected one of {sorted(_ARCHS)}")
    return _ARCHS[arch]


def _family(reader: Any, arch: _Arch) -> str:
    """The file's family: microscale's record (a family of ``arch``), else ``arch``'s."""
    fam = _field(reader, MS_FAMILY_KEY, arch.family)
    if fam not in FAMILIES or FAMILIES[fam].gguf_arch != arch.name:
        known = sorted(f.name for f in FAMILIES.values() if f.gguf_arch == arch.name)
        raise ValueError(
            f"GGUF {MS_FAMILY_KEY}={fam!r}: not a family of general.architecture="
            f"{arch.name!r} (expected one of {known})"
        )
    return fam


def gguf_model_config(reader: Any) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF (a ``gguf.GGUFReader``) from its metadata: the family
    (the module doc), the shape, RoPE."""
    arch = _file_arch(reader)
    a = arch.name + "."
    n_vocab = _field(reader, a + "vocab_size", None)
    if n_vocab is None:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    d = int(_field(reader, a + "embedding_length"))
    n_heads = int(_field(reader, a + "attention.head_count"))
    hd = int(_field(reader, a + "attention.key_length", d // n_heads))
    value = int(_field(reader, a + "attention.value_length", hd))
    if value != hd:
        raise ValueError(
            f"GGUF {a}attention.value_length={value}: microscale's heads have one width "
            f"(key_length {hd})"
        )
    rot = _field(reader, a + "rope.dimension_count", hd)
    if rot != hd:
        raise ValueError(
            f"GGUF {a}rope.dimension_count={rot}: partial RoPE is not supported "
            f"(expected head_dim {hd})"
        )
    names = {t.name for t in reader.tensors}
    if ROPE_FREQS in names and not arch.rope_freqs:
        raise ValueError(f"GGUF {ROPE_FREQS}: llama.cpp's {arch.name} graph does not read it")
    cfg = ModelConfig(
        **_layer_kinds(reader, arch, n_heads, d),
        family=_family(reader, arch),
        vocab_size=int(n_vocab),
        d_model=d,
        n_layers=int(_field(reader, a + "block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, a + "attention.head_count_kv", n_heads)),
        d_ff=int(_field(reader, a + "feed_forward_length")),
        attn_head_dim=None if n_heads * hd == d else hd,
        max_seq_len=int(_field(reader, a + "context_length")),
        rope_theta=float(_field(reader, a + "rope.freq_base", 10000.0)),
        norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        dim_multiple=16,
    )
    rope = read_gguf_rope(reader, lambda key, default=...: _field(reader, key, default), cfg)
    return cfg if rope is None else cfg.replace(rope_scaling=rope)


def _layer_kinds(reader: Any, arch: _Arch, n_heads: int, d: int) -> dict[str, Any]:
    """The local/global layer fields of a ``ModelConfig`` for a file of ``arch`` (what its
    graph reads; none for an architecture without local layers)."""
    if not arch.swa_pattern:
        return {}
    a = arch.name + "."
    cap = _field(reader, a + "final_logit_softcapping", None)
    if cap:
        raise ValueError(
            f"GGUF {a}final_logit_softcapping={cap}: microscale's {arch.family} model has no "
            "logit softcapping"
        )
    n_layers = int(_field(reader, a + "block_count"))
    window = _field(reader, a + "attention.sliding_window", None)
    context = int(_field(reader, a + "context_length"))
    pattern = _field(reader, a + "attention.sliding_window_pattern", arch.swa_pattern)
    if not isinstance(pattern, int):
        raise ValueError(
            f"GGUF {a}attention.sliding_window_pattern={pattern!r}: microscale reads one "
            "period (an int), not a per-layer list"
        )
    local = window is not None and int(window) > 0
    wide = n_layers == arch.wide_scale_layers
    return {
        "sliding_window": int(window) if local and int(window) < context else None,
        "sliding_window_pattern": pattern if local else 0,
        "rope_local_theta": (
            float(_field(reader, a + "rope.freq_base_swa", arch.swa_theta)) if local else None
        ),
        "query_pre_attn_scalar": float(d // n_heads) if wide else None,
    }


def _decoded(reader: Any) -> dict[str, np.ndarray]:
    """Every tensor decoded to float32 in numpy (row-major, GGUF ``ne`` reversed); a
    ``<name>.scale`` tensor is multiplied onto ``<name>.weight`` (exact: float32 products,
    as ggml's) and dropped."""
    gguf = _gguf()
    out = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        vals = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = np.asarray(vals, np.float32).reshape(shape)
    for name in [n for n in out if n.endswith(".scale")]:
        weight = name[: -len(".scale")] + ".weight"
        if weight in out:
            out[weight] = out[weight] * out.pop(name).reshape(())
    return out


def _hf_tensors(reader: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """{HF tensor name: float32 array} of every parameter of ``cfg``'s model (weights in HF
    ``[out, in]`` orientation, q/k rows back in HF's order); a tensor of the file that none
    of them reads is refused, naming it."""
    arch = _ARCHS[cfg.arch.gguf_arch]
    src = _decoded(reader)
    src.pop(ROPE_FREQS, None)  # read by gguf_model_config (read_gguf_rope)
    out = {}
    for p in param_shapes(cfg):
        name = _param_tensor(p)
        if name not in src:
            raise ValueError(f"GGUF tensor {name!r} is missing (a {cfg.family} model has it)")
        w = src.pop(name)
        rows = _stored_rows(arch, p, w.shape[0], cfg.head_dim)
        if rows is not None:
            back = np.empty_like(w)
            back[rows] = w  # the writer's rows, undone
            w = back
        if _is_norm(p) and cfg.arch.norm_offset:  # the writer's (converter's) + 1, undone
            w = (w - np.float32(cfg.arch.norm_offset)).astype(np.float32)
        out[hf_param_name(p, cfg.family)] = w
    if src:
        raise ValueError(
            f"GGUF tensor {sorted(src)[0]!r}: microscale's {cfg.family} model has no "
            f"such parameter (general.architecture={arch.name!r})"
        )
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


def _tokenizer(reader: Any, context: int) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config.json dict)`` from the GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model={model!r}: expected 'gpt2' (byte-level BPE)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    # A merge of symbols that are not tokens never fires (every symbol BPE holds is a token):
    # dropped, as ``tokenizers`` refuses it (microscale's byte vocabulary has one such merge).
    pairs = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    merges = [pair for pair in pairs if all(part in vocab for part in pair)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
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
        "model_max_length": context,
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
        p = ms_param_name(name, cfg.family)
        flat[p] = np.ascontiguousarray(arr.T) if p.endswith(".kernel") else arr
    return flat, cfg


def gguf_to_hf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the HF folder of the GGUF file ``path`` into ``out_dir`` (created; an
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
    tok, tok_conf = _tokenizer(reader, cfg.max_seq_len)
    tensors = _hf_tensors(reader, cfg)
    ids = {k: _field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("bos", "eos")}
    config = hf_config(cfg, dtype="float32", eos_token_id=ids["eos"], bos_token_id=ids["bos"])
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_conf, indent=2) + "\n")
    return out
