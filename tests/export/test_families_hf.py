"""The model families against transformers' own classes: a tiny random
``LlamaForCausalLM``, ``MistralForCausalLM`` (sliding window 8, head_dim 8 < hidden 64 / 4
heads), ``Qwen2ForCausalLM`` (q/k/v biases), ``Qwen3ForCausalLM`` (q/k norms, head_dim
32 > 64 / 4, tied embeddings) and ``Gemma3ForCausalLM`` (``1 + w`` norms, four per block,
GeGLU, scaled embedding, a local layer with window 8 and its own RoPE base beside a
global one, ``query_pre_attn_scalar`` 24 against head_dim 16), each built and saved by transformers itself, imported by
microscale (``read_checkpoint``, ``microscale import``), run, exported (NVFP4 through
compressed-tensors, and float) and loaded by transformers again; config.json both ways;
what the block does not compute refused by name (skipped without torch / transformers).

The weights are moved off transformers' init so that a misplaced tensor shows: every
norm weight (q_norm / k_norm too) is ``1 + 0.2 N(0, 1)``, Qwen2's biases ``0.5 N(0, 1)``
(transformers inits them to 0), and attention is sharp: q/k projections x4, and Qwen3's
q/k norm weights x2 (its norms undo a scaled projection); the top key of a query past
position 8 takes 0.3-0.67 of the weight on average (uniform: < 1/9). The sequences (32
tokens) are 4 windows long. The reference runs ``attn_implementation="eager"``, whose
mask applies Mistral's window: asserted, since without the window its logits are the
same before position 8 and others at every position past it (by 0.11 to 2.3 at the
largest logit of a position).

Tolerances (float32 logits, |logits| up to 1.9):

* microscale's inference engine in float32 vs transformers in float32: atol 3e-5
  (measured at most 2.5e-6, Qwen3). The same math in another summation order: ~1e-6
  relative per float32 matmul of width <= 128, a few in a row through 2 layers and a
  softmax, plus RoPE tables within a few ulp of transformers' at positions < 40
  (``tests/export/test_rope_hf.py`` derives the same bound).
* microscale's ``Transformer`` (training, PTQ) in its bf16 recipe vs transformers: atol
  0.15 (measured 0.009 Qwen2, 0.030 Mistral, 0.034 Llama, 0.070 Qwen3). Every matmul
  operand is rounded to bfloat16 (2^-9 relative each, ~10 roundings on the path from
  the embedding to a logit), and the sharp softmax amplifies a score's error by the
  score's size; Qwen3 is the worst: its q/k norms (weights ~2) make the largest scores.
  The bound is twice the worst measured; ``test_rope_hf`` holds the same recipe to
  0.25 with wider, sharper models.
* greedy generation with the KV cache vs transformers' ``generate``: token for token, 26
  new tokens, past 3 windows (argmax of logits that agree to 3e-5; no near-ties at that
  level in a random tiny model, and a tie would show as a differing token, not as a
  pass). Two prompts of different lengths run as one left-padded batch, each compared
  with transformers generating it alone; Mistral without its window generates others.
* NVFP4 through compressed-tensors into transformers vs microscale's packed engine of the
  same folder: atol 0.1 (measured 0.003 Qwen2, 0.009 Llama, 0.014 Mistral, 0.031
  Qwen3). Every weight transformers holds is microscale's decoded NVFP4 weight rounded
  to bfloat16, exactly (asserted: compressed-tensors decompresses to bfloat16; microscale
  keeps the float32 product of FP4 code, FP8 block scale and float32 global scale), and
  microscale on those rounded weights agrees with transformers to 3e-5 (asserted;
  measured at most 2.8e-6). So the whole difference is one bfloat16 rounding of each
  weight (2^-9 relative), the bf16 recipe's kind of error with fewer roundings: the
  bound is that row's 0.15 less a margin. The quantized logits are others than the float
  ones by 0.21-1.02 (asserted > 0.1: the comparison is of the quantized model).
* the float "hf" export (float32 tensors) read by transformers vs transformers on the
  folder it wrote itself: bit for bit (measured 0; the same tensors and config values,
  so the same torch computation).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", exc_type=ImportError)
transformers = pytest.importorskip("transformers", exc_type=ImportError)

from flax import nnx  # noqa: E402

from microscale.cli import main  # noqa: E402
from microscale.data import ByteTokenizer  # noqa: E402
from microscale.export import build_model, export_checkpoint, read_checkpoint  # noqa: E402
from microscale.export.hf import hf_config, hf_param_name, model_config_from_hf  # noqa: E402
from microscale.formats import QArray  # noqa: E402
from microscale.inference import GenerationConfig, InferenceModel  # noqa: E402
from microscale.model import FAMILIES  # noqa: E402
from microscale.train import load_checkpoint  # noqa: E402

WINDOW = 8  # Mistral's sliding window: the sequences are 4 of them
LONG = 32
TOKENS = np.random.default_rng(0).integers(0, 257, (2, LONG))
PROMPTS = (6, 9)  # prompt lengths of the generation batch (left-padded together)

SHARED = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.05,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    config: str  # transformers' config class
    model: str  # transformers' model class (config.json's architectures[0])
    keys: dict[str, Any]  # config keys beside SHARED
    head_dim: int  # microscale's head_dim of it
    window: int | None = None  # microscale's sliding_window of it
    tied: bool = False


ROWS = {
    "llama": Row(config="LlamaConfig", model="LlamaForCausalLM", keys={}, head_dim=16),
    # head_dim 8 < 64 / 4 heads (Mistral Nemo's kind: 128 < 5120 / 32)
    "mistral": Row(
        config="MistralConfig",
        model="MistralForCausalLM",
        keys={"sliding_window": WINDOW, "head_dim": 8},
        head_dim=8,
        window=WINDOW,
    ),
    "qwen2": Row(config="Qwen2Config", model="Qwen2ForCausalLM", keys={}, head_dim=16),
    # head_dim 32 > 64 / 4 heads (Qwen3's kind: 128 > 1024 / 16), tied (Qwen3-0.6B's)
    "qwen3": Row(
        config="Qwen3Config",
        model="Qwen3ForCausalLM",
        keys={"head_dim": 32, "tie_word_embeddings": True},
        head_dim=32,
        tied=True,
    ),
    # layer 0 local (window 8, its own RoPE base), layer 1 global; a scores' scale unlike
    # head_dim's; tied (every Gemma 3)
    "gemma3": Row(
        config="Gemma3TextConfig",
        model="Gemma3ForCausalLM",
        keys={
            "sliding_window": WINDOW,
            "sliding_window_pattern": 2,
            "rope_local_base_freq": 1000.0,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": True,
        },
        head_dim=16,
        window=WINDOW,
        tied=True,
    ),
}


def _hf_model(family: str, **changes):
    row = ROWS[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, row.config)(
        **{**SHARED, **row.keys, **changes}, attn_implementation="eager"
    )
    model = getattr(transformers, row.model)(cfg).eval()
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norms so a misplaced norm weight would show
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith(".bias"):  # transformers inits them to 0
                p.copy_(0.5 * torch.randn_like(p))
            if "q_proj.weight" in name or "k_proj.weight" in name:  # sharp attention
                p.mul_(4.0)
            if "q_norm" in name or "k_norm" in name:  # Qwen3: its norms undo the x4
                p.mul_(2.0)
    return model


@dataclasses.dataclass(frozen=True)
class Folder:
    family: str
    path: Path  # written by transformers' save_pretrained
    logits: np.ndarray  # transformers' float32 logits of TOKENS, from the folder


def _load(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _logits(model, tokens=TOKENS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Folder]:
    out = {}
    for family in ROWS:
        path = tmp_path_factory.mktemp(f"hf-{family}")
        _hf_model(family).save_pretrained(path)
        ByteTokenizer().save(path / "tokenizer.json")
        out[family] = Folder(family, path, _logits(_load(path)))
    return out


@pytest.fixture(params=sorted(ROWS))
def hf(request, folders) -> Folder:
    return folders[request.param]


# The tensors of a block beside the linear kernels and the two norms, per family.
EXTRA = {
    "llama": (),
    "mistral": (),
    "qwen2": ("attn.q_proj.bias", "attn.k_proj.bias", "attn.v_proj.bias"),
    "qwen3": ("attn.q_norm.scale", "attn.k_norm.scale"),
    "gemma3": (
        "attn.q_norm.scale",
        "attn.k_norm.scale",
        "attn_post_norm.scale",
        "mlp_post_norm.scale",
    ),
}


def test_each_family_comes_in_with_its_shape_and_tensors(hf):
    row = ROWS[hf.family]
    ck = read_checkpoint(hf.path)
    cfg = ck.config
    assert cfg.family == hf.family and FAMILIES[hf.family].hf_architecture == row.model
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.n_layers) == (64, 4, 2, 128, 2)
    assert cfg.head_dim == row.head_dim
    assert cfg.attn_head_dim == (None if row.head_dim == 64 // 4 else row.head_dim)
    assert cfg.sliding_window == row.window and cfg.tie_embeddings == row.tied
    assert (cfg.norm_eps, cfg.rope_theta, cfg.max_seq_len) == (1e-5, 10000.0, 64)
    block = sorted(n.removeprefix("layers.0.") for n in ck.params if n.startswith("layers.0."))
    linears = [f"attn.{p}_proj.kernel" for p in "qkvo"]
    linears += [f"mlp.{p}_proj.kernel" for p in ("gate", "up", "down")]
    assert block == sorted([*linears, "attn_norm.scale", "mlp_norm.scale", *EXTRA[hf.family]])
    assert ("lm_head.kernel" in ck.params) == (not row.tied)
    # every tensor is transformers' own, exactly (kernels transposed)
    state = {k: v.numpy() for k, v in _load(hf.path).state_dict().items()}
    for name, got in ck.params.items():
        want = state[hf_param_name(name, hf.family)]
        np.testing.assert_array_equal(got.T if name.endswith(".kernel") else got, want, name)
    # and the family's own ones are not transformers' init (biases 0, norms 1 or 0)
    for i in range(cfg.n_layers):
        for e in EXTRA[hf.family]:
            w = ck.params[f"layers.{i}.{e}"]
            if e.endswith(".bias"):  # [heads x head_dim]: 4 x 16 for q, 2 x 16 for k, v
                assert w.shape == ((64,) if e.startswith("attn.q") else (32,))
                assert np.std(w) > 0.3
            else:
                init = 0.0 if hf.family == "gemma3" else 1.0  # Gemma's norms are 1 + w
                width = 64 if "post_norm" in e else row.head_dim
                assert w.shape == (width,) and np.abs(w - init).max() > 0.2


@pytest.mark.slow
def test_microscale_import_cli_keeps_the_family(hf, tmp_path):
    out = tmp_path / "run"
    assert main(["import", "--model", str(hf.path), "--out", str(out), "-q"]) == 0
    _, cfg, _ = load_checkpoint(out)
    assert cfg.model.family == hf.family
    assert cfg.model == read_checkpoint(hf.path).config


@pytest.mark.slow
def test_logits_equal_transformers(hf):
    ck = read_checkpoint(hf.path)
    engine = InferenceModel.from_checkpoint(ck, compute_dtype="float32")
    got = np.asarray(engine.logits(TOKENS))
    np.testing.assert_allclose(got, hf.logits, atol=3e-5, rtol=0)
    model = build_model(ck.config, ck.params)
    got = np.asarray(nnx.jit(lambda m, t: m(t))(model, TOKENS))
    np.testing.assert_allclose(got, hf.logits, atol=0.15, rtol=0)


@pytest.mark.slow
def test_the_window_is_applied_on_both_sides(folders, tmp_path):
    """Mistral without its window: the same logits for positions < window, others past
    it, in transformers' eager attention (so the reference applies the window); and
    microscale without the window agrees with transformers without it."""
    windowed = folders["mistral"].logits
    plain_model = _hf_model("mistral", sliding_window=None)
    plain = _logits(plain_model)
    np.testing.assert_allclose(plain[:, :WINDOW], windowed[:, :WINDOW], atol=1e-6, rtol=0)
    gap = np.abs(plain[:, WINDOW:] - windowed[:, WINDOW:]).max(axis=-1)
    assert gap.min() > 1e-2 and gap.max() > 0.5  # every position past the window moves
    plain_model.save_pretrained(tmp_path)
    ck = read_checkpoint(tmp_path)
    assert ck.config.family == "mistral" and ck.config.sliding_window is None
    engine = InferenceModel.from_checkpoint(ck, compute_dtype="float32")
    np.testing.assert_allclose(np.asarray(engine.logits(TOKENS)), plain, atol=3e-5, rtol=0)


@pytest.mark.slow
def test_greedy_generation_equals_transformers_generate(hf):
    n_new = LONG - PROMPTS[0]  # 26 new tokens: past 3 windows
    model = _load(hf.path)
    prompts = [TOKENS[i, :n].tolist() for i, n in enumerate(PROMPTS)]
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones((1, len(p)), dtype=torch.long),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                pad_token_id=0,
            )
            refs.append(out[0, len(p) :].tolist())
    ck = read_checkpoint(hf.path)
    gen = GenerationConfig(max_new_tokens=n_new)
    got = InferenceModel.from_checkpoint(ck, compute_dtype="float32").generate(prompts, gen)
    for i, ref in enumerate(refs):
        assert int(got.lengths[i]) == n_new
        assert got.tokens[i, :n_new].tolist() == ref, i
    if hf.family == "mistral":  # and the window is what made these tokens
        cfg = ck.config.replace(sliding_window=None, compute_dtype="float32")
        off = InferenceModel.from_params(ck.params, cfg).generate(prompts, gen)
        assert off.tokens[:, :n_new].tolist() != got.tokens[:, :n_new].tolist()


def _ct_config():
    try:  # decode the packed weights at load time (older releases: run_compressed=False)
        return transformers.CompressedTensorsConfig(dequantize=True)
    except TypeError:
        return transformers.CompressedTensorsConfig(run_compressed=False)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_nvfp4_export_loads_in_transformers_as_the_family(hf, tmp_path):
    """The imported model exported as NVFP4 (compressed-tensors) and loaded by transformers:
    its class, its weights (microscale's decoded NVFP4 rounded to bfloat16, exactly: what
    compressed-tensors decompresses to), and the logits of microscale's packed engine."""
    pytest.importorskip("compressed_tensors", exc_type=ImportError)
    ck = read_checkpoint(hf.path)
    out = tmp_path / "nvfp4"
    export_checkpoint(ck, out, layer_formats="nvfp4", tokenizer=ByteTokenizer())
    back = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=_ct_config(), attn_implementation="eager"
    ).eval()
    assert type(back).__name__ == ROWS[hf.family].model
    ref = _logits(back)
    packed = read_checkpoint(out)
    assert packed.config == ck.config and packed.layout == "compressed-tensors"
    decoded = packed.dequantized_params()
    state = {k: v.numpy() for k, v in back.state_dict().items()}
    rounded = {}
    for name, v in decoded.items():
        w = np.asarray(v)
        if isinstance(packed.params[name], QArray):  # a packed linear: bf16-decoded there
            w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
        rounded[name] = w
        hf_w = state[hf_param_name(name, hf.family)]
        np.testing.assert_array_equal(w.T if name.endswith(".kernel") else w, hf_w, name)
    assert sum(isinstance(v, QArray) for v in packed.params.values()) == 14  # lm_head bf16
    f32 = ck.config.replace(compute_dtype="float32")
    # microscale on transformers' bf16-decoded weights: the float32 engine's bound
    same = np.asarray(InferenceModel.from_params(rounded, f32).logits(TOKENS))
    np.testing.assert_allclose(same, ref, atol=3e-5, rtol=0)
    # microscale's packed engine (float32 decode) vs transformers: the bf16 decode's bound
    engine = InferenceModel.from_checkpoint(out, compute_dtype="float32")
    assert engine.memory_stats().packed_layers == 14
    got = np.asarray(engine.logits(TOKENS))
    np.testing.assert_allclose(got, ref, atol=0.1, rtol=0)
    assert np.abs(got - hf.logits).max() > 0.1  # and it is the quantized model


@pytest.mark.slow
def test_float_export_loads_in_transformers_bit_for_bit(hf, tmp_path):
    ck = read_checkpoint(hf.path)
    out = tmp_path / "hf"
    export_checkpoint(ck, out, layout="hf", dtype="float32", tokenizer=ByteTokenizer())
    back = _load(out)
    assert type(back).__name__ == ROWS[hf.family].model
    got = _logits(back)
    np.testing.assert_array_equal(got, hf.logits)
    assert read_checkpoint(out).config == ck.config


def _math_attrs(c) -> dict[str, Any]:
    """What a transformers config of these families computes with."""
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "hidden_activation",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_parameters",
        "tie_word_embeddings",
        "sliding_window",
        "use_sliding_window",
        "layer_types",
        "attention_bias",
        "mlp_bias",
    )
    out = {k: getattr(c, k, None) for k in keys}
    if out["head_dim"] is None:  # Qwen2Config has none: hidden / heads
        out["head_dim"] = c.hidden_size // c.num_attention_heads
    return out


def test_config_json_round_trip_through_transformers(hf, tmp_path):
    """config.json (transformers') -> ModelConfig -> config.json (microscale's) ->
    transformers' AutoConfig -> ModelConfig: the same ModelConfig, and transformers
    computes with the same values as from its own config.json."""
    d = json.loads((hf.path / "config.json").read_text())
    ours = model_config_from_hf(d)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(ours)))
    back = transformers.AutoConfig.from_pretrained(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(hf.path)
    assert type(back).__name__ == type(theirs).__name__ == ROWS[hf.family].config
    assert model_config_from_hf(back.to_dict()) == ours
    assert _math_attrs(back) == _math_attrs(theirs)


# The keys no config.json of these families can leave out; 32 heads so that every
# family's default kv heads (8, 32) divide them.
SPARSE = dict(
    vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=32,
)  # fmt: skip


@pytest.mark.parametrize("nulls", [False, True], ids=["absent", "null"])
@pytest.mark.parametrize("family", sorted(ROWS))
def test_keys_config_json_leaves_out_mean_what_transformers_takes(family, nulls, tmp_path):
    """A sparse config.json: what microscale reads is what transformers' config class
    makes of it (Mistral's 8 kv heads and 4096-token window, Qwen's 32 kv heads, Qwen3's
    head_dim 128, each family's context), written out in full by ``to_dict``. Written as
    null, the keys are derived (kv heads = heads, no window) where transformers derives
    them (Qwen3's head_dim null has no meaning there)."""
    d = {"model_type": FAMILIES[family].hf_model_type, **SPARSE}
    if nulls:  # (transformers 5's MistralConfig refuses a null num_key_value_heads,
        windowed = family in ("mistral", "gemma3")  # (and Gemma3TextConfig's)
        d |= {"sliding_window": None} if windowed else {"num_key_value_heads": None}
    (tmp_path / "config.json").write_text(json.dumps(d))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
    ours = model_config_from_hf(d)
    assert ours == model_config_from_hf(theirs)
    want = {
        "llama": (32, 8, None, 2048),
        "mistral": (8, 8, 4096, 131072),
        "qwen2": (32, 8, None, 32768),
        "qwen3": (32, 128, None, 32768),
        "gemma3": (4, 256, 4096, 131072),
    }[family]
    if nulls:
        want = (want[0] if windowed else 32, want[1], None, want[3])
    assert (ours.n_kv_heads, ours.head_dim, ours.sliding_window, ours.max_seq_len) == want


# ---------------------------------------------------------------------- refused


def _big_tokenizer(path: Path) -> None:
    """An HF tokenizer.json with 300 ids (the models embed 257)."""
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(299)} | {"</s>": 299}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(path))


DROP = object()  # the key left out of config.json
REFUSED = [
    # (family, config.json changes, the one line names)
    (
        "llama",
        {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
        "model_type='gemma3'",
    ),
    ("llama", {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}, "model_type='phi3'"),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ("gemma3", {"attention_bias": True}, "attention_bias=True"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    (
        "gemma3",
        {"layer_types": ["full_attention", "sliding_attention"]},
        "layer_types (layer 1: 'sliding_attention')",
    ),
    (
        "gemma3",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e4},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e3},
            }
        },
        "rope_parameters.sliding_attention=",
    ),
    ("gemma3", {"rope_local_base_freq": 500.0}, "two different local RoPE bases"),
    (
        "qwen2",
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
        "rope_parameters.rope_type='longrope'",
    ),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh'"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True"),
    ("qwen2", {"mlp_bias": True}, "mlp_bias=True"),
    ("llama", {"attention_bias": True}, "attention_bias=True"),
    ("mistral", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=True"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=True"),
    (
        "llama",
        {"layer_types": ["full_attention", "sliding_attention"]},
        "layer_types=['full_attention', 'sliding_attention']",
    ),
    (
        "qwen2",
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
        "layer_types=['full_attention', 'sliding_attention']",
    ),
    (
        "mistral",
        {"layer_types": ["sliding_attention", "full_attention"]},
        "layer_types=['full_attention', 'sliding_attention']",
    ),
    # config and tensors disagree on the heads: named by config.json's keys
    ("mistral", {"head_dim": 16}, "head_dim=16"),
    ("llama", {"num_key_value_heads": 4}, "num_key_value_heads=4"),
    ("qwen3", {"head_dim": DROP}, "head_dim=128"),  # Qwen3Config's default: not 32
    ("qwen2", {"num_key_value_heads": DROP}, "num_key_value_heads=32"),  # Qwen2Config's
    ("qwen3", {"tokenizer": True}, "ids up to 299 (300 ids) but the model embeds 257"),
]


@pytest.mark.parametrize(
    "family, change, names", REFUSED, ids=[f"{f}-{next(iter(c))}" for f, c, _ in REFUSED]
)
def test_import_refuses_what_the_family_does_not_compute(
    folders, family, change, names, tmp_path, capsys
):
    src = tmp_path / "src"
    shutil.copytree(folders[family].path, src)
    change = dict(change)
    if change.pop("tokenizer", False):
        _big_tokenizer(src / "tokenizer.json")
    d = json.loads((src / "config.json").read_text())
    d = {k: v for k, v in {**d, **change}.items() if v is not DROP}
    (src / "config.json").write_text(json.dumps(d))
    out = tmp_path / "run"
    assert main(["import", "--model", str(src), "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("microscale import: error: "), err
    assert names in err[0] and "Traceback" not in err[0], err
    assert "config.json: config.json" not in err[0], err  # the file named once
    assert not out.exists()


# ---------------------------------------------------------------------- Gemma 3's image-text model

VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip


@pytest.mark.slow
def test_gemma3_image_text_checkpoint_comes_in_as_its_text_model(tmp_path):
    """``Gemma3ForConditionalGeneration`` (the 4B-27B checkpoints' class): microscale reads
    config.json's ``text_config`` and the ``language_model.`` tensors, leaves the vision
    tower out, and its logits on text are transformers' (the same float32 bound as the
    text class); the float export is the text model, ``Gemma3ForCausalLM``."""
    text = {**SHARED, **ROWS["gemma3"].keys, "vocab_size": 300}
    cfg = transformers.Gemma3Config(
        text_config=text, vision_config=VISION, mm_tokens_per_image=4,
        image_token_index=299, boi_token_index=297, eoi_token_index=298,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "mm")
    ck = read_checkpoint(tmp_path / "mm")
    assert ck.config.family == "gemma3" and ck.config.vocab_size == 300
    assert ck.config.sliding_window_pattern == 2 and ck.config.rope_local_theta == 1000.0
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(TOKENS)).logits.float().numpy()
    got = np.asarray(InferenceModel.from_checkpoint(ck, compute_dtype="float32").logits(TOKENS))
    np.testing.assert_allclose(got, ref, atol=3e-5, rtol=0)
    out = tmp_path / "text"
    export_checkpoint(ck, out, layout="hf", dtype="float32", tokenizer=ByteTokenizer())
    back = _load(out)
    assert type(back).__name__ == "Gemma3ForCausalLM"
    np.testing.assert_allclose(_logits(back), ref, atol=3e-5, rtol=0)


def test_gemma3_hub_style_config_reads_as_transformers_reads_it(tmp_path):
    """A hub-style image-text config.json, whose text_config names only what differs from
    Gemma3TextConfig's defaults (gemma-3-4b's kind): microscale reads what transformers
    reads (every absent key: the config class's default)."""
    d = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                          "image_size": 896, "intermediate_size": 4304,
                          "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14},
        "mm_tokens_per_image": 256,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(d))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
    ours = model_config_from_hf(d)
    assert ours == model_config_from_hf(theirs)
    assert (ours.vocab_size, ours.n_heads, ours.n_kv_heads, ours.head_dim) == (262208, 8, 4, 256)
    assert (ours.sliding_window_pattern, ours.rope_theta, ours.rope_local_theta) == (6, 1e6, 1e4)
    assert ours.rope_scaling is not None and ours.rope_scaling.factor == 8.0
    assert ours.tie_embeddings and ours.query_pre_attn_scalar is None  # 256 = head_dim
