"""GGUF export writes the model's own tokenizer: the pre-tokenizer llama.cpp must use, chosen
from tokenizer.json (gpt-2, smollm, llama-bpe); bos / eos / pad ids, add_bos and the chat
template from tokenizer_config.json; an unknown pre-tokenizer refused before any work. Where
llama.cpp is present, its tokens equal the `tokenizers` package's on a table of strings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", exc_type=ImportError)

from gguf import GGUFReader  # noqa: E402
from tokenizers import (  # noqa: E402
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from microscale.cli import main  # noqa: E402
from microscale.export import flat_params  # noqa: E402
from microscale.export.gguf.llamacpp import LlamaCpp, llama_cpp_available  # noqa: E402
from microscale.export.gguf.vocab import LLAMA3_SPLIT, QWEN2_SPLIT, gguf_vocab  # noqa: E402
from microscale.export.gguf.writer import write_gguf  # noqa: E402
from microscale.model import ModelConfig, Transformer  # noqa: E402

CFG = ModelConfig(
    vocab_size=448, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (SmolLM2's order)
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
)
# SmolLM2-Instruct's tokenizer_config.json, in what matters here
INSTRUCT = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "chat_template": TEMPLATE,
    "tokenizer_class": "GPT2Tokenizer",
}
STRINGS = [
    "Hello world",
    "12345 + 678 = 13023",
    "numbers 1234567890 and 2024",
    "  two  spaces\tand\ttabs\n\nnew lines",
    "émigré naïve 東京 🙂 Ωmega",
    "it's they're I'll we'd",
    "x=3.14159; y=[1,22,333]",
    "<|im_start|>user\nhi<|im_end|>",
    "trailing space ",
    "a1b22c333d4444",
]


def _corpus() -> list[str]:
    base = [
        "the quick brown fox jumps over the lazy dog",
        "numbers 1234567890 and 2024",
        "def f(x):\n    return x * 2  # double",
        "émigré naïve café 東京 🙂",
        "they're it's I'll we'd you've",
    ]
    return [f"{s} {i}" for i in range(40) for s in base]


def _tokenizer(kind: str) -> Tokenizer:
    """A byte-level BPE trained with GPT-2's pre-tokenizer (so it has merges across digits
    and spaces, which the other pre-tokenizers never apply), then given ``kind``'s."""
    tok = Tokenizer(models.BPE())
    bytelevel = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = bytelevel
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(
            vocab_size=420,
            special_tokens=SPECIAL,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.pre_tokenizer = {
        "gpt2": bytelevel,
        "smollm": pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), bytelevel]
        ),
        "llama3": pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        "qwen2": pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        "digits-grouped": pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=False), bytelevel]
        ),
        "whitespace": pre_tokenizers.Whitespace(),
    }[kind]
    if kind == "qwen2":  # Qwen2's tokenizer.json normalizes to NFC
        tok.normalizer = normalizers.NFC()
    if kind == "llama3":  # Llama 3 adds <|begin_of_text|> through its post-processor
        tok.add_special_tokens(["<|begin_of_text|>"])
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A",
                    special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
                ),
            ]
        )
    return tok


def _folder(tmp_path: Path, kind: str, config: dict | None = None) -> Path:
    d = tmp_path / kind
    d.mkdir()
    _tokenizer(kind).save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def params():
    from flax import nnx

    return flat_params(Transformer(CFG, rngs=nnx.Rngs(0)))


def _fields(path) -> dict:
    r = GGUFReader(path)

    def value(f):
        v = f.contents() if hasattr(f, "contents") else f.parts[f.data[0]]
        return v

    return {k: value(f) for k, f in r.fields.items()}


@pytest.mark.parametrize(
    "kind, pre",
    [("gpt2", "gpt-2"), ("smollm", "smollm"), ("llama3", "llama-bpe"), ("qwen2", "qwen2")],
)
def test_pre_tokenizer_is_chosen_from_tokenizer_json(tmp_path, params, kind, pre):
    d = _folder(tmp_path, kind)
    res = write_gguf(
        params,
        tmp_path / "m.gguf",
        config=CFG,
        layer_formats="bf16",
        tokenizer=d / "tokenizer.json",
    )
    f = _fields(tmp_path / "m.gguf")
    assert f["tokenizer.ggml.pre"] == pre == res.tokenizer["pre"]
    hf = Tokenizer.from_file(str(d / "tokenizer.json"))
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == CFG.vocab_size
    for text, i in hf.get_vocab(with_added_tokens=True).items():
        assert tokens[i] == text
    assert tokens[-1] == f"[PAD{CFG.vocab_size - 1}]"
    merges = f["tokenizer.ggml.merges"]
    assert len(merges) == len(json.loads(hf.to_str())["model"]["merges"]) > 50
    if kind == "llama3":  # its post-processor prepends <|begin_of_text|>: so does llama.cpp
        bot = hf.token_to_id("<|begin_of_text|>")
        assert (
            f["tokenizer.ggml.add_bos_token"] is True or int(f["tokenizer.ggml.add_bos_token"]) == 1
        )
        assert int(f["tokenizer.ggml.bos_token_id"]) == bot == hf.encode("a").ids[0]
    else:
        assert not bool(f["tokenizer.ggml.add_bos_token"])


def test_special_tokens_and_chat_template_come_from_tokenizer_config(tmp_path, params):
    d = _folder(tmp_path, "smollm", INSTRUCT)
    write_gguf(
        params,
        tmp_path / "m.gguf",
        config=CFG,
        layer_formats="bf16",
        tokenizer=d / "tokenizer.json",
    )
    f = _fields(tmp_path / "m.gguf")
    # the model's own end of turn (<|im_end|> = 2), not the end-of-document token (0)
    assert int(f["tokenizer.ggml.eos_token_id"]) == 2
    assert int(f["tokenizer.ggml.bos_token_id"]) == 1
    assert int(f["tokenizer.ggml.padding_token_id"]) == 2
    assert not bool(f["tokenizer.ggml.add_bos_token"])
    assert f["tokenizer.chat_template"] == TEMPLATE
    # named templates (a list) and chat_template.jinja beside the config work alike
    d2 = _folder(
        tmp_path,
        "gpt2",
        {
            **INSTRUCT,
            "chat_template": [
                {"name": "tool_use", "template": "x"},
                {"name": "default", "template": TEMPLATE},
            ],
            "add_bos_token": True,
            "eos_token": {"content": "<|endoftext|>", "special": True},
        },
    )
    write_gguf(
        params,
        tmp_path / "m2.gguf",
        config=CFG,
        layer_formats="bf16",
        tokenizer=d2 / "tokenizer.json",
    )
    f = _fields(tmp_path / "m2.gguf")
    assert f["tokenizer.chat_template"] == TEMPLATE
    assert int(f["tokenizer.ggml.eos_token_id"]) == 0
    assert bool(f["tokenizer.ggml.add_bos_token"]) and int(f["tokenizer.ggml.bos_token_id"]) == 1
    cfg = {k: v for k, v in INSTRUCT.items() if k != "chat_template"}
    d3 = _folder(tmp_path, "llama3", cfg)
    (d3 / "chat_template.jinja").write_text(TEMPLATE)
    assert gguf_vocab(d3 / "tokenizer.json").chat_template == TEMPLATE
    # without a tokenizer_config.json: the end-of-document token, and no template
    (tmp_path / "bare").mkdir()
    voc = gguf_vocab(_folder(tmp_path / "bare", "gpt2") / "tokenizer.json")
    assert (voc.eos_id, voc.bos_id, voc.pad_id, voc.chat_template) == (0, 0, None, None)


def test_a_special_token_the_vocab_lacks_is_refused(tmp_path):
    d = _folder(tmp_path, "gpt2", {**INSTRUCT, "eos_token": "</s>"})
    with pytest.raises(ValueError, match=r"eos_token='</s>' is not a token"):
        gguf_vocab(d / "tokenizer.json")


@pytest.mark.parametrize(
    "kind, named", [("digits-grouped", '"individual_digits": false'), ("whitespace", "Whitespace")]
)
def test_unknown_pre_tokenizer_is_refused_before_any_work(tmp_path, kind, named):
    d = _folder(tmp_path, kind)
    # no model at all: the tokenizer is judged first
    with pytest.raises(ValueError, match="pre-tokenizer") as e:
        write_gguf(None, tmp_path / "m.gguf", config=CFG, tokenizer=d / "tokenizer.json")
    assert named in str(e.value)
    assert not (tmp_path / "m.gguf").exists()


def test_cli_refuses_the_tokenizer_before_reading_the_model(tmp_path, capsys):
    # an HF folder whose weights are unreadable: the pre-tokenizer is named, not the weights
    d = _folder(tmp_path, "whitespace")
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    rc = main(["export", "-m", str(d), "--out", str(tmp_path / "m.gguf"), "layout=gguf"])
    err = capsys.readouterr().err
    assert rc == 2 and "pre-tokenizer" in err and "Whitespace" in err, err


@pytest.mark.slow
@pytest.mark.skipif(
    llama_cpp_available() is None,
    reason="no llama.cpp (pip install '.[llama]' or set MICROSCALE_LIBLLAMA)",
)
@pytest.mark.parametrize("kind", ["gpt2", "smollm", "llama3", "qwen2"])
def test_llama_cpp_tokenizes_like_tokenizers(tmp_path, params, kind):
    d = _folder(tmp_path, kind, {k: v for k, v in INSTRUCT.items() if k != "bos_token"})
    write_gguf(
        params,
        tmp_path / "m.gguf",
        config=CFG,
        layer_formats="bf16",
        tokenizer=d / "tokenizer.json",
    )
    hf = Tokenizer.from_file(str(d / "tokenizer.json"))
    llm = LlamaCpp(tmp_path / "m.gguf", n_ctx=64)
    try:
        for text in STRINGS:
            want = hf.encode(text, add_special_tokens=False).ids
            assert llm.tokenize(text, special=True) == want, text
            hf.encode_special_tokens = True  # special tokens' text as plain text
            plain = hf.encode(text, add_special_tokens=False).ids
            hf.encode_special_tokens = False
            assert llm.tokenize(text, special=False) == plain, text
        assert np.all(np.asarray(want) < CFG.vocab_size)
        if kind == "qwen2":  # llama.cpp does not apply the NFC normalizer: NFD text differs
            nfc, nfd = "\u00e9migr\u00e9 caf\u00e9", "e\u0301migre\u0301 cafe\u0301"
            assert hf.encode(nfd, add_special_tokens=False).ids == hf.encode(nfc).ids
            assert llm.tokenize(nfc, special=False) == hf.encode(nfc).ids
            assert llm.tokenize(nfd, special=False) != hf.encode(nfc).ids
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.skipif(
    llama_cpp_available() is None,
    reason="no llama.cpp (pip install '.[llama]' or set MICROSCALE_LIBLLAMA)",
)
def test_llama_cpp_ends_generation_at_the_models_own_end_of_turn(tmp_path, params):
    """llama.cpp reads the exported file's end-of-turn token as end-of-generation (not the
    end-of-document token 0), its chat template is tokenizer_config.json's, and
    ``greedy(stop_at_eog=True)`` stops after such a token."""
    d = _folder(tmp_path, "smollm", INSTRUCT)
    write_gguf(
        params,
        tmp_path / "m.gguf",
        config=CFG,
        layer_formats="bf16",
        tokenizer=d / "tokenizer.json",
    )
    llm = LlamaCpp(tmp_path / "m.gguf", n_ctx=64)
    try:
        assert llm.is_eog(2) and not llm.is_eog(5)
        assert llm.chat_template() == TEMPLATE
        out, _ = llm.greedy([3, 4, 5], 40, stop_at_eog=True)
        assert all(not llm.is_eog(t) for t in out[:-1])
        assert len(out) == 40 or llm.is_eog(out[-1])
    finally:
        llm.close()
