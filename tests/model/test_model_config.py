"""ModelConfig: presets, parameter counts, validation, serialization."""

import dataclasses

import jax
import pytest
from flax import nnx

from microscale.model import ModelConfig, Transformer, list_presets


def _abstract_param_count(cfg: ModelConfig) -> int:
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,lo,hi",
    [
        ("tiny", 1.0e6, 3.0e6),
        ("small", 20e6, 30e6),
        ("gpt2-124m", 120e6, 128e6),
        ("llama-1b", 1.20e9, 1.27e9),
        ("llama-8b", 7.9e9, 8.1e9),
        ("llama-70b", 70.0e9, 71.0e9),
    ],
)
def test_preset_param_counts(name, lo, hi):
    cfg = ModelConfig.preset(name)
    n = cfg.num_params()
    assert lo <= n <= hi, f"{name}: {n:,}"
    # The arithmetic count equals what the model allocates (abstractly: no memory used).
    assert _abstract_param_count(cfg) == n


def test_known_sizes_exact():
    assert ModelConfig.llama_1b().num_params() == 1_235_814_400  # Llama 3.2 1B
    assert ModelConfig.llama_8b().num_params() == 8_030_261_248  # Llama 3.1 8B
    assert ModelConfig.llama_70b().num_params() == 70_553_706_496  # Llama 3.1 70B


def test_preset_names():
    assert list_presets() == ["tiny", "small", "gpt2-124m", "llama-1b", "llama-8b", "llama-70b"]
    assert ModelConfig.preset("gpt2_124m") == ModelConfig.gpt2_124m()
    assert ModelConfig.preset("LLAMA-1B") == ModelConfig.llama_1b()
    with pytest.raises(ValueError, match="unknown model preset 'huge'.*tiny"):
        ModelConfig.preset("huge")


def test_untied_adds_head():
    cfg = ModelConfig.tiny()
    untied = cfg.replace(tie_embeddings=False)
    assert untied.num_params() - cfg.num_params() == cfg.d_model * cfg.vocab_size
    assert _abstract_param_count(untied) == untied.num_params()


def test_round_trip_and_frozen():
    for name in list_presets():
        cfg = ModelConfig.preset(name)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    cfg = ModelConfig.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        ModelConfig(128)  # type: ignore[misc]  # kw_only
    assert ModelConfig.from_dict({"rope_theta": 500000}).rope_theta == 500000.0


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"d_model": 100}, r"d_model=100 is not divisible by n_heads=8"),
        ({"d_model": 192, "n_heads": 5}, r"d_model=192 is not divisible by n_heads=5"),
        ({"n_heads": 4, "n_kv_heads": 3}, r"n_heads=4 is not divisible by n_kv_heads=3"),
        ({"d_ff": 500}, r"d_ff=500 is not a multiple of dim_multiple=32.*e\.g\. 512"),
        (
            {"d_model": 144, "n_heads": 6, "n_kv_heads": 6},
            r"d_model=144 is not a multiple of "
            r"dim_multiple=32",
        ),
        ({"n_layers": 0}, r"n_layers=0: expected a positive int"),
        ({"compute_dtype": "fp4"}, r"compute_dtype='fp4': expected one of"),
        ({"norm_eps": -1.0}, r"norm_eps=-1.0: expected a positive float"),
        ({"d_model": 192, "n_heads": 64, "n_kv_heads": 64}, r"head_dim .* = 3 is odd"),
    ],
)
def test_validation_errors(changes, match):
    base = {"d_model": 192, "n_heads": 8, "n_kv_heads": 2, "d_ff": 512}
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**base, **changes})


def test_dim_multiple_16_allows_nvfp4_only_shapes():
    cfg = ModelConfig(d_model=144, n_heads=6, n_kv_heads=6, d_ff=400, dim_multiple=16)
    assert cfg.head_dim == 24


def test_from_dict_errors():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['dmodel'\]; expected some of"):
        ModelConfig.from_dict({"dmodel": 128})
    with pytest.raises(TypeError, match=r"ModelConfig.d_model='128' \(str\): expected int"):
        ModelConfig.from_dict({"d_model": "128"})
    with pytest.raises(TypeError, match=r"tie_embeddings=1 \(int\): expected bool"):
        ModelConfig.from_dict({"tie_embeddings": 1})
    with pytest.raises(TypeError, match=r"n_layers=True \(bool\): expected int"):
        ModelConfig.from_dict({"n_layers": True})
