"""Scaled RoPE against transformers: a tiny random ``LlamaForCausalLM`` per kind, built and
saved by transformers itself, imported by microscale (skipped without torch /
transformers).

The sequences (48 tokens) run past the original context (16 positions), so the scaling
changes the rotation of every pair it touches. Tolerances (float32 logits, |logits| ~ 1):

* microscale's inference engine in float32 vs transformers in float32: atol 3e-5
  (|logits| up to ~2.7; measured at most 1.1e-5). The same math in another summation order (~1e-6 per float32
  matmul of width 128, a few in a row), plus RoPE tables that differ by a few ulp
  (``tests/model/test_rope.py``): an angle ``p * w`` at p < 48 moves by < 48 * 4 ulp
  of ``w``, ~1e-5 rad at most, which moves q.k by ~1e-5 of its size.
* microscale's ``Transformer`` (training, PTQ) vs transformers: atol 0.25. Its bf16 recipe
  rounds every matmul operand to bfloat16 (2^-9 relative each), and the sharp attention
  of these weights (q/k scaled up so that positions matter) amplifies that: measured at
  most 0.17. The default RoPE misses the reference by more than 1 past the original
  context (asserted), so the scaling is what this pins there.
* greedy generation with the KV cache vs transformers' ``generate``: token for token
  (argmax of logits that agree to 3e-5; a random tiny model has no near-ties at that
  level, and a tie would show as one differing token, not as a pass).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", exc_type=ImportError)
transformers = pytest.importorskip("transformers", exc_type=ImportError)

from flax import nnx  # noqa: E402

from microscale.cli import main  # noqa: E402
from microscale.data import ByteTokenizer  # noqa: E402
from microscale.export import build_model, export_checkpoint, read_checkpoint  # noqa: E402
from microscale.export.hf import hf_config, model_config_from_hf  # noqa: E402
from microscale.inference import GenerationConfig, InferenceModel  # noqa: E402
from microscale.model import ModelConfig, RopeScaling, Transformer  # noqa: E402
from microscale.train import load_checkpoint  # noqa: E402

ORIGINAL = 16  # the "pretraining" context of these tiny models
LONG = 48  # the sequences: past ORIGINAL
PROMPT = 6
TOKENS = np.random.default_rng(0).integers(0, 257, (2, LONG))

# kind -> (rope_scaling as transformers takes it, max_position_embeddings). Dynamic NTK's
# original length is max_position_embeddings itself; the others' is in the dict.
KINDS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, 64),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
        64,
    ),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
        64,
    ),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, ORIGINAL),
}


def _hf_model(kind: str):
    rope, context = KINDS[kind]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=257,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        rope_theta=500.0,  # pair wavelengths 6.3 ... 2900: all three llama3 regimes at L=16
        rope_scaling=dict(rope),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.05,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norms so a misplaced norm weight would show
                p.add_(0.2 * torch.randn_like(p))
            if "q_proj" in name or "k_proj" in name:  # sharp attention: positions matter
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module", params=sorted(KINDS))
def hf_folder(request, tmp_path_factory):
    """(kind, folder saved by transformers' save_pretrained)."""
    out = tmp_path_factory.mktemp(f"hf-{request.param}")
    _hf_model(request.param).save_pretrained(out)
    ByteTokenizer().save(out / "tokenizer.json")
    return request.param, out


def _fresh(folder):
    """A new transformers model from the folder: dynamic NTK keeps state between calls."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_logits(folder, tokens) -> np.ndarray:
    with torch.no_grad():
        return _fresh(folder)(torch.tensor(tokens)).logits.float().numpy()


def test_the_folder_comes_in_with_its_rope(hf_folder):
    kind, folder = hf_folder
    cfg = read_checkpoint(folder).config
    assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == kind
    assert cfg.rope_scaling.factor == 4.0 and cfg.rope_theta == 500.0
    if kind != "linear":
        assert cfg.rope_scaling.original_max_position_embeddings == ORIGINAL
    # dynamic runs past config.json's max_position_embeddings (its L): factor * L
    assert cfg.max_seq_len == (4 * ORIGINAL if kind == "dynamic" else 64)


@pytest.mark.slow
@pytest.mark.parametrize("length", [12, LONG])
def test_logits_equal_transformers_below_and_past_the_original_context(hf_folder, length):
    kind, folder = hf_folder
    tokens = TOKENS[:, :length]
    ref = _hf_logits(folder, tokens)
    ck = read_checkpoint(folder)
    engine = InferenceModel.from_checkpoint(ck, compute_dtype="float32")
    np.testing.assert_allclose(np.asarray(engine.logits(tokens)), ref, atol=3e-5, rtol=0)
    model = build_model(ck.config, ck.params)
    got = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
    np.testing.assert_allclose(got, ref, atol=0.25, rtol=0)
    if length == LONG:  # the scaling matters here: the default RoPE's logits are others
        plain = ck.config.replace(compute_dtype="float32", rope_scaling=None)
        if kind == "dynamic":
            plain = plain.replace(max_seq_len=LONG)
        off = np.asarray(InferenceModel.from_params(ck.params, plain).logits(tokens))
        assert np.abs(off - ref).max() > 1.0


@pytest.mark.slow
def test_greedy_generation_equals_transformers_generate(hf_folder):
    kind, folder = hf_folder
    prompt = TOKENS[0, :PROMPT]
    n_new = LONG - PROMPT  # crosses the original context
    with torch.no_grad():
        ref = _fresh(folder).generate(
            torch.tensor(prompt[None]),
            attention_mask=torch.ones((1, PROMPT), dtype=torch.long),
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            pad_token_id=0,
        )[0, PROMPT:]
    engine = InferenceModel.from_checkpoint(read_checkpoint(folder), compute_dtype="float32")
    out = engine.generate([prompt.tolist()], GenerationConfig(max_new_tokens=n_new))
    assert out.tokens[0, : out.lengths[0]].tolist() == ref.tolist()


def test_exported_config_loads_in_transformers_with_the_same_rope(hf_folder, tmp_path):
    """microscale's config.json (both forms written) -> transformers: the same inverse
    frequencies and attention scaling as the folder transformers wrote itself."""
    kind, folder = hf_folder
    ours = model_config_from_hf(json.loads((folder / "config.json").read_text()))
    theirs = _fresh(folder).model.rotary_emb
    (tmp_path / "config.json").write_text(json.dumps(hf_config(ours)))
    back = transformers.AutoConfig.from_pretrained(tmp_path)
    again = transformers.LlamaForCausalLM(back).model.rotary_emb
    assert again.rope_type == theirs.rope_type == kind
    np.testing.assert_array_equal(again.inv_freq.numpy(), theirs.inv_freq.numpy())
    assert again.attention_scaling == theirs.attention_scaling
    assert again.original_max_seq_len == theirs.original_max_seq_len
    assert model_config_from_hf(back.to_dict()) == ours


@pytest.mark.slow
def test_microscale_import_cli_keeps_the_rope(hf_folder, tmp_path):
    kind, folder = hf_folder
    out = tmp_path / "run"
    assert main(["import", "--model", str(folder), "--out", str(out), "-q"]) == 0
    _, cfg, _ = load_checkpoint(out)
    assert cfg.model.rope_scaling == read_checkpoint(folder).config.rope_scaling
    assert cfg.model.rope_scaling is not None and cfg.model.rope_scaling.kind == kind


# microscale's side of the tiny models above.
SMALL = ModelConfig(
    vocab_size=257,
    d_model=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=256,
    max_seq_len=64,
    rope_theta=500.0,
)
ROUND_TRIPS = [
    RopeScaling(kind="linear", factor=2.5),
    RopeScaling(kind="dynamic", factor=2.0, original_max_position_embeddings=32),
    RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=16),
    RopeScaling(
        kind="llama3",
        factor=32.0,
        low_freq_factor=2.0,
        high_freq_factor=8.0,
        original_max_position_embeddings=8192,
    ),
    RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16),
    RopeScaling(
        kind="yarn",
        factor=8.0,
        original_max_position_embeddings=32,
        beta_fast=16.0,
        beta_slow=2.0,
        mscale=0.707,
        mscale_all_dim=1.0,
        truncate=False,
    ),
    RopeScaling(kind="yarn", factor=2.0, original_max_position_embeddings=32, attention_factor=1.5),
]


@pytest.mark.parametrize("rope", ROUND_TRIPS, ids=lambda r: r.kind)
def test_config_json_round_trip_and_transformers_agrees(rope, tmp_path):
    """ModelConfig -> config.json -> ModelConfig is the identity, and transformers reading
    that config.json builds the tables microscale computes."""
    cfg = SMALL.replace(rope_scaling=rope)
    d = hf_config(cfg)
    assert model_config_from_hf(d) == cfg
    # either form alone reads back the same (transformers 4.x / 5.x)
    four = {k: v for k, v in d.items() if k != "rope_parameters"}
    five = {k: v for k, v in d.items() if k not in ("rope_scaling", "rope_theta")}
    assert model_config_from_hf(four) == model_config_from_hf(five) == cfg
    (tmp_path / "config.json").write_text(json.dumps(d))
    emb = transformers.LlamaForCausalLM(
        transformers.AutoConfig.from_pretrained(tmp_path)
    ).model.rotary_emb
    assert emb.rope_type == rope.kind
    cos, _ = _tables(cfg)
    x = torch.zeros((1, 1, 1))
    hf_cos, _ = emb(x, torch.arange(cfg.max_seq_len)[None])
    half = cfg.head_dim // 2
    # angles p * w at p < 64 with w within a few ulp of transformers' (|w| <= 1): 64 * 8
    # ulp(1) = 6e-5 at most, and torch's cos and XLA's round differently
    np.testing.assert_allclose(cos, hf_cos[0, :, :half].numpy(), atol=1e-4, rtol=0)


def _tables(cfg: ModelConfig):
    import jax.numpy as jnp

    from microscale.model import rope_tables

    cos, sin = rope_tables(
        jnp.arange(cfg.max_seq_len), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    )
    return np.asarray(cos), np.asarray(sin)


def test_an_exported_folder_with_rope_loads_in_transformers_with_the_same_logits(tmp_path):
    cfg = SMALL.replace(
        rope_scaling=RopeScaling(kind="llama3", factor=4.0, original_max_position_embeddings=16),
        compute_dtype="float32",
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    export_checkpoint(
        model, tmp_path, layer_formats="bf16", dtype="float32", tokenizer=ByteTokenizer()
    )
    ref = _hf_logits(tmp_path, TOKENS)
    got = np.asarray(InferenceModel.from_params(model, cfg).logits(TOKENS))
    np.testing.assert_allclose(got, ref, atol=3e-5, rtol=0)
