"""The precision sub-config: one kind per registry row, one vocabulary; the keys before it
refused by name (:data:`REMOVED`)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from microscale.config import ConfigError, apply_overrides, load_yaml
from microscale.model import PrecisionRules, late_switch
from microscale.ops import BF16_PARTS, get_recipe
from microscale.train import PrecisionConfig, TrainConfig
from microscale.train.precision import PRECISION_KINDS, REMOVED_KEYS, PrecisionKind

# (kind, old-key overrides, the same request in new keys); "{rules}" is a rules file.
# A request in the keys before this sub-config (each removed; docs/release-notes.md) and
# what the one-line error must say replaces it.
REMOVED = [
    ("bf16_first=1", "precision.bf16_first"),
    ("bf16_last=0", "precision.bf16_last"),
    ("bf16_layout=paper_12b", "precision.kind=layout precision.layout=NAME"),
    ("rules=r.json", "precision.kind=rules precision.rules=PATH"),
    ("rules_mode=full", "precision.rules_bf16"),
    ("bf16_policy=sensitivity", "precision.kind=sensitivity"),
    ("adaptive.warmup_fraction=0.25", "precision.warmup"),
    ("adaptive.calib_tokens=256", "precision.sensitivity."),
    ("late_switch.fraction=0.2", "precision.late."),
    ("late_switch.mode=fwd_only", "precision.late.bf16"),
]


@pytest.mark.parametrize("override, new", REMOVED, ids=[o for o, _ in REMOVED])
def test_removed_keys_are_refused_naming_what_replaces_them(tmp_path, override, new):
    """An old key, as an override or in a config file, is one error naming it and its new
    key; nothing is read for it."""
    key, value = override.split("=")
    with pytest.raises(ConfigError, match="was removed") as e:
        apply_overrides(TrainConfig.tiny(), [override])
    assert f"key {key!r} was removed" in str(e.value) and f"write {new}" in str(e.value)
    *parents, last = key.split(".")
    data: dict = {last: value}
    for p in reversed(parents):
        data = {p: data}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=f"write {re.escape(new)}"):
        load_yaml(TrainConfig, path)


def test_every_removed_key_is_in_the_release_notes():
    notes = (Path(__file__).parents[2] / "docs" / "release-notes.md").read_text()
    for key in REMOVED_KEYS:
        assert f"`{key}" in notes, key


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
