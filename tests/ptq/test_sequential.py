"""Block-sequential GPTQ (`microscale.ptq.sequential`) against a plain whole-model
reference, per family, for both calibration streams.

The reference builds the whole model, block by block: for block i it takes the input
Hessians from the whole-model engine (`Engine.input_hessians`) on a model whose earlier
blocks hold the kernels already quantized ("quantized") or the original ones
("original"), and GPTQ-quantizes block i's fused groups with them. The streamed version
holds one block at a time; the two must agree exactly (the same block definition runs
the same bf16 arithmetic in both).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from family_configs import CONFIGS, moved_model
from microscale.export import export_checkpoint, flat_params, read_checkpoint
from microscale.model import ModelConfig, Transformer, fused_groups

# inspected, never run: compiled as `plan` compiles (the HLO and memory do not depend on it)
from microscale.plan.compile import COMPILER_OPTIONS as INSPECT
from microscale.ptq.engine import Engine
from microscale.ptq.sequential import _Blocks, folder_source, params_source, sequential_gptq
from microscale.ptq.weights import WeightPTQ, quantize_group

# A format per fused group, cycling: every block mixes 4-bit, 8-bit and float groups.
PALETTE = ("nvfp4", "mxfp4", "fp8_e4m3", "nvfp4", "bf16")
PTQ = WeightPTQ(method="gptq")


def _formats(cfg: ModelConfig) -> dict[str, str]:
    return {p: PALETTE[k % len(PALETTE)] for k, g in enumerate(fused_groups(cfg)) for p in g}


def _batches(n=2, rows=2, seq=24, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 257, (rows, seq + 1)).astype(np.int32) for _ in range(n)]


def _reference(model: Transformer, batches, formats, inputs: str) -> dict[str, np.ndarray]:
    """{path: dequantized [in, out] kernel}: the whole-model engine, block by block."""
    cfg = model.config
    done: dict[str, np.ndarray] = {}
    for i in range(cfg.n_layers):
        eng = Engine(model)
        if inputs == "quantized" and done:
            work = Transformer(cfg, rngs=nnx.Rngs(0))
            nnx.update(work, nnx.State(eng.with_kernels(done)))
            eng = Engine(work)
        hs = eng.input_hessians(np.stack(batches))
        for g in fused_groups(cfg):
            if g[0].startswith(f"layers.{i}."):
                qs = quantize_group(
                    [eng.kernels[p] for p in g], formats[g[0]], PTQ, [hs[p] for p in g]
                )
                done.update((p, np.asarray(q.values)) for p, q in zip(g, qs, strict=True))
    return done


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request):
    cfg = CONFIGS[request.param]
    return cfg, moved_model(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("inputs", ["quantized", "original"])
def test_streamed_equals_the_whole_model_reference(family, inputs):
    cfg, model = family
    batches, formats = _batches(), _formats(cfg)
    got = sequential_gptq(params_source(cfg, flat_params(model)), batches, formats, inputs=inputs)
    ref = _reference(model, batches, formats, inputs)
    assert sorted(got.weights) == sorted(ref)
    assert got.tokens == 2 * 2 * 24 and got.inputs == inputs
    for p, want in ref.items():
        assert got.weights[p].format == formats[p]
        np.testing.assert_array_equal(np.asarray(got.weights[p].values), want, err_msg=p)


@pytest.mark.slow
def test_the_two_streams_differ_after_the_first_block(family):
    """The choice matters (so the test above can tell the streams apart): block 0 sees
    the embedding either way, every later block sees different inputs."""
    cfg, model = family
    src, batches, formats = params_source(cfg, flat_params(model)), _batches(), _formats(cfg)
    a = sequential_gptq(src, batches, formats, inputs="quantized").weights
    b = sequential_gptq(src, batches, formats, inputs="original").weights
    for p in a:
        same = np.array_equal(np.asarray(a[p].values), np.asarray(b[p].values))
        quantized = formats[p] != "bf16"
        assert same == (p.startswith("layers.0.") or not quantized), p


@pytest.mark.slow
def test_a_folder_source_reads_what_the_checkpoint_holds(tmp_path):
    cfg = CONFIGS["qwen2"]
    export_checkpoint(moved_model(cfg), tmp_path / "hf", layout="hf", dtype="float32")
    src = folder_source(tmp_path / "hf")
    assert src.config.n_layers == cfg.n_layers and src.config.family == "qwen2"
    held = read_checkpoint(tmp_path / "hf").params
    batches, formats = _batches(n=1), _formats(cfg)
    a: dict = {}  # through a sink: the result keeps nothing
    assert sequential_gptq(src, batches, formats, sink=a.__setitem__).weights == {}
    b = sequential_gptq(params_source(src.config, held), batches, formats).weights
    assert list(a) == list(b)
    for p in b:
        np.testing.assert_array_equal(np.asarray(a[p].values), np.asarray(b[p].values), err_msg=p)


def _block_temps(n_layers: int) -> tuple[int, set[int]]:
    """(programs compiled, their temporaries' sizes) for every block of a llama of
    ``n_layers`` blocks."""
    cfg = CONFIGS["llama"].replace(n_layers=n_layers)
    params = flat_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    blocks = _Blocks(cfg)
    x = jax.ShapeDtypeStruct((2, 24, cfg.d_model), np.float32)
    cs = jax.ShapeDtypeStruct((24, cfg.head_dim // 2), np.float32)
    temps = set()
    for i in range(n_layers):
        head = f"layers.{i}."
        graphdef, p, rest = blocks.build(
            i, {k[len(head) :]: v for k, v in params.items() if k.startswith(head)}
        )
        _, grams, _ = blocks.programs(graphdef)
        compiled = grams.lower(p, rest, x, cs, cs).compile(compiler_options=INSPECT)
        temps.add(compiled.memory_analysis().temp_size_in_bytes)
    return len(blocks._fns), temps


def test_one_program_per_block_kind_and_its_memory_does_not_grow():
    """The per-block program is compiled once per kind of block (one kind in a llama)
    and its temporaries are those of one block, the same at 2 and 6 blocks."""
    shallow, deep = _block_temps(2), _block_temps(6)
    assert shallow[0] == deep[0] == 1
    assert len(shallow[1]) == 1 and shallow[1] == deep[1]


_Q = "layers.0.attn.q_proj"


@pytest.mark.parametrize(
    ("kwargs", "formats", "match"),
    [
        (dict(inputs="sequential"), None, r"inputs='sequential': expected one of \['quantized', "),
        (dict(batches=[]), None, "no calibration batches"),
        (dict(batches=[np.zeros((2, 1), np.int32)]), None, r"shape \(2, 1\).*seq >= 1"),
        (dict(batches=[np.full((2, 9), 300, np.int32)]), None, "ids span 300..300, outside the vocabulary 0..256"),
        (dict(batches=[np.zeros((2, 9), np.int32), np.zeros((2, 5), np.int32)]), None, r"shapes \[\(2, 5\), \(2, 9\)\]: expected one"),
        ({}, {}, f"formats has no entry for '{_Q}'"),
        ({}, {_Q: "mxfp4"}, rf"fused group \['{_Q}'.*needs one format; formats gives \['fp8_e4m3', 'mxfp4'\]"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_any_work(kwargs, formats, match):
    cfg = CONFIGS["llama"]
    if formats is None:  # a good allocation: the bad value is elsewhere
        formats = _formats(cfg)
    elif formats:  # one member of q/k/v's group in a format of its own
        formats = dict.fromkeys(_formats(cfg), "fp8_e4m3") | formats

    class Untouched:
        config = cfg

        def embed(self, tokens):
            raise AssertionError("read before the input was checked")

        block = embed

    batches = kwargs.pop("batches", _batches(n=1))
    with pytest.raises(ValueError, match=match):
        sequential_gptq(Untouched(), batches, formats, **kwargs)


def test_a_quantized_folder_is_refused(tmp_path):
    cfg = CONFIGS["llama"]
    export_checkpoint(moved_model(cfg), tmp_path / "ct", layer_formats="nvfp4")
    with pytest.raises(ValueError, match="already quantized; block-sequential PTQ reads float"):
        folder_source(tmp_path / "ct")
