"""GGUF vocabulary, both ways: an HF tokenizer as llama.cpp's ``gpt2`` vocabulary (export),
and a GGUF vocabulary back as an HF ``tokenizer.json`` + ``tokenizer_config.json``.

Export: byte-level BPE in ggml's ``gpt2`` vocabulary (token text = GPT-2's
byte-to-unicode characters). microscale's byte tokenizer has no merges; llama.cpp's
``gpt2`` vocabulary needs a merge list, so it gets one merge of two multi-character
symbols that no merge creates, which therefore never fires, and every byte stays its
own token (id = byte value, ``<|eos|>`` = 256). A trained or imported BPE keeps its vocab
and merges; its pre-tokenizer must be one llama.cpp implements (GPT-2's ByteLevel regex ->
``gpt-2``, digits split then GPT-2's regex -> ``smollm``, Llama 3's split regex ->
``llama-bpe``, Qwen2's -> ``qwen2``, with its NFC normalizer, which llama.cpp does not
apply: text in NFC tokenizes the same, other text may not); anything else is refused,
naming it, before any weight is read. Given a ``tokenizer.json`` path, the
``tokenizer_config.json`` beside it supplies the bos / eos / pad ids, ``add_bos_token`` and
the chat template (:func:`gguf_vocab`), so an Instruct model stops at its own end-of-turn
token in llama.cpp. :func:`add_vocab` writes a :class:`GGUFVocab` into a ``GGUFWriter``.

Back (:func:`hf_tokenizer`): ``tokenizer.json`` rebuilt from the GGUF vocabulary and
merges (byte-level BPE, ggml ``gpt2`` model) with the pre-tokenizer its
``tokenizer.ggml.pre`` names (``gpt-2`` / ``default``, ``smollm``, ``llama-bpe``), and the
``tokenizer_config.json`` with the bos / eos / pad / unk tokens and the chat template.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from microscale.data import check_vocab_fits
from microscale.export.gguffile import GGUFContents, gguf_package
from microscale.export.tokenizer import byte_tokenizer_hf

__all__ = ["LLAMA3_SPLIT", "QWEN2_SPLIT", "GGUFVocab", "add_vocab", "gguf_vocab", "hf_tokenizer"]

# Pre-tokenizer regexes llama.cpp implements (src/llama-vocab.cpp) -> tokenizer.ggml.pre.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (Qwen2.5, Qwen3): Llama 3's with single digits -> "qwen2".
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}
# The one normalizer a pre-tokenizer's tokenizers carry: Qwen2's NFC. llama.cpp applies
# none, so text already in NFC (what most text is) tokenizes the same, other text not.
_NORMALIZERS = {"qwen2": ({"type": "NFC"},)}
# A merge that never fires: no merge creates either multi-character symbol.
_NOOP_MERGE = "\u0120\u0120 \u0120\u0120"


def _tokenizer_json(tokenizer) -> tuple[dict, int, Path | None]:
    """``(tokenizer.json as a dict, its end-of-document id, its file or None)``."""
    from microscale.data import BPETokenizer, ByteTokenizer, load_tokenizer

    file = None
    if isinstance(tokenizer, (str, os.PathLike)):
        file = Path(tokenizer)
        tokenizer = load_tokenizer(file)
    if isinstance(tokenizer, ByteTokenizer):
        return json.loads(byte_tokenizer_hf().to_str()), tokenizer.eos_id, file
    if isinstance(tokenizer, BPETokenizer):
        return json.loads(tokenizer.hf.to_str()), tokenizer.eos_id, file
    raise TypeError(
        f"tokenizer {tokenizer!r}: expected a microscale ByteTokenizer / "
        "BPETokenizer or a tokenizer file path"
    )


def _is_bytelevel(p: Any, regex: bool) -> bool:
    return (
        isinstance(p, dict)
        and p.get("type") == "ByteLevel"
        and bool(p.get("use_regex", True)) == regex
        and not p.get("add_prefix_space", False)
    )


def _ggml_pre(pre: Any, has_merges: bool) -> str:
    """tokenizer.ggml.pre for an HF byte-level pre-tokenizer (refuses unknown ones):
    GPT-2's ByteLevel regex -> ``gpt-2``; each digit split off, then GPT-2's regex
    (SmolLM) -> ``smollm``; Llama 3's split regex, then ByteLevel -> ``llama-bpe``; Qwen2's
    (Llama 3's with single digits) -> ``qwen2``."""
    if not has_merges and (_is_bytelevel(pre, False) or _is_bytelevel(pre, True)):
        return "default"  # every byte is its own token: how text is split cannot matter
    if _is_bytelevel(pre, True):
        return "gpt-2"
    seq = (
        (pre.get("pretokenizers") or [])
        if isinstance(pre, dict) and pre.get("type") == "Sequence"
        else []
    )
    if len(seq) == 2 and isinstance(seq[0], dict):
        first = seq[0]
        if (
            first.get("type") == "Digits"
            and first.get("individual_digits") is True
            and _is_bytelevel(seq[1], True)
        ):
            return "smollm"
        regex = (first.get("pattern") or {}).get("Regex")
        if (
            first.get("type") == "Split"
            and _is_bytelevel(seq[1], False)
            and regex in _SPLITS
            and first.get("behavior", "Isolated") == "Isolated"
            and not first.get("invert", False)
        ):
            return _SPLITS[regex]
    raise ValueError(
        f"tokenizer pre-tokenizer {json.dumps(pre)[:300]} is not one llama.cpp "
        "implements the same way; GGUF export knows GPT-2's ByteLevel regex "
        "(gpt-2), digits split then GPT-2's regex (smollm), Llama 3's split "
        "regex (llama-bpe) and Qwen2's (qwen2)"
    )


def _token_text(v: Any, key: str, where: Path | None) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken object."""
    if v is None:
        return None
    if isinstance(v, dict):
        v = v.get("content")
    if not isinstance(v, str):
        raise ValueError(f"{where}: {key}={v!r}: expected a token string")
    return v


def _chat_template(cfg: dict, folder: Path, where: Path | None) -> str | None:
    """The default chat template: tokenizer_config.json's ``chat_template`` (a string, or
    a list of named templates: "default"), else ``chat_template.jinja`` beside it."""
    t = cfg.get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    if t is not None and not isinstance(t, str):
        raise ValueError(
            f"{where}: chat_template: expected a string or a list of "
            "{name, template} with a 'default'"
        )
    if t is None and (folder / "chat_template.jinja").is_file():
        t = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return t


def _template_start(proc: Any) -> str | None:
    """The special token a ``TemplateProcessing`` post-processor (alone or in a
    ``Sequence``) puts before a single sequence (Llama 3's ``<|begin_of_text|>``), or None."""
    if not isinstance(proc, dict):
        return None
    if proc.get("type") == "Sequence":
        return next((t for p in proc.get("processors") or [] if (t := _template_start(p))), None)
    single = proc.get("single") if proc.get("type") == "TemplateProcessing" else None
    if not single or not isinstance(single[0], dict):
        return None
    return (single[0].get("SpecialToken") or {}).get("id")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GGUFVocab:
    """A tokenizer as llama.cpp's ``gpt2`` vocabulary (see :func:`gguf_vocab`)."""

    # {token text: id} of the model vocabulary and the added tokens.
    vocab: dict[str, int]
    # {id: special (control) or not (user-defined)} of the added tokens.
    added: dict[int, bool]
    # BPE merges ("a b"), in rank order.
    merges: list[str]
    # tokenizer.ggml.pre.
    pre: str
    # Special token ids: bos (eos when the tokenizer names none), eos, pad (or None).
    bos_id: int
    eos_id: int
    pad_id: int | None
    # Whether llama.cpp prepends bos when it tokenizes a prompt.
    add_bos: bool
    # tokenizer.chat_template, or None.
    chat_template: str | None

    @property
    def n_ids(self) -> int:
        return max(self.vocab.values()) + 1


def gguf_vocab(tokenizer: Any) -> GGUFVocab:
    """What a GGUF file stores of ``tokenizer`` (a microscale tokenizer or a
    ``tokenizer.json`` path), checked before any weight is touched: byte-level BPE with a
    pre-tokenizer llama.cpp implements (others are refused, naming it). With a path, the
    special tokens (``bos_token``, ``eos_token``, ``pad_token``), ``add_bos_token`` and
    ``chat_template`` come from ``tokenizer_config.json`` beside it (and
    ``chat_template.jinja``) when present; ``add_bos_token`` absent, bos is added when the
    tokenizer's post-processor template starts with it."""
    tj, eos, file = _tokenizer_json(tokenizer)
    model = tj.get("model") or {}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    pre = _ggml_pre(tj.get("pre_tokenizer"), bool(merges))
    norm = tj.get("normalizer")
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or (norm and norm not in _NORMALIZERS.get(pre, ()))
    ):
        raise ValueError(
            "tokenizer: GGUF export supports byte-level BPE tokenizers (model "
            f"type {model.get('type')!r}, byte_fallback "
            f"{model.get('byte_fallback')!r}, normalizer "
            f"{(norm or {}).get('type')!r}); expected BPE, no "
            "byte fallback, no normalizer (NFC with Qwen2's pre-tokenizer)"
        )
    if (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(
            f"tokenizer decoder {(tj.get('decoder') or {}).get('type')!r}: expected ByteLevel"
        )
    vocab = dict(model.get("vocab") or {})
    added = {}
    for t in tj.get("added_tokens") or []:
        vocab[t["content"]] = int(t["id"])
        added[int(t["id"])] = bool(t.get("special"))
    cfg: dict = {}
    folder = where = None
    if file is not None:
        folder, where = file.parent, file.parent / "tokenizer_config.json"
        if where.is_file():
            from microscale.files import read_json

            cfg = read_json(where, what="tokenizer config")
            if not isinstance(cfg, dict):
                raise ValueError(f"{where}: expected a JSON object")

    def token_id(key: str) -> int | None:
        text = _token_text(cfg.get(key), key, where)
        if text is None:
            return None
        if text not in vocab:
            raise ValueError(f"{where}: {key}={text!r} is not a token of {file}")
        return vocab[text]

    eos_id = token_id("eos_token")
    eos_id = eos if eos_id is None else eos_id
    bos_id = token_id("bos_token")
    add_bos = cfg.get("add_bos_token")
    if not isinstance(add_bos, bool):
        first = _template_start(tj.get("post_processor"))
        add_bos = first in vocab and (bos_id is None or vocab[first] == bos_id)
        if add_bos and bos_id is None:
            bos_id = vocab[first]
    return GGUFVocab(
        vocab=vocab,
        added=added,
        merges=merges,
        pre=pre,
        bos_id=eos_id if bos_id is None else bos_id,
        eos_id=eos_id,
        pad_id=token_id("pad_token"),
        add_bos=add_bos,
        chat_template=_chat_template(cfg, folder, where) if folder else None,
    )


def add_vocab(w: Any, voc: GGUFVocab, vocab_size: int) -> dict[str, Any]:
    """Writes ``voc`` into the ``gguf.GGUFWriter`` ``w`` as llama.cpp's ``gpt2`` vocabulary of
    ``vocab_size`` ids (unused ids as ``[PADi]``); returns the report's tokenizer entry."""
    gguf = gguf_package("GGUF export")
    check_vocab_fits(voc.n_ids, vocab_size)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in voc.vocab.items():
        tokens[i] = text
        types[i] = (
            gguf.TokenType.NORMAL
            if i not in voc.added
            else (gguf.TokenType.CONTROL if voc.added[i] else gguf.TokenType.USER_DEFINED)
        )
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(voc.pre)
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(voc.merges or [_NOOP_MERGE])
    w.add_eos_token_id(voc.eos_id)
    # always written: llama.cpp's gpt2 default bos (11) would be wrong
    w.add_bos_token_id(voc.bos_id)
    if voc.pad_id is not None:
        w.add_pad_token_id(voc.pad_id)
    w.add_add_bos_token(voc.add_bos)
    w.add_add_eos_token(False)
    if voc.chat_template is not None:
        w.add_chat_template(voc.chat_template)
    return {
        "model": "gpt2",
        "pre": voc.pre,
        "tokens": voc.n_ids,
        "merges": len(voc.merges),
        "bos_id": voc.bos_id,
        "eos_id": voc.eos_id,
        "pad_id": voc.pad_id,
        "add_bos": voc.add_bos,
        "chat_template": voc.chat_template is not None,
    }


# ---------------------------------------------------------------------- GGUF -> HF

# GGUF token_type values (gguf.TokenType): CONTROL tokens are HF special tokens.
_CONTROL = 3


def _hf_pre_tokenizer(pre: str) -> Any:
    """The HF pre-tokenizer of a GGUF's ``tokenizer.ggml.pre``."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt-2", "default"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(
        f"GGUF tokenizer.ggml.pre={pre!r}: expected 'gpt-2', 'smollm' or "
        "'llama-bpe' (the byte-level pre-tokenizers microscale implements)"
    )


def hf_tokenizer(file: GGUFContents, context: int) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config.json dict)`` from the GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = file.value("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model={model!r}: expected 'gpt2' (byte-level BPE)")
    tokens = list(file.value("tokenizer.ggml.tokens"))
    types = list(file.value("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    # A merge of symbols that are not tokens never fires (every symbol BPE holds is a token):
    # dropped, as ``tokenizers`` refuses it (microscale's byte vocabulary has one such merge).
    pairs = [tuple(m.split(" ", 1)) for m in file.value("tokenizer.ggml.merges")]
    merges = [pair for pair in pairs if all(part in vocab for part in pair)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = _hf_pre_tokenizer(file.value("tokenizer.ggml.pre", "gpt-2"))
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
        "add_bos_token": bool(file.value("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": context,
    }
    for name in ("bos", "eos", "unk", "pad"):
        tid = file.value(f"tokenizer.ggml.{name}_token_id", None)
        if tid is not None:
            conf[f"{name}_token"] = tokens[int(tid)]
    template = file.value("tokenizer.chat_template", None)
    if template is not None:
        conf["chat_template"] = template
    return tok, conf
