"""``microscale verify``: one flipped byte anywhere in a tensor of a GGUF file, a safetensors
export or a training checkpoint is found and its tensor named (exit 1); a flipped byte in
a GGUF header fails the header checksum or the parse, never passes; intact outputs verify
clean (exit 0); files without stored checksums say so (exit 3); anything else is a usage
error (exit 2). Every file is written by microscale's real writers (or, for the
"before checksums" cases, the same writers' libraries without microscale's entries)."""

from __future__ import annotations

import json
import re
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from microscale.cli import main
from microscale.export.gguffile import CRC_HEADER_KEY, CRC_TENSORS_KEY, verify_gguf
from microscale.export.tensorfile import read_safetensors_header
from microscale.integrity import CorruptDataError
from microscale.verify import NotAnOutputError, verify_path

from .conftest import copy_tree

gguf = pytest.importorskip("gguf")

# Every stored GGUF type (fused q/k/v and gate/up share one format); FP8 is stored as Q8_0.
ALLOC = {
    f"layers.{i}.{k}": f
    for i, fmts in enumerate(
        [("nvfp4", "mxfp4", "q8_0", "bf16"), ("nvfp4", "nvfp4", "bf16", "fp8_e4m3")]
    )
    for k, f in (
        ("attn.q_proj", fmts[0]),
        ("attn.k_proj", fmts[0]),
        ("attn.v_proj", fmts[0]),
        ("attn.o_proj", fmts[1]),
        ("mlp.gate_proj", fmts[2]),
        ("mlp.up_proj", fmts[2]),
        ("mlp.down_proj", fmts[3]),
    )
}


def _flip(path: Path, pos: int, mask: int = 0x01) -> None:
    b = bytearray(path.read_bytes())
    b[pos] ^= mask
    path.write_bytes(bytes(b))


def _line(out: str, label: str, path) -> bool:
    """Whether ``out`` has a ``label`` line for ``path``."""
    return any(ln.split(" ", 1)[0] == label and f" {path} (" in ln for ln in out.splitlines())


def _verify(capsys, *args) -> tuple[int, str, str]:
    rc = main(["verify", "-q", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tiny_run) -> Path:
    """``tiny_run`` exported to GGUF with NVFP4, MXFP4, Q8_0 and BF16 layers (copy it
    before damaging it)."""
    out = tmp_path_factory.mktemp("verify-gguf") / "tiny.gguf"
    assert (
        main(
            [
                "export",
                "--model",
                str(tiny_run),
                "layout=gguf",
                "--out",
                str(out),
                f"formats={json.dumps(ALLOC)}",
            ]
        )
        == 0
    )
    return out


@pytest.fixture(scope="module")
def modelopt_export(tmp_path_factory, tiny_run) -> Path:
    out = tmp_path_factory.mktemp("verify-mo") / "mo"
    assert main(["export", "--model", str(tiny_run), "layout=modelopt", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def quantize_out(tmp_path_factory, tiny_run) -> Path:
    out = tmp_path_factory.mktemp("verify-q") / "q"
    assert (
        main(
            [
                "quantize",
                "--model",
                str(tiny_run),
                "--out",
                str(out),
                "budget=6",
                "formats=nvfp4,bf16",
                "calib_tokens=128",
                "pareto_budgets=6",
                "ptq_effects=false",
                "--no-compile-cache",
                "-q",
            ]
        )
        == 0
    )
    return out


def _gguf_tensor(path: Path, name: str):
    return next(t for t in gguf.GGUFReader(path).tensors if t.name == name)


# ---------------------------------------------------------------------- GGUF: golden


def test_gguf_keys_are_read_by_the_gguf_package(gguf_file):
    """gguf's own reader opens the file; the two entries are plain strings; the stored
    CRCs are zlib's CRC-32 of exactly the bytes GGUFReader hands out as each tensor's
    data, and the header CRC is zlib's over the header with its own value as 00000000."""
    r = gguf.GGUFReader(gguf_file)
    sums = json.loads(r.fields[CRC_TENSORS_KEY].contents())
    assert set(sums) == {t.name for t in r.tensors} and len(sums) > 20
    for t in r.tensors:
        assert sums[t.name] == f"{zlib.crc32(np.ascontiguousarray(t.data).tobytes()):08x}"
        if t.tensor_type.name in ("NVFP4", "MXFP4", "Q8_0", "BF16"):  # decodes as before
            assert np.isfinite(gguf.quants.dequantize(t.data, t.tensor_type)).all()
    types = {t.tensor_type.name for t in r.tensors}
    assert {"NVFP4", "MXFP4", "Q8_0", "BF16", "F32"} <= types
    field = r.fields[CRC_HEADER_KEY]
    value_at = field.offset + sum(p.nbytes for p in field.parts[:-1])
    last = r.tensors[-1].field
    header_end = last.offset + sum(p.nbytes for p in last.parts)
    raw = bytearray(gguf_file.read_bytes()[:header_end])
    assert raw[value_at : value_at + 8].decode() == field.contents()
    raw[value_at : value_at + 8] = b"00000000"
    assert field.contents() == f"{zlib.crc32(bytes(raw)):08x}"


# ---------------------------------------------------------------------- GGUF: tensor data

# (id, tensor, byte inside the tensor). NVFP4 block = 4 UE4M3 scale bytes + 32 code bytes
# (36 per 64 values); MXFP4 = E8M0 byte + 16; Q8_0 = float16 scale + 32 int8.
GGUF_DATA = [
    ("nvfp4-codes", "blk.0.attn_q.weight", 36 * 3 + 4 + 7),
    ("nvfp4-codes-last-byte", "blk.1.attn_output.weight", -1),
    ("nvfp4-e4m3-block-scale", "blk.0.attn_k.weight", 36 * 5 + 2),
    ("nvfp4-global-scale", "blk.0.attn_q.scale", 2),
    ("nvfp4-global-scale-exponent", "blk.1.attn_v.scale", 3),
    ("mxfp4-e8m0-scale", "blk.0.attn_output.weight", 17 * 2),
    ("mxfp4-codes", "blk.0.attn_output.weight", 17 * 2 + 9),
    ("q8_0-scale", "blk.0.ffn_gate.weight", 34 * 4 + 1),
    ("q8_0-value", "blk.1.ffn_down.weight", 34 * 4 + 20),  # fp8_e4m3 layer stored as Q8_0
    ("bf16-linear", "blk.0.ffn_down.weight", 1001),
    ("bf16-embedding", "token_embd.weight", 0),
    ("f32-norm", "blk.1.ffn_norm.weight", 17),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, tensor, at", GGUF_DATA, ids=[c[0] for c in GGUF_DATA])
@pytest.mark.parametrize("mask", [0x01, 0x80])
def test_gguf_tensor_flip_is_named(gguf_file, tmp_path, capsys, case, tensor, at, mask):
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_file.read_bytes())
    t = _gguf_tensor(path, tensor)
    _flip(path, t.data_offset + (at % t.n_bytes), mask)
    res = verify_path(path)
    assert res.exit_code == 1
    [rep] = res.files
    assert [p.tensor for p in rep.problems] == [tensor], rep.problems
    assert "fails its checksum" in rep.problems[0].message
    rc, out, _ = _verify(capsys, path)
    assert rc == 1 and "DAMAGED" in out and str(path) in out and repr(tensor) in out
    with pytest.raises(CorruptDataError, match=rf"m\.gguf: tensor '{tensor}' .*checksum"):
        verify_gguf(path)


def test_llama_cpp_loader_refuses_a_damaged_gguf(gguf_file, tmp_path):
    """microscale's own way of reading a GGUF (into llama.cpp) checks it first: the error
    names the file and the tensor, whether or not llama.cpp is installed."""
    from microscale.export.gguf.llamacpp import LlamaCpp

    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_file.read_bytes())
    t = _gguf_tensor(path, "blk.1.attn_q.weight")
    _flip(path, t.data_offset + 40)
    with pytest.raises(CorruptDataError, match=r"m\.gguf: tensor 'blk\.1\.attn_q\.weight'"):
        LlamaCpp(path)


def test_gguf_kinds_in_the_table(gguf_file):
    """The table covers each stored type (guards the table against a changed export)."""
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(gguf_file).tensors}
    want = {
        "nvfp4": "NVFP4",
        "e4m3": "NVFP4",
        "global": "F32",
        "mxfp4": "MXFP4",
        "q8_0": "Q8_0",
        "bf16": "BF16",
        "f32": "F32",
    }
    for case, tensor, _ in GGUF_DATA:
        key = next(
            k for k in ("global", "e4m3", "nvfp4", "mxfp4", "q8_0", "bf16", "f32") if k in case
        )
        assert types[tensor] == want[key], (case, types[tensor])


# ---------------------------------------------------------------------- GGUF: header


def _kv_at(r, key: str, part: int, offset: int = 0) -> int:
    """Byte position of ``part`` (0 key length, 1 key, 2 type, 3.. value) of a KV entry."""
    f = r.fields[key]
    return f.offset + sum(p.nbytes for p in f.parts[:part]) + offset


def _ti_at(r, name: str, part: int, offset: int = 0) -> int:
    """Byte position of ``part`` (0 name length, 1 name, 2 n_dims, 3 dims, 4 type, 5
    offset) of a tensor's entry in the tensor table."""
    f = next(t for t in r.tensors if t.name == name).field
    return f.offset + sum(p.nbytes for p in f.parts[:part]) + offset


# (id, position in the file given a GGUFReader of it, xor mask)
GGUF_HEADER = [
    ("magic", lambda r: 0, 0x01),
    ("version", lambda r: 4, 0x01),
    ("tensor-count", lambda r: 8, 0x01),
    ("tensor-count-high", lambda r: 8 + 7, 0x80),
    ("kv-count", lambda r: 16, 0x01),
    ("key-text", lambda r: _kv_at(r, "llama.block_count", 1, 3), 0x01),
    ("key-length", lambda r: _kv_at(r, "general.name", 0), 0x02),
    ("value-type", lambda r: _kv_at(r, "llama.block_count", 2), 0x01),
    ("uint32-value", lambda r: _kv_at(r, "llama.block_count", 3), 0x01),
    ("float-value", lambda r: _kv_at(r, "llama.rope.freq_base", 3, 2), 0x10),
    ("string-value", lambda r: _kv_at(r, "general.name", 4), 0x01),
    ("token-text", lambda r: _kv_at(r, "tokenizer.ggml.tokens", 5 + 2 * ord("a") + 1), 0x01),
    # a count the gguf package's reader loops on (2^32 + 257 elements; > 20 s, killed)
    ("array-length", lambda r: _kv_at(r, "tokenizer.ggml.token_type", 4, 4), 0x01),
    ("tensor-name", lambda r: _ti_at(r, "blk.0.attn_q.weight", 1, 4), 0x01),
    ("tensor-ndims", lambda r: _ti_at(r, "blk.0.attn_q.weight", 2), 0x01),
    ("tensor-shape", lambda r: _ti_at(r, "blk.0.ffn_up.weight", 3), 0x40),
    ("tensor-type", lambda r: _ti_at(r, "blk.0.ffn_gate.weight", 4), 0x01),
    ("tensor-offset", lambda r: _ti_at(r, "blk.0.attn_k.weight", 5, 1), 0x01),
    ("tensor-offset-aligned", lambda r: _ti_at(r, "blk.1.ffn_up.weight", 5), 0x20),
    ("crc-map", lambda r: _kv_at(r, CRC_TENSORS_KEY, 4, 30), 0x01),
    ("crc-key", lambda r: _kv_at(r, CRC_TENSORS_KEY, 1, 12), 0x01),
    ("header-crc-value", lambda r: _kv_at(r, CRC_HEADER_KEY, 4, 7), 0x01),
]


@pytest.mark.parametrize("case, where, mask", GGUF_HEADER, ids=[c[0] for c in GGUF_HEADER])
def test_gguf_header_flip_fails_clearly(gguf_file, tmp_path, capsys, case, where, mask):
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_file.read_bytes())
    _flip(path, where(gguf.GGUFReader(gguf_file)), mask)
    t0 = time.perf_counter()
    res = verify_path(path)
    assert time.perf_counter() - t0 < 30  # no hang on a damaged length
    assert res.exit_code == 1 and res.files[0].status == "damaged"
    msgs = " | ".join(p.message for p in res.files[0].problems)
    assert "header" in msgs and "damaged" in msgs, msgs
    rc, out, err = _verify(capsys, path)
    assert rc == 1 and "DAMAGED" in out and "header" in out and not err
    with pytest.raises(CorruptDataError, match=r"m\.gguf"):
        verify_gguf(path)


@pytest.mark.slow
def test_gguf_every_header_region_sweep(gguf_file, tmp_path):
    """Every 7th header byte (all regions: counts, keys, types, the vocabulary, the
    checksums, the tensor table), flipped alone: never a silent pass."""
    from microscale.export.gguffile import check_gguf, read_gguf_header

    raw = gguf_file.read_bytes()
    end = read_gguf_header(gguf_file).header_end
    path = tmp_path / "m.gguf"
    silent = []
    for pos in range(3, end, 7):
        b = bytearray(raw)
        b[pos] ^= 0x01
        path.write_bytes(bytes(b))
        if not check_gguf(path).problems:
            silent.append(pos)
    assert not silent and end > 1000


def test_gguf_truncated(gguf_file, tmp_path, capsys):
    path = tmp_path / "m.gguf"
    for keep in (0, 100, len(gguf_file.read_bytes()) - 5):
        path.write_bytes(gguf_file.read_bytes()[:keep])
        rc, out, _ = _verify(capsys, path)
        assert rc == 1 and "DAMAGED" in out and ("truncated" in out or "past the end" in out)


def test_gguf_without_checksums_says_so(gguf_file, tmp_path, capsys):
    """A GGUF written before microscale stored checksums (the same gguf writer, the same
    metadata and tensors, no microscale entries) is reported unverified, exit 3."""
    r = gguf.GGUFReader(gguf_file)
    w = gguf.GGUFWriter(tmp_path / "old.gguf", "llama")
    w.add_block_count(int(r.fields["llama.block_count"].contents()))
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    res = verify_path(tmp_path / "old.gguf")
    assert res.exit_code == 3 and res.files[0].status == "unverified"
    rc, out, _ = _verify(capsys, tmp_path / "old.gguf")
    assert rc == 3 and "UNVERIFIED" in out and "no checksums stored" in out
    assert verify_gguf(tmp_path / "old.gguf").checksums is False


# ---------------------------------------------------------------------- safetensors exports

# (id, export fixture, tensor, byte inside it)
SAFETENSORS = [
    ("ct-nvfp4-codes", "tiny_export", "model.layers.0.self_attn.q_proj.weight_packed", 77),
    ("ct-e4m3-scales", "tiny_export", "model.layers.1.mlp.down_proj.weight_scale", 5),
    ("ct-global-scale", "tiny_export", "model.layers.0.mlp.up_proj.weight_global_scale", 1),
    ("ct-bf16-embedding", "tiny_export", "model.embed_tokens.weight", -2),
    ("ct-bf16-norm", "tiny_export", "model.norm.weight", 0),
    ("mo-nvfp4-codes", "modelopt_export", "model.layers.1.mlp.gate_proj.weight", 3),
    ("mo-e4m3-scales", "modelopt_export", "model.layers.0.self_attn.o_proj.weight_scale", 0),
    ("mo-weight-scale-2", "modelopt_export", "model.layers.0.self_attn.k_proj.weight_scale_2", 2),
]


@pytest.mark.parametrize("case, fixture, tensor, at", SAFETENSORS, ids=[c[0] for c in SAFETENSORS])
def test_safetensors_flip_is_named(request, tmp_path, capsys, case, fixture, tensor, at):
    exp = copy_tree(request.getfixturevalue(fixture), tmp_path / "exp")
    f = exp / "model.safetensors"
    info = read_safetensors_header(f)[0][tensor]
    _flip(f, info.begin + at % (info.end - info.begin), 0x08)
    res = verify_path(exp)
    assert res.exit_code == 1
    [rep] = res.damaged
    assert rep.path == f and [p.tensor for p in rep.problems] == [tensor], rep.problems
    rc, out, _ = _verify(capsys, exp)
    assert rc == 1 and "DAMAGED" in out and str(f) in out and repr(tensor) in out


def test_safetensors_without_checksums_says_so(tiny_export, tmp_path, capsys):
    """An export written before microscale stored checksums: the same tensors and header
    (tensorfile's own header writer), with only the "format" entry in __metadata__."""
    from microscale.export.tensorfile import TensorStore, _header_bytes

    exp = copy_tree(tiny_export, tmp_path / "exp")
    f = exp / "model.safetensors"
    store = TensorStore(f)
    arrays = {n: np.array(store.get(n)) for n in store.names()}
    raw, order = _header_bytes(arrays, {"format": "pt"})
    f.write_bytes(
        len(raw).to_bytes(8, "little") + raw + b"".join(arrays[n].tobytes() for n in order)
    )
    assert TensorStore(f).checksums == {}
    rc, out, _ = _verify(capsys, exp)
    assert rc == 3 and _line(out, "UNVERIFIED", f) and "no checksums stored" in out
    b = bytearray(f.read_bytes())
    b[-2:] = b"\xc0\x7f"  # the last value (of the bf16 final norm) becomes NaN
    f.write_bytes(bytes(b))
    rc, out, _ = _verify(capsys, exp)
    assert rc == 1 and "non-finite" in out  # what can still be checked, is


def test_sharded_export_checks_every_shard_and_the_index(tiny_run, tmp_path, capsys):
    exp = tmp_path / "exp"
    assert main(["export", "--model", str(tiny_run), "--out", str(exp), "shard_size=0.00005"]) == 0
    shards = sorted(exp.glob("model-*.safetensors"))
    assert len(shards) >= 2
    rc, out, _ = _verify(capsys, exp)
    assert rc == 0 and out.count("\nok ") + out.startswith("ok ") == len(shards) + 1, out
    name = sorted(read_safetensors_header(shards[-1])[0])[0]
    info = read_safetensors_header(shards[-1])[0][name]
    _flip(shards[-1], info.begin)
    rc, out, _ = _verify(capsys, exp)
    assert rc == 1 and _line(out, "DAMAGED", shards[-1]) and repr(name) in out
    shards[0].unlink()
    rc, out, _ = _verify(capsys, exp)
    assert rc == 1 and shards[0].name in out


# ---------------------------------------------------------------------- checkpoints


def _restored(step_dir: Path) -> dict[str, np.ndarray]:
    """Every array of an orbax step, restored by orbax itself (None when it cannot)."""
    import jax
    import orbax.checkpoint as ocp

    ck = ocp.PyTreeCheckpointer()
    tree = ck.metadata(step_dir / "state").item_metadata.tree
    is_arr = lambda m: hasattr(m, "shape")  # noqa: E731
    args = jax.tree.map(
        lambda m: ocp.RestoreArgs(restore_type=np.ndarray) if is_arr(m) else m, tree, is_leaf=is_arr
    )
    out = ck.restore(step_dir / "state", args=ocp.args.PyTreeRestore(restore_args=args))
    return {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(out)[0]
    }


def _data_files(step_dir: Path) -> list[Path]:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: -p.stat().st_size)


@pytest.mark.parametrize("at", [0.1, 0.35, 0.6, 0.85])
def test_checkpoint_tensor_flip_is_named(tiny_run, tmp_path, capsys, at):
    """A flipped byte in the array data of step 4: verify names exactly the array orbax
    itself restores differently, and step 2 stays ok."""
    run = copy_tree(tiny_run, tmp_path / "run")
    step = run / "checkpoints" / "4"
    data = _data_files(step)[0]
    _flip(data, int(data.stat().st_size * at), 0x04)
    res = verify_path(run)
    assert res.what == "training run" and res.exit_code == 1
    by_step = {f.path.name: f for f in res.files}
    assert by_step["2"].status == "ok" and by_step["4"].status == "damaged"
    named = {p.tensor for p in by_step["4"].problems}
    assert len(named) == 1 and None not in named, by_step["4"].problems
    try:
        bad = _restored(step)
    except Exception:  # noqa: BLE001 - orbax cannot read it either: named as unreadable
        assert "cannot be restored" in by_step["4"].problems[0].message
    else:  # the named array is exactly the one orbax restores differently
        good = _restored(tiny_run / "checkpoints" / "4")
        changed = {_tokens(k) for k in good if good[k].tobytes() != bad[k].tobytes()}
        assert {_tokens(k) for k in named} == changed, (named, changed)
    rc, out, _ = _verify(capsys, run)
    assert rc == 1 and _line(out, "DAMAGED", step) and next(iter(named)) in out
    assert _line(out, "ok", run / "checkpoints" / "2")


def _tokens(keystr: str) -> tuple[str, ...]:
    """``['opt_state'][1].mu['layers'][0]`` and ``['opt_state'][1]['mu']['layers']['0']``
    alike as ``('opt_state', '1', 'mu', 'layers', '0')``."""
    return tuple(re.findall(r"\w+", keystr))


def test_checkpoint_folder_and_step_paths(tiny_run, tmp_path, capsys):
    run = copy_tree(tiny_run, tmp_path / "run")
    assert verify_path(run / "checkpoints").what == "checkpoint folder"
    res = verify_path(run / "checkpoints" / "2")
    assert res.what == "checkpoint step" and res.exit_code == 0
    assert res.files[0].checked == res.files[0].tensors > 10
    for f in _data_files(run / "checkpoints" / "2")[:1]:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated
    res = verify_path(run / "checkpoints" / "2")
    lost = [p for p in res.files[0].problems if "cannot be restored" in p.message]
    assert res.exit_code == 1 and len(lost) > 1
    for p in lost:  # each names its own array, with orbax's own error about that array
        assert ".".join(_tokens(p.tensor)) in p.message, p
    rc, out, err = _verify(capsys, run / "checkpoints" / "2")
    assert rc == 1 and "DAMAGED" in out and "Traceback" not in out + err


def test_checkpoint_without_checksums_says_so(tiny_run, tmp_path, capsys):
    """A step saved before checkpoints stored checksums (meta without "checksums")."""
    run = copy_tree(tiny_run, tmp_path / "run")
    for step in ("2", "4"):
        meta = run / "checkpoints" / step / "meta" / "metadata"
        obj = json.loads(meta.read_text())
        del obj["checksums"]
        meta.write_text(json.dumps(obj))
    rc, out, _ = _verify(capsys, run)
    assert rc == 3 and out.count("UNVERIFIED") == 2 and "no checksums stored" in out


def test_damaged_checkpoints_folder_is_noted(tiny_run, tmp_path, capsys):
    run = copy_tree(tiny_run, tmp_path / "run")
    (run / "damaged-checkpoints").mkdir()
    (run / "checkpoints" / "2").rename(run / "damaged-checkpoints" / "2-123")
    rc, out, _ = _verify(capsys, run)
    assert rc == 0 and "damaged-checkpoints" in out and "not checked" in out


# ---------------------------------------------------------------------- clean, usage, API


@pytest.mark.slow
def test_intact_outputs_verify_clean(
    tiny_run, tiny_export, modelopt_export, gguf_file, quantize_out, capsys
):
    rc, out, err = _verify(capsys, gguf_file, tiny_export, modelopt_export, tiny_run, quantize_out)
    assert rc == 0, out + err
    assert "DAMAGED" not in out and "UNVERIFIED" not in out
    assert "verify: 7 files checked: 7 ok, 0 damaged, 0 without checksums" in out, out
    rc = main(["verify", "--json", str(gguf_file), str(quantize_out)])
    objs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rc == 0 and [o["what"] for o in objs] == ["GGUF file", "quantize output"]
    assert all(f["status"] == "ok" for o in objs for f in o["files"])


def test_quantize_output_flip_is_named(quantize_out, tmp_path, capsys):
    q = copy_tree(quantize_out, tmp_path / "q")
    f = q / "checkpoint" / "model.safetensors"
    infos = read_safetensors_header(f)[0]
    name = sorted(n for n in infos if n.startswith("model.layers.1."))[0]
    _flip(f, infos[name].begin + 1)
    rc, out, _ = _verify(capsys, q)
    assert rc == 1 and _line(out, "DAMAGED", f) and repr(name) in out


def _json_edit(name: str, edit):
    def apply(q: Path) -> None:
        obj = json.loads((q / name).read_text())
        edit(obj)
        (q / name).write_text(json.dumps(obj, indent=2))

    return apply


def _move_rule(rules: dict) -> None:
    """The bf16 rule of layers.1.attn.o_proj moved to its q_proj: one layer's format."""
    [rule] = rules["rules"]
    assert rule[0] == r"(?:layers\.1\.attn\.o_proj)" and rule[1] == "bf16", rule
    rule[0] = rule[0].replace("o_proj", "q_proj")


def _flip_file(name: str, at: float = 0.5):
    return lambda q: _flip(q / name, int((q / name).stat().st_size * at), 0x02)


# (id, the file, how it changes): an edit to any file of a quantize output that stores no
# checksums of its own is named by verify (exit 1), the weights still ok.
QUANTIZE_EDITS = [
    (
        "rules-one-layer-format",
        "precision_rules.json",
        _json_edit("precision_rules.json", _move_rule),
    ),
    (
        "report-layer-format",
        "report.json",
        _json_edit("report.json", lambda r: r["layers"].update({"layers.0.attn.k_proj": "bf16"})),
    ),
    ("report-budget", "report.json", _json_edit("report.json", lambda r: r.update(budget=4.5))),
    ("report-md", "report.md", lambda q: (q / "report.md").write_text("# edited\n")),
    ("plot-byte", "pareto.png", _flip_file("pareto.png")),
    ("sensitivity-plot-byte", "sensitivity.png", _flip_file("sensitivity.png")),
    (
        "checkpoint-config",
        "checkpoint/config.json",
        _json_edit("checkpoint/config.json", lambda c: c.update(rope_theta=500000.0)),
    ),
    ("tokenizer-byte", "checkpoint/tokenizer.json", _flip_file("checkpoint/tokenizer.json", 0.3)),
]


@pytest.mark.parametrize("case, name, edit", QUANTIZE_EDITS, ids=[c[0] for c in QUANTIZE_EDITS])
def test_quantize_output_edited_file_is_named(quantize_out, tmp_path, capsys, case, name, edit):
    q = copy_tree(quantize_out, tmp_path / "q")
    edit(q)
    res = verify_path(q)
    assert res.exit_code == 1
    [rep] = res.damaged
    assert rep.kind == "file checksums" and rep.path == q / "checksums.json"
    assert [p.tensor for p in rep.problems] == [name], rep.problems
    assert f"{q / name} fails its checksum" in rep.problems[0].message
    rc, out, _ = _verify(capsys, q)
    assert rc == 1 and _line(out, "DAMAGED", q / "checksums.json"), out
    assert f"{q / name} fails its checksum" in out and "1 of " in out and " files damaged" in out
    assert _line(out, "ok", q / "checkpoint" / "model.safetensors"), out


def test_every_file_the_owner_names_is_checked(quantize_out):
    """Each file :class:`~microscale.outputs.QuantizeOutput` names is covered: the model by
    its tensors' own CRC-32s (verify's model items), every other one by checksums.json."""
    from microscale.outputs import QuantizeOutput

    listed = json.loads((quantize_out / QuantizeOutput.CHECKSUMS).read_text())["files"]
    plan = QuantizeOutput.verify_plan(quantize_out)
    model = QuantizeOutput.model(quantize_out)
    assert any(p.parent == model for _, p in plan.items)
    for name in QuantizeOutput.VERIFIED:
        path = quantize_out / name
        if name == QuantizeOutput.CHECKSUMS or not path.exists():
            continue  # the listing itself; model.gguf of the other kind of layout
        if path == model:
            inside = [f for f in path.rglob("*") if f.is_file() and f.suffix != ".safetensors"]
            assert all(f.relative_to(quantize_out).as_posix() in listed for f in inside)
        else:
            assert name in listed, name


# (id, what is done to the output, exit code, text of verify's output)
QUANTIZE_LISTING = [
    ("file-removed", lambda q: (q / "report.md").unlink(), 1, "report.md is missing"),
    (
        "listing-garbled",
        lambda q: (q / "checksums.json").write_text('{"files": '),
        1,
        "checksums.json is damaged",
    ),
    (
        "listing-escapes",
        _json_edit("checksums.json", lambda c: c["files"].update({"../x": "00000000"})),
        1,
        "outside the folder",
    ),
    (
        "written-before-listings",
        lambda q: (q / "checksums.json").unlink(),
        3,
        "no checksums stored (written before microscale stored them); 10 files found",
    ),
]


@pytest.mark.parametrize(
    "case, change, code, text", QUANTIZE_LISTING, ids=[c[0] for c in QUANTIZE_LISTING]
)
def test_quantize_output_listing_problems(quantize_out, tmp_path, capsys, case, change, code, text):
    q = copy_tree(quantize_out, tmp_path / "q")
    change(q)
    rc, out, err = _verify(capsys, q)
    assert rc == code and text in out and not err, out + err


@pytest.mark.parametrize(
    "kind", ["missing", "text-file", "empty-folder", "other-folder", "run-without-checkpoints"]
)
def test_not_an_output_is_a_usage_error(tiny_run, tmp_path, capsys, kind):
    p = tmp_path / "x"
    if kind == "text-file":
        p.write_text("hello")
    elif kind == "empty-folder":
        p.mkdir()
    elif kind == "other-folder":
        p.mkdir()
        (p / "notes.json").write_text("{}")
    elif kind == "run-without-checkpoints":
        p = copy_tree(tiny_run, p)
        for d in (p / "checkpoints").iterdir():
            shutil.rmtree(d)
    rc, out, err = _verify(capsys, p)
    assert rc == 2 and not out
    assert err.startswith("microscale verify: error: ") and str(p) in err
    assert err.count("\n") == 1
    assert (
        "does not exist"
        if kind == "missing"
        else "no finished checkpoint"
        if kind == "run-without-checkpoints"
        else "not a microscale output"
    ) in err
    with pytest.raises((FileNotFoundError, NotAnOutputError)):
        verify_path(p)


def test_one_bad_path_stops_before_any_work(gguf_file, tmp_path, capsys):
    rc, out, err = _verify(capsys, gguf_file, tmp_path / "nope")
    assert rc == 2 and not out and "nope" in err


def test_progress_counts_every_byte(gguf_file, tiny_run):
    for path in (gguf_file, tiny_run):
        total, seen, files = [], [], []
        res = verify_path(path, on_start=total.append, on_bytes=seen.append, on_file=files.append)
        assert len(total) == 1 and sum(seen) == total[0] > 0
        assert files == list(res.files)


def test_relative_paths(tiny_run, gguf_file, tmp_path, monkeypatch, capsys):
    """Paths as typed (orbax needs absolute ones internally; the report shows them as
    given)."""
    copy_tree(tiny_run, tmp_path / "run")
    shutil.copy(gguf_file, tmp_path / "m.gguf")
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _verify(capsys, "run", "m.gguf")
    assert rc == 0 and _line(out, "ok", Path("run/checkpoints/4")) and _line(out, "ok", "m.gguf")
