"""``microscale plan``: a pulse on 8 simulated devices, the stochastic-rounding size limit
at the llama-8b microbatch, the 70B preset from shapes, and clear errors for bad configs."""

from __future__ import annotations

import json

import pytest

from microscale.cli import main
from microscale.model import ModelConfig

TINY = ["--config", "tiny", "model.n_layers=1", "model.vocab_size=256", "precision.bf16_last=0"]


@pytest.mark.slow
def test_plan_tiny_on_eight_simulated_devices(tmp_path, capsys):
    rc = main(
        [
            "plan",
            *TINY,
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "grad_accum=2",
            "--recipe",
            "bf16",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    md = capsys.readouterr().out
    assert "**Fits**" in md and "XLA:CPU's buffer assignment needs" in md
    assert "all-gather" in md
    res = json.loads((tmp_path / "plan.json").read_text())
    assert (tmp_path / "plan.md").read_text() == md
    comp = res["compiled"]
    assert comp["devices"] == 8 and comp["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    # Every dimension divides the mesh: each device holds 1/(fsdp * tensor) = 1/4 of every
    # weight (the data axis replicates; norm scales are replicated by rule), and the same
    # share of AdamW state.
    shapes = res["shapes"]["bytes"]
    m = ModelConfig.tiny().replace(n_layers=1, vocab_size=256)
    norms = 3 * m.d_model
    assert shapes["params"] == pytest.approx((m.num_params() - norms) * 4 / 4 + norms * 4)
    assert res["shapes"]["replicated"] == []
    # XLA's arguments: params + 2 Adam moments (+ the batch shard and a few scalars).
    assert comp["memory"]["argument"] == pytest.approx(3 * shapes["params"], rel=0.02)
    # The compiled program's matmuls, loop counted twice (grad_accum=2), are the model's
    # 6N + attention FLOPs split evenly over 8 devices.
    tokens = 16 * 128
    assert comp["dot_flops"] == pytest.approx(m.flops_per_token(128) * tokens / 8, rel=1e-6)
    assert comp["unknown_trip_counts"] == 0
    assert comp["collectives"]["all-gather"]["count"] > 0
    # The target recipe (bf16 here) is compared with the other baseline only.
    assert set(res["roofline"]["speedup"]) == {"fp8"}
    assert res["roofline"]["recipes"]["bf16"]["terms"]["quantize"] == 0


@pytest.mark.slow
def test_sr_past_2_32_elements_lowers_at_the_llama8b_microbatch(capsys):
    # llama-8b with 4 microbatches: 128 sequences x 4096 tokens, so up_proj's dY has
    # 128 * 4096 * 14336 = 7.5e9 > 2^32 elements. One block keeps the trace short.
    over = [
        "model.n_layers=1",
        "precision.bf16_last=0",
        "grad_accum=4",
        "mesh.data=1",
        "mesh.fsdp=8",
    ]
    assert 512 // 4 * 4096 * ModelConfig.llama_8b().d_ff > 2**32
    rc = main(
        ["plan", "--config", "llama-8b", *over, "--recipe", "nvfp4", "--lower-only", "--json"]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert "error" not in res["compiled"], res["compiled"]
    assert res["compiled"]["lower_s"] > 0


@pytest.mark.slow
def test_plan_70b_from_shapes(capsys):
    rc = main(
        ["plan", "--config", "llama-70b", "mesh.fsdp=64", "mesh.tensor=8", "--no-compile", "--json"]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["devices"] == 512 and res["compiled"] is None
    m = ModelConfig.llama_70b()
    norms = (2 * m.n_layers + 1) * m.d_model  # RMSNorm scales stay replicated
    expected = (m.num_params() - norms) * 4 / 512 + norms * 4
    assert res["shapes"]["bytes"]["params"] == pytest.approx(expected, rel=1e-9)
    assert res["fit"]["basis"] == "shapes" and res["fit"]["fits"]
    assert 1.0 < res["roofline"]["speedup"]["fp8"]["step"] < 2.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "--devices", "4"],
            "but only 4 devices are available",
        ),
        (["mesh.data=1", "mesh.tensor=4"], "mesh.tensor=4 does not divide model.n_kv_heads=2"),
        (["mesh.data=1", "--accelerator", "tpu-v9"], "unknown accelerator 'tpu-v9'"),
        (["mesh.data=32"], "is not divisible by mesh.data * mesh.fsdp = 32"),
        (["mesh.data=1", "recipe_typo=1"], "recipe_typo"),
    ],
)
def test_bad_configs_are_named(args, message, capsys):
    assert main(["plan", "--config", "tiny", "--no-compile", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_mesh_axis_of_minus_one_gets_one_node(capsys):
    """Plain `microscale plan`: tiny's mesh.data=-1 spans cli.plan.DEFAULT_DEVICES (8);
    the library, given no device count, still refuses -1 with one line."""
    from microscale.cli.plan import DEFAULT_DEVICES
    from microscale.plan.run import check_config
    from microscale.train import TrainConfig

    assert main(["plan", "--no-compile", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"] == DEFAULT_DEVICES
    with pytest.raises(ValueError, match="mesh.data=-1 means 'the remaining devices'"):
        check_config(TrainConfig.tiny(), None)


def test_replicated_dimensions_are_listed(capsys):
    assert main(["plan", "--config", "tiny", "mesh.data=1", "mesh.tensor=2", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "embed.embedding dim 0 'vocab' (257): length 257 is not divisible" in out
