"""One CLI style: ``quantize`` and ``export`` take ``key=value`` (plus ``--list-keys``) like
``train``; every old flag still works, is the same config as its key, and says so."""

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

REQ = ["--checkpoint", "run", "--out", "out"]


def _parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(REQ + argv)


def _quantize(argv):
    return quantize_cli.configs(_parse(quantize_cli, argv))


def _export(argv):
    return export_cli.export_config(_parse(export_cli, argv))


# (old flags, the same request as key=value)
QUANTIZE_TABLE = [
    (["--budget", "5.5"], ["budget=5.5"]),
    (["--formats", "nvfp4,fp8,bf16"], ["formats=nvfp4,fp8,bf16"]),
    (["--formats", "nvfp4,fp8,bf16"], ["formats=nvfp4,fp8_e4m3,bf16"]),
    (["--target", "gguf"], ["layout=gguf"]),
    (["--target", "gguf", "--formats", "nvfp4,q8_0"], ["layout=gguf", "formats=nvfp4,q8_0"]),
    (["--method", "kl"], ["method=kl"]),
    (["--calib-tokens", "8192"], ["calib_tokens=8192"]),
    (["--seed", "3"], ["seed=3"]),
    (["--corpus", "texts/"], ["corpus=texts/"]),
    (["--step", "40"], ["step=40"]),
    (["--eval-batches", "2"], ["eval_batches=2"]),
    (["--w4a4"], ["activations=true"]),
    (["--w4a4", "--dynamic-act-scales"], ["activations=true", "static_act_scales=false"]),
    (["--no-mse-scale"], ["ptq.mse_scale=false"]),
    (["--no-four-over-six"], ["ptq.four_over_six=false"]),
    (["--weight-method", "gptq"], ["ptq.method=gptq"]),
    (["--monotone", "on"], ["monotone=true"]),
    (["--monotone", "off"], ["monotone=false"]),
    (["--monotone", "auto"], ["monotone=none"]),
    (["--no-ptq-effects"], ["ptq_effects=false"]),
    (["--count-other-params"], ["count_other_params=true"]),
    (["--pareto-budgets", "5,8"], ["pareto_budgets=5,8"]),
    (["--solver", "milp"], ["solver=milp"]),
    (["--layout", "microscale"], ["layout=microscale"]),
]


@pytest.mark.parametrize("old,new", QUANTIZE_TABLE, ids=lambda a: " ".join(a))
def test_each_old_quantize_flag_is_its_key(old, new, capsys):
    assert _quantize(old) == _quantize(new)
    err = capsys.readouterr().out
    for flag in old:
        if flag.startswith("--"):
            assert f"microscale quantize: {flag}" in err and " is now " in err
    assert _quantize(new) != _quantize([]) or new == ["monotone=none"]


def test_old_quantize_command_line_builds_the_old_config():
    """The config the old flag parsing built, field by field (so numbers cannot move)."""
    old = [
        "--budget",
        "6",
        "--formats",
        "nvfp4,fp8,bf16",
        "--method",
        "gradient",
        "--calib-tokens",
        "256",
        "--seed",
        "1",
        "--w4a4",
        "--dynamic-act-scales",
        "--no-mse-scale",
        "--weight-method",
        "gptq",
        "--monotone",
        "off",
        "--no-ptq-effects",
        "--count-other-params",
        "--pareto-budgets",
        "5,8",
        "--solver",
        "dp",
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
    assert _quantize(old) == (expected, QuantizeRunConfig())
    gguf = _quantize(["--target", "gguf", "--budget", "5.0", "--calib-tokens", "256"])
    assert gguf == (
        QuantizeConfig.for_gguf(budget=5.0, calib_tokens=256, ptq=WeightPTQ()),
        QuantizeRunConfig(layout="gguf"),
    )


def test_keys_win_over_old_flags_and_old_flags_must_agree(capsys):
    cfg, _ = _quantize(["--budget", "5", "budget=6"])
    assert cfg.budget == 6.0
    with pytest.raises(ValueError, match="--target gguf and --layout microscale both set layout"):
        _quantize(["--target", "gguf", "--layout", "microscale"])


EXPORT_TABLE = [
    (["--format", "gguf"], ["layout=gguf"]),
    (["--formats", "mxfp4"], ["formats=mxfp4"]),
    (["--rules", "r.json"], ["rules=r.json"]),
    (["--activations"], ["activations=true"]),
    (["--activations", "--calib-batches", "3"], ["activations=true", "calib_batches=3"]),
    (["--data", "texts/"], ["corpus=texts/"]),
    (["--step", "7"], ["step=7"]),
    (["--dtype", "float16"], ["dtype=float16"]),
    (["--embed-format", "q8_0"], ["embed_format=q8_0"]),
    (["--shard-size", "0.5"], ["shard_size=0.5"]),
    (["--overwrite"], ["overwrite=true"]),
]


@pytest.mark.parametrize("old,new", EXPORT_TABLE, ids=lambda a: " ".join(a))
def test_each_old_export_flag_is_its_key(old, new, capsys):
    cfg, _ = _export(old)
    assert cfg == _export(new)[0] != ExportConfig()
    assert f"microscale export: {old[0]}" in capsys.readouterr().out


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
    assert "budget = 5.0" in out and "heuristic = [q8_0, nvfp4]" in out


def test_checkpoint_and_out_are_required_to_run(capsys):
    assert main(["quantize", "--out", "x"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
