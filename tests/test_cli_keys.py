"""One CLI style: ``quantize`` and ``export`` take ``key=value`` (plus ``--list-keys``) like
``train``; every flag from before ``key=value`` is refused, naming the key that replaced it."""

from __future__ import annotations

import argparse

import pytest

from microscale.cli import export as export_cli
from microscale.cli import main
from microscale.cli import quantize as quantize_cli
from microscale.config import config_keys
from microscale.inference.export_run import ExportConfig
from microscale.ptq import QuantizeConfig, WeightPTQ
from microscale.workflows.quantize import QuantizeRunConfig

REQ = ["--model", "run", "--out", "out"]


def _parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(REQ + argv)


def _quantize(argv):
    return quantize_cli.configs(_parse(quantize_cli, argv))


def _export(argv):
    return export_cli.export_config(_parse(export_cli, argv))


REMOVED = [
    (command, flag, new)
    for command, module in (("quantize", quantize_cli), ("export", export_cli))
    for flag, new in module.REMOVED_FLAGS.items()
]


@pytest.mark.parametrize("command,flag,new", REMOVED, ids=[f"{c} {f}" for c, f, _ in REMOVED])
def test_each_removed_flag_is_refused_naming_its_key(command, flag, new, capsys):
    """The flags before key=value are gone: each, with or without a value, exits 2 with
    one line naming it and the key that replaces it."""
    for argv in ([flag], [flag, "1"]):
        with pytest.raises(SystemExit) as e:
            main([command, *REQ, *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{flag} was removed" in err[0] and f"write {new}" in err[0]


def test_the_quantize_command_line_builds_the_config():
    """The config key=value builds, field by field."""
    argv = [
        "budget=6",
        "formats=nvfp4,fp8,bf16",
        "method=gradient",
        "calib_tokens=256",
        "seed=1",
        "activations=true",
        "static_act_scales=false",
        "ptq.mse_scale=false",
        "ptq.method=gptq",
        "monotone=false",
        "ptq_effects=false",
        "count_other_params=true",
        "pareto_budgets=5,8",
        "solver=dp",
    ]
    expected = QuantizeConfig(
        budget=6.0,
        formats=("nvfp4", "fp8_e4m3", "bf16"),
        method="gradient",
        calib_tokens=256,
        seed=1,
        ptq=WeightPTQ(mse_scale=False, four_over_six=True, method="gptq"),
        activations=True,
        static_act_scales=False,
        monotone=False,
        ptq_effects=False,
        count_other_params=True,
        solver="dp",
        pareto_budgets=(5.0, 8.0),
    )
    assert _quantize(argv) == (expected, QuantizeRunConfig())
    gguf = _quantize(["layout=gguf", "budget=5.0", "calib_tokens=256"])
    assert gguf == (
        QuantizeConfig.for_gguf(budget=5.0, calib_tokens=256, ptq=WeightPTQ()),
        QuantizeRunConfig(layout="gguf"),
    )
    assert _export(["layout=modelopt", "overwrite=true"]) == ExportConfig(
        layout="modelopt", overwrite=True
    )


@pytest.mark.parametrize(
    "command,key",
    [("quantize", "nosuchkey"), ("quantize", "ptq.nosuchkey"), ("export", "nosuchkey")],
)
def test_an_unknown_key_is_named(command, key, capsys):
    assert main([command, *REQ, f"{key}=1"]) == 2
    assert key.split(".")[-1] in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["quantize", "layout=hf"], "layout='hf'"),
        (["quantize", "static_act_scales=false"], "static_act_scales=false has no effect"),
        (["quantize", "layout=gguf", "activations=true"], "a GGUF stores weights only"),
        (["quantize", "budget=-1"], "budget=-1"),
        (["quantize", "eval_batches=0"], "eval_batches=0"),
        (["export", "layout=microscale"], "layout='microscale'"),
        (["export", "formats=nvfp4", "rules=r.json"], "give one"),
        (["export", "shard_size=0"], "shard_size=0"),
    ],
)
def test_bad_values_are_refused_before_any_work(argv, fragment, capsys):
    assert main([argv[0], *REQ, *argv[1:]]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "command,classes",
    [("quantize", (QuantizeConfig, QuantizeRunConfig)), ("export", (ExportConfig,))],
)
def test_list_keys_lists_every_key_with_its_comment(command, classes, capsys):
    assert main([command, "--list-keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for cls in classes:
        for key in config_keys(cls):
            line = next((x for x in lines if x.startswith((f"{key} = ", f"{key}:"))), None)
            assert line is not None and "  # " in line, key


def test_list_keys_shows_the_resolved_values(capsys):
    assert main(["quantize", "--list-keys", "layout=gguf", "budget=5"]) == 0
    out = capsys.readouterr().out
    assert "budget = 5.0" in out and "heuristic = [q6_k, q4_k]" in out


def test_model_and_out_are_required_to_run(capsys):
    assert main(["quantize", "--out", "x"]) == 2
    assert "--model" in capsys.readouterr().err
