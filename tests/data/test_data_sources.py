"""Sources: stdlib split determinism/disjointness, content hash, folder/JSONL/text readers."""

import json
import re

import pytest

from microscale.data.sources import (
    content_hash,
    read_documents,
    read_stdlib,
    read_stdlib_docs,
    split_fraction,
    stdlib_files,
)


def test_stdlib_split_deterministic_and_disjoint():
    a, b = read_stdlib(), read_stdlib()
    assert a.content_hash == b.content_hash
    assert re.fullmatch(r"[0-9a-f]{64}", a.content_hash)
    assert [n for n, _ in a.val] == [n for n, _ in b.val]
    train, val = {n for n, _ in a.train}, {n for n, _ in a.val}
    assert train and val and not train & val
    assert train | val == {n for n, _ in stdlib_files()}
    assert [n for n, _ in a.train] == sorted(train)
    assert 0.01 < len(val) / (len(train) + len(val)) < 0.12
    # the split is a function of the path alone
    assert all(split_fraction(n) < 0.05 for n in val)


def test_stdlib_excludes_tests_and_site_packages():
    names = [n for n, _ in stdlib_files()]
    assert "os.py" in names and "json/decoder.py" in names
    bad = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data"}
    assert not [n for n in names if bad & set(n.split("/")[:-1])]
    assert not [n for n in names if n.rsplit("/", 1)[-1].startswith("_sysconfigdata")]


def test_stdlib_docs_is_val_only_prose():
    docs = read_stdlib_docs()
    assert docs.train == () and len(docs.val) > 10
    text = "".join(t for _, t in docs.val)
    assert len(text) > 50_000
    assert " the " in text
    code_val = {n for n, _ in read_stdlib().val}
    for name, _ in docs.val:
        if name.endswith(":docstrings"):
            assert name.removesuffix(":docstrings") in code_val


def test_content_hash_stable_and_sensitive():
    docs = [("b.txt", "two"), ("a.txt", "one")]
    h = content_hash(docs)
    assert h == content_hash(list(reversed(docs)))
    assert h != content_hash([("b.txt", "two"), ("a.txt", "one!")])
    assert h != content_hash([("c.txt", "two"), ("a.txt", "one")])
    # names and texts are framed: moving bytes between them changes the hash
    assert content_hash([("ab", "c")]) != content_hash([("a", "bc")])


def test_folder_source(tmp_path):
    for i in range(40):
        (tmp_path / f"d{i % 3}").mkdir(exist_ok=True)
        (tmp_path / f"d{i % 3}" / f"f{i:02d}.txt").write_text(f"file {i}\n")
    (tmp_path / "skip.md").write_text("markdown")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / ".hidden.txt").write_text("hidden")
    docs = read_documents(str(tmp_path), 0.1, pattern="*.txt")
    names = [n for n, _ in docs.train + docs.val]
    assert len(names) == 40 and docs.n_skipped == 1
    assert not any(n.startswith(".") or n.endswith(".md") for n in names)
    assert docs.val and all(split_fraction(n) < 0.1 for n, _ in docs.val)
    # adding a file never moves another one across the split
    (tmp_path / "d0" / "new.txt").write_text("new")
    again = read_documents(str(tmp_path), 0.1, pattern="*.txt")
    assert {n for n, _ in docs.val} <= {n for n, _ in again.val}
    assert again.content_hash != docs.content_hash
    with pytest.raises(ValueError, match="matching pattern"):
        read_documents(str(tmp_path), 0.1, pattern="*.rst")


def test_jsonl_source(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"doc {i}", "id": i}) for i in range(50)) + "\n\n")
    docs = read_documents(str(p), 0.2)
    assert len(docs.train) + len(docs.val) == 50 and docs.val
    assert {t for _, t in docs.val} | {t for _, t in docs.train} == {f"doc {i}" for i in range(50)}
    p.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"line 2.*'text'"):
        read_documents(str(p))
    p.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"c.jsonl.*line 2: not valid JSON"):
        read_documents(str(p))
    p.write_text('{"body": "ok"}\n{"body": "two"}\n')
    assert len(read_documents(str(p), 0.5, text_field="body").val) == 1


def test_text_file_tail_split(tmp_path):
    p = tmp_path / "book.txt"
    text = "".join(f"line {i}\n" for i in range(1000))
    p.write_text(text)
    docs = read_documents(str(p), 0.1)
    (_, train), (_, val) = docs.train[0], docs.val[0]
    assert train + val == text and train.endswith("\n")
    assert abs(len(val) / len(text) - 0.1) < 0.02


def test_source_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.*expected 'stdlib'"):
        read_documents(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="val_fraction"):
        read_stdlib(1.5)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="bad.txt.*UTF-8"):
        read_documents(str(tmp_path / "bad.txt"))
