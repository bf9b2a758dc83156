"""One mapping from logical axis names to a PartitionSpec (`logical_to_mesh_spec`):
the trainer's rules (replicate what cannot be sharded) and the record of each dimension
it replicated. Expected specs are written from the rule table in the module docstring."""

import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from microscale.model import ModelConfig, Transformer, logical_to_mesh_spec, partition_specs

MESH = {"data": 2, "fsdp": 2, "tensor": 2}

# (axes, shape, mesh, expected spec, expected replicated (dim, reason fragment) or None)
CASES = [
    (("embed", "heads"), (64, 64), MESH, P("fsdp", "tensor"), None),
    (("heads", "embed"), (64, 64), MESH, P("tensor", "fsdp"), None),
    (("vocab", "embed"), (257, 64), MESH, P(None, "fsdp"), (0, "257 is not divisible")),
    (
        ("embed", "kv_heads"),
        (64, 6),
        {"fsdp": 2, "tensor": 4},
        P("fsdp", None),
        (1, "6 is not divisible by mesh axes ('tensor',) (size 4)"),
    ),
    (("batch", "length"), (8, 16), MESH, P(("data", "fsdp"), None), None),
    (("batch",), (6,), MESH, P(None), (0, "not divisible by mesh axes ('data', 'fsdp')")),
    (("batch",), (6,), {"data": 1, "fsdp": 2, "tensor": 2}, P("fsdp"), None),
    (("embed", "embed"), (4, 4), MESH, P("fsdp", None), (1, "already shards")),
    (("norm",), (64,), MESH, P(None), None),
    (("expert", "embed"), (4, 64), MESH, P(None, "fsdp"), (0, "no mesh rule")),
    (("embed", "heads"), (64, 64), {"data": 8, "fsdp": 1, "tensor": 1}, P(None, None), None),
    (("heads",), (64,), {"data": 2}, P(None), (0, "the mesh has no axis ['tensor']")),
    (
        ("batch", "length", "embed"),
        None,
        None,
        P(("data", "fsdp"), None, None),
        (2, "mesh axis ['fsdp'] already shards"),
    ),
    (("embed", "mlp"), (63, 64), None, P("fsdp", "tensor"), None),  # no mesh: no check
    (None, (3,), MESH, P(), None),
    ((), (), MESH, P(), None),
]


@pytest.mark.parametrize(("axes", "shape", "mesh", "spec", "rep"), CASES)
def test_logical_to_mesh_spec_table(axes, shape, mesh, spec, rep):
    recs = []
    assert logical_to_mesh_spec(axes, shape, mesh, where="w", replicated=recs) == spec
    if rep is None:
        assert recs == []
    else:
        (r,) = recs
        assert r.dim == rep[0] and rep[1] in r.reason and r.where == "w"
        assert r.name == axes[rep[0]]
        assert r.size == (None if shape is None else shape[rep[0]])


def test_bad_rank_names_the_array():
    with pytest.raises(ValueError, match=r"q: logical axes \('embed',\) do not match shape"):
        logical_to_mesh_spec(("embed",), (4, 4), MESH, where="q")


def test_partition_specs_on_a_mesh_reports_parameter_paths():
    cfg = ModelConfig(
        vocab_size=257, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=96, max_seq_len=16
    )
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    recs = []
    specs = partition_specs(model, mesh={"data": 1, "fsdp": 2, "tensor": 4}, replicated=recs)
    # d_ff 96 = 4 * 24 shards; kv 1 * 32 = 4 * 8 shards; vocab 257 does not.
    assert specs["layers"][0]["mlp"]["up_proj"]["kernel"].get_value() == P("fsdp", "tensor")
    assert specs["embed"]["embedding"].get_value() == P(None, "fsdp")
    assert [(r.where, r.dim) for r in recs] == [("embed.embedding", 0)]
    assert "embed.embedding dim 0 'vocab' (257)" in str(recs[0])
