"""No CLI input ends in a traceback: each bad input exits non-zero with one line on stderr
that names the bad value (run in-process through ``microscale.cli.main``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microscale.cli import main

from .conftest import TRAIN_ARGS, copy_tree

TINY = ["--config", "tiny", *TRAIN_ARGS]

# (id, argv with placeholders, text the one-line error must contain). Placeholders:
# {run} a trained run, {exp} its export, {file} a regular file, {dir} an empty folder,
# {tmp} a fresh path, {corpus} a text corpus, and the damaged inputs made by _fixtures().
CASES = [
    # -- top level and argparse
    ("no-command", [], "COMMAND"),
    ("unknown-command", ["nosuchcmd"], "nosuchcmd"),
    ("unknown-option", ["train", "--nosuch"], "--nosuch"),
    ("option-after-override", ["train", "steps=abc", "--quiet", "out={tmp}"], "abc"),
    ("bad-int-option", ["compare", "--parallel", "abc"], "abc"),
    ("missing-required", ["export", "--out", "{tmp}"], "--model"),
    # -- train: config
    ("unknown-preset", ["train", "--config", "nosuchpreset"], "nosuchpreset"),
    ("missing-yaml", ["train", "--config", "{tmp}/nope.yaml"], "nope.yaml"),
    ("non-utf8-yaml", ["train", "--config", "{latin1_yaml}"], "latin1.yaml"),
    ("bad-yaml-syntax", ["train", "--config", "{broken_yaml}"], "broken.yaml"),
    ("yaml-a-list", ["train", "--config", "{list_yaml}"], "list.yaml"),
    ("yaml-a-folder", ["train", "--config", "{dir}"], "{dir}"),
    ("steps-not-int", ["train", "steps=abc"], "abc"),
    ("steps-negative", ["train", "steps=-5"], "-5"),
    ("unknown-key", ["train", "nosuchkey=1"], "nosuchkey"),
    ("typo-key", ["train", "optim.lrr=1e-3"], "optim.lrr"),
    ("unknown-recipe", ["train", "recipe=nosuchrecipe"], "nosuchrecipe"),
    ("override-no-equals", ["train", "steps"], "steps"),
    ("override-empty-key", ["train", "=5"], "=5"),
    ("seed-not-int", ["train", "seed=abc"], "abc"),
    ("bool-not-bool", ["train", "resume=maybe"], "maybe"),
    ("d-model-zero", ["train", "model.d_model=0"], "d_model"),
    ("heads-not-dividing", ["train", "model.n_heads=5"], "n_heads"),
    ("lr-not-number", ["train", "optim.lr=fast"], "fast"),
    ("batch-zero", ["train", "data.batch_size=0"], "batch_size"),
    # -- train: paths and run folders
    (
        "out-unwritable",
        ["train", *TINY, "data.corpus={corpus}", "out=/proc/microscale/x"],
        "/proc/microscale/x",
    ),
    ("out-is-file", ["train", *TINY, "data.corpus={corpus}", "out={file}"], "{file}"),
    ("out-under-file", ["train", *TINY, "data.corpus={corpus}", "out={file}/run"], "{file}"),
    ("corpus-nowhere", ["train", *TINY, "data.corpus={tmp}/no-corpus", "out={tmp}/r"], "no-corpus"),
    ("run-exists", ["train", *TINY, "data.corpus={corpus}", "out={run}"], "resume=true"),
    (
        "resume-other-seed",
        ["train", *TINY, "data.corpus={corpus}", "out={run}", "resume=true", "seed=5"],
        "seed=5",
    ),
    (
        "resume-other-lr",
        ["train", *TINY, "data.corpus={corpus}", "out={run}", "resume=true", "optim.lr=0.5"],
        "optim.lr=0.5",
    ),
    # -- compare
    ("seeds-abc", ["compare", "--seeds", "abc"], "abc"),
    ("seeds-partly-bad", ["compare", "--seeds", "0,x"], "x"),
    ("seeds-empty", ["compare", "--seeds", ","], "--seeds"),
    ("runs-unknown", ["compare", "--runs", "bf16,nosuchrun"], "nosuchrun"),
    ("ablation-unknown", ["compare", "--ablations", "nosuchabl"], "nosuchabl"),
    ("parallel-zero", ["compare", "--parallel", "0"], "parallel"),
    ("compare-steps-bad", ["compare", "steps=xyz"], "xyz"),
    ("compare-out-file", ["compare", *TRAIN_ARGS, "data.corpus={corpus}", "out={file}"], "{file}"),
    # -- quantize
    ("q-no-run", ["quantize", "-m", "{tmp}/norun", "--out", "{tmp}/q"], "norun"),
    ("q-run-is-file", ["quantize", "-m", "{file}", "--out", "{tmp}/q"], "{file}"),
    ("q-out-file", ["quantize", "-m", "{run}", "--out", "{file}"], "{file}"),
    (
        "q-out-unwritable",
        ["quantize", "-m", "{run}", "--out", "/proc/microscale/q"],
        "/proc/microscale/q",
    ),
    ("q-out-someones-folder", ["quantize", "-m", "{run}", "--out", "{full_dir}"], "{full_dir}"),
    ("q-budget-abc", ["quantize", "-m", "{run}", "--out", "{tmp}/q", "budget=abc"], "abc"),
    ("q-budget-negative", ["quantize", "-m", "{run}", "--out", "{tmp}/q", "budget=-1"], "-1"),
    (
        "q-format-unknown",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "formats=nvfp4,nosuchfmt"],
        "nosuchfmt",
    ),
    (
        "q-pareto-xy",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "pareto_budgets=x,y"],
        "x,y",
    ),
    (
        "q-calib-zero",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "calib_tokens=0"],
        "calib",
    ),
    (
        "q-calib-negative",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "calib_tokens=-5"],
        "-5",
    ),
    (
        "q-eval-batches-zero",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "eval_batches=0"],
        "eval",
    ),
    (
        "q-method-unknown",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "method=magic"],
        "magic",
    ),
    ("q-step-missing", ["quantize", "-m", "{run}", "--out", "{tmp}/q", "step=999"], "999"),
    (
        "q-corpus-nowhere",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "corpus={tmp}/no-corpus"],
        "no-corpus",
    ),
    ("q-bitflip-ckpt", ["quantize", "-m", "{flipped_run}", "--out", "{tmp}/q"], "checkpoints"),
    ("q-truncated-ckpt", ["quantize", "-m", "{truncated_run}", "--out", "{tmp}/q"], "checkpoints"),
    # -- export
    ("x-no-checkpoint", ["export", "-m", "{tmp}/nothing", "--out", "{tmp}/x"], "nothing"),
    ("x-out-file", ["export", "-m", "{run}", "--out", "{file}"], "{file}"),
    (
        "x-out-unwritable",
        ["export", "-m", "{run}", "--out", "/proc/microscale/x"],
        "/proc/microscale/x",
    ),
    ("x-out-exists", ["export", "-m", "{run}", "--out", "{exp}"], "overwrite=true"),
    (
        "x-overwrite-foreign",
        ["export", "-m", "{run}", "--out", "{full_dir}", "overwrite=true"],
        "{full_dir}",
    ),
    (
        "x-format-unknown",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "formats=nosuchfmt"],
        "nosuchfmt",
    ),
    (
        "x-formats-bad-json",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "formats={bad"],
        "{bad",
    ),
    (
        "x-formats-bad-layer-format",
        [
            "export",
            "-m",
            "{run}",
            "--out",
            "{tmp}/x",
            'formats={"layers.0.attn.q_proj": "nosuchfmt"}',
        ],
        "nosuchfmt",
    ),
    (
        "x-formats-missing-file",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "formats={tmp}/nofile.json"],
        "nofile.json",
    ),
    (
        "x-rules-missing",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "rules={tmp}/norules.json"],
        "norules.json",
    ),
    (
        "x-rules-empty",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "rules={empty_json}"],
        "empty.json",
    ),
    (
        "x-rules-non-utf8",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "rules={latin1_json}"],
        "latin1.json",
    ),
    (
        "x-rules-wrong-shape",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "rules={list_json}"],
        "list.json",
    ),
    ("x-step-missing", ["export", "-m", "{run}", "--out", "{tmp}/x", "step=999"], "999"),
    ("x-shard-zero", ["export", "-m", "{run}", "--out", "{tmp}/x", "shard_size=0"], "shard"),
    (
        "x-calib-zero",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "activations=true", "calib_batches=0"],
        "calib",
    ),
    ("x-bitflip-ckpt", ["export", "-m", "{flipped_run}", "--out", "{tmp}/x"], "checkpoints"),
    (
        "x-bitflip-safetensors",
        ["export", "-m", "{flipped_exp}", "--out", "{tmp}/x", "formats=nvfp4"],
        "model.safetensors",
    ),
    ("x-huge-layers", ["export", "-m", "{huge_exp}", "--out", "{tmp}/x"], "num_hidden_layers"),
    # -- generate
    ("g-no-model", ["generate", "-m", "{tmp}/nomodel", "-p", "x"], "nomodel"),
    ("g-tokens-negative", ["generate", "-m", "{exp}", "-p", "x", "-n", "-1"], "-1"),
    ("g-tokens-abc", ["generate", "-m", "{exp}", "-p", "x", "-n", "abc"], "abc"),
    ("g-temperature-negative", ["generate", "-m", "{exp}", "-p", "x", "-t", "-1"], "-1"),
    ("g-top-p-zero", ["generate", "-m", "{exp}", "-p", "x", "--top-p", "0"], "--top-p"),
    ("g-top-p-big", ["generate", "-m", "{exp}", "-p", "x", "--top-p", "1.5"], "1.5"),
    ("g-top-k-negative", ["generate", "-m", "{exp}", "-p", "x", "--top-k", "-2"], "-2"),
    ("g-prompt-bad-utf8", ["generate", "-m", "{exp}", "-p", "ab\udcffc"], "prompt"),
    ("g-bitflip-safetensors", ["generate", "-m", "{flipped_exp}", "-p", "x"], "model.safetensors"),
    (
        "g-truncated-safetensors",
        ["generate", "-m", "{truncated_exp}", "-p", "x"],
        "model.safetensors",
    ),
    ("g-huge-layers", ["generate", "-m", "{huge_exp}", "-p", "x"], "num_hidden_layers"),
    ("g-config-not-json", ["generate", "-m", "{garbled_config_exp}", "-p", "x"], "config.json"),
    ("g-no-weights", ["generate", "-m", "{no_weights_exp}", "-p", "x"], "no_weights"),
    ("g-bitflip-ckpt", ["generate", "-m", "{flipped_run}", "-p", "x"], "checkpoints"),
    # -- eval
    ("e-seq-len-zero", ["eval", "-m", "{exp}", "--seq-len", "0"], "--seq-len"),
    ("e-seq-len-negative", ["eval", "-m", "{exp}", "--seq-len", "-3"], "-3"),
    ("e-batch-size-zero", ["eval", "-m", "{exp}", "--batch-size", "0"], "--batch-size"),
    ("e-batches-zero", ["eval", "-m", "{exp}", "--batches", "0"], "--batches"),
    ("e-data-nowhere", ["eval", "-m", "{exp}", "--data", "{tmp}/nodata"], "nodata"),
    ("e-split-unknown", ["eval", "-m", "{exp}", "--split", "test"], "test"),
    ("e-formats-unknown", ["eval", "-m", "{run}", "--formats", "nosuchfmt"], "nosuchfmt"),
    ("e-no-model", ["eval", "-m", "{tmp}/nomodel"], "nomodel"),
    (
        "e-bitflip-safetensors",
        ["eval", "-m", "{flipped_exp}", "--data", "{corpus}"],
        "model.safetensors",
    ),
    ("e-bitflip-ckpt", ["eval", "-m", "{flipped_run}"], "checkpoints"),
    ("p-devices-zero", ["plan", "--devices", "0", "--no-compile"], "--devices"),
    ("p-devices-word", ["plan", "--devices", "eight", "--no-compile"], "eight"),
    ("p-accelerator-unknown", ["plan", "--accelerator", "tpu9", "--no-compile"], "tpu9"),
    ("p-override-unknown", ["plan", "mesh.fdsp=2", "--no-compile"], "mesh.fdsp"),
    # -- list options: every comma-separated list alike (empty or repeated: refused)
    ("runs-empty", ["compare", "--runs", ""], "--runs"),
    ("runs-commas", ["compare", "--runs", " , "], "--runs"),
    ("runs-repeated", ["compare", "--runs", "bf16,nvfp4,bf16"], "bf16"),
    ("sizes-empty", ["compare", "--sizes", ""], "--sizes"),
    ("sizes-repeated", ["compare", "--sizes", "0.16M,0.16M"], "0.16M"),
    ("ablations-empty", ["compare", "--ablations", ""], "--ablations"),
    ("seeds-empty-string", ["compare", "--seeds", ""], "--seeds"),
    ("seeds-repeated", ["compare", "--seeds", "0,0"], "0,0"),
    (
        "q-formats-empty",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "formats="],
        "formats=: '' is empty",
    ),
    (
        "q-formats-repeated",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "formats=nvfp4,bf16,nvfp4"],
        "nvfp4",
    ),
    (
        "q-pareto-empty",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "pareto_budgets="],
        "pareto_budgets=: '' is empty",
    ),
    (
        "q-pareto-repeated",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "pareto_budgets=5,6,5"],
        "5,6,5",
    ),
    # -- options that the combination ignores: refused, never dropped
    ("min-steps-without-sizes", ["compare", "--min-steps", "5"], "--min-steps"),
    (
        "tokens-per-param-without-sizes",
        ["compare", "--tokens-per-param", "2"],
        "--tokens-per-param",
    ),
    (
        "q-dynamic-without-w4a4",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "static_act_scales=false"],
        "static_act_scales=false has no effect",
    ),
    (
        "x-gguf-shard-size",
        ["export", "-m", "{run}", "--out", "{tmp}/x.gguf", "layout=gguf", "shard_size=2"],
        "shard_size=2.0 has no effect",
    ),
    (
        "x-calib-without-activations",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "calib_batches=4"],
        "calib_batches=4 has no effect",
    ),
    (
        "x-data-without-activations",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "corpus={corpus}"],
        "corpus={corpus} has no effect",
    ),
    # -- the flags and keys removed at 0.1.0 (docs/release-notes.md): refused by name, with
    # what replaces them
    (
        "q-removed-budget",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "--budget", "5"],
        "--budget was removed (docs/release-notes.md); write budget=",
    ),
    (
        "q-removed-w4a4",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "--w4a4"],
        "--w4a4 was removed (docs/release-notes.md); write activations=true",
    ),
    (
        "q-removed-target",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "--target", "gguf"],
        "--target was removed (docs/release-notes.md); write layout=gguf",
    ),
    (
        "q-removed-weight-method",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "--weight-method", "gptq"],
        "write ptq.method=",
    ),
    (
        "x-removed-format",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "--format", "gguf"],
        "--format was removed (docs/release-notes.md); write layout=",
    ),
    (
        "x-removed-data",
        ["export", "-m", "{run}", "--out", "{tmp}/x", "--data", "{corpus}"],
        "--data was removed (docs/release-notes.md); write corpus=",
    ),
    (
        "x-removed-overwrite",
        ["export", "-m", "{run}", "--out", "{exp}", "--overwrite"],
        "--overwrite was removed (docs/release-notes.md); write overwrite=true",
    ),
    (
        "train-removed-bf16-first",
        ["train", "bf16_first=1"],
        "key 'bf16_first' was removed (TrainConfig, docs/release-notes.md): write "
        "precision.bf16_first",
    ),
    (
        "train-removed-rules-mode",
        ["train", "rules_mode=full"],
        "key 'rules_mode' was removed (TrainConfig, docs/release-notes.md): write "
        "precision.rules_bf16",
    ),
    (
        "train-removed-late-switch",
        ["train", "late_switch.fraction=0.2"],
        "key 'late_switch.fraction' was removed (TrainConfig, docs/release-notes.md): write "
        "precision.late.",
    ),
    (
        "train-removed-adaptive-yaml",
        ["train", "--config", "{old_keys_yaml}"],
        "key 'adaptive.method' was removed (TrainConfig, docs/release-notes.md): write "
        "precision.sensitivity.",
    ),
    # -- a file where a folder is expected: say what it is
    (
        "init-from-file",
        ["train", *TINY, "data.corpus={corpus}", "init_from={file}", "out={tmp}/r"],
        "is a file",
    ),
    ("q-checkpoint-file", ["quantize", "-m", "{file}", "--out", "{tmp}/q"], "is a file"),
    # -- issue 38's probe: the same source refused alike by train, quantize and import
    (
        "init-from-gguf",
        ["train", *TINY, "data.corpus={corpus}", "init_from={gguf}", "out={tmp}/r"],
        "model.gguf' is a file (",
    ),
    (
        "init-from-nowhere",
        ["train", *TINY, "data.corpus={corpus}", "init_from={tmp}/nothing", "out={tmp}/r"],
        "nothing' does not exist; expected",
    ),
    (
        "init-from-not-a-model",
        ["train", *TINY, "data.corpus={corpus}", "init_from={dir}", "out={tmp}/r"],
        "is not a model folder",
    ),
    (
        "q-checkpoint-gguf",
        ["quantize", "-m", "{gguf}", "--out", "{tmp}/q"],
        "model.gguf' is a file (",
    ),
    ("import-gguf", ["import", "--model", "{gguf}", "--out", "{tmp}/i"], "model.gguf' is a file ("),
    # -- refused before any work (issue 38's probe: after 36 s and 51 s)
    (
        "q-awq-no-quantized-format",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "awq=true", "formats=bf16", "budget=16"],
        "formats=bf16: no quantized format",
    ),
    (
        "q-budget-below-cheapest",
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "budget=2.0"],
        "budget 2.0 bits/element is below the cheapest allocation (4.2500 bits/element",
    ),
    ("x-checkpoint-file", ["export", "-m", "{file}", "--out", "{tmp}/x"], "is a file"),
    ("e-model-file", ["eval", "-m", "{file}"], "is a file"),
    ("g-model-file", ["generate", "-m", "{file}", "-p", "x"], "is a file"),
    # -- absurd sizes: refused before anything is built, naming the value
    (
        "p-layers-billion",
        ["plan", "model.n_layers=1000000000", "--no-compile"],
        "n_layers=1,000,000,000",
    ),
    ("p-layers-1e9", ["plan", "model.n_layers=1e9", "--no-compile"], "n_layers=1,000,000,000"),
    ("p-layers-1e30", ["plan", "model.n_layers=1e30", "--no-compile"], "1e30"),
    ("p-vocab-huge", ["plan", "model.vocab_size=100000000", "--no-compile"], "vocab_size"),
    ("p-d-model-huge", ["plan", "model.d_model=1048576", "--no-compile"], "d_model"),
    ("p-seq-huge", ["plan", "model.max_seq_len=1e9", "--no-compile"], "max_seq_len"),
    (
        "p-params-huge",
        [
            "plan",
            "model.d_model=8192",
            "model.n_layers=4000",
            "model.d_ff=400000",
            "model.n_heads=64",
            "model.n_kv_heads=8",
            "--no-compile",
        ],
        "parameters",
    ),
    ("train-layers-huge", ["train", "model.n_layers=1e9"], "n_layers"),
    ("steps-1e30", ["train", "steps=1e30"], "1e30"),
    # -- a run folder whose config.yaml no longer matches its checkpoint
    (
        "x-config-edited",
        ["export", "-m", "{edited_run}", "--out", "{tmp}/x"],
        "model.d_model=128 (the checkpoint has 64)",
    ),
    (
        "q-config-edited",
        ["quantize", "-m", "{edited_run}", "--out", "{tmp}/q"],
        "model.d_model=128",
    ),
    ("e-config-edited", ["eval", "-m", "{edited_run}"], "model.d_model=128"),
    ("g-config-edited", ["generate", "-m", "{theta_run}", "-p", "x"], "model.rope_theta"),
    (
        "init-from-edited",
        ["train", *TINY, "data.corpus={corpus}", "init_from={theta_run}", "out={tmp}/r"],
        "model.rope_theta",
    ),
]


def _flip(path: Path, at: float = 0.5) -> None:
    b = bytearray(path.read_bytes())
    b[int(len(b) * at)] ^= 0x40
    path.write_bytes(bytes(b))


def _biggest(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_run, tiny_export, words_corpus) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "file").write_text("not a folder")
    (root / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    (root / "dir").mkdir()
    (root / "full").mkdir()
    (root / "full" / "precious.txt").write_text("someone's data")
    (root / "latin1.yaml").write_bytes("steps: 3 # caf\xe9\n".encode("latin-1"))
    (root / "broken.yaml").write_text("steps: [3\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "old_keys.yaml").write_text("adaptive:\n  method: kl\n")  # before precision:
    (root / "empty.json").write_text("")
    (root / "latin1.json").write_bytes('{"default": "caf\xe9"}'.encode("latin-1"))
    (root / "list.json").write_text("[1, 2]\n")
    run = copy_tree(tiny_run, root / "run")
    flipped_run = copy_tree(tiny_run, root / "flipped_run")
    for step in ("2", "4"):
        _flip(_biggest(flipped_run / "checkpoints" / step / "state"))
    truncated_run = copy_tree(tiny_run, root / "truncated_run")
    for step in ("2", "4"):
        big = _biggest(truncated_run / "checkpoints" / step / "state")
        big.write_bytes(big.read_bytes()[: big.stat().st_size // 3])
    flipped_exp = copy_tree(tiny_export, root / "flipped_exp")
    _flip(flipped_exp / "model.safetensors", 0.7)
    truncated_exp = copy_tree(tiny_export, root / "truncated_exp")
    st = truncated_exp / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    huge_exp = copy_tree(tiny_export, root / "huge_exp")
    cfg = json.loads((huge_exp / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**9
    (huge_exp / "config.json").write_text(json.dumps(cfg))
    garbled = copy_tree(tiny_export, root / "garbled_config_exp")
    (garbled / "config.json").write_text('{"num_hidden_layers": ')
    no_weights = copy_tree(tiny_export, root / "no_weights_exp")
    (no_weights / "model.safetensors").unlink()
    edited_run = copy_tree(tiny_run, root / "edited_run")  # d_model 64 -> 128 by hand
    text = (edited_run / "config.yaml").read_text()
    assert "  d_model: 64\n" in text
    (edited_run / "config.yaml").write_text(text.replace("  d_model: 64\n", "  d_model: 128\n"))
    theta_run = copy_tree(tiny_run, root / "theta_run")  # same shapes, other RoPE base
    text = (theta_run / "config.yaml").read_text()
    assert "  rope_theta: 10000.0\n" in text
    (theta_run / "config.yaml").write_text(
        text.replace("rope_theta: 10000.0", "rope_theta: 500000.0")
    )
    return {
        "run": str(run),
        "exp": str(tiny_export),
        "file": str(root / "file"),
        "gguf": str(root / "model.gguf"),
        "dir": str(root / "dir"),
        "full_dir": str(root / "full"),
        "corpus": str(words_corpus),
        "latin1_yaml": str(root / "latin1.yaml"),
        "broken_yaml": str(root / "broken.yaml"),
        "list_yaml": str(root / "list.yaml"),
        "old_keys_yaml": str(root / "old_keys.yaml"),
        "empty_json": str(root / "empty.json"),
        "latin1_json": str(root / "latin1.json"),
        "list_json": str(root / "list.json"),
        "flipped_run": str(flipped_run),
        "truncated_run": str(truncated_run),
        "flipped_exp": str(flipped_exp),
        "truncated_exp": str(truncated_exp),
        "huge_exp": str(huge_exp),
        "garbled_config_exp": str(garbled),
        "no_weights_exp": str(no_weights),
        "edited_run": str(edited_run),
        "theta_run": str(theta_run),
    }


def _fill(s: str, places: dict[str, str]) -> str:
    for k, v in places.items():
        s = s.replace("{" + k + "}", v)
    return s


def test_enough_cases():
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("argv,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_one_clear_line(argv, expect, places, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing lands in the repository (runs/, caches)
    places = {**places, "tmp": str(tmp_path)}
    argv = [_fill(a, places) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc not in (0, None), f"exit 0 for {argv}: {err}"
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert _fill(expect, places) in lines[0], lines[0]
    assert "error" in lines[0]
