"""Roofline terms against hand arithmetic from the published peaks, and the accelerator
table's lookups. Expected values are computed here from first principles (FLOPs of a
GEMM, bytes of a pass), not by calling the model's helpers."""

import dataclasses

import pytest

from microscale.data import DataConfig
from microscale.model import ModelConfig
from microscale.ops import get_recipe
from microscale.plan import ACCELERATORS, get_accelerator, recipe_step_time, roofline
from microscale.plan.roofline import _quantize_bytes
from microscale.train import PrecisionConfig, TrainConfig

B200 = get_accelerator("b200")


def _cfg(**model):
    m = dict(
        vocab_size=512,
        d_model=4096,
        n_layers=2,
        n_heads=32,
        n_kv_heads=8,
        d_ff=16384,
        max_seq_len=4096,
        remat=False,
    )
    m.update(model)
    return TrainConfig(
        model=ModelConfig(**m),
        data=DataConfig(seq_len=4096, batch_size=64, grad_accum=1),
        precision=PrecisionConfig(bf16_last=0),
    )


def test_table_lookups_and_errors():
    assert B200.peak(4) == 9e15 and B200.peak(8) == 4.5e15 and B200.peak(16) == 2.25e15
    assert get_accelerator("H100").peak(4) is None  # Hopper: no FP4 tensor cores
    assert set(ACCELERATORS) >= {"b200", "gb200", "h100", "h200"}
    for acc in ACCELERATORS.values():
        assert acc.source and acc.hbm_bytes > 0 and acc.peak(16) < acc.peak(8)
    with pytest.raises(ValueError, match=r"unknown accelerator 'tpu'; expected one of"):
        get_accelerator("tpu")


def test_bf16_gemm_term_is_6_n_tokens_over_peak():
    cfg = _cfg()
    mesh = {"data": 1, "fsdp": 8, "tensor": 1}
    r = recipe_step_time(cfg, mesh, B200, "bf16")
    n_lin = cfg.model.num_linear_params()
    tokens = 64 * 4096 / 8
    assert r["terms"]["gemm"] == pytest.approx(6 * n_lin * tokens / 2.25e15, rel=1e-3)
    assert r["terms"]["quantize"] == 0
    # QK^T and PV, forward and backward: 12 * layers * d_model * seq FLOPs per token, BF16.
    assert r["terms"]["attention"] == pytest.approx(12 * 2 * 4096 * 4096 * tokens / 2.25e15)
    # Tensor parallelism splits the GEMMs, data parallelism the tokens: the same FLOPs per
    # device (within 1%: k/v's 1024 outputs split 4 ways are memory-bound on B200).
    r2 = recipe_step_time(cfg, {"data": 2, "fsdp": 1, "tensor": 4}, B200, "bf16")
    assert r2["terms"]["gemm"] == pytest.approx(r["terms"]["gemm"], rel=1e-2)
    assert r2["terms"]["gemm"] >= r["terms"]["gemm"]


def test_gemm_only_speedup_is_the_peak_ratio_when_compute_bound():
    roof = roofline(_cfg(), {"data": 1, "fsdp": 8, "tensor": 1}, B200)
    s = roof["speedup"]
    assert s["fp8"]["gemm_only"] == pytest.approx(2.0, rel=0.05)
    assert s["bf16"]["gemm_only"] == pytest.approx(4.0, rel=0.05)
    # Every other term only pulls the step ratio below the GEMM ratio.
    assert 1.0 < s["fp8"]["step"] < s["fp8"]["gemm_only"]
    assert s["fp8"]["step"] < s["fp8"]["step_without_quantize"]


def test_nvfp4_quantize_bytes_by_hand():
    m, k, n = 4096, 1024, 2048
    b, flops = _quantize_bytes(get_recipe("nvfp4"), m, k, n, fused=False)
    q = 4.5 / 8  # NVFP4 bytes per element incl. its E4M3 scale per 16
    x, w, dy = m * k, k * n, m * n
    # fprop X, fprop W (16x16 tiles serve dgrad too), dgrad dY (SR), wgrad X^T (RHT),
    # wgrad dY (RHT, SR): read bf16 + write; amax reads: X, W, dY, RHT(X), RHT(dY).
    writes = (x + w + dy + x + dy) * q
    reads = (x + w + dy + x + dy) * 2 + (x + w + dy + x + dy) * 2
    assert b == pytest.approx(writes + reads)
    assert flops == pytest.approx(2 * 16 * (x + dy) * 2)
    fused, _ = _quantize_bytes(get_recipe("nvfp4"), m, k, n, fused=True)
    assert fused == pytest.approx(b - (x + dy) * 2)  # X and dY read once for both slots


def test_fp8_reuses_transpose_invariant_copies():
    m, k, n = 4096, 1024, 2048
    b, flops = _quantize_bytes(get_recipe("fp8"), m, k, n, fused=False)
    x, w, dy = m * k, k * n, m * n
    # E4M3 X (serves wgrad), E4M3 W (serves dgrad), E5M2 dY (serves wgrad): one pass each
    # (read + 1-byte write) and one amax read each.
    assert b == pytest.approx((x + w + dy) * (2 + 1) + (x + w + dy) * 2)
    assert flops == 0


def test_no_fp4_tensor_cores_means_no_nvfp4_total():
    r = roofline(_cfg(), {"data": 1, "fsdp": 8, "tensor": 1}, get_accelerator("h100"))
    assert r["recipes"]["nvfp4"]["total"] is None
    assert r["recipes"]["nvfp4"]["missing_bits"] == [4]
    assert r["speedup"]["fp8"] is None
    assert r["recipes"]["fp8"]["total"] > 0


def test_remat_adds_a_forward():
    cfg = _cfg()
    mesh = {"data": 1, "fsdp": 8, "tensor": 1}
    plain = recipe_step_time(cfg, mesh, B200, "bf16")["terms"]["gemm"]
    remat = dataclasses.replace(cfg, model=cfg.model.replace(remat=True))
    assert recipe_step_time(remat, mesh, B200, "bf16")["terms"]["gemm"] == pytest.approx(
        plain * 4 / 3, rel=1e-3
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,mesh",
    [
        ("llama-8b", {"data": 1, "fsdp": 8, "tensor": 1}),
        ("llama-70b", {"data": 1, "fsdp": 8, "tensor": 8}),
        ("llama-1b", {"data": 2, "fsdp": 2, "tensor": 2}),
    ],
)
@pytest.mark.parametrize("gb", [20, 80, 141])
def test_largest_microbatch_is_the_edge_of_the_fit(preset, mesh, gb):
    """The largest microbatch fits, one more sequence per device does not; None when not
    even one fits (the state alone can exceed a small device)."""
    from microscale.plan import largest_microbatch, shape_memory
    from microscale.plan.run import abstract_model

    cfg = TrainConfig.preset(preset)
    model = abstract_model(cfg.model)
    dp = mesh["data"] * mesh["fsdp"]

    def peak(seqs):
        data = dataclasses.replace(cfg.data, batch_size=seqs * dp * cfg.data.grad_accum)
        return shape_memory(dataclasses.replace(cfg, data=data), mesh, model)["bytes"]["total"]

    big = largest_microbatch(cfg, mesh, gb * 1e9, model)
    if big is None:
        assert peak(1) > gb * 1e9
        return
    s = big["sequences_per_device"]
    assert peak(s) == big["peak"] <= gb * 1e9 < peak(s + 1)
    assert big["tokens_per_device"] == s * cfg.data.seq_len
