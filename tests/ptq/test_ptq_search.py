"""The budgeted search: exact vs brute force, budgets, groups, pins, costs from FormatSpec."""

from __future__ import annotations

import math

import numpy as np
import pytest

from microscale.formats import get_format
from microscale.ptq import (
    DEFAULT_GROUPS,
    Problem,
    brute_force,
    effective_bits,
    group_layers,
    model_bits,
    monotone,
    search,
)

FORMATS = ("nvfp4", "mxfp4", "mxfp8", "fp8_e4m3", "bf16")


def _paths(n_blocks: int) -> list[str]:
    out = []
    for i in range(n_blocks):
        out += [f"layers.{i}.attn.{n}_proj" for n in "qkvo"]
        out += [f"layers.{i}.mlp.{n}_proj" for n in ("gate", "up", "down")]
    return out


def _problem(rng, n_blocks=1, pinned=None, formats=FORMATS, grouped=True) -> Problem:
    paths = _paths(n_blocks)
    numel = {p: int(rng.choice([32, 64, 96, 128])) * 64 for p in paths}
    scores = {p: {f: float(rng.exponential()) for f in formats} for p in paths}
    return Problem(
        formats=formats,
        scores=scores,
        numel=numel,
        groups=group_layers(paths) if grouped else None,
        pinned=pinned or {},
    )


def test_costs_come_from_formatspec():
    numel = {"a": 1024, "b": 3072}
    for f in FORMATS:
        assert effective_bits({"a": f, "b": f}, numel) == get_format(f).bits_per_element
    assert effective_bits({"a": "nvfp4", "b": "bf16"}, numel) == (4.5 * 1024 + 16 * 3072) / 4096
    assert effective_bits({"a": "nvfp4"}, {"a": 1024}, extra_numel=1024) == (4.5 + 16) / 2
    assert model_bits({"a": "nvfp4", "b": "mxfp4"}, numel, 4096) == {
        "linear_bits": (4.5 * 1024 + 4.25 * 3072) / 4096,
        "model_bits": (4.5 * 1024 + 4.25 * 3072 + 16 * 4096) / 8192,
    }
    assert model_bits({"a": "bf16"}, numel, 1024, other_bits=32)["model_bits"] == 24


@pytest.mark.parametrize("solver", ["dp", "milp"])
def test_exact_vs_brute_force(solver):
    rng = np.random.default_rng(0)
    for trial in range(25):
        pinned = {"layers.0.attn.o_proj": "bf16"} if trial % 3 == 0 else {}
        grouped = trial % 2 == 0  # ungrouped: 7 decisions, so fewer formats for brute force
        prob = _problem(
            rng,
            pinned=pinned,
            grouped=grouped,
            formats=FORMATS if grouped else ("nvfp4", "mxfp4", "fp8_e4m3"),
        )
        budget = float(rng.uniform(4.3, 10.0))
        try:
            ref = brute_force(prob, budget)
        except ValueError:  # a bf16 pin can make a low budget infeasible: both must say so
            with pytest.raises(ValueError, match="below the cheapest"):
                search(prob, budget, solver=solver)
            continue
        got = search(prob, budget, solver=solver)
        assert got.total_score == pytest.approx(ref.total_score, rel=1e-9, abs=1e-12)
        assert got.effective_bits <= budget
        assert got.solver == solver


def test_budget_never_exceeded_and_monotone_in_budget():
    rng = np.random.default_rng(1)
    prob = _problem(rng, n_blocks=3)
    prev = math.inf
    for budget in np.linspace(4.25, 16.0, 40):
        a = search(prob, float(budget))
        assert a.effective_bits <= budget + 1e-12
        assert a.total_score <= prev + 1e-12  # more bits never hurt the optimum
        prev = a.total_score
    # exactly at a uniform allocation's bits: feasible, and at least as good as it
    a = search(prob, 4.5)
    uniform = sum(prob.scores[p]["nvfp4"] for p in prob.numel)
    assert a.total_score <= uniform + 1e-12


def test_groups_share_a_format_and_pins_hold():
    rng = np.random.default_rng(2)
    paths = _paths(4)
    pinned = {"layers.3.mlp.down_proj": "bf16", "layers.0.attn.k_proj": "fp8_e4m3"}
    prob = _problem(rng, n_blocks=4, pinned=pinned)
    groups = group_layers(paths)
    assert groups["layers.2.attn.v_proj"] == "layers.2.attn.qkv_proj"
    assert groups["layers.2.mlp.up_proj"] == "layers.2.mlp.gate_up_proj"
    assert groups["layers.2.mlp.down_proj"] == "layers.2.mlp.down_proj"
    for budget in (6.0, 7.0, 9.0):
        for solver in ("dp", "milp"):
            a = search(prob, budget, solver=solver)
            for p, f in pinned.items():
                assert a.formats[p] == f
            # k_proj is pinned to fp8: its whole q/k/v group follows
            assert {a.formats[f"layers.0.attn.{n}_proj"] for n in "qkv"} == {"fp8_e4m3"}
            for i in range(4):
                assert len({a.formats[f"layers.{i}.attn.{n}_proj"] for n in "qkv"}) == 1
                assert (
                    a.formats[f"layers.{i}.mlp.gate_proj"] == a.formats[f"layers.{i}.mlp.up_proj"]
                )


def test_conflicting_pins_in_a_group_raise():
    rng = np.random.default_rng(3)
    prob = _problem(rng, pinned={"layers.0.attn.q_proj": "bf16", "layers.0.attn.k_proj": "nvfp4"})
    with pytest.raises(ValueError, match="pinned to different formats"):
        search(prob, 8.0)


def test_infeasible_budget_names_the_minimum():
    rng = np.random.default_rng(4)
    prob = _problem(rng, formats=("nvfp4", "bf16"))
    with pytest.raises(ValueError, match=r"budget 4\.4 .*4\.5000"):
        search(prob, 4.4)
    with pytest.raises(ValueError, match="budget"):
        search(prob, -1.0)
    with pytest.raises(ValueError, match="solver"):
        search(prob, 5.0, solver="greedy")


def test_check_budget_is_the_search_refusal_without_scores():
    """The cheapest allocation does not depend on the scores: check_budget on a problem of
    zero scores refuses exactly the budgets search refuses, with the same message."""
    import dataclasses

    from microscale.ptq.search import check_budget

    rng = np.random.default_rng(5)
    for pinned in ({}, {"layers.0.attn.o_proj": "bf16"}):
        prob = _problem(rng, n_blocks=2, pinned=pinned)
        zero = dataclasses.replace(
            prob, scores={p: dict.fromkeys(FORMATS, 0.0) for p in prob.scores}
        )
        low = (
            4.25
            if not pinned
            else effective_bits({p: pinned.get(p, "mxfp4") for p in prob.numel}, prob.numel)
        )
        for budget in (2.0, 4.0, low - 1e-9, low, 5.0):
            try:
                search(prob, budget)
            except ValueError as e:
                assert budget < low
                with pytest.raises(ValueError) as got:
                    check_budget(zero, budget)
                assert str(got.value) == str(e)
                assert f"({low:.4f} bits/element" in str(e)
            else:
                assert budget >= low
                check_budget(zero, budget)


def test_problem_validation_messages():
    with pytest.raises(ValueError, match="unknown format"):
        Problem(formats=("nvfp9",), scores={}, numel={"a": 1})
    with pytest.raises(ValueError, match=r"scores\['a'\] lacks"):
        Problem(formats=("nvfp4", "bf16"), scores={"a": {"nvfp4": 1.0}}, numel={"a": 16})
    with pytest.raises(ValueError, match="positive int"):
        Problem(formats=("bf16",), scores={"a": {"bf16": 0.0}}, numel={"a": 0})


def test_large_instance_and_determinism():
    """224 layers (32 Llama-8B-shaped blocks) x 5 formats; both solvers agree."""
    rng = np.random.default_rng(5)
    paths = _paths(32)
    shapes = {
        "q": 4096 * 4096,
        "k": 4096 * 1024,
        "v": 4096 * 1024,
        "o": 4096 * 4096,
        "gate": 4096 * 14336,
        "up": 4096 * 14336,
        "down": 14336 * 4096,
    }
    numel = {p: shapes[p.split(".")[-1][:-5]] for p in paths}
    scores = {p: {f: float(rng.exponential()) for f in FORMATS} for p in paths}
    prob = Problem(formats=FORMATS, scores=scores, numel=numel, groups=group_layers(paths))
    a = search(prob, 4.8, solver="dp")
    b = search(prob, 4.8, solver="milp")
    assert a.total_score == pytest.approx(b.total_score, rel=1e-9)
    assert a.effective_bits <= 4.8 and b.effective_bits <= 4.8
    assert search(prob, 4.8, solver="dp").formats == a.formats


def test_default_groups_patterns_are_regex_templates():
    assert group_layers(["model.layers.3.self_attn.q_proj"], DEFAULT_GROUPS) == {
        "model.layers.3.self_attn.q_proj": "model.layers.3.self_attn.qkv_proj"
    }
    assert group_layers(["fc1"]) == {"fc1": "fc1"}


def test_monotone_correction():
    raw = {"a": {"nvfp4": 1.0, "mxfp4": 0.5, "mxfp8": 0.3, "fp8_e4m3": 0.4, "bf16": 0.1}}
    out = monotone(raw, FORMATS)["a"]
    # ordered by bits: mxfp4 4.25 < nvfp4 4.5 < fp8 8 < mxfp8 8.25 < bf16 16
    assert out == {"mxfp4": 0.5, "nvfp4": 0.5, "fp8_e4m3": 0.4, "mxfp8": 0.3, "bf16": 0.1}
    bits = {f: get_format(f).bits_per_element for f in FORMATS}
    for f in FORMATS:
        for g in FORMATS:
            if bits[g] >= bits[f]:
                assert out[g] <= out[f]


def test_a_group_takes_the_formats_all_its_members_may_take():
    """Members restricted differently (a layout's candidates on one, every format on the
    other) share the formats both may take; none in common is refused, naming the group."""
    scores = {
        "a": {"nvfp4": 0.0, "mxfp4": 5.0, "bf16": 9.0},
        "b": {"nvfp4": 0.0, "mxfp4": 5.0, "bf16": 9.0},
    }
    kw = dict(formats=("nvfp4", "mxfp4", "bf16"), scores=scores, numel={"a": 64, "b": 64},
              groups={"a": "g", "b": "g"})  # fmt: skip
    free = search(Problem(**kw), 16.0)
    assert free.formats == {"a": "nvfp4", "b": "nvfp4"}
    kept = search(Problem(**kw, options={"b": ("mxfp4", "bf16")}), 16.0)
    assert kept.formats == {"a": "mxfp4", "b": "mxfp4"}
    with pytest.raises(ValueError, match="group 'g' has members with no candidate format"):
        search(Problem(**kw, options={"a": ("nvfp4",), "b": ("bf16",)}), 16.0)
