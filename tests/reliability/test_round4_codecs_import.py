"""Bad input, round 4 (issue 58): ggml's codecs and HF config import, one table per class.

Each row is one bad input and the one clear line (a regex) it must raise: every public
ggml codec (``formats.ggml``) refuses non-finite values, bad importance weights and byte
counts that are not whole blocks by name; HF config.json values are refused naming the
config.json key (never microscale's internal field) and the folder.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from family_configs import CONFIGS
from microscale.cli import main
from microscale.data import ByteTokenizer
from microscale.export import CheckpointError, export_checkpoint, import_model, read_checkpoint
from microscale.export.hf import _HF_KEYS, hf_config
from microscale.export.reader import hf_head_config
from microscale.formats.ggml import dequantize_ggml, libggml_quantize, quantize_ggml
from microscale.formats.spec import GGML_FORMATS, get_ggml_format
from microscale.model import ModelConfig, Transformer
from microscale.ptq.sequential import folder_source
from microscale.train import load_checkpoint
from microscale.train.init import source_model

TYPES = list(GGML_FORMATS)


def _row(fmt: str, rows: int = 2) -> np.ndarray:
    n = get_ggml_format(fmt).super_block or get_ggml_format(fmt).block_size
    assert n is not None
    return np.random.default_rng(0).standard_normal((rows, 2 * n)).astype(np.float32)


# ---------------------------------------------------------------- ggml: values

# (id, where the bad value goes in a [2, 2 blocks] table, the value, the message)
BAD_VALUES = [
    ("nan", (1, 5), np.nan, r"x of shape \(2, \d+\) holds 1 non-finite value\(s\) in float32, the first "
     r"x\[1, 5\] = nan"),
    ("inf", (0, 0), np.inf, r"the first x\[0, 0\] = inf"),
    ("-inf", (1, 33), -np.inf, r"the first x\[1, 33\] = -inf"),
    ("float64-overflow", (0, 2), 1e300, r"x\[0, 2\] = 1e\+300 \(past float32's range\)"),
]  # fmt: skip


@pytest.mark.parametrize("fmt", TYPES)
@pytest.mark.parametrize(("case", "at", "value", "msg"), BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_quantize_ggml_refuses_non_finite(fmt, case, at, value, msg):
    # One NaN in a block made Q4_0 and IQ4_NL write an all-zero block without a word.
    x = _row(fmt).astype(np.float64)
    x[at] = value
    with pytest.raises(ValueError, match=rf"^quantize_ggml\({fmt}\): .*" + msg):
        quantize_ggml(x, fmt)


def test_libggml_quantize_checks_like_quantize_ggml():
    # The reference encoder refuses the same inputs before it needs the library.
    x = _row("q4_0")
    x[0, 3] = np.nan
    with pytest.raises(ValueError, match=r"^libggml_quantize\(q4_0\): .* x\[0, 3\] = nan"):
        libggml_quantize(x, "q4_0", lib="/nonexistent/libggml-base.so")
    with pytest.raises(ValueError, match=r"imatrix\[1\] = -1.0 \(negative\)"):
        libggml_quantize(_row("q4_0"), "q4_0", np.r_[1.0, -1.0, np.ones(62)], lib="/nonexistent")


# (id, x, fmt, the message)
BAD_SHAPES = [
    ("scalar", np.float32(1.0), "q4_0", r"x needs at least one dimension, got a scalar"),
    ("empty-rows", np.zeros((2, 0), np.float32), "q4_0", r"a row of 0 is not a multiple of 32"),
    ("partial-block", np.zeros((2, 40), np.float32), "q4_0", r"a row of 40 is not a multiple of 32"),
    ("partial-super-block", np.zeros((1, 288), np.float32), "q4_k",
     r"a row of 288 is not a multiple of 256"),
    ("strings", np.array([["a"] * 32]), "q8_0", r"x of dtype <U1 .*: expected real numbers"),
    ("complex", np.ones((1, 32), np.complex64), "q8_0", r"dtype complex64 .*expected real numbers"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "x", "fmt", "msg"), BAD_SHAPES, ids=[c[0] for c in BAD_SHAPES])
def test_quantize_ggml_refuses_bad_shapes(case, x, fmt, msg):
    with pytest.raises(ValueError, match=msg):
        quantize_ggml(x, fmt)


# ---------------------------------------------------------------- ggml: importance weights


def _imatrix(fmt: str, case: str) -> np.ndarray:
    n = _row(fmt).shape[1]
    w = np.ones(n, np.float32)
    if case == "nan":
        w[7] = np.nan
    elif case == "inf":
        w[0] = np.inf
    elif case == "all-negative":
        w = -w
    elif case == "one-negative":
        w[n - 1] = -1e-3
    elif case == "too-short":
        w = w[:-1]
    elif case == "one-per-block":
        w = w[: n // 2].reshape(2, -1)
    elif case == "two-rows":
        w = np.ones((2, n), np.float32)
    elif case == "strings":
        return np.array(["1"] * n)
    return w


# (id, the message); every type that takes importance weights checks them (one helper)
BAD_WEIGHTS = [
    ("nan", r"imatrix of shape \(\d+,\) holds 1 non-finite or negative weight\(s\), the "
     r"first imatrix\[7\] = nan \(non-finite\); expected finite weights >= 0"),
    ("inf", r"the first imatrix\[0\] = inf \(non-finite\)"),
    ("all-negative", r"holds (64|512) non-finite or negative weight\(s\), the first "
     r"imatrix\[0\] = -1.0 \(negative\)"),
    ("one-negative", r"imatrix\[(63|511)\] = -0.001 \(negative\)"),
    ("too-short", r"imatrix of shape \((63|511),\): expected one weight per column, "
     r"shape \((64|512),\)"),
    ("one-per-block", r"imatrix of shape \(2, (16|128)\): expected one weight per column"),
    ("two-rows", r"imatrix of shape \(2, (64|512)\): expected one weight per column"),
    ("strings", r"imatrix of shape \(\d+,\), dtype <U1: expected real numbers"),
]  # fmt: skip


@pytest.mark.parametrize("fmt", TYPES)
@pytest.mark.parametrize(("case", "msg"), BAD_WEIGHTS, ids=[c[0] for c in BAD_WEIGHTS])
def test_quantize_ggml_refuses_bad_imatrix(fmt, case, msg):
    # iq4_nl took a NaN weight (relative error 0.697) and all-negative ones (0.087)
    # silently. Q8_0 has no weighted encoder but checks them too: they are still wrong.
    with pytest.raises(ValueError, match=rf"^quantize_ggml\({fmt}\): .*" + msg):
        quantize_ggml(_row(fmt), fmt, _imatrix(fmt, case))


@pytest.mark.parametrize("fmt", ["q4_0", "iq4_nl", "q4_k"])
def test_quantize_ggml_takes_zero_weights(fmt):
    # Zeros are valid weights (llama.cpp's imatrix of an unused column).
    assert quantize_ggml(_row(fmt), fmt, np.zeros(_row(fmt).shape[1])).dtype == np.uint8


# ---------------------------------------------------------------- ggml: bytes

# (id, data, fmt, n_per_row, the message): the type, its block bytes, the count given and,
# where a shape is given, the bytes expected.
BAD_BYTES = [
    ("17-bytes-q4_0", np.zeros(17, np.uint8), "q4_0", 32,
     r"^dequantize_ggml\(q4_0\): 17 bytes are not whole rows: q4_0 blocks are 18 bytes "
     r"\(32 values\), a row of 32 values 18 bytes; expected a multiple of 18 bytes"),
    ("half-row-q4_k", np.zeros(144, np.uint8), "q4_k", 512,
     r"^dequantize_ggml\(q4_k\): 144 bytes .*q4_k blocks are 144 bytes \(256 values\), a "
     r"row of 512 values 288 bytes; expected a multiple of 288 bytes"),
    ("shaped-rows-short", np.zeros((3, 17), np.uint8), "q4_0", 32,
     r"^dequantize_ggml\(q4_0\): data of shape \(3, 17\) \(51 bytes\) is not whole rows: q4_0 blocks are 18 "
     r"bytes .*; expected shape \(3, 18\) \(54 bytes\)"),
    ("shaped-blocks-partial-row", np.zeros((3, 18), np.uint8), "q4_0", 64,
     r"data of shape \(3, 18\) \(54 bytes\) is not whole rows: .*a row of 64 values 36 "
     r"bytes; expected shape \(3, 36\) \(108 bytes\)"),
    ("floats-not-bytes", np.zeros(18, np.float32), "q4_0", 32,
     r"data of dtype float32 \(shape \(18,\)\): expected ggml's bytes \(uint8\)"),
    ("bytes-object-short", bytes(35), "q8_0", 32, r"35 bytes are not whole rows.*34 bytes"),
    ("row-not-blocks", np.zeros(18, np.uint8), "q4_0", 33, r"^q4_0: a row of 33 is not a multiple"),
    ("row-zero", np.zeros(18, np.uint8), "q4_0", 0, r"^q4_0: a row of 0 is not a multiple"),
    ("row-not-int", np.zeros(18, np.uint8), "q4_0", 32.0, r"n_per_row=32.0: expected a positive int"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "data", "fmt", "n", "msg"), BAD_BYTES, ids=[c[0] for c in BAD_BYTES]
)
def test_dequantize_ggml_refuses_partial_blocks(case, data, fmt, n, msg):
    with pytest.raises(ValueError, match=msg):
        dequantize_ggml(data, fmt, n)


def test_dequantize_ggml_takes_bytes_and_flat_rows():
    x = _row("q4_0")
    b = quantize_ggml(x, "q4_0")
    want = dequantize_ggml(b, "q4_0", x.shape[1])
    np.testing.assert_array_equal(dequantize_ggml(b.tobytes(), "q4_0", x.shape[1]), want)
    np.testing.assert_array_equal(dequantize_ggml(b.reshape(-1), "q4_0", x.shape[1]), want)


# ---------------------------------------------------------------- HF config.json keys


def _config_json(family: str) -> dict:
    return hf_config(CONFIGS[family])


# (family, config.json key, bad value, the message after "<folder>: config.json: "): every
# key mapped to a ModelConfig field is named as config.json names it, never as the field.
BAD_KEYS = [
    ("llama", "rms_norm_eps", -1e-05, r"rms_norm_eps=-1e-05: expected a positive float"),
    ("gemma3", "rms_norm_eps", 0.0, r"rms_norm_eps=0.0: expected a positive float"),
    ("llama", "rms_norm_eps", "1e-5", r"rms_norm_eps='1e-5' \(str\): expected int or float"),
    ("llama", "rms_norm_eps", True, r"rms_norm_eps=True \(bool\): expected int or float"),
    ("gemma3", "query_pre_attn_scalar", -1.0,
     r"query_pre_attn_scalar=-1.0: expected a positive float or none"),
    ("llama", "initializer_range", 0, r"initializer_range=0.0: expected a positive float"),
    ("llama", "tie_word_embeddings", "yes", r"tie_word_embeddings='yes' \(str\): expected bool"),
    ("gemma3", "rope_local_base_freq", -5, r"rope_local_base_freq=-5.0: expected a positive "
     r"float or none"),
    ("llama", "rope_theta", 0, r"rope_theta=0: expected a positive number"),
    ("llama", "hidden_size", 0, r"hidden_size=0: expected a positive int"),
    ("llama", "intermediate_size", -1, r"intermediate_size=-1: expected a positive int"),
    ("llama", "num_key_value_heads", 3, r"num_attention_heads=4 is not divisible by "
     r"num_key_value_heads=3"),
    ("llama", "max_position_embeddings", 0, r"max_position_embeddings=0: expected a positive int"),
    ("mistral", "sliding_window", 0, r"sliding_window=0: expected a positive int or none"),
    ("gemma3", "sliding_window_pattern", 0, r"sliding_window_pattern=0: expected an int >= 1"),
    ("gemma3", "sliding_window_pattern", -2, r"sliding_window_pattern=-2: expected an int >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("family", "key", "value", "msg"),
    BAD_KEYS,
    ids=[f"{c[0]}-{c[1]}={c[2]!r}" for c in BAD_KEYS],
)
def test_config_json_values_are_named_by_their_key(tmp_path, family, key, value, msg):
    # rms_norm_eps and query_pre_attn_scalar were named ".norm_eps=-1e-05" (the field).
    # Gemma 3's sliding_window_pattern 0 came in as every layer local; transformers
    # divides by it (and reads -2 as 2), so a pattern < 1 is refused.
    d = _config_json(family)
    d[key] = value
    if key in ("rope_theta", "rope_local_base_freq"):  # not the 5.x spelling beside it
        d.pop("rope_parameters", None)
    if key == "sliding_window_pattern":
        d.pop("layer_types")
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path)
    line = str(e.value)
    assert re.match(rf"{re.escape(str(tmp_path))}: config\.json: {msg}", line), line
    assert "\n" not in line
    after = line.removeprefix(f"{tmp_path}: config.json: ")
    internal = [f for f, k in _HF_KEYS.items() if f != k]  # microscale's own field names
    assert not after.startswith(".") and "ModelConfig" not in after, line
    assert not re.search(rf"\b({'|'.join(internal)})\b", after), line


def test_every_field_from_config_json_has_its_key():
    # The class: a ModelConfig field model_config_from_hf sets from a key is in _HF_KEYS
    # (so ModelConfig's own refusals name the key); the rest config.json never sets.

    not_from_config_json = {"family", "param_dtype", "compute_dtype", "dim_multiple", "remat",
                            "loss_chunk", "attention_chunk", "scan_layers",
                            "scale_residual_init"}  # fmt: skip
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert fields - not_from_config_json == set(_HF_KEYS)


# ---------------------------------------------------------------- a tied config, its own head


@pytest.fixture(scope="module")
def untied_folder(tmp_path_factory) -> Path:
    """A tiny untied Llama in the HF layout (float32 tensors)."""
    path = tmp_path_factory.mktemp("untied")
    model = Transformer(CONFIGS["llama"].replace(tie_embeddings=False), rngs=nnx.Rngs(0))
    export_checkpoint(model, path, layout="hf", dtype="float32", overwrite=True)
    return path


def _tied_copy(src: Path, dst: Path, head: str) -> dict[str, np.ndarray]:
    """``src`` with config.json's tie_word_embeddings flipped to true, and lm_head.weight
    the file's own (``"distinct"``), the embedding's bits (``"equal"``) or the wrong shape."""
    shutil.copytree(src, dst)
    d = json.loads((dst / "config.json").read_text())
    d["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(d))
    tensors = safetensors.numpy.load_file(dst / "model.safetensors")
    emb = tensors["model.embed_tokens.weight"]
    if head == "equal":
        tensors["lm_head.weight"] = emb.copy()
    elif head == "wrong-shape":
        tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :32].copy()
    safetensors.numpy.save_file(tensors, dst / "model.safetensors")
    return tensors


def test_tied_config_with_its_own_head_keeps_the_head(untied_folder, tmp_path):
    """The choice: keep the file's head and build the untied model, with one warning
    naming the folder and what was done -- what transformers builds (it keeps a head the
    file holds and warns), where microscale used to build the tied model and drop the
    head without a word (logits up to 2.39 off transformers'). Nothing in the reader's
    design ties the two: config.json's flag only decides which tensors are expected, and
    an untied model is a plain ModelConfig(tie_embeddings=False)."""
    path = tmp_path / "flipped"
    tensors = _tied_copy(untied_folder, path, "distinct")
    want = rf"^{re.escape(str(path))}: config\.json says tie_word_embeddings=true but " + (
        r"lm_head\.weight differs from model\.embed_tokens\.weight; keeping the file's head "
        r"\(an untied model, as transformers builds it\)$"
    )
    with pytest.warns(UserWarning, match=want) as got:
        ck = read_checkpoint(path)
    assert len([w for w in got if "tie_word_embeddings" in str(w.message)]) == 1
    assert not ck.config.tie_embeddings
    np.testing.assert_array_equal(ck.params["lm_head.kernel"], tensors["lm_head.weight"].T)
    with pytest.warns(UserWarning, match=want):
        model, cfg = import_model(path)
    untied = CONFIGS["llama"].replace(tie_embeddings=False)
    assert cfg.num_params() == untied.num_params()
    # the config read before the weights (`microscale import`, block-sequential GPTQ's
    # folder source) makes the same choice
    with pytest.warns(UserWarning, match=want):
        assert not hf_head_config(path, CONFIGS["llama"]).tie_embeddings
    with pytest.warns(UserWarning, match=want):
        assert not folder_source(path).config.tie_embeddings
    with pytest.warns(UserWarning, match=want):  # train init_from=<folder>
        assert not source_model(path)[0].tie_embeddings  # type: ignore[index]


def test_tied_config_with_the_embedding_as_head_is_tied(untied_folder, tmp_path):
    # A head equal to the embedding bit for bit is the tied model: no warning.
    path = tmp_path / "equal"
    _tied_copy(untied_folder, path, "equal")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck = read_checkpoint(path)
    assert ck.config.tie_embeddings and "lm_head.kernel" not in ck.params


def test_tied_config_with_a_head_of_the_wrong_shape_is_refused(untied_folder, tmp_path):
    path = tmp_path / "wrong"
    _tied_copy(untied_folder, path, "wrong-shape")
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head.weight' has shape \[257, 32\]; "):
        read_checkpoint(path)


def test_import_cli_keeps_the_head_of_a_tied_config(untied_folder, tmp_path):
    # `microscale import` reads config.json before the weights: the same choice, and the
    # run's model is the untied one the weights fill.
    path = tmp_path / "flipped"
    _tied_copy(untied_folder, path, "distinct")
    ByteTokenizer().save(path / "tokenizer.json")
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match=r"keeping the file's head"):
        assert main(["import", "--model", str(path), "--out", str(out), "-q"]) == 0
    _, cfg, _ = load_checkpoint(out)
    assert not cfg.model.tie_embeddings
