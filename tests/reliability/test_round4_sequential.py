"""Issue 58, round 4: block-sequential GPTQ refuses bad input before any block, and
``quantize`` refuses an existing output as ``export`` does.

Each row: the bad value, the one line (regex) it must print, and that nothing was done
first (no block read, no progress called, no kernel sunk).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from family_configs import CONFIGS, moved_model
from microscale.export import export_checkpoint, flat_params
from microscale.export.tensorfile import TensorStore
from microscale.model import fused_groups
from microscale.ptq.sequential import folder_source, params_source, sequential_gptq
from microscale.ptq.weights import WeightPTQ

CFG = CONFIGS["llama"]  # 2 blocks, max_seq_len 64
_Q = "layers.0.attn.q_proj"
_K1 = "layers.1.mlp.down_proj.kernel"


def _formats() -> dict[str, str]:
    return {p: "nvfp4" for g in fused_groups(CFG) for p in g}


def _batches(seq=24) -> list[np.ndarray]:
    return [np.random.default_rng(0).integers(0, 257, (2, seq + 1)).astype(np.int32)]


class Counting:
    """A source that counts the blocks read (the work the refusal must come before)."""

    def __init__(self, inner):
        self.inner, self.blocks = inner, 0
        self.config = inner.config

    def embed(self, tokens):
        return self.inner.embed(tokens)

    def block(self, i):
        self.blocks += 1
        return self.inner.block(i)

    def scan(self):
        self.inner.scan()


@pytest.fixture(scope="module")
def params():
    return flat_params(moved_model(CFG))


def _poke(folder, name: str, value: float) -> None:
    """Write ``value`` over the first float32 of tensor ``name`` in the folder's file."""
    info = TensorStore(folder).info(name)
    with open(info.file, "r+b") as f:
        f.seek(info.begin)
        f.write(np.float32(value).tobytes())


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("r4seq") / "hf"
    export_checkpoint(moved_model(CFG), out, layout="hf", dtype="float32")
    return out


ROWS = {
    "unknown format": (dict(formats={_Q: "nvfp5"}), r"formats\['layers\.0\.attn\.q_proj'\]: unknown format 'nvfp5'.*did you mean 'nvfp4'\?$"),
    "format not a string": (dict(formats={_Q: 4}), r"formats\['layers\.0\.attn\.q_proj'\]: unknown format 4"),
    "path not a layer": (dict(formats={"layers.7.attn.q_proj": "nvfp4"}), r"formats names 'layers\.7\.attn\.q_proj', not a linear layer of this 2-block model"),
    "formats not a mapping": (dict(formats=["nvfp4"]), r"formats is a list; expected a mapping"),
    "rows past the context": (dict(batches=_batches(seq=199)), r"calibration rows of 199 positions .* exceed the model's context max_seq_len=64$"),
    "ptq not a WeightPTQ": (dict(ptq="gptq"), r"ptq='gptq': expected a WeightPTQ or None"),
    "sink not callable": (dict(sink="out/"), r"sink='out/': expected a callable or None"),
    "progress not callable": (dict(progress=3), r"progress=3: expected a callable or None"),
    "attention_chunk a float": (dict(attention_chunk=1.5), r"attention_chunk=1\.5: expected a positive integer or None"),
    "attention_chunk negative": (dict(attention_chunk=-1), r"attention_chunk=-1"),
    "NaN in block 1 (memory)": (dict(nan=True), rf"params_source: tensor '{_K1}' holds 1 non-finite value\(s\) .* before any block"),
}  # fmt: skip


@pytest.mark.parametrize(("case", "match"), ROWS.values(), ids=list(ROWS))
def test_sequential_gptq_refuses_before_any_block(params, case, match):
    case = dict(case)
    formats = case.pop("formats", {})
    if isinstance(formats, dict):  # one bad entry in a good allocation
        formats = _formats() | formats
    batches = case.pop("batches", _batches())
    held = dict(params)
    if case.pop("nan", False):
        bad = np.array(held[_K1], np.float32)
        bad[3, 5] = np.nan
        held[_K1] = bad
    src = Counting(params_source(CFG, held))
    done: list = []
    case.setdefault("progress", done.append)
    with pytest.raises(ValueError, match=match):
        sequential_gptq(src, batches, formats, **case)
    assert src.blocks == 0 and not done


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.nan, r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.down_proj\.weight' holds 1 non-finite value\(s\)"),
        (np.inf, r"model\.layers\.1\.mlp\.down_proj\.weight' holds 1 non-finite"),
        (0.5, r"model\.layers\.1\.mlp\.down_proj\.weight' fails its checksum .* the file is damaged"),
    ],
)  # fmt: skip
def test_a_damaged_block_1_in_a_folder_is_named_before_block_0(tmp_path, hf_folder, value, match):
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    _poke(folder, "model.layers.1.mlp.down_proj.weight", value)
    src = Counting(folder_source(folder))
    sunk: dict = {}
    with pytest.raises(ValueError, match=match):
        sequential_gptq(src, _batches(), _formats(), sink=sunk.__setitem__)
    assert src.blocks == 0 and not sunk


def test_a_clean_folder_passes_the_scan(hf_folder):
    src = Counting(folder_source(hf_folder))
    out = sequential_gptq(src, _batches(), _formats(), ptq=WeightPTQ())
    assert src.blocks == CFG.n_layers and len(out.weights) == len(_formats())


# ------------------------------------------------ quantize and export: one rule for outputs

_EARLIER_Q = {"report.json": "{}", "precision_rules.json": "{}"}  # an earlier quantize output
_EARLIER_X = {"config.json": "{}"}  # an earlier export
_SOMEONES = {"notes.txt": "mine"}  # no output of either command

OUT_ROWS = {
    "quantize over an earlier output": ("quantize", _EARLIER_Q, [], r"quantize output folder '.*/out' is not empty; pass overwrite=True \(CLI: overwrite=true\) to replace it"),
    "quantize overwrite=true over someone's folder": ("quantize", _SOMEONES, ["overwrite=true"], r"refusing to overwrite '.*/out': it does not look like an earlier quantize output"),
    "export over an earlier output": ("export", _EARLIER_X, [], r"output folder '.*/out' is not empty; pass overwrite=True \(CLI: overwrite=true\) to replace it"),
    "export overwrite=true over someone's folder": ("export", _SOMEONES, ["overwrite=true"], r"refusing to overwrite '.*/out': it does not look like an exported model"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("command", "held", "keys", "match"), OUT_ROWS.values(), ids=list(OUT_ROWS)
)
def test_an_existing_output_is_replaced_only_with_overwrite(
    tmp_path, tiny_run, monkeypatch, capsys, command, held, keys, match
):
    """quantize and export share one rule (microscale.files.check_replace_dir), checked
    before any work: the folder is left as it was and nothing is computed."""
    import re

    import microscale.workflows.quantize as wq
    from microscale.cli import main

    def no_work(*a, **k):
        raise AssertionError("work started before the output folder was checked")

    monkeypatch.setattr(wq, "quantize_model", no_work)
    out = tmp_path / "out"
    out.mkdir()
    for name, text in held.items():
        (out / name).write_text(text)
    assert main([command, "-m", str(tiny_run), "--out", str(out), *keys]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(match, err[0]), err
    assert {p.name: p.read_text() for p in out.iterdir()} == held


def test_quantize_overwrite_true_passes_the_check(tmp_path, tiny_run, monkeypatch, capsys):
    """overwrite=true reaches the work over an earlier quantize output (the replacement
    itself: tests/reliability/test_kill.py)."""
    import microscale.workflows.quantize as wq
    from microscale.cli import main

    class Reached(Exception):
        pass

    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(wq, "quantize_model", reached)
    out = tmp_path / "out"
    out.mkdir()
    for name, text in _EARLIER_Q.items():
        (out / name).write_text(text)
    assert main(["quantize", "-m", str(tiny_run), "--out", str(out), "overwrite=true", "-q"]) == 2
    assert "error: Reached" in capsys.readouterr().err  # the work began
