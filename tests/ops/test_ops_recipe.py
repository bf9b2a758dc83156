"""Recipes: presets, validation, hashing, JSON round trips."""

import dataclasses
import json

import jax
import pytest

from microscale.ops import OperandSpec, Recipe, get_recipe, list_recipes, make_dot_general

REQUIRED = [
    "bf16",
    "fp8",
    "fp8_e4m3",
    "mxfp8",
    "nvfp4",
    "mxfp4",
    "nvfp4_no_rht",
    "nvfp4_no_sr",
    "nvfp4_1d",
    "nvfp4_fwd_only",
]


def test_required_presets_exist():
    assert set(REQUIRED) <= set(list_recipes())
    for name in list_recipes():
        assert get_recipe(name).name == name


@pytest.mark.parametrize("name", list_recipes())
def test_hashable_and_json_round_trip(name):
    r = get_recipe(name)
    hash(r)
    back = Recipe.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and hash(back) == hash(r)
    assert get_recipe(r.to_dict()) == r
    assert get_recipe(r) is r


def test_unknown_recipe_names_valid_ones():
    with pytest.raises(ValueError, match="unknown recipe 'nvfp5'.*'bf16'.*'nvfp4'"):
        get_recipe("nvfp5")


def test_nvfp4_matches_design():
    r = get_recipe("nvfp4")
    assert r.fprop_x == OperandSpec(format="nvfp4")
    assert r.fprop_w == r.dgrad_w == OperandSpec(format="nvfp4", block_shape=(16, 16))
    assert r.dgrad_dy.rounding == r.wgrad_dy.rounding == "stochastic"
    assert r.wgrad_x.rounding == "nearest"
    assert r.wgrad_x.hadamard == r.wgrad_dy.hadamard == 16
    assert r.dgrad_dy.hadamard is None and r.fprop_x.hadamard is None
    assert r.reuses_fprop_w and r.needs_key and r.quantized


def test_ablations_switch_one_thing():
    base = get_recipe("nvfp4")
    assert get_recipe("nvfp4_no_rht") == base.replace(
        name="nvfp4_no_rht",
        wgrad_x=OperandSpec(format="nvfp4"),
        wgrad_dy=OperandSpec(format="nvfp4", rounding="stochastic"),
    )
    no_sr = get_recipe("nvfp4_no_sr")
    assert not no_sr.needs_key and no_sr.wgrad_dy.hadamard == 16
    one_d = get_recipe("nvfp4_1d")
    assert one_d.fprop_w.block_shape is None and not one_d.reuses_fprop_w
    fwd = get_recipe("nvfp4_fwd_only")
    assert fwd.fprop_x == base.fprop_x and fwd.fprop_w == base.fprop_w
    assert not any(s.quantized for s in (fwd.dgrad_dy, fwd.dgrad_w, fwd.wgrad_x, fwd.wgrad_dy))
    assert not get_recipe("bf16").quantized and not get_recipe("bf16").needs_key
    fp8 = get_recipe("fp8")
    assert fp8.fprop_x.format == "fp8_e4m3" and fp8.dgrad_dy.format == "fp8_e5m2"
    assert fp8.reuses_fprop_w


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(format="nvfp5"), "unknown format 'nvfp5'"),
        (dict(format="nvfp4", rounding="up"), "unknown rounding 'up'"),
        (dict(format="nvfp4", block_shape=(32, 32)), r"block size is 16"),
        (dict(format="fp8_e4m3", block_shape=(16, 16)), r"block size is None"),
        (dict(format="nvfp4", block_shape=(16,)), "block_shape"),
        (dict(format="nvfp4", hadamard=12), "power of two"),
        (dict(format="mxfp4", scale_rounding="round"), "scale_rounding"),
    ],
)
def test_operand_spec_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OperandSpec(**kwargs)


def test_recipe_errors():
    with pytest.raises(ValueError, match="same hadamard size"):
        Recipe(wgrad_x=OperandSpec(hadamard=16))
    with pytest.raises(TypeError, match="OperandSpec"):
        Recipe(fprop_x="nvfp4")
    with pytest.raises(ValueError, match="unknown Recipe field"):
        Recipe.from_dict({"name": "x", "fprop_q": {}})
    with pytest.raises(ValueError, match="unknown backend 'tpu9'"):
        make_dot_general("bf16", backend="tpu9")


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_recipe("nvfp4").name = "x"


def test_recipe_is_static_jit_metadata():
    g = jax.jit(lambda x, r: x + len(r.name), static_argnums=1)
    assert int(g(1, get_recipe("nvfp4"))) == 6
    assert int(g(1, Recipe.from_dict(get_recipe("nvfp4").to_dict()))) == 6
