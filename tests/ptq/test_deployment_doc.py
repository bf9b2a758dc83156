"""docs/deployment.md's snippets, run as written against a tiny quantized model.

Each fenced block the page marks ``<!-- test: NAME -->`` is run here, in a folder laid out
as the page's commands leave it: ``out/q`` is ``microscale quantize --model RUN --out out/q``
of ``trained_run`` (compressed-tensors, the model in ``out/q/checkpoint``) and ``out/g`` the
same with ``layout=gguf`` (``out/g/model.gguf``), with small search settings. A block runs
where its runtime is installed: transformers and compressed-tensors are in the test extra,
so that block always runs; vLLM and llama.cpp are not (CI never installs them), and their
blocks are skipped naming the missing package or program.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from microscale.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
_MARKED = re.compile(r"<!-- test: ([\w-]+) -->\n```(\w+)\n(.*?)```", re.S)
BLOCKS = {
    "vllm-serve": "bash",
    "vllm": "python",
    "transformers": "python",
    "llama-completion": "bash",
    "llama-cpp-python": "python",
}
# small search settings: one Pareto point, no PTQ-effect table (the page's budget=4.8 with
# the defaults takes minutes; the folder it writes has the same layout)
QUANTIZE = [
    "calib_tokens=256",
    "ptq_effects=false",
    "--no-compile-cache",
    "-q",
]
FORMATS = "formats=nvfp4,fp8_e4m3,bf16"  # compressed-tensors: a mixed-precision folder


def snippets() -> dict[str, tuple[str, str]]:
    """{name: (language, code)} of the page's marked blocks."""
    found: dict[str, tuple[str, str]] = {}
    for name, lang, code in _MARKED.findall(DOC.read_text()):
        assert name not in found, f"two blocks marked {name!r}"
        found[name] = (lang, code)
    return found


def test_the_page_marks_each_runtime_block():
    blocks = snippets()
    assert {k: lang for k, (lang, _) in blocks.items()} == BLOCKS
    for name, (lang, code) in blocks.items():
        if lang == "python":
            compile(code, f"{DOC.name}[{name}]", "exec")
    text = DOC.read_text()  # the folders the fixtures below lay out are the page's
    assert "microscale quantize --model runs/x --out out/q budget=4.8" in text
    assert "microscale quantize --model runs/x --out out/g layout=gguf budget=5.0" in text


def _quantize(run: str, out: Path, *keys: str) -> None:
    assert main(["quantize", "--model", run, "--out", str(out), *keys, *QUANTIZE]) == 0


@pytest.fixture(scope="module")
def deployed(trained_run, tmp_path_factory) -> Path:
    """A folder holding ``out/q``: the run quantized as the page's first command does."""
    root = tmp_path_factory.mktemp("deploy")
    _quantize(trained_run, root / "out" / "q", "budget=6", "pareto_budgets=6", FORMATS)
    return root


@pytest.fixture(scope="module")
def deployed_gguf(trained_run, deployed) -> Path:
    """``deployed`` with ``out/g``: the run quantized with ``layout=gguf``."""
    _quantize(trained_run, deployed / "out" / "g", "layout=gguf", "budget=5", "pareto_budgets=5")
    return deployed


def _run_python(name: str, root: Path, monkeypatch) -> dict:
    """Run the page's block ``name`` in ``root``; returns its globals."""
    monkeypatch.chdir(root)
    scope: dict = {"__name__": "__main__"}
    exec(compile(snippets()[name][1], f"{DOC.name}[{name}]", "exec"), scope)
    return scope


def _run_bash(code: str, root: Path, timeout: float) -> str:
    """Run a bash block in ``root``; ``timeout``: the suite's hang guard (never a speed check)."""
    done = subprocess.run(
        ["bash", "-ec", code],
        cwd=root,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _need_program(name: str, package: str) -> None:
    if shutil.which(name) is None:
        pytest.skip(f"{name} not on PATH ({package} is not installed)")


@pytest.mark.slow
def test_transformers_snippet(request, monkeypatch, capsys):
    pytest.importorskip("torch", exc_type=ImportError)
    pytest.importorskip("transformers", exc_type=ImportError)
    pytest.importorskip("compressed_tensors", exc_type=ImportError)
    root = request.getfixturevalue("deployed")
    capsys.readouterr()  # quantize's lines
    scope = _run_python("transformers", root, monkeypatch)
    lines = capsys.readouterr().out.splitlines()  # the prompt and its continuation
    assert any(line.startswith("def fib(n):") for line in lines), lines
    # what loaded is the quantize output's searched allocation, decompressed by
    # compressed-tensors (not a float checkpoint that happens to sit there)
    qc = scope["model"].config.quantization_config
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    assert qc["quant_method"] == "compressed-tensors"
    report = json.loads((root / "out" / "q" / "report.json").read_text())
    assert report["checkpoint"]["layout"] == "compressed-tensors"
    assert "fallback_reason" not in report["checkpoint"]
    assert set(report["layers"].values()) - {"bf16"}, "nothing quantized"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("block", "module", "folder"),
    [("vllm", "vllm", "deployed"), ("llama-cpp-python", "llama_cpp", "deployed_gguf")],
)
def test_python_runtime_snippet(block, module, folder, request, monkeypatch):
    """The offline vLLM and llama-cpp-python blocks (their packages: neither in CI)."""
    pytest.importorskip(module, exc_type=ImportError)
    _run_python(block, request.getfixturevalue(folder), monkeypatch)


@pytest.mark.slow
def test_vllm_serve_snippet(request, tmp_path, hang_guard_s):
    pytest.importorskip("vllm", exc_type=ImportError)
    _need_program("vllm", "vllm")
    root = request.getfixturevalue("deployed")
    serve, client = snippets()["vllm-serve"][1].split("\n", 1)
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        shlex.split(serve, comments=True),
        cwd=root,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + hang_guard_s  # a hung server, not a slow one
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            assert time.monotonic() < deadline, f"vllm serve not up in {hang_guard_s} s"
            try:
                with urllib.request.urlopen("http://localhost:8000/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        assert json.loads(_run_bash(client, root, hang_guard_s))["choices"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.mark.slow
def test_llama_completion_snippet(request, hang_guard_s):
    _need_program("llama-completion", "llama.cpp")
    root = request.getfixturevalue("deployed_gguf")
    _run_bash(snippets()["llama-completion"][1], root, hang_guard_s)
