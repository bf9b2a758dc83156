"""precision.kind=sensitivity: the knapsack's choice, the run's phases and records, resume."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from microscale.config import apply_overrides
from microscale.model import PrecisionRules, Transformer
from microscale.train import train
from microscale.train.adaptive import allocate_bf16, bf16_rules, choose_bf16_layers


def _records(out, kind):
    lines = Path(out, "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 257, 20_000).astype(np.int32)


PATHS = [
    f"layers.{b}.{m}"
    for b in range(3)
    for m in (
        "attn.q_proj",
        "attn.k_proj",
        "attn.v_proj",
        "attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


def _group(path: str) -> str:
    for a, b in (
        ("q_proj", "qkv"),
        ("k_proj", "qkv"),
        ("v_proj", "qkv"),
        ("gate_proj", "gate_up"),
        ("up_proj", "gate_up"),
    ):
        path = path.replace(a, b)
    return path


@pytest.mark.parametrize(
    "seed, fraction", [(s, f) for s in range(3) for f in (0.0, 0.1, 0.25, 0.5, 0.9)]
)
def test_allocation_is_the_best_feasible_set(seed, fraction):
    """Brute force over every set of fused groups: the bf16 layers avoid the largest total
    score (signed: a layer whose rounding lowers the loss is never worth bf16) within the
    FLOP budget."""
    rng = np.random.default_rng(seed)
    numel = {p: int(rng.choice([1024, 2048, 4096, 8192])) for p in PATHS}
    scores = {p: {"nvfp4": float(rng.normal(0.01, 0.02)), "bf16": 0.0} for p in PATHS}
    groups = {p: _group(p) for p in PATHS}
    chosen = allocate_bf16(scores, numel, groups, "nvfp4", fraction)
    members: dict[str, list[str]] = {}
    for p in PATHS:
        members.setdefault(groups[p], []).append(p)
    total = sum(numel.values())
    best, best_set = 0.0, set()
    names = sorted(members)
    for r in range(1, len(names) + 1):
        for combo in itertools.combinations(names, r):
            layers = [p for g in combo for p in members[g]]
            if sum(numel[p] for p in layers) > fraction * total:
                continue
            gain = sum(scores[p]["nvfp4"] for p in layers)
            if gain > best + 1e-12:
                best, best_set = gain, set(layers)
    assert set(chosen) == best_set
    assert sum(numel[p] for p in chosen) <= fraction * total


@pytest.mark.slow
def test_choice_on_a_model_block_granularity_and_positional_default(make_cfg, tokens):
    cfg = make_cfg(
        "recipe=nvfp4",
        "precision.kind=sensitivity",
        "precision.sensitivity.granularity=block",
        "precision.sensitivity.calib_tokens=512",
    )
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    rules, rec = choose_bf16_layers(model, cfg, tokens)
    paths = list(rec["scores"])
    assert len(paths) == 14 and all(np.isfinite(v) for v in rec["scores"].values())
    # default budget: what the positional rule keeps (the last of 2 blocks = half the FLOPs)
    assert rec["positional_bf16_layers"] == [p for p in paths if p.startswith("layers.1.")]
    assert rec["budget_bf16_flops"] == pytest.approx(0.5)
    assert rec["bf16_flops"] <= 0.5 + 1e-12
    blocks = {p.split(".")[1] for p in rec["bf16_layers"]}
    for b in blocks:  # whole blocks only
        assert {p for p in paths if p.split(".")[1] == b} <= set(rec["bf16_layers"])
    # the block whose rounding costs more stays bf16 (when rounding costs anything at all)
    cost = {b: sum(v for p, v in rec["scores"].items() if p.split(".")[1] == b) for b in ("0", "1")}
    worst = max(cost, key=cost.get)
    assert blocks == ({worst} if cost[worst] > 0 else set())
    for p in paths:
        assert rules.resolve_name(p) == ("bf16" if p in rec["bf16_layers"] else "nvfp4")


def test_bf16_rules_table():
    r = bf16_rules("nvfp4", ["layers.0.attn.q_proj", "layers.1.mlp.down_proj"])
    assert r.resolve_name("layers.0.attn.q_proj") == "bf16"
    assert r.resolve_name("layers.1.mlp.down_proj") == "bf16"
    assert r.resolve_name("layers.0.attn.k_proj") == "nvfp4"
    assert r.resolve_name("layers.10.attn.q_proj") == "nvfp4"  # exact paths only
    assert bf16_rules("nvfp4", []) == PrecisionRules(default="nvfp4")


@pytest.mark.slow
def test_run_records_allocation_and_resumes_with_it(make_cfg, tmp_path):
    common = (
        "recipe=nvfp4",
        "precision.kind=sensitivity",
        "precision.warmup=0.3",
        "precision.sensitivity.calib_tokens=512",
        "steps=10",
        "eval_every=5",
        "checkpoint_every=4",
    )
    straight = make_cfg(*common, f"out={tmp_path / 'a'}")
    s = train(straight, progress=False)
    alloc = s["bf16_allocation"]
    assert alloc["step"] == 3 and alloc["bf16_flops"] <= alloc["budget_bf16_flops"]
    ev = [r for r in _records(straight.out, "event") if r["event"] == "bf16_allocation"]
    assert len(ev) == 1 and ev[0]["bf16_layers"] == alloc["bf16_layers"]
    phases = [r["phase"] for r in _records(straight.out, "train")]
    assert phases == ["warmup"] * 3 + ["main"] * 7
    saved = PrecisionRules.load(Path(straight.out) / "precision_rules.json")
    assert saved == bf16_rules("nvfp4", alloc["bf16_layers"])
    assert {p: r for p, r in s["precision"].items()} == {
        p: saved.resolve_name(p) for p in s["precision"]
    }
    # quantize evaluates the same allocation as the run's "trained" point
    from microscale.ptq import trained_allocation

    trained = trained_allocation(straight.out, straight)
    assert {p for p, f in trained.items() if f == "bf16"} == set(alloc["bf16_layers"])
    assert set(trained.values()) == {"bf16", "nvfp4"}

    class Crash(Exception):
        pass

    def crash(rec):
        if rec["kind"] == "train" and rec["step"] == 6:
            raise Crash

    split = make_cfg(*common, f"out={tmp_path / 'b'}")
    with pytest.raises(Crash):
        train(split, progress=False, callbacks=[crash])
    s2 = train(replace(split, resume=True), progress=False)
    a = [(r["step"], r["loss"]) for r in _records(straight.out, "train")]
    b = [(r["step"], r["loss"]) for r in _records(split.out, "train")]
    assert a == b
    assert s2["bf16_allocation"]["bf16_layers"] == alloc["bf16_layers"]


@pytest.mark.slow
def test_position_warmup_is_the_warmup_then_the_positional_rule(make_cfg, tmp_path):
    """The control for sensitivity's warm-up: the same all-bf16 steps, then exactly the
    positional rules (no allocation is chosen or recorded)."""
    cfg = make_cfg(
        "recipe=nvfp4", "precision.warmup=0.3", "steps=6", "eval_every=0", f"out={tmp_path / 'w'}"
    )
    assert cfg.warmup_steps == 2
    s = train(cfg, progress=False)
    assert [r["phase"] for r in _records(cfg.out, "train")] == ["warmup"] * 2 + ["main"] * 4
    ev = [r["event"] for r in _records(cfg.out, "event")]
    assert "warmup_end" in ev and "bf16_allocation" not in ev
    assert s.get("bf16_allocation") is None
    positional = make_cfg("recipe=nvfp4").precision_rules()
    assert PrecisionRules.load(Path(cfg.out) / "precision_rules.json") == positional
    assert s["precision"] == {p: positional.resolve_name(p) for p in s["precision"]}


@pytest.mark.parametrize(
    "override, expected",
    [
        (["precision.kind=sometimes"], ("precision.kind", "sometimes")),
        (["precision.warmup=0.1"], ("needs a quantized recipe",)),
        (
            [
                "recipe=nvfp4",
                "precision.warmup=0.1",
                "precision.kind=rules",
                "precision.rules=r.json",
            ],
            ("precision.warmup=0.1 is not read by precision.kind='rules'",),
        ),
        (["precision.kind=sensitivity"], ("needs a quantized recipe",)),
        (
            ["recipe=nvfp4", "precision.kind=sensitivity", "precision.warmup=1.5"],
            ("precision.warmup=1.5",),
        ),
        (
            ["recipe=nvfp4", "precision.kind=sensitivity", "precision.sensitivity.bf16_flops=1.2"],
            ("precision.sensitivity.bf16_flops=1.2",),
        ),
        (
            ["recipe=nvfp4", "precision.kind=sensitivity", "precision.sensitivity.method=magic"],
            ("precision.sensitivity.method='magic'",),
        ),
        (
            [
                "recipe=nvfp4",
                "precision.kind=sensitivity",
                "precision.sensitivity.granularity=head",
            ],
            ("granularity", "head"),
        ),
        (
            ["recipe=nvfp4", "precision.kind=sensitivity", "precision.late.fraction=0.95"],
            ("leaves no step",),
        ),
        (
            ["recipe=nvfp4", "precision.kind=sensitivity", "precision.rules=r.json"],
            ("precision.rules='r.json' is not read by precision.kind='sensitivity'",),
        ),
        (["precision.rules_bf16=sideways"], ("precision.rules_bf16", "sideways")),
    ],
)
def test_bad_values_name_the_key(make_cfg, override, expected):
    from microscale.config import ConfigError

    with pytest.raises((ConfigError, ValueError)) as e:
        apply_overrides(make_cfg(), override)
    msg = str(e.value)
    assert "\n" not in msg and all(x in msg for x in expected), msg


def test_every_new_key_is_listed(capsys):
    from microscale.cli import main

    assert main(["train", "--list-keys"]) == 0
    out = capsys.readouterr().out
    for key in (
        "init_from",
        "init_step",
        "precision.kind",
        "precision.rules_bf16",
        "precision.warmup",
        "precision.sensitivity.bf16_flops",
        "precision.sensitivity.method",
        "precision.sensitivity.calib_tokens",
        "precision.sensitivity.activations",
        "precision.sensitivity.granularity",
        "precision.late.fraction",
        "precision.late.bf16",
    ):
        line = next((x for x in out.splitlines() if x.startswith(key + " =")), None)
        assert line is not None and "#" in line, key


@pytest.mark.parametrize(
    "overrides, own",
    [
        ((), False),
        (("recipe=nvfp4",), False),
        (("recipe=nvfp4", "precision.warmup=0.1"), False),
        (("recipe=nvfp4", "precision.kind=sensitivity"), True),
        (("precision.kind=rules", "precision.rules={rules}"), True),
    ],
)
def test_own_allocation(make_cfg, tmp_path, overrides, own):
    """Runs that record an allocation of their own (export writes it, quantize scores it)."""
    rules = tmp_path / "rules.json"
    bf16_rules("nvfp4", ["layers.0.attn.q_proj"]).save(rules)
    cfg = make_cfg(*(o.format(rules=rules) for o in overrides))
    assert cfg.own_allocation is own
