"""Published peak rates of the accelerators ``microscale plan`` models: one table, with sources.

Every rate is NVIDIA's *dense* tensor-core peak per GPU. NVIDIA's datasheets print the
2:4-sparse figure first; the dense one is half of it. "fp4" is the NVFP4/MXFP4 tensor-core
rate (Blackwell only: Hopper has no FP4 tensor cores, so an FP4 GEMM there is ``None`` and
a recipe that needs one cannot run natively). Memory is the HBM capacity per GPU in bytes
(decimal), bandwidth HBM bytes/s, ``link`` the NVLink bandwidth per GPU per direction
(half the bidirectional figure NVIDIA prints).

| name | BF16 | FP8 | FP4 | HBM | HBM B/W | NVLink / dir | source |
|---|---:|---:|---:|---:|---:|---:|---|
| h100 | 989 T | 1979 T | - | 80 GB | 3.35 TB/s | 450 GB/s | H100 SXM datasheet |
| h200 | 989 T | 1979 T | - | 141 GB | 4.8 TB/s | 450 GB/s | H200 SXM datasheet |
| b200 | 2.25 P | 4.5 P | 9 P | 180 GB | 8 TB/s | 900 GB/s | HGX B200 (8 GPUs, 1000 W) spec, / 8 |
| gb200 | 2.5 P | 5 P | 10 P | 186 GB | 8 TB/s | 900 GB/s | GB200 NVL72 spec, / 72 |
| gb300 | 2.5 P | 5 P | 15 P | 279 GB | 8 TB/s | 900 GB/s | GB300 NVL72 spec, / 72 |

The rates are marketing peaks: real GEMMs reach 60-80% of them, attention less. The model
uses them for *ratios* between recipes on one GPU, where a common efficiency factor
cancels only if every precision reaches the same fraction of its peak (it does not, in
practice: FP4 GEMMs are newer and smaller ones are further from peak).
"""

from __future__ import annotations

import dataclasses

__all__ = ["ACCELERATORS", "Accelerator", "get_accelerator"]

T = 1e12


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One GPU's published peak rates (dense tensor-core FLOP/s by element width)."""

    name: str  # table key, e.g. "b200"
    label: str  # product name as NVIDIA prints it
    # Dense tensor-core FLOP/s by the GEMM's operand element bits (16: BF16, 8: FP8,
    # 4: FP4); a missing width has no tensor-core path on this GPU.
    peak_flops: dict[int, float]
    hbm_bytes: float  # HBM capacity per GPU (bytes)
    hbm_bw: float  # HBM bandwidth (bytes/s)
    link_bw: float  # NVLink bandwidth per GPU and direction (bytes/s)
    source: str  # where the numbers come from

    def peak(self, bits: int) -> float | None:
        """Dense FLOP/s of a GEMM whose widest operand has ``bits`` element bits (the
        wider operand sets the tensor-core mode); None when this GPU has no tensor-core
        mode of that width (FP4 on Hopper: E2M1 x E4M3-scale products are not FP8 values,
        so an NVFP4 GEMM cannot borrow the FP8 rate)."""
        return self.peak_flops.get(int(bits))


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            name="h100",
            label="H100 SXM",
            peak_flops={16: 989 * T, 8: 1979 * T},
            hbm_bytes=80e9,
            hbm_bw=3.35e12,
            link_bw=450e9,
            source="NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 "
            "1,979 / FP8 3,958 TFLOPS with sparsity, 80 GB, 3.35 TB/s, NVLink "
            "900 GB/s",
        ),
        Accelerator(
            name="h200",
            label="H200 SXM",
            peak_flops={16: 989 * T, 8: 1979 * T},
            hbm_bytes=141e9,
            hbm_bw=4.8e12,
            link_bw=450e9,
            source="NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 "
            "1,979 / FP8 3,958 TFLOPS with sparsity, 141 GB, 4.8 TB/s, NVLink "
            "900 GB/s",
        ),
        Accelerator(
            name="b200",
            label="B200 (HGX, 1000 W)",
            peak_flops={16: 2250 * T, 8: 4500 * T, 4: 9000 * T},
            hbm_bytes=180e9,
            hbm_bw=8e12,
            link_bw=900e9,
            source="NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx), "
            "8 GPUs: FP4 144 / FP8 72 / BF16 36 PFLOPS with sparsity, 1.44 TB "
            "HBM3e, 64 TB/s; NVLink 5 1.8 TB/s per GPU",
        ),
        Accelerator(
            name="gb200",
            label="GB200 (NVL72)",
            peak_flops={16: 2500 * T, 8: 5000 * T, 4: 10000 * T},
            hbm_bytes=186e9,
            hbm_bw=8e12,
            link_bw=900e9,
            source="NVIDIA GB200 NVL72 specifications (nvidia.com/en-us/data-center/"
            "gb200-nvl72), 72 GPUs: FP4 1,440 / FP8 720 / BF16 360 PFLOPS with "
            "sparsity, 13.4 TB HBM3e, 576 TB/s; NVLink 5 1.8 TB/s per GPU",
        ),
        Accelerator(
            name="gb300",
            label="GB300 (NVL72, Blackwell Ultra)",
            peak_flops={16: 2500 * T, 8: 5000 * T, 4: 15000 * T},
            hbm_bytes=279e9,
            hbm_bw=8e12,
            link_bw=900e9,
            source="NVIDIA GB300 NVL72 specifications (nvidia.com/en-us/data-center/"
            "gb300-nvl72), 72 GPUs: FP4 1,080 PFLOPS dense, FP8 720 / BF16 360 "
            "PFLOPS with sparsity, 20 TB HBM3e, 576 TB/s",
        ),
    )
}


def get_accelerator(name: str) -> Accelerator:
    """An accelerator by name (case-insensitive); raises naming the known ones."""
    key = str(name).strip().lower()
    if key not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; expected one of {sorted(ACCELERATORS)}")
    return ACCELERATORS[key]
