"""The trainer's named parts, each alone: the phases and a phase change, the clock, evaluate,
write_summary."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from microscale.train import build_state, make_eval_step
from microscale.train.adaptive import bf16_rules
from microscale.train.loop import Clock, RunFacts, evaluate, write_summary
from microscale.train.metrics import MetricsLogger
from microscale.train.phases import Phases, enter_phase, start_precision
from microscale.train.step import lm_loss

from .conftest import TEST_MODEL


@pytest.mark.parametrize(
    ("phases", "expected"),
    [
        (Phases(warmup_end=0, late_start=None), ["main"] * 6),
        (Phases(warmup_end=2, late_start=None), ["warmup"] * 2 + ["main"] * 4),
        (Phases(warmup_end=0, late_start=4), ["main"] * 4 + ["late"] * 2),
        (Phases(warmup_end=1, late_start=5), ["warmup"] + ["main"] * 4 + ["late"]),
    ],
)
def test_phases(phases, expected):
    assert [phases.of(s) for s in range(6)] == expected


def test_phases_of_run(make_cfg):
    cfg = make_cfg("recipe=nvfp4", "precision.late.fraction=0.25", "steps=20")
    assert Phases.of_run(cfg, {"main": None, "late": None}) == Phases(warmup_end=0, late_start=15)
    assert Phases.of_run(cfg, {"main": None}).late_start is None


def test_a_phase_change_returns_a_new_precision(make_cfg, tmp_path):
    """A restored allocation and a phase change each return a new Precision; the state and
    the precision they start from are left as they were."""
    cfg = make_cfg("recipe=nvfp4", "precision.late.fraction=0.25", "steps=20")
    st = build_state(cfg)
    rules = dict(st.rules)
    main = start_precision(st, "main", None)
    assert (main.phase, main.st, main.allocation) == ("main", st, None)
    alloc = {"bf16_layers": ["layers.0.attn.q_proj"]}
    chosen = start_precision(st, "main", alloc)
    assert chosen.st is not st and st.rules == rules  # st untouched
    assert chosen.st.rules["main"] == bf16_rules("nvfp4", alloc["bf16_layers"])
    assert chosen.allocation is alloc and chosen.programs is not main.programs
    records: list[dict] = []
    logger = MetricsLogger(tmp_path, total_steps=20, main=False, callbacks=[records.append])
    late = enter_phase(chosen, "late", 15, logger=logger)
    assert (late.phase, chosen.phase) == ("late", "main")
    assert (late.st, late.programs, late.allocation) == (chosen.st, chosen.programs, alloc)
    assert [(r["event"], r["step"], r["tokens"]) for r in records] == [
        ("late_switch", 15, 15 * cfg.tokens_per_step)
    ]


def test_clock_time_split_and_pause():
    c = Clock(t_start=0.0, step=0, t_prev=10.0, win_t0=10.0)
    c.tick(12.0, 100, compiling=True)  # 2 s of compilation
    c.tick(13.0, 100, compiling=False)  # 1 s timed
    c.pause(5.0)  # an evaluation: moves both clocks on
    assert (c.t_prev, c.win_t0) == (18.0, 15.0)
    c.tick(18.5, 100, compiling=False)  # 0.5 s timed
    assert c.train_time == 3.5 and c.compile_s == 2.0 and c.timed_s == 1.5
    assert c.timed_tokens == 200 and c.tokens_per_s == pytest.approx(200 / 1.5)
    assert Clock(t_start=0.0, step=0).tokens_per_s is None  # no timed step yet


def test_clock_counts_streaks_and_windows():
    c = Clock(t_start=0.0, step=3, win_t0=0.0)
    for step, (loss, finite) in enumerate(
        [(4.0, True), (9.0, False), (8.0, False), (2.0, True), (1.0, True), (3.0, True)], start=4
    ):
        c.count(step, loss, finite=finite, keep=3)
        c.win_tokens += 10
        if step == 6:
            assert (c.streak, c.nonfinite_total) == (2, 2)
    assert c.step == 9 and c.streak == 0 and c.nonfinite_total == 2
    assert c.recent == [2.0, 1.0, 3.0] and c.train_loss == 2.0  # the last `keep` finite
    loss_avg, rate = c.end_window(4.0)
    assert loss_avg == 2.5 and rate == 60 / 4.0  # finite losses only; all tokens
    assert (c.win_loss, c.win_tokens, c.win_t0) == ([], 0, 4.0)
    assert c.end_window(4.0) == (None, None)  # an empty window of no time


def test_clock_resumed_from_checkpoint_meta():
    c = Clock.resumed(
        {"nonfinite_total": 3, "nonfinite_streak": 1, "train_time_s": 7.5}, t_start=1.0, start=40
    )
    assert (c.step, c.nonfinite_total, c.streak, c.train_time) == (40, 3, 1, 7.5)
    assert Clock.resumed({}, t_start=1.0, start=0) == Clock(t_start=1.0, step=0)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_evaluate_is_the_mean_loss_of_the_batches(make_cfg, recipe):
    cfg = make_cfg(f"recipe={recipe}", "precision.bf16_last=0")
    st = build_state(cfg)
    g = st.graphdefs["main"]
    rng = np.random.default_rng(0)
    batches = {
        "val": [rng.integers(0, TEST_MODEL.vocab_size, (4, 17), dtype=np.int32) for _ in range(2)],
        "other": [rng.integers(0, TEST_MODEL.vocab_size, (4, 17), dtype=np.int32)],
    }
    step = make_eval_step(g, seed=cfg.seed)
    rec = evaluate(step, st.params, st.rest, batches, g, step=7, tokens=70, phase="main")
    expect = [float(step(st.params, st.rest, b)) for b in batches["val"]]
    assert rec["val_batch_losses"]["val"] == expect
    assert rec["val_loss"] == rec["val_losses"]["val"] == float(np.mean(expect))
    assert rec["val_ppl"] == math.exp(rec["val_loss"])
    assert len(rec["val_batch_losses"]["other"]) == 1
    assert (rec["kind"], rec["step"], rec["tokens"], rec["phase"]) == ("eval", 7, 70, "main")
    assert rec["eval_time_s"] >= 0
    model = nnx.merge(g, nnx.State(st.params), st.rest)
    if recipe == "bf16":
        # a bf16 model: nothing quantized, and the loss is the plain forward pass's
        assert rec["quant"] == {}
        np.testing.assert_allclose(expect[0], float(lm_loss(model, batches["val"][0])), rtol=1e-6)
    else:
        assert set(rec["quant"]) == {
            "layers.0.attn.q_proj",
            "layers.0.attn.k_proj",
            "layers.0.attn.v_proj",
            "layers.0.attn.o_proj",
            "layers.0.mlp.gate_proj",
            "layers.0.mlp.up_proj",
            "layers.0.mlp.down_proj",
            "layers.1.attn.q_proj",
            "layers.1.attn.k_proj",
            "layers.1.attn.v_proj",
            "layers.1.attn.o_proj",
            "layers.1.mlp.gate_proj",
            "layers.1.mlp.up_proj",
            "layers.1.mlp.down_proj",
        }
        assert set(rec["quant"]["layers.0.attn.q_proj"]) == {"zero", "saturated", "scale_underflow"}


def _facts(cfg, tmp_path):
    return RunFacts(
        cfg=cfg,
        out=tmp_path / "run",
        n_params=1234,
        corpus_hash="abc",
        entropy={"val": 3.5, "wiki": 4.0},
        late_switch_step=15,
        mesh_shape={"data": 1, "fsdp": 1, "tensor": 1},
        data={"rows": 9},
    )


def test_write_summary(make_cfg, tmp_path):
    cfg = make_cfg("steps=20")
    clock = Clock(
        t_start=0.0,
        step=20,
        nonfinite_total=2,
        train_time=3.0,
        compile_s=1.0,
        timed_s=2.0,
        timed_tokens=1000,
        recent=[2.0, 4.0],
    )
    last_eval = {
        "val_loss": 2.5,
        "val_ppl": math.exp(2.5),
        "val_losses": {"val": 2.5},
        "val_batch_losses": {"val": [2.0, 3.0]},
    }
    path = tmp_path / "summary.json"
    s = write_summary(
        path,
        "completed",
        facts=_facts(cfg, tmp_path),
        clock=clock,
        last_eval=last_eval,
        precision={"layers.0.attn.q_proj": "bf16"},
        init_source=None,
        allocation=None,
    )
    assert json.loads(path.read_text()) == json.loads(json.dumps(s))
    assert s["status"] == "completed" and s["recipe"] == cfg.recipe
    assert (s["final_val_loss"], s["final_val_batch_losses"]) == (2.5, {"val": [2.0, 3.0]})
    assert s["final_train_loss"] == 3.0 and s["steps"] == 20
    assert s["tokens"] == 20 * cfg.tokens_per_step and s["tokens_per_s"] == 500.0
    assert (s["nonfinite_steps"], s["train_time_s"], s["compile_time_s"]) == (2, 3.0, 1.0)
    assert s["unigram_entropy"] == 3.5 and s["late_switch_step"] == 15
    assert s["out"] == str(tmp_path / "run") and s["devices"] == jax.device_count()
    assert s["precision"] == {"layers.0.attn.q_proj": "bf16"}
    assert s["config"]["steps"] == 20


def test_write_summary_aborted_without_eval_and_unwritten(make_cfg, tmp_path):
    s = write_summary(
        None,
        "aborted",
        facts=_facts(make_cfg(), tmp_path),
        clock=Clock(t_start=0.0, step=4),
        last_eval=None,
        precision={},
        init_source=None,
        allocation=None,
        error="boom",
        last_good_checkpoint=None,
    )
    assert not list(tmp_path.glob("*.json"))  # path None: returned, not written
    assert s["final_val_loss"] is None and s["final_train_loss"] is None
    assert s["tokens_per_s"] is None
    assert list(s)[-2:] == ["error", "last_good_checkpoint"] and s["error"] == "boom"
