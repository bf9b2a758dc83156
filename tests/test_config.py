"""Generic config serialization: dataclass <-> dict / YAML / key=value overrides."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from microscale.config import (
    ConfigError,
    apply_overrides,
    config_keys,
    describe,
    dump_yaml,
    field_comments,
    from_dict,
    load_yaml,
    to_dict,
    to_yaml,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    # Hidden width.
    width: int = 8
    # Scale factor.
    scale: float = 1.0
    # Kind of thing.
    kind: Literal["a", "b"] = "a"

    def __post_init__(self):
        if self.width % 4:
            raise ValueError(f"width={self.width} must be divisible by 4")

    @classmethod
    def preset(cls, name: str) -> Inner:
        table = {"big": cls(width=64, scale=2.0)}
        if name not in table:
            raise ValueError(f"unknown Inner preset {name!r}; expected one of {sorted(table)}")
        return table[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    # The nested part.
    inner: Inner = Inner()
    # Optional inner.
    maybe: Inner | None = None
    # Learning rate.
    lr: float = 1e-3
    # Number of steps.
    steps: int = 10
    # A flag.
    flag: bool = False
    # Output folder.
    out: str = "runs/x"
    # Adam betas.
    betas: tuple[float, float] = (0.9, 0.95)
    # Steps to do something at.
    at: tuple[int, ...] = ()
    # Optional path.
    path: str | None = None
    # An optional count.
    count: int | None = None


def test_roundtrip_dict_and_yaml(tmp_path):
    cfg = Outer(inner=Inner(width=16, kind="b"), maybe=Inner(), betas=(0.8, 0.9), at=(1, 2))
    d = to_dict(cfg)
    assert d["betas"] == [0.8, 0.9] and d["inner"]["kind"] == "b"
    assert from_dict(Outer, d) == cfg
    dump_yaml(cfg, tmp_path / "c.yaml")
    assert load_yaml(Outer, tmp_path / "c.yaml") == cfg
    assert "betas" in to_yaml(cfg)


def test_overrides_coerce_types():
    cfg = apply_overrides(
        Outer(),
        [
            "inner.width=32",
            "lr=3e-4",
            "steps=1_000",
            "flag=true",
            "out=123",
            "betas=0.5,0.6",
            "at=[3, 4]",
            "path=none",
            "count=5",
            "inner.kind=b",
            "inner.scale=2",
        ],
    )
    assert cfg.inner.width == 32 and cfg.lr == pytest.approx(3e-4) and cfg.steps == 1000
    assert cfg.flag is True and cfg.out == "123" and cfg.betas == (0.5, 0.6)
    assert cfg.at == (3, 4) and cfg.path is None and cfg.count == 5
    assert cfg.inner.kind == "b" and cfg.inner.scale == 2.0 and isinstance(cfg.inner.scale, float)
    assert apply_overrides(cfg, ["count=none"]).count is None
    assert apply_overrides(Outer(), ["steps=1e3"]).steps == 1000


def test_override_nested_preset_and_optional():
    cfg = apply_overrides(Outer(), ["inner=big", "inner.scale=3"])
    assert cfg.inner.width == 64 and cfg.inner.scale == 3.0
    cfg = apply_overrides(Outer(), ["maybe.width=12"])
    assert cfg.maybe == Inner(width=12)


def test_unknown_key_suggests():
    with pytest.raises(ConfigError) as e:
        apply_overrides(Outer(), ["inner.widht=3"])
    msg = str(e.value)
    assert "inner.widht" in msg and "did you mean 'inner.width'" in msg and "scale" in msg
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        from_dict(Outer, {"stpes": 3})


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError) as e:
        apply_overrides(Outer(), ["lr=fast"])
    assert "'lr'" in str(e.value) and "'fast'" in str(e.value) and "float" in str(e.value)
    with pytest.raises(ConfigError, match="inner.kind.*'a' \\| 'b'.*'c'"):
        apply_overrides(Outer(), ["inner.kind=c"])
    with pytest.raises(ConfigError, match="steps.*int.*2.5"):
        apply_overrides(Outer(), ["steps=2.5"])
    with pytest.raises(ConfigError, match="flag"):
        from_dict(Outer, {"flag": "maybe"})
    with pytest.raises(ConfigError, match="betas"):
        apply_overrides(Outer(), ["betas=1,2,3"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(Outer(), ["steps"])
    with pytest.raises(ConfigError, match="lr.*not a nested config"):
        apply_overrides(Outer(), ["lr.x=1"])


def test_overrides_are_validated_once_after_the_last():
    # An intermediate state may be invalid (width 6); only the final config is checked, so
    # the order of the overrides does not decide whether a request is accepted.
    assert apply_overrides(Outer(), ["inner.width=6", "inner.width=12"]).inner.width == 12
    assert apply_overrides(
        Outer(), ["inner=big", "inner.width=6", "inner.width=16"]
    ).inner == Inner(width=16, scale=2.0)
    with pytest.raises(ConfigError, match="inner.*width=6"):
        apply_overrides(Outer(), ["inner.width=12", "inner.width=6"])


def test_post_init_errors_carry_the_path():
    with pytest.raises(ConfigError, match="inner.*divisible by 4"):
        apply_overrides(Outer(), ["inner.width=6"])
    with pytest.raises(ConfigError, match="unknown Inner preset"):
        apply_overrides(Outer(), ["inner=huge"])


def test_yaml_errors(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("inner:\n  width: 8\n  colour: red\n")
    with pytest.raises(ConfigError, match="bad.yaml.*inner.colour"):
        load_yaml(Outer, p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(Outer, tmp_path / "nope.yaml")


def test_comments_keys_describe():
    c = field_comments(Outer)
    assert c["lr"] == "Learning rate." and set(c) == {f.name for f in dataclasses.fields(Outer)}
    assert "inner.width" in config_keys(Outer)
    text = describe(Outer())
    assert "lr = 0.001  # Learning rate." in text and "inner.width = 8" in text
