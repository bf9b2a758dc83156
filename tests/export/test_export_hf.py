"""Against transformers (optional: skipped without torch / transformers / compressed-tensors).

Tolerances (float32 logits of a random tiny Llama, |logits| ~ 1):
* microscale's inference engine in float32 vs transformers in float32: atol 1e-5 (same
  math, different summation order);
* microscale's ``Transformer`` vs transformers: atol 1e-2 (its bf16 recipe rounds every
  matmul operand to bfloat16, as in training);
* packed NVFP4 through compressed-tensors + transformers vs microscale's packed engine:
  atol 5e-3 (compressed-tensors decodes the weights into bfloat16, we keep float32).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", exc_type=ImportError)
transformers = pytest.importorskip("transformers", exc_type=ImportError)

from flax import nnx  # noqa: E402

from microscale.data import ByteTokenizer  # noqa: E402
from microscale.export import (  # noqa: E402
    build_model,
    export_checkpoint,
    flat_params,
    import_model,
    read_checkpoint,
)
from microscale.inference import InferenceModel  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, 257, (2, 24))


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
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
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms so a misplaced norm weight would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("hf")
    model.save_pretrained(out)
    return out, _hf_logits(model)


def test_hf_llama_imports_with_the_same_logits(hf_folder):
    folder, ref = hf_folder
    ck = read_checkpoint(folder)
    assert ck.layout == "hf" and not ck.config.tie_embeddings
    engine = InferenceModel.from_checkpoint(ck, compute_dtype="float32")
    np.testing.assert_allclose(np.asarray(engine.logits(TOKENS)), ref, atol=1e-5, rtol=0)
    model, cfg = import_model(folder)
    got = np.asarray(nnx.jit(lambda m, t: m(t))(model, TOKENS))
    np.testing.assert_allclose(got, ref, atol=1e-2, rtol=0)


def test_exported_model_loads_in_transformers(tiny_model, tiny_cfg, tmp_path):
    export_checkpoint(
        tiny_model, tmp_path, layer_formats="bf16", dtype="float32", tokenizer=ByteTokenizer()
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ref = _hf_logits(hf.eval())
    cfg32 = tiny_cfg.replace(compute_dtype="float32")
    engine = InferenceModel.from_params(tiny_model, cfg32)
    np.testing.assert_allclose(np.asarray(engine.logits(TOKENS)), ref, atol=1e-5, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "héllo, wörld"
    assert tok(text)["input_ids"] == ByteTokenizer().encode(text)
    assert tok.eos_token_id == 256
    # and back: import the exported folder, same weights as the source model
    back = flat_params(build_model(tiny_cfg, read_checkpoint(tmp_path).params))
    for k, v in flat_params(tiny_model).items():
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(v))


def test_packed_nvfp4_through_compressed_tensors_and_transformers(tiny_model, tmp_path):
    pytest.importorskip("compressed_tensors", exc_type=ImportError)
    export_checkpoint(tiny_model, tmp_path)
    try:  # decode the packed weights at load time (older releases: run_compressed=False)
        qc = transformers.CompressedTensorsConfig(dequantize=True)
    except TypeError:
        qc = transformers.CompressedTensorsConfig(run_compressed=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=qc
    )
    ref = _hf_logits(hf.eval())
    engine = InferenceModel.from_checkpoint(tmp_path, compute_dtype="float32")
    assert engine.memory_stats().packed_layers == 14
    np.testing.assert_allclose(np.asarray(engine.logits(TOKENS)), ref, atol=5e-3, rtol=0)
