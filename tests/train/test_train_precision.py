"""The precision sub-config: one kind per registry row, one vocabulary, the old keys.

The table :data:`OLD_AND_NEW` is the promise of the refactor: every old-key request and its
new-key spelling build the same config, the same per-layer rules (main, warm-up and late
phases) and train to bit-identical losses.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from microscale.config import ConfigError, apply_overrides, dump_yaml, load_yaml, to_dict
from microscale.model import PrecisionRules, late_switch
from microscale.ops import BF16_PARTS, get_recipe
from microscale.train import PrecisionConfig, TrainConfig, train
from microscale.train.precision import PRECISION_KINDS, PrecisionKind

# (kind, old-key overrides, the same request in new keys); "{rules}" is a rules file.
OLD_AND_NEW = [
    (
        "position",
        ["recipe=nvfp4", "bf16_first=1", "bf16_last=0"],
        ["recipe=nvfp4", "precision.bf16_first=1", "precision.bf16_last=0"],
    ),
    (
        "layout",
        ["recipe=nvfp4", "model.n_layers=12", "bf16_layout=paper_12b"],
        [
            "recipe=nvfp4",
            "model.n_layers=12",
            "precision.kind=layout",
            "precision.layout=paper_12b",
        ],
    ),
    ("rules", ["rules={rules}"], ["precision.kind=rules", "precision.rules={rules}"]),
    (
        "rules",
        ["rules={rules}", "rules_mode=full"],
        ["precision.kind=rules", "precision.rules={rules}", "precision.rules_bf16=nothing"],
    ),
    (
        "rules",
        ["rules={rules}", "rules_mode=as_written"],
        ["precision.kind=rules", "precision.rules={rules}", "precision.rules_bf16=as_written"],
    ),
    (
        "sensitivity",
        [
            "recipe=nvfp4",
            "bf16_policy=sensitivity",
            "adaptive.calib_tokens=256",
            "adaptive.warmup_fraction=0.25",
        ],
        [
            "recipe=nvfp4",
            "precision.kind=sensitivity",
            "precision.sensitivity.calib_tokens=256",
            "precision.warmup=0.25",
        ],
    ),
    (
        "position",
        ["recipe=nvfp4", "bf16_policy=position_warmup"],
        ["recipe=nvfp4", "precision.warmup=0.1"],
    ),
    (
        "position",
        ["recipe=nvfp4", "late_switch.fraction=0.25", "late_switch.mode=full"],
        ["recipe=nvfp4", "precision.late.fraction=0.25", "precision.late.bf16=all"],
    ),
    (
        "position",
        ["recipe=nvfp4", "late_switch.fraction=0.25", "late_switch.mode=fwd_only"],
        ["recipe=nvfp4", "precision.late.fraction=0.25", "precision.late.bf16=forward"],
    ),
]
IDS = [f"{k}:{' '.join(o[1:] or o)}" for k, o, _ in OLD_AND_NEW]


@pytest.fixture
def rules_file(tmp_path) -> str:
    """A mixed allocation as `microscale quantize` writes it (derived ptq recipes)."""
    from microscale.ptq import allocation_rules

    path = tmp_path / "rules.json"
    allocation_rules(
        {
            "layers.0.attn.q_proj": "fp8_e4m3",
            "layers.1.mlp.down_proj": "nvfp4",
            "layers.1.mlp.up_proj": "mxfp4",
        }
    ).save(path)
    return str(path)


def _old_and_new(make_cfg, rules_file, old, new):
    with pytest.warns(FutureWarning, match="deprecated config keys") as w:
        a = make_cfg(*(o.format(rules=rules_file) for o in old))
    b = make_cfg(*(o.format(rules=rules_file) for o in new))
    return a, b, " ".join(str(x.message) for x in w if x.category is FutureWarning)


@pytest.mark.parametrize("kind, old, new", OLD_AND_NEW, ids=IDS)
def test_old_keys_build_the_new_config(make_cfg, rules_file, kind, old, new):
    a, b, msg = _old_and_new(make_cfg, rules_file, old, new)
    assert a == b and a.precision.kind == kind
    assert a.precision_rules() == b.precision_rules()
    assert (a.warmup_steps, a.switch_step) == (b.warmup_steps, b.switch_step)
    for o in old:  # the message names every old key and its new one
        key = o.split("=")[0]
        if not key.startswith(("recipe", "model.")):
            assert f"{key} -> precision." in msg, (key, msg)


@pytest.mark.parametrize(
    "base, old, kind, warmup",
    [
        (["recipe=nvfp4", "precision.kind=sensitivity"], ["bf16_policy=position"], "position", 0),
        (["precision.kind=rules", "precision.rules=r.json"], ["rules=none"], "position", 0),
        (
            ["recipe=nvfp4", "model.n_layers=12"],
            ["bf16_layout=paper_12b", "bf16_policy=position_warmup"],
            "layout",
            0.1,
        ),
    ],
)
def test_old_keys_over_a_new_base(make_cfg, base, old, kind, warmup):
    """Old keys on top of a config of another kind mean what they meant before."""
    with pytest.warns(FutureWarning, match="deprecated config keys"):
        cfg = apply_overrides(make_cfg(*base), old)
    assert (cfg.precision.kind, cfg.precision.warmup_fraction) == (kind, warmup)


def test_old_run_folder_config_reads_as_new(tmp_path):
    """A config.yaml written before the precision sub-config (its precision keys as the old
    TrainConfig.tiny() dumped them, plus a few set) loads into the new config."""
    old = to_dict(TrainConfig.tiny())
    del old["precision"]
    old.update(
        recipe="nvfp4",
        bf16_first=1,
        bf16_last=0,
        bf16_layout=None,
        rules=None,
        rules_mode="forward",
        bf16_policy="sensitivity",
        adaptive={
            "warmup_fraction": 0.1,
            "bf16_flops": None,
            "method": "kl",
            "calib_tokens": 16384,
            "activations": True,
            "granularity": "layer",
        },
        late_switch={"fraction": 0.2, "mode": "fwd_only"},
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    with pytest.warns(FutureWarning, match="bf16_policy -> precision.kind=sensitivity"):
        cfg = load_yaml(TrainConfig, path)
    assert cfg == apply_overrides(
        TrainConfig.tiny(),
        [
            "recipe=nvfp4",
            "precision.kind=sensitivity",
            "precision.bf16_first=1",
            "precision.bf16_last=0",
            "precision.sensitivity.method=kl",
            "precision.late.fraction=0.2",
            "precision.late.bf16=forward",
        ],
    )
    dump_yaml(cfg, path)  # a resumed run rewrites it in the new keys, without a message
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert load_yaml(TrainConfig, path) == cfg


@pytest.mark.parametrize(
    "data, match",
    [
        ({"adaptive": {"warmup": 0.1}}, "unknown key 'adaptive.warmup'"),
        ({"bf16_first": 1, "precision": {"bf16_first": 2}}, "'precision.bf16_first' is set twice"),
    ],
)
def test_old_yaml_keys_fail_clearly(tmp_path, data, match):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        load_yaml(TrainConfig, path)


@pytest.mark.parametrize(
    "override, expected",
    [
        (["precision.kind=magic"], ("precision.kind='magic'", "position", "sensitivity")),
        (["precision.kind=rules"], ("precision.rules=PATH",)),
        (
            [
                "recipe=nvfp4",
                "precision.kind=rules",
                "precision.rules=r.json",
                "precision.bf16_first=1",
            ],
            ("precision.bf16_first=1 is not read", "rules_bf16"),
        ),
        (["recipe=nvfp4", "precision.kind=layout"], ("precision.layout=None", "paper_12b")),
        (
            [
                "recipe=nvfp4",
                "precision.kind=layout",
                "precision.layout=paper_12b",
                "precision.bf16_last=1",
            ],
            ("precision.bf16_last=1 is not read",),
        ),
        (
            ["recipe=nvfp4", "precision.kind=sensitivity", "precision.warmup=0"],
            ("precision.warmup=0", "warm-up"),
        ),
        (["precision.warmup=0.1"], ("needs a quantized recipe",)),
        (["precision.late.bf16=full"], ("precision.late.bf16", "full")),
        (["precision.rules_bf16=forward"], ("precision.rules_bf16", "forward")),
        (
            ["recipe=nvfp4", "precision.bf16_first=2", "precision.bf16_last=1"],
            ("bf16_first=2 + bf16_last=1 exceeds n_layers=2",),
        ),
    ],
)
def test_bad_precision_names_the_key(make_cfg, override, expected):
    with pytest.raises(ConfigError) as e:
        make_cfg(*override)
    msg = str(e.value)
    assert "\n" not in msg and all(x in msg for x in expected), msg


def test_every_kind_is_a_row_with_documented_fields():
    fields = {f.name for f in dataclasses.fields(PrecisionConfig)}
    for name, row in PRECISION_KINDS.items():
        assert row.name == name and set(row.fields) <= fields, name
    assert PrecisionConfig().kind in PRECISION_KINDS


def test_a_new_kind_is_one_row(make_cfg, monkeypatch):
    """A kind added as one row (here: every block but the last in bf16) is accepted,
    checked and trained from; nothing else names the kinds."""

    def last_only(p, recipe, n_layers):
        return PrecisionRules.for_recipe(recipe, n_layers, bf16_first=n_layers - 1, bf16_last=0)

    row = PrecisionKind(
        name="last_only",
        description="only the last block quantized",
        fields=(),
        main_rules=last_only,
        needs_quantized=True,
    )
    monkeypatch.setitem(PRECISION_KINDS, row.name, row)
    with pytest.warns(UserWarning, match="only 1 of 2 blocks"):
        cfg = make_cfg("recipe=nvfp4", "precision.kind=last_only")
    assert cfg.precision_rules().resolve_name("layers.0.attn.q_proj") == "bf16"
    assert cfg.precision_rules().resolve_name("layers.1.attn.q_proj") == "nvfp4"
    with pytest.raises(ConfigError, match="precision.bf16_last=0 is not read"):
        make_cfg("recipe=nvfp4", "precision.kind=last_only", "precision.bf16_last=0")
    with pytest.raises(ConfigError, match="needs a quantized recipe"):
        make_cfg("precision.kind=last_only")


# ----------------------------------------------------------------------------- Recipe.derive


def test_derive_names_what_runs_in_bf16():
    nv = get_recipe("nvfp4")
    fwd = nv.derive(bf16="forward")
    assert fwd.name == "nvfp4+bf16_forward"
    assert not fwd.fprop_x.quantized and not fwd.fprop_w.quantized
    assert fwd.dgrad_dy == nv.dgrad_dy and fwd.wgrad_x == nv.wgrad_x
    back = nv.derive(bf16="backward")
    assert back.name == "nvfp4+bf16_backward"
    assert back.replace(name="nvfp4_fwd_only") == get_recipe("nvfp4_fwd_only")
    both = back.derive(bf16="forward")  # parts accumulate, in BF16_PARTS order
    assert both.name == "nvfp4+bf16_forward_backward" and not both.quantized
    for part, slots in BF16_PARTS.items():
        r = nv.derive(bf16=part)
        assert {s for s, spec in r.operands().items() if not spec.quantized} == set(slots)
    with pytest.raises(ValueError, match="sideways.*forward"):
        nv.derive(bf16="sideways")


def test_ptq_and_late_recipes_come_from_derive():
    from microscale.ptq import ptq_recipe

    w = ptq_recipe("nvfp4")
    wa = ptq_recipe("nvfp4", activations=True)
    assert w.name == "ptq_nvfp4+bf16_backward_inputs" and wa.name == "ptq_nvfp4+bf16_backward"
    assert [s for s, spec in w.operands().items() if spec.quantized] == ["fprop_w"]
    assert [s for s, spec in wa.operands().items() if spec.quantized] == ["fprop_x", "fprop_w"]
    late = late_switch(PrecisionRules(default="nvfp4"), "forward")
    assert late.default == get_recipe("nvfp4").derive(bf16="forward")


# ----------------------------------------------------------------------------- same numbers


def _losses(out) -> list[float]:
    lines = Path(out, "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


# test_old_keys_build_the_new_config asserts, for every row, that both spellings build equal
# configs, and training is a function of its config; two rows are trained end to end to guard
# what lies outside the config (the rules file a run reads, the late switch's own rules file).
# The migration itself was checked bit for bit, old code against new, when it landed.
TRAINED = [2, 8]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, old, new", [OLD_AND_NEW[i] for i in TRAINED], ids=[IDS[i] for i in TRAINED]
)
def test_old_and_new_keys_train_bit_identically(make_cfg, rules_file, tmp_path, kind, old, new):
    """Each row trains 4 steps twice, once from each spelling: the losses are equal to the
    bit and the written rules are the same."""
    common = ["steps=4", "eval_every=0"]
    a, b, _ = _old_and_new(
        make_cfg,
        rules_file,
        [*old, *common, f"out={tmp_path / 'a'}"],
        [*new, *common, f"out={tmp_path / 'b'}"],
    )
    train(a, progress=False)
    train(b, progress=False)
    la, lb = _losses(a.out), _losses(b.out)
    assert len(la) == 4 and np.array_equal(np.array(la), np.array(lb)), (la, lb)
    for name in ("precision_rules.json", "precision_rules_late.json"):
        pa, pb = Path(a.out, name), Path(b.out, name)
        assert pa.exists() == pb.exists()
        if pa.exists():
            assert pa.read_text() == pb.read_text()
