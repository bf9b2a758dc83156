"""GGUF -> HF Llama folder: a tiny synthetic GGUF written here with the ``gguf`` package's
writer the way llama.cpp's ``convert_hf_to_gguf.py`` writes one (q/k rows permuted for its
RoPE, a Q8_0 token embedding, F32 elsewhere, a byte-level BPE vocabulary with merges and the
``smollm`` pre-tokenizer) is converted back exactly; ``microscale import`` reads the result."""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from safetensors.numpy import load_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from microscale.cli import main  # noqa: E402
from microscale.export.gguf.to_hf import gguf_to_hf  # noqa: E402
from microscale.export.gguffile import GGUFFormatError, open_gguf  # noqa: E402

D, LAYERS, HEADS, KV, FF = 64, 2, 4, 2, 64
TEXT = [
    "The year 2024 had 366 days; 1999 had 365.",
    "def add(a, b):\n    return a + b\n",
    "Quantized weights, calibrated scales, and 4-bit blocks.",
] * 20


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (q: n_head, k: n_head_kv), verbatim."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        TEXT,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    rng = np.random.default_rng(0)
    tok = _tokenizer()
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    n_vocab = len(tokens)
    hd = D // HEADS
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((n_vocab, D)).astype(np.float32),
        "model.norm.weight": rng.uniform(0.5, 1.5, D).astype(np.float32),
    }
    shapes = {
        "self_attn.q_proj": (HEADS * hd, D),
        "self_attn.k_proj": (KV * hd, D),
        "self_attn.v_proj": (KV * hd, D),
        "self_attn.o_proj": (D, HEADS * hd),
        "mlp.gate_proj": (FF, D),
        "mlp.up_proj": (FF, D),
        "mlp.down_proj": (D, FF),
    }
    gnames = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages }}")
    emb_q8 = gguf.quants.quantize(hf["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", emb_q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for i in range(LAYERS):
        for norm, gname in (
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "ffn_norm"),
        ):
            v = rng.uniform(0.5, 1.5, D).astype(np.float32)
            hf[f"model.layers.{i}.{norm}.weight"] = v
            w.add_tensor(f"blk.{i}.{gname}.weight", v)
        for kind, shp in shapes.items():
            v = (rng.standard_normal(shp) * 0.1).astype(np.float32)
            hf[f"model.layers.{i}.{kind}.weight"] = v
            if kind == "self_attn.q_proj":
                v = llama_cpp_permute(v, HEADS)
            elif kind == "self_attn.k_proj":
                v = llama_cpp_permute(v, KV)
            w.add_tensor(f"blk.{i}.{gnames[kind]}.weight", v)
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = gguf_to_hf(path, tmp_path_factory.mktemp("hf") / "model")
    return hf, emb_q8, tok, out, path


def test_weights_round_trip_exactly(synthetic):
    hf, emb_q8, _, out, _ = synthetic
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(hf)
    for name, want in hf.items():
        if name == "model.embed_tokens.weight":  # stored as Q8_0: its decoded values
            want = gguf.quants.dequantize(emb_q8, gguf.GGMLQuantizationType.Q8_0)
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_config_and_tokenizer(synthetic):
    _, _, tok, out, _ = synthetic
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
    ) == (D, LAYERS, HEADS, KV, FF)
    assert cfg["rope_theta"] == 100000.0 and cfg["eos_token_id"] == 2
    conf = json.loads((out / "tokenizer_config.json").read_text())
    assert conf["eos_token"] == "<|im_end|>" and conf["bos_token"] == "<|im_start|>"
    assert conf["chat_template"] == "{{ messages }}"
    rebuilt = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in [
        "In 2025, 12345 tokens cost $6.78.",
        "def f(x):\n\treturn x ** 2  # ok",
        "<|im_start|>user\nhi<|im_end|>",
        "naïve café, 東京",
    ]:
        want = tok.encode(text).ids
        assert rebuilt.encode(text).ids == want, text
        assert rebuilt.decode(want, skip_special_tokens=False) == tok.decode(
            want, skip_special_tokens=False
        )
    digits = rebuilt.encode("2025").tokens
    assert len(digits) == 4  # smollm: every digit on its own


def test_microscale_import_reads_it(synthetic, tmp_path, capsys):
    *_, out, _ = synthetic
    assert main(["import", "--model", str(out), "--out", str(tmp_path / "run")]) == 0, (
        capsys.readouterr().err
    )
    assert (tmp_path / "run" / "tokenizer.json").is_file()


def test_the_validating_reader_reads_what_the_gguf_package_reads(synthetic):
    """gguf_to_hf reads through microscale's parser (gguffile.open_gguf): every metadata
    value and every decoded tensor equal the ``gguf`` package's reader's."""
    path = synthetic[-1]
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):  # the reader's own pseudo-fields (version, counts)
            assert ours.value(key) == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        np.testing.assert_array_equal(ours.decode(mine), want.reshape(ours.decode(mine).shape))


def test_a_damaged_array_length_fails_at_once(synthetic, tmp_path):
    """A token-type count flipped to 2^32 + n (the ``gguf`` package's reader loops on it)
    fails in the parser, naming the byte, before anything is written."""
    path = synthetic[-1]
    ours = open_gguf(path)
    v = ours.header.kv["tokenizer.ggml.token_type"]
    raw = bytearray(path.read_bytes())
    raw[v.value_begin + 4 + 4] ^= 0x01  # the count's fifth byte: + 2^32
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(GGUFFormatError, match=r"damaged or truncated at byte"):
        gguf_to_hf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refusals_name_the_value(tmp_path):
    path = tmp_path / "gpt.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="general.architecture='gpt2'"):
        gguf_to_hf(path, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        gguf_to_hf(tmp_path / "nothing.gguf", tmp_path / "out")
