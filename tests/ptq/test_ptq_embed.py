"""The token embedding / LM head as an item of the search (``count_other_params=true``):
its candidates, its scores measured with the table as a GGUF stores it, the budget
accounting with its bits, the GGUF that ``quantize layout=gguf`` and a later ``export``
write, and the default path without the item."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from microscale.config import apply_overrides
from microscale.export.gguf.tensors import EMBED_FORMATS, embed_values
from microscale.model import Transformer
from microscale.ptq import (
    EMBED_ITEM,
    Engine,
    Problem,
    QuantizeConfig,
    brute_force,
    quantize_model,
    search,
    table_scores,
    write_outputs,
)

from .conftest import TINY

# TINY's parameters: 14 linear layers (2 blocks x q 4096, k 2048, v 2048, o 4096, gate,
# up, down 4096 each), the tied embedding 257 x 64, the norms 2 x 2 x 64 + 64.
LINEAR, TABLE, NORMS = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 4096), 257 * 64, 5 * 64
BITS = {"bf16": Fraction(16), "nvfp4": Fraction(9, 2), "mxfp4": Fraction(17, 4)}
BITS["q8_0"] = Fraction(17, 2)

# The pipeline runs of this module: the search's points, no PTQ-effect evaluations.
BASE = dict(
    uniform_formats=("nvfp4", "bf16"),
    heuristic=("q8_0", "nvfp4"),
    ptq_effects=False,
)


def _gguf_cfg(**kw) -> QuantizeConfig:
    return QuantizeConfig.for_gguf(fp4=True, **{**BASE, **kw})


@pytest.fixture(scope="module")
def searched(tiny_model, token_batches):
    """6.0 bits over the whole model, the embedding searched, with a tight (4.4) and a loose
    (16) point; layer formats that compressed-tensors stores too."""
    calib, evals = token_batches
    cfg = _gguf_cfg(
        budget=6.0,
        formats=("nvfp4", "mxfp4", "bf16"),
        count_other_params=True,
        pareto_budgets=(4.4, 16.0),
    )
    return quantize_model(tiny_model, calib, evals, cfg)


@pytest.fixture(scope="module")
def default(tiny_model, token_batches):
    calib, evals = token_batches
    return quantize_model(tiny_model, calib, evals, _gguf_cfg(budget=6.0, pareto_budgets=()))


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({}, ()),
        ({"count_other_params": True}, EMBED_FORMATS),
        ({"count_other_params": True, "method": "loss"}, EMBED_FORMATS),
        ({"count_other_params": True, "method": "kl"}, EMBED_FORMATS),
        ({"count_other_params": True, "method": "gradient"}, ()),
        ({"count_other_params": True, "embed_formats": "q8_0,bf16"}, ("q8_0", "bf16")),
        ({"count_other_params": True, "method": "gradient", "embed_formats": "bf16"}, ("bf16",)),
    ],
)
def test_the_item_is_searched_only_with_count_other_params(kw, expected):
    assert QuantizeConfig(**kw).searched_embed_formats == expected
    assert EMBED_FORMATS == ("bf16", "mxfp4", "q8_0")
    # key=value, as the command line and YAML give it
    text = [f"{k}={','.join(v) if isinstance(v, tuple) else str(v).lower()}" for k, v in kw.items()]
    assert apply_overrides(QuantizeConfig(), text) == QuantizeConfig(**kw)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"embed_formats": ("q8_0",)}, "no effect without count_other_params"),
        ({"count_other_params": True, "embed_formats": ("nvfp4",)}, "cannot store"),
        ({"count_other_params": True, "embed_formats": ("fp8_e4m3",)}, "cannot store"),
        ({"count_other_params": True, "embed_formats": ()}, "is empty"),
        ({"count_other_params": True, "embed_formats": ("q8_0", "q8_0")}, "twice"),
        (
            {"count_other_params": True, "method": "gradient", "embed_formats": ("q8_0",)},
            "cannot score",
        ),
    ],
)
def test_embed_formats_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        QuantizeConfig(**kw)


# ---------------------------------------------------------------------- the search


def _problem(embed_scores: dict[str, float]) -> Problem:
    """Two linear layers (nvfp4 / bf16) and the embedding item with its own candidates."""
    numel = {"a": 64 * 64, "b": 64 * 128, EMBED_ITEM: 256 * 64}
    scores = {
        "a": {"nvfp4": 0.3, "bf16": 0.0},
        "b": {"nvfp4": 0.2, "bf16": 0.0},
        EMBED_ITEM: embed_scores,
    }
    return Problem(
        formats=("nvfp4", "bf16"),
        scores=scores,
        numel=numel,
        options={EMBED_ITEM: EMBED_FORMATS},
        extra_numel=320,
    )


# (budget, expected embedding format), worked by hand: at 16 bits everything fits; at 14
# storing b in nvfp4 (score 0.2) saves enough; at 10 the table in q8_0 (0.25) and b; at 7
# and 4.5 only the mxfp4 table (0.5) with b (and a) fit.
EMBED_SCORES = {"bf16": 0.0, "mxfp4": 0.5, "q8_0": 0.25}


@pytest.mark.parametrize(
    "budget,expected",
    [(4.5, "mxfp4"), (7.0, "mxfp4"), (10.0, "q8_0"), (14.0, "bf16"), (16, "bf16")],
)
def test_budget_picks_the_embedding_format(budget, expected):
    p = _problem(EMBED_SCORES)
    for solver in ("dp", "milp"):
        a = search(p, budget, solver=solver)
        assert a.formats[EMBED_ITEM] == expected
        ref = brute_force(p, budget)
        assert a.formats == ref.formats and a.total_score == pytest.approx(ref.total_score)
        assert a.effective_bits <= budget


def test_budget_accounting_with_the_embedding_is_exact():
    p = _problem(EMBED_SCORES)
    a = search(p, 10.0)
    total = 64 * 64 + 64 * 128 + 256 * 64 + 320
    bits = sum(BITS[a.formats[k]] * n for k, n in p.numel.items()) + 16 * 320
    assert a.effective_bits == float(bits / total)
    # by hand: a bf16 (16), b nvfp4 (4.5), the table q8_0 (8.5), 320 others at 16 bits
    assert a.formats == {"a": "bf16", "b": "nvfp4", EMBED_ITEM: "q8_0"}
    assert a.effective_bits == (16 * 4096 + 4.5 * 8192 + 8.5 * 16384 + 16 * 320) / 28992
    assert a.total_score == 0.2 + 0.25


@pytest.mark.parametrize(
    "options,message",
    [
        ({"c": ("bf16",)}, "not a layer"),
        ({EMBED_ITEM: ()}, "is empty"),
        ({EMBED_ITEM: ("bf16", "zz")}, "zz"),
        ({EMBED_ITEM: ("bf16", "fp8_e4m3")}, "lacks format"),
    ],
)
def test_problem_options_validation(options, message):
    p = _problem(EMBED_SCORES)
    with pytest.raises(ValueError, match=message):
        Problem(formats=p.formats, scores=p.scores, numel=p.numel, options=options)


# ---------------------------------------------------------------------- the scores


@pytest.mark.slow  # ~12 s: four GGUF files
@pytest.mark.parametrize("fmt", ["q8_0", "mxfp4"])
@pytest.mark.parametrize("tied", [True, False])
def test_tables_hold_what_a_gguf_stores(tied, fmt, tmp_path):
    """Tied: the one table (lookup and LM head); untied: the embedding and the LM head
    each, quantized along d_model: the values write_gguf stores, bit for bit."""
    import gguf

    from microscale.data.tokenizers import ByteTokenizer
    from microscale.export.gguf.writer import write_gguf

    cfg = dataclasses.replace(TINY, tie_embeddings=tied)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    engine = Engine(model)
    keys = {("embed", "embedding"): False} | ({} if tied else {("lm_head", "kernel"): True})
    assert engine.tables == keys
    assert engine.table_numel == TABLE * (1 if tied else 2)
    assert engine.other_numel == engine.table_numel + NORMS
    q = engine.with_tables(fmt)
    emb = engine.params["embed"]["embedding"]
    np.testing.assert_array_equal(q["embed"]["embedding"], embed_values(emb, fmt))
    assert not np.array_equal(q["embed"]["embedding"], emb)
    stored = {"token_embd.weight": q["embed"]["embedding"]}
    if not tied:
        head = engine.params["lm_head"]["kernel"]
        np.testing.assert_array_equal(q["lm_head"]["kernel"], embed_values(head.T, fmt).T)
        stored["output.weight"] = q["lm_head"]["kernel"].T
    same = engine.with_tables("bf16")  # unquantized: unchanged
    assert all(same[k] is v for k, v in engine.params.items())
    path = tmp_path / "m.gguf"
    write_gguf(model, path, tokenizer=ByteTokenizer(), embed_format=fmt)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, want in stored.items():
        t = tensors[name]
        assert t.tensor_type.name == fmt.upper()
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(got.reshape(want.shape), np.asarray(want))


@pytest.mark.slow  # ~4 s: three compiled forward passes
def test_table_scores_measure_the_loss_change(tiny_model, token_batches):
    calib, _ = token_batches
    engine = Engine(tiny_model)
    taylor = table_scores(engine, calib, EMBED_FORMATS, "taylor")
    loss = table_scores(engine, calib, EMBED_FORMATS, "loss")
    kl = table_scores(engine, calib, ("bf16", "mxfp4"), "kl")
    base = engine.batch_losses(engine.params, calib)
    want = engine.batch_losses(engine.with_tables("mxfp4"), calib) - base
    assert taylor["bf16"] == loss["bf16"] == kl["bf16"] == 0.0
    assert taylor["mxfp4"] == float(np.mean(want))
    assert loss["mxfp4"] == float(np.sum(want))
    assert kl["mxfp4"] > 0
    with pytest.raises(ValueError, match="does not measure"):
        table_scores(engine, calib, EMBED_FORMATS, "gradient")


# ---------------------------------------------------------------------- the pipeline


@pytest.mark.slow  # the pipeline runs of the module fixtures take ~25 s
def test_the_item_in_the_pipeline(searched, default):
    emb = searched.embedding
    assert emb is not None and emb["candidates"] == list(EMBED_FORMATS)
    assert emb["numel"] == TABLE and emb["format"] == searched.embed_format
    assert emb["scores"]["bf16"] == 0.0 and emb["scores"]["mxfp4"] > 0
    assert set(searched.allocation.formats) == set(searched.paths)  # linear layers only
    rep = searched.report().to_dict()
    assert rep["embed_format"] == emb["format"] and rep["embedding"] == emb
    assert EMBED_ITEM not in rep["layers"] and EMBED_ITEM not in rep["scores"]
    # the default: no item, no key in the report
    assert default.embedding is None and default.embed_format is None
    plain = default.report().to_dict()
    assert "embedding" not in plain and "embed_format" not in plain
    assert all("embedding" not in p for p in default.points.values())


@pytest.mark.slow  # the pipeline runs of the module fixtures take ~25 s
def test_pipeline_budget_accounting_is_exact(searched):
    """Effective bits of every point by hand: linear layers at their formats, the table
    at its format (bf16 for the fixed allocations), the norms at 16 bits."""
    total = LINEAR + TABLE + NORMS
    for label, point in searched.points.items():
        layers = point.get("layers") or dict.fromkeys(searched.paths)
        if label == "uniform_nvfp4":
            layers = dict.fromkeys(searched.paths, "nvfp4")
        elif label == "bf16":
            layers = dict.fromkeys(searched.paths, "bf16")
        elif label == "heuristic":
            continue  # its layers are not in the point; covered by test_ptq_pipeline
        emb = point["embedding"]
        linear = sum(BITS[f] * searched.numel[p] for p, f in layers.items())
        want = (linear + BITS[emb] * TABLE + 16 * NORMS) / total
        assert point["effective_bits"] == float(want) == point["model_bits"], label
        assert point["linear_bits"] == float(linear / LINEAR), label
    a = searched.allocation
    assert a.effective_bits == searched.points["searched"]["effective_bits"] <= 6.0
    # the fixed points keep the bf16 table: uniform NVFP4 = (4.5 L + 16 (T + N)) / total
    assert searched.points["uniform_nvfp4"]["effective_bits"] == (
        4.5 * LINEAR + 16 * (TABLE + NORMS)
    ) / (LINEAR + TABLE + NORMS)


@pytest.mark.slow  # the pipeline runs of the module fixtures take ~25 s
def test_tight_budget_shrinks_the_table_loose_keeps_bf16(searched):
    pts = searched.points
    assert pts["pareto_4.4"]["embedding"] == "mxfp4"  # the only table that fits
    assert pts["pareto_16"]["embedding"] in ("bf16", "q8_0")
    sc = searched.embedding["scores"]
    loose = "bf16" if sc["q8_0"] >= 0 else "q8_0"  # signed scores: q8_0 may lower the loss
    assert pts["pareto_16"]["embedding"] == loose
    for label in ("bf16", "uniform_nvfp4", "heuristic"):
        assert pts[label]["embedding"] == "bf16"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["gguf", "compressed-tensors"])
def test_gguf_stores_the_chosen_format(searched, default, layout, tmp_path):
    """quantize layout=gguf writes the chosen token_embd type; a compressed-tensors output
    keeps the table bf16 and a later export to GGUF uses the recorded choice unless
    embed_format= is given. The stored values are those the score measured."""
    import gguf

    from microscale.data.tokenizers import ByteTokenizer
    from microscale.inference.export_run import export_run

    def read(path):
        r = gguf.GGUFReader(path)
        t = next(t for t in r.tensors if t.name == "token_embd.weight")
        return t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type)

    tok = ByteTokenizer()
    chosen = searched.embed_format
    assert chosen in ("mxfp4", "q8_0")
    out = tmp_path / "q"
    write_outputs(searched, out, model_config=TINY, tokenizer=tok, layout=layout)
    assert (
        f"the token embedding / LM head searched: **{chosen}**" in (out / "report.md").read_text()
    )
    if layout == "gguf":
        kind, values = read(out / "model.gguf")
    else:
        export_run(out, tmp_path / "later.gguf", layout="gguf")
        kind, values = read(tmp_path / "later.gguf")
        export_run(out, tmp_path / "bf16.gguf", layout="gguf", embed_format="bf16")
        assert read(tmp_path / "bf16.gguf")[0] == "BF16"
    assert kind == chosen.upper()
    engine = searched.engine
    assert engine is not None
    # quantize layout=gguf stores what the score measured, from the master table; a
    # compressed-tensors checkpoint holds the table in bf16, and a later export quantizes that
    want = engine.with_tables(chosen)["embed"]["embedding"]
    if layout != "gguf":
        table = np.asarray(engine.params["embed"]["embedding"], ml_dtypes.bfloat16)
        want = embed_values(table.astype(np.float32), chosen)
    np.testing.assert_array_equal(values.reshape(TINY.vocab_size, TINY.d_model), want)
    # the default output keeps the bf16 table
    write_outputs(default, tmp_path / "d", model_config=TINY, tokenizer=tok, layout="gguf")
    assert read(tmp_path / "d" / "model.gguf")[0] == "BF16"
