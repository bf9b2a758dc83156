"""Per-layer precision rules: matching, JSON, defaults, apply_rules on any NNX model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from microscale.model import (
    BF16_LAYOUTS,
    ModelConfig,
    PrecisionRules,
    QLinear,
    Transformer,
    apply_rules,
    assignments,
    default_bf16_last,
    late_switch,
    quantized_blocks,
)
from microscale.ops import Recipe, get_recipe


def test_first_match_wins_and_fullmatch():
    rules = PrecisionRules(
        rules=(
            (r"layers\.1\..*", "bf16"),
            (r"layers\.\d+\.mlp\..*", "mxfp8"),
            (r".*q_proj", "fp8"),
        ),
        default="nvfp4",
    )
    assert rules.resolve("layers.1.mlp.up_proj") == "bf16"  # first rule beats the second
    assert rules.resolve("layers.2.mlp.up_proj") == "mxfp8"
    assert rules.resolve("layers.2.attn.q_proj") == "fp8"
    assert rules.resolve("layers.2.attn.k_proj") == "nvfp4"  # default
    assert rules.resolve("layers.10.attn.k_proj") == "nvfp4"  # 'layers\.1\.' not a prefix hit
    # fullmatch: a rule for "layers.1" does not match "layers.11..." or a suffix
    r2 = PrecisionRules(rules=(("q_proj", "bf16"),), default="nvfp4")
    assert r2.resolve("layers.0.attn.q_proj") == "nvfp4"


def test_rule_validation():
    with pytest.raises(ValueError, match=r"unknown recipe 'nvfp5'"):
        PrecisionRules(rules=((".*", "nvfp5"),))
    with pytest.raises(ValueError, match=r"rules\[0\] pattern '\(' is not a valid regex"):
        PrecisionRules(rules=(("(", "bf16"),))
    with pytest.raises(ValueError, match=r"rules\[0\]=.*expected a \(regex, recipe\) pair"):
        PrecisionRules(rules=(("a", "bf16", "x"),))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rule'\]"):
        PrecisionRules.from_dict({"rule": []})


def test_json_round_trip(tmp_path):
    custom = get_recipe("nvfp4").replace(name="nvfp4_custom", hadamard_seed=7)
    rules = PrecisionRules(
        rules=((r"layers\.3\..*", "bf16"), (r".*down_proj", custom)), default="nvfp4"
    )
    again = PrecisionRules.from_json(rules.to_json())
    assert again == rules
    assert isinstance(again.rules[1][1], Recipe) and again.rules[1][1].hadamard_seed == 7
    path = tmp_path / "rules.json"
    rules.save(path)
    assert PrecisionRules.load(path) == rules
    assert PrecisionRules.from_json('{"rules": [["a", "fp8"]]}').default == "bf16"


@pytest.mark.parametrize("n,last", [(1, 1), (4, 1), (8, 1), (12, 2), (16, 2), (32, 5), (62, 9)])
def test_default_last_15_percent(n, last):
    assert default_bf16_last(n) == last
    if n == 1:
        return  # refused: see test_defaults_that_quantize_little_warn_or_refuse
    rules = PrecisionRules.for_recipe("nvfp4", n)
    kept = [i for i in range(n) if rules.resolve(f"layers.{i}.attn.q_proj") == "bf16"]
    assert kept == list(range(n - last, n))
    assert all(rules.resolve(f"layers.{i}.mlp.down_proj") == "nvfp4" for i in range(n - last))


def test_for_recipe_options():
    assert PrecisionRules.for_recipe("bf16", 8) == PrecisionRules(default="bf16")
    r = PrecisionRules.for_recipe("nvfp4", 62, bf16_first=2, bf16_last=8)  # the paper's 12B
    kept = [i for i in range(62) if r.resolve(f"layers.{i}.mlp.up_proj") == "bf16"]
    assert kept == [0, 1, *range(54, 62)]
    assert PrecisionRules.for_recipe("mxfp4", 4, bf16_last=0) == PrecisionRules(default="mxfp4")
    with pytest.raises(ValueError, match=r"bf16_first=3 \+ bf16_last=2 exceeds n_layers=4"):
        PrecisionRules.for_recipe("nvfp4", 4, bf16_first=3, bf16_last=2)
    with pytest.raises(ValueError, match=r"bf16_last=-1: expected an int >= 0"):
        PrecisionRules.for_recipe("nvfp4", 4, bf16_last=-1)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8", "fp8"])
def test_defaults_that_quantize_little_warn_or_refuse(recipe):
    # 1 block: the default (last 15%, at least 1) would quantize nothing -> refused.
    with pytest.raises(
        ValueError,
        match=rf"recipe '{recipe}' on 1 block\(s\) keeps 1 in bf16"
        r".*no block would be quantized: set bf16_last=0",
    ):
        PrecisionRules.for_recipe(recipe, 1)
    # Asked for explicitly: allowed, with a warning.
    with pytest.warns(UserWarning, match="no block is quantized"):
        r = PrecisionRules.for_recipe(recipe, 4, bf16_first=2, bf16_last=2)
    assert r.resolve("layers.3.attn.q_proj") == "bf16"
    # Half or more in bf16 (2 blocks -> 1; the paper's layout on 16 blocks): a warning.
    with pytest.warns(UserWarning, match="only 1 of 2 blocks are quantized"):
        PrecisionRules.for_recipe(recipe, 2)
    with pytest.warns(UserWarning, match="only 6 of 16 blocks are quantized"):
        PrecisionRules.for_recipe(recipe, 16, bf16_first=2, bf16_last=8)
    # bf16 itself, bf16_last=0 and the usual sizes: silent.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PrecisionRules.for_recipe("bf16", 1)
        PrecisionRules.for_recipe(recipe, 1, bf16_last=0)
        PrecisionRules.for_recipe(recipe, 4)
        PrecisionRules.for_recipe(recipe, 62, bf16_first=2, bf16_last=8)


@pytest.mark.parametrize(
    "assign, quantized, high",
    [
        (
            {
                "layers.0.attn.q_proj": "nvfp4",
                "layers.0.mlp.up_proj": "bf16",
                "layers.1.attn.q_proj": "bf16",
                "layers.10.mlp.down_proj": "fp8",
            },
            [0, 10],
            [1],
        ),
        ({"layers.0.attn.q_proj": "bf16", "head": "nvfp4"}, [], [0]),
        ({"blocks.2.fc1": None, "layers.3.x": "mxfp4"}, [3], []),
        ({}, [], []),
    ],
)
def test_quantized_blocks_table(assign, quantized, high):
    assert quantized_blocks(assign) == (quantized, high)


def test_paper_12b_layout_is_named():
    from microscale.train import PrecisionConfig, TrainConfig

    assert BF16_LAYOUTS["paper_12b"] == (2, 8)
    layout = PrecisionConfig(kind="layout", layout="paper_12b")
    model = _small_cfg(n_layers=62, max_seq_len=256)
    rules = TrainConfig(recipe="nvfp4", model=model, precision=layout).precision_rules()
    kept = [i for i in range(62) if rules.resolve(f"layers.{i}.mlp.up_proj") == "bf16"]
    assert kept == [0, 1, *range(54, 62)]
    with pytest.raises(
        ValueError, match="precision.bf16_last=3 is not read by precision.kind='layout'"
    ):
        PrecisionConfig(kind="layout", layout="paper_12b", bf16_last=3)
    with pytest.raises(ValueError, match=r"precision.layout='paper'.*\['paper_12b'\]"):
        PrecisionConfig(kind="layout", layout="paper")
    with pytest.raises(ValueError, match="bf16_first=2 \\+ bf16_last=8 exceeds n_layers=4"):
        TrainConfig(recipe="nvfp4", model=_small_cfg(max_seq_len=256), precision=layout)


def _small_cfg(**kw):
    base = dict(
        vocab_size=64, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    return ModelConfig(**{**base, **kw})


def test_transformer_assignments():
    cfg = _small_cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0), rules=PrecisionRules.for_recipe("nvfp4", 4))
    got = assignments(model)
    assert len(got) == 4 * 7
    assert {p for p, r in got.items() if r == "bf16"} == {
        f"layers.3.{m}"
        for m in (
            "attn.q_proj",
            "attn.k_proj",
            "attn.v_proj",
            "attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert model.layers[0].attn.q_proj.recipe == "nvfp4"
    assert got == model.rules.assignments(model)
    # Late switch re-applies rules in place.
    model.set_rules(late_switch(model.rules, "all"))
    assert set(assignments(model).values()) == {"bf16"}


class UserMLP(nnx.Module):
    """A user's own model: plain flax layers, nothing microscale."""

    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([nnx.Linear(64, 64, rngs=rngs) for _ in range(3)])
        self.mix = nnx.Einsum("bi,io->bo", (64, 64), rngs=rngs)
        self.head = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        for blk in self.blocks:
            x = jax.nn.gelu(blk(x))
        return self.head(self.mix(x))


@pytest.mark.slow
def test_apply_rules_on_user_model():
    x = jax.random.normal(jax.random.key(1), (32, 64), jnp.float32)
    model = UserMLP(nnx.Rngs(0))
    fwd = nnx.jit(lambda m, x: m(x))  # retraces when the rules change the graph's statics
    y_plain = fwd(model, x)
    rules = PrecisionRules(rules=((r"head", "bf16"),), default="nvfp4")
    touched = apply_rules(model, rules)
    assert touched == {
        "blocks.0": "nvfp4",
        "blocks.1": "nvfp4",
        "blocks.2": "nvfp4",
        "mix": "nvfp4",
        "head": "bf16",
    }
    assert model.blocks[0].dot_general is not jax.lax.dot_general
    assert assignments(model) == touched
    y_nvfp4 = fwd(model, x)

    apply_rules(model, PrecisionRules(default="bf16"))
    y_bf16 = fwd(model, x)
    # bf16 recipe ~ the plain f32 model up to bf16 rounding; nvfp4 is visibly different.
    np.testing.assert_allclose(y_bf16, y_plain, atol=0.05, rtol=0.05)
    assert float(jnp.abs(y_nvfp4 - y_bf16).max()) > 1e-2

    # Gradients flow through the quantized dot_general (fixed per-layer SR key) under jit.
    apply_rules(model, rules)

    @nnx.jit
    def grads(m, x):
        return nnx.grad(lambda m: jnp.mean(m(x) ** 2))(m)

    g = grads(model, x)
    leaves = jax.tree.leaves(g)
    assert leaves and all(bool(jnp.isfinite(v).all()) for v in leaves)
    assert float(jnp.abs(g["blocks"][0]["kernel"][...]).sum()) > 0


def test_default_none_leaves_layers_alone():
    model = UserMLP(nnx.Rngs(0))
    touched = apply_rules(model, PrecisionRules(rules=((r"blocks\.0", "fp8"),), default=None))
    assert touched["blocks.0"] == "fp8" and touched["head"] is None
    assert model.head.dot_general is jax.lax.dot_general


def test_late_switch_forward_only():
    rules = PrecisionRules.for_recipe("nvfp4", 4)
    fwd = late_switch(rules, "forward")
    r = get_recipe(fwd.default)
    nv = get_recipe("nvfp4")
    assert r.name == "nvfp4+bf16_forward"
    assert not r.fprop_x.quantized and not r.fprop_w.quantized
    assert (r.dgrad_dy, r.wgrad_x, r.wgrad_dy) == (nv.dgrad_dy, nv.wgrad_x, nv.wgrad_dy)
    assert fwd.resolve("layers.3.attn.q_proj") == "bf16"  # bf16 layers stay bf16
    assert PrecisionRules.from_json(fwd.to_json()) == fwd
    with pytest.raises(ValueError, match="late_switch bf16='both'"):
        late_switch(rules, "both")  # type: ignore[arg-type]

    # On a layer: the forward equals bf16's, the gradients do not (backward still NVFP4).
    lin = QLinear(64, 32, rngs=nnx.Rngs(0), recipe=fwd.default, layer_id=1)
    x = jax.random.normal(jax.random.key(0), (32, 64))
    key = jax.random.key(3)

    @nnx.jit
    def value_and_grads(m):
        return nnx.value_and_grad(lambda m: jnp.mean(m(x, key=key).astype(jnp.float32) ** 2))(m)

    l_fwd, g_fwd = value_and_grads(lin)
    lin.recipe = "bf16"
    l_bf16, g_bf16 = value_and_grads(lin)
    assert float(l_fwd) == float(l_bf16)
    assert not np.allclose(g_fwd["kernel"][...], g_bf16["kernel"][...])


def test_qlinear_dtypes_and_per_layer_keys():
    lin = QLinear(64, 32, rngs=nnx.Rngs(0), recipe="nvfp4", layer_id=5)
    x = jax.random.normal(jax.random.key(0), (16, 64))
    key = jax.random.key(0)

    @nnx.jit
    def run(m):
        return nnx.value_and_grad(
            lambda m: jnp.sum(m(x, key=key).astype(jnp.float32) ** 2),
            argnums=nnx.DiffState(0, nnx.Param),
        )(m)

    y = nnx.jit(lambda m, x: m(x))(lin, x)
    assert y.shape == (16, 32) and y.dtype == jnp.bfloat16
    assert lin.kernel[...].dtype == jnp.float32 and lin.kernel[...].shape == (64, 32)
    _, g5 = run(lin)
    _, g5_again = run(lin)
    lin.layer_id = 6  # same step key, another layer: other stochastic-rounding bits
    _, g6 = run(lin)
    np.testing.assert_array_equal(g5["kernel"][...], g5_again["kernel"][...])
    assert not np.array_equal(g5["kernel"][...], g6["kernel"][...])
    with pytest.raises(ValueError, match="unknown recipe"):
        QLinear(64, 32, rngs=nnx.Rngs(0), recipe="int3")
