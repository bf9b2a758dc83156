"""Unit tests of the trainer's pieces: config, presets, schedule, step, stats, mesh."""

from __future__ import annotations

import dataclasses
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from microscale.config import ConfigError, apply_overrides, field_comments, load_yaml, to_dict
from microscale.data import DataConfig
from microscale.model import logical_to_mesh_spec
from microscale.ops import OperandSpec
from microscale.train import (
    LateSwitchConfig,
    MeshConfig,
    OptimConfig,
    PrecisionConfig,
    SensitivityConfig,
    TrainConfig,
    build_state,
    list_presets,
    lr_schedule,
    make_train_step,
    resolve_config,
    weight_quant_stats,
)
from microscale.train.mesh import build_mesh, resolve_mesh_shape

from .conftest import TEST_MODEL


@pytest.mark.parametrize("name", list_presets())
def test_preset_yaml_files_are_the_presets(name):
    path = resources.files("microscale") / "configs" / f"{name.replace('-', '_')}.yaml"
    assert load_yaml(TrainConfig, path) == TrainConfig.preset(name)
    assert resolve_config(name) == TrainConfig.preset(name)
    assert resolve_config(str(path)) == TrainConfig.preset(name)


def test_every_config_field_has_a_comment():
    for cls in (
        TrainConfig,
        OptimConfig,
        LateSwitchConfig,
        MeshConfig,
        PrecisionConfig,
        SensitivityConfig,
    ):
        names = {f.name for f in dataclasses.fields(cls)}
        assert set(field_comments(cls)) == names, cls


def test_train_config_overrides_and_validation():
    cfg = resolve_config(
        "tiny",
        [
            "recipe=nvfp4",
            "lr=1e-3",
            "batch_size=8",
            "model=small",
            "seq_len=64",
            "precision.late.bf16=forward",
            "mesh.fsdp=2",
        ],
    )
    assert (
        cfg.recipe,
        cfg.optim.lr,
        cfg.data.batch_size,
        cfg.model.d_model,
        cfg.data.seq_len,
        cfg.precision.late.bf16,
        cfg.mesh.fsdp,
    ) == ("nvfp4", 1e-3, 8, 512, 64, "forward", 2)
    with pytest.raises(ConfigError, match="unknown recipe 'nvfp5'.*nvfp4"):
        resolve_config("tiny", ["recipe=nvfp5"])
    with pytest.raises(ConfigError, match="seq_len=512 exceeds model.max_seq_len=256"):
        resolve_config("tiny", ["seq_len=512"])
    with pytest.raises(ConfigError, match="mxfp4.*blocks of 32.*d_ff=48"):
        resolve_config("tiny", ["model.dim_multiple=16", "model.d_ff=48", "recipe=mxfp4"])
    with pytest.raises(ConfigError, match="bf16_first=3 \\+ bf16_last=3 exceeds n_layers=4"):
        resolve_config("tiny", ["recipe=nvfp4", "precision.bf16_last=3", "precision.bf16_first=3"])
    # Validated once after all overrides: both orders of a valid pair are accepted, even
    # where the first alone would exceed the layer count with the other's old value.
    for order in (
        ["precision.bf16_first=3", "precision.bf16_last=0"],
        ["precision.bf16_last=0", "precision.bf16_first=3"],
    ):
        with pytest.warns(UserWarning, match="only 1 of 4 blocks are quantized"):
            cfg = resolve_config("tiny", ["recipe=nvfp4", *order])
        assert (cfg.precision.bf16_first, cfg.precision.bf16_last) == (3, 0), order
    with pytest.raises(ConfigError, match="precision.late.fraction"):
        resolve_config("tiny", ["precision.late.fraction=1.5"])
    with pytest.raises(ConfigError, match="did you mean 'optim.warmup_steps'"):
        resolve_config("tiny", ["optim.warmup=3"])
    with pytest.raises(ConfigError, match="unknown train preset 'huge'"):
        resolve_config("huge")
    assert to_dict(TrainConfig.tiny())["optim"]["betas"] == [0.9, 0.95]


def test_switch_step_and_rules():
    cfg = apply_overrides(
        TrainConfig.tiny(), ["steps=100", "precision.late.fraction=0.18", "recipe=nvfp4"]
    )
    assert cfg.switch_step == 82
    rules = cfg.precision_rules()
    assert rules.resolve_name("layers.0.attn.q_proj") == "nvfp4"
    assert rules.resolve_name("layers.3.mlp.up_proj") == "bf16"  # last 15% of 4 blocks


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_lr_schedules(schedule):
    opt = OptimConfig(
        lr=1.0, warmup_steps=10, schedule=schedule, min_lr_ratio=0.1, decay_fraction=0.2
    )
    f = lr_schedule(opt, 100)
    lr = np.array([float(f(s)) for s in range(100)])
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert lr[-1] == pytest.approx(0.1, abs=0.02) and lr.min() >= 0.1 - 1e-6
    if schedule == "wsd":
        assert np.allclose(lr[10:80], 1.0) and lr[90] < 1.0
    else:
        assert np.all(np.diff(lr[10:]) <= 1e-7)


@pytest.mark.slow
def test_step_skips_nonfinite_updates():
    cfg = TrainConfig(model=TEST_MODEL, data=DataConfig(seq_len=32), recipe="bf16")
    st = build_state(cfg)
    fn = make_train_step(
        st.graphdefs["main"], st.tx, lr_schedule(cfg.optim, 10), seed=0, inject=True
    )
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 257, (1, 4, 33)), jnp.int32)
    p0 = jax.tree.map(np.asarray, st.params)
    o0 = jax.tree.map(np.asarray, st.opt_state)
    params, opt, m = fn(st.params, st.opt_state, st.rest, batch, jnp.int32(0), jnp.bool_(True))
    assert not bool(m["finite"]) and np.isfinite(float(m["loss"]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), p0)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, opt), o0)
    params, opt, m = fn(params, opt, st.rest, batch, jnp.int32(0), jnp.bool_(False))
    assert bool(m["finite"])
    moved = jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), b), params, p0)
    assert all(jax.tree.leaves(moved))


def test_weight_quant_stats():
    nv = OperandSpec(format="nvfp4", block_shape=(16, 16))
    const = jnp.full((32, 32), 0.5)
    assert weight_quant_stats(const, nv) == {"zero": 0.0, "saturated": 1.0, "scale_underflow": 0.0}
    zeros = weight_quant_stats(jnp.zeros((32, 32)), nv)
    assert zeros["zero"] == 1.0 and zeros["scale_underflow"] == 0.0
    # One huge block: the other three 16x16 tiles' scales underflow E4M3 -> 3/4 blocks lost.
    w = jnp.full((32, 32), 1e-6).at[:16, :16].set(1e6)
    s = weight_quant_stats(w, nv)
    assert s["scale_underflow"] == pytest.approx(0.75) and s["zero"] == pytest.approx(0.75)
    assert weight_quant_stats(const, OperandSpec()) is None  # bf16: nothing quantized
    mx = weight_quant_stats(const, OperandSpec(format="mxfp4"))
    assert mx["zero"] == 0.0


def test_mesh_shapes_and_specs():
    assert resolve_mesh_shape(MeshConfig(), 8) == (8, 1, 1)
    assert resolve_mesh_shape(MeshConfig(data=2, fsdp=-1, tensor=2), 8) == (2, 2, 2)
    with pytest.raises(ValueError, match="only 4 devices"):
        resolve_mesh_shape(MeshConfig(data=1, fsdp=8), 4)
    with pytest.raises(ValueError, match="not divisible"):
        resolve_mesh_shape(MeshConfig(data=-1, fsdp=3), 8)
    mesh = build_mesh(MeshConfig())
    # Size-1 mesh axes shard nothing (the trainer's specs: model.logical_to_mesh_spec).
    assert logical_to_mesh_spec(("embed", "heads"), (64, 64), mesh) == P(None, None)
    assert logical_to_mesh_spec(None, (3,), mesh) == P()


# The multi-process launch settings: each bad combination is refused before any process
# starts, by a line naming the setting and the value (the rows are the class: missing
# partners, an id outside the job, a malformed address, a timeout of no time).
MESH_LAUNCH_ERRORS = [
    (dict(process_id=1), "mesh.process_id=1 without mesh.coordinator_address"),
    (dict(num_processes=2), "mesh.num_processes=2 without mesh.coordinator_address"),
    (dict(coordinator_address="h:1", num_processes=2), "needs mesh.process_id too"),
    (dict(coordinator_address="h:1", process_id=0), "needs mesh.num_processes too"),
    (dict(coordinator_address="h:1"), "needs mesh.num_processes and mesh.process_id"),
    (
        dict(coordinator_address="h:1", num_processes=2, process_id=2),
        r"process_id=2: expected 0 \.\. 1",
    ),
    (dict(coordinator_address="h:1", num_processes=2, process_id=-1), "process_id=-1"),
    (dict(coordinator_address="h:1", num_processes=0, process_id=0), "num_processes=0"),
    (dict(coordinator_address="h", num_processes=2, process_id=0), "'h': expected HOST:PORT"),
    (dict(coordinator_address=":1", num_processes=2, process_id=0), "':1': expected HOST:PORT"),
    (dict(coordinator_address="h:x", num_processes=2, process_id=0), "'h:x': expected HOST:PORT"),
    (dict(coordinator_address="h:70000", num_processes=2, process_id=0), "expected HOST:PORT"),
    (dict(init_timeout_s=0), "mesh.init_timeout_s=0: expected a whole number of seconds"),
    (dict(heartbeat_timeout_s=-5), "mesh.heartbeat_timeout_s=-5"),
]


@pytest.mark.parametrize("kw,message", MESH_LAUNCH_ERRORS)
def test_mesh_launch_settings_are_refused_with_the_value(kw, message):
    with pytest.raises(ValueError, match=message):
        MeshConfig(**kw)


def test_mesh_launch_settings_that_work():
    MeshConfig(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
    MeshConfig(coordinator_address="[::1]:1234", num_processes=1, process_id=0)
    MeshConfig(init_timeout_s=1, heartbeat_timeout_s=1)
