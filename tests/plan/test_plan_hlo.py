"""HloModule on hand-written HLO: loop multiplicities, collective bytes (ring formulas:
all-gather out*(n-1)/n, reduce-scatter out*(n-1), all-reduce 2*size*(n-1)/n) and dot
FLOPs (2 * output elements * contracted length)."""

import pytest

from microscale.plan.hlo import HloModule, shape_bytes

HLO = """HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_dot (p0: bf16[8,64], p1: bf16[64,32]) -> f32[8,32] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %d = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[8,32])) -> (s32[], f32[8,32]) {
  %t = (s32[], f32[8,32]{1,0}) parameter(0)
  %w = bf16[64,32]{1,0} constant({...})
  %x = bf16[8,64]{1,0} constant({...})
  %ag = bf16[64,32]{1,0} all-gather(%w), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %f = f32[8,32]{1,0} fusion(%x, %ag), kind=kOutput, calls=%fused_dot
  %ar = f32[8,32]{1,0} all-reduce(%f), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  ROOT %r = (s32[], f32[8,32]{1,0}) tuple(%i, %ar)
}

%cond (c: (s32[], f32[8,32])) -> pred[] {
  %c = (s32[], f32[8,32]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (g: f32[128,16]) -> f32[16,16] {
  %g = f32[128,16]{1,0} parameter(0)
  %init = (s32[], f32[8,32]{1,0}) tuple()
  %loop = (s32[], f32[8,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[16,16]{1,0} reduce-scatter(%g), channel_id=3, replica_groups={}, dimensions={0}, to_apply=%add
  ROOT %d2 = f32[16,16]{1,0} dot(%rs, %rs), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}
"""


def test_multiplicity_follows_known_trip_counts():
    h = HloModule(HLO, n_devices=8)
    assert h.entry == "main"
    assert h.multiplicity["main"] == 1
    assert h.multiplicity["body"] == 3
    assert h.multiplicity["fused_dot"] == 3
    assert h.unknown_trip_counts == 0


def test_collective_bytes_ring_formulas():
    c = HloModule(HLO, n_devices=8).collectives()
    ag = 64 * 32 * 2  # bf16 result, group of 4 (iota [2,4]), 3 iterations
    assert c["all-gather"]["count"] == 3
    assert c["all-gather"]["bytes"] == pytest.approx(3 * ag * 3 / 4)
    ar = 8 * 32 * 4  # f32, groups of 2
    assert c["all-reduce"]["bytes"] == pytest.approx(3 * 2 * ar * 1 / 2)
    rs = 16 * 16 * 4  # replica_groups={} = all 8 devices, once
    assert c["reduce-scatter"]["count"] == 1
    assert c["reduce-scatter"]["bytes"] == pytest.approx(rs * 7)
    assert c["all-to-all"]["count"] == 0
    # elements: the same ring factors, one per element whatever the dtype
    assert c["all-gather"]["elements"] == pytest.approx(3 * 64 * 32 * 3 / 4)
    assert c["all-reduce"]["elements"] == pytest.approx(3 * 2 * 8 * 32 * 1 / 2)
    assert c["reduce-scatter"]["elements"] == pytest.approx(16 * 16 * 7)


def test_dot_flops_with_operand_shapes_from_the_computation():
    # loop body (3 runs): out 8x32, K=64; entry: out 16x16, K = dim 0 of rs = 16
    expected = 3 * 2 * 8 * 32 * 64 + 2 * 16 * 16 * 16
    assert HloModule(HLO, n_devices=8).dot_flops() == expected


def test_unknown_trip_count_is_counted_once_and_reported():
    text = HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    h = HloModule(text, n_devices=8)
    assert h.multiplicity["body"] == 1 and h.unknown_trip_counts == 1


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ("f32[4,8]{1,0}", 128),
        ("bf16[3]", 6),
        ("(s32[], f32[2,2]{1,0})", 20),
        ("f4e2m1fn[16]", 8),
        ("f8e4m3fn[10,10]", 100),
        ("pred[]", 1),
    ],
)
def test_shape_bytes(shape, nbytes):
    assert shape_bytes(shape) == nbytes


def test_no_entry_is_an_error():
    with pytest.raises(ValueError, match="no ENTRY"):
        HloModule("%c (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n", 1)
