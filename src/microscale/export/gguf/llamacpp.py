"""Run a GGUF file in llama.cpp from Python: the independent check of an export, and the
peer of microscale's engine in ``benchmarks/decode.py``.

Two ways to reach llama.cpp work (both optional, tried in this order):

* ``llama-cpp-python`` (``import llama_cpp``), built from source (see docs/llamacpp.md for
  the build flags);
* any llama.cpp shared library named by ``MICROSCALE_LIBLLAMA=/path/libllama.so`` (e.g. a
  llama.cpp build, or the prebuilt CPU libraries of the ``@node-llama-cpp/linux-x64`` npm
  package), called through ``ctypes`` with the few C functions of ``llama.h`` that have been
  stable for a long time (model/context creation, ``llama_batch``, ``llama_decode``,
  ``llama_get_logits_ith``, ``llama_tokenize``). Only the first three fields of
  ``llama_context_params`` (n_ctx, n_batch, n_ubatch) are set; structs received by value
  are given spare room, so the library's own defaults fill the rest.

:class:`LlamaCpp` gives next-token logits for every position of a prompt (a fresh KV cache
per call), greedy generation and llama.cpp's own tokenizer. llama.cpp computes in its own
way: on CPU it quantizes a matmul's activations to 8 bits for the quantized weight types,
so its logits agree with microscale's, they are not bit-identical.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence

import numpy as np

__all__ = ["LLAMA_FTYPES", "LlamaCpp", "llama_cpp_available", "llama_quantize", "logits_agreement"]

# llama.cpp's own quantization presets: name -> ``enum llama_ftype`` of llama.h (values
# stable since 2023). The K-quant mixes (``_s``, ``_m``) keep some tensors in more bits.
LLAMA_FTYPES: dict[str, int] = {
    "q4_0": 2,
    "q4_1": 3,
    "q8_0": 7,
    "q5_0": 8,
    "q5_1": 9,
    "q4_k_s": 14,
    "q4_k_m": 15,
    "q5_k_m": 17,
    "q6_k": 18,
}


def logits_agreement(a, b) -> tuple[float, int]:
    """``(||a - b|| / ||b||, positions whose argmax agree)`` of two ``[T, V]`` logit arrays
    (e.g. llama.cpp's against microscale's on the same tokens)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"logits_agreement: shapes {a.shape} and {b.shape} differ")
    return (
        float(np.linalg.norm(a - b) / np.linalg.norm(b)),
        int((a.argmax(-1) == b.argmax(-1)).sum()),
    )


def llama_cpp_available() -> str | None:
    """The name of an importable llama.cpp binding, or None."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is not None:
        return "llama_cpp"
    lib = os.environ.get("MICROSCALE_LIBLLAMA")
    return "libllama" if lib and os.path.isfile(lib) else None


class _Batch(ctypes.Structure):
    _fields_ = [
        ("n_tokens", ctypes.c_int32),
        ("token", ctypes.POINTER(ctypes.c_int32)),
        ("embd", ctypes.POINTER(ctypes.c_float)),
        ("pos", ctypes.POINTER(ctypes.c_int32)),
        ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
        ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))),
        ("logits", ctypes.POINTER(ctypes.c_int8)),
    ]


class _Params(ctypes.Structure):  # opaque, larger than any llama.cpp params struct
    _fields_ = [("head", ctypes.c_uint32 * 3), ("rest", ctypes.c_uint8 * 1012)]


class _QuantizeParams(ctypes.Structure):  # opaque: only nthread and ftype (the first two
    # int32 fields of llama_model_quantize_params in every version) are set
    _fields_ = [
        ("nthread", ctypes.c_int32),
        ("ftype", ctypes.c_int32),
        ("rest", ctypes.c_uint8 * 1016),
    ]


def llama_quantize(
    src: str | os.PathLike, dst: str | os.PathLike, ftype: str, *, n_threads: int | None = None
) -> None:
    """llama.cpp's own quantizer (``llama_model_quantize``, what ``llama-quantize`` runs,
    with its default parameters: no importance matrix) from the float GGUF ``src`` to
    ``dst`` in the preset ``ftype`` (a key of :data:`LLAMA_FTYPES`). The metadata is copied,
    microscale's checksums included, so ``dst`` no longer passes ``microscale verify``."""
    if ftype not in LLAMA_FTYPES:
        raise ValueError(f"ftype={ftype!r}: expected one of {sorted(LLAMA_FTYPES)}")
    backend = llama_cpp_available()
    if backend is None:
        raise ImportError(
            "no llama.cpp: pip install llama-cpp-python or set "
            "MICROSCALE_LIBLLAMA=/path/to/libllama.so"
        )
    c = ctypes
    if backend == "llama_cpp":
        import llama_cpp as lib

        params = lib.llama_model_quantize_default_params()
        pointer = c.byref(params)
    else:
        lib = c.CDLL(os.environ["MICROSCALE_LIBLLAMA"])
        lib.llama_model_quantize_default_params.restype = _QuantizeParams
        lib.llama_model_quantize.restype = c.c_uint32
        lib.llama_model_quantize.argtypes = [c.c_char_p, c.c_char_p, c.POINTER(_QuantizeParams)]
        params = lib.llama_model_quantize_default_params()
        pointer = c.byref(params)
    params.nthread, params.ftype = int(n_threads or os.cpu_count() or 1), LLAMA_FTYPES[ftype]
    rc = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), pointer)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({str(src)!r} -> {ftype}) failed: {rc}")


class _LibLlama:
    """The minimal ctypes surface of libllama used by :class:`LlamaCpp`."""

    def __init__(self, path: str, model_path: str, n_ctx: int, n_threads: int):
        c = ctypes
        lib = self.lib = c.CDLL(path)
        P = c.c_void_p
        for name, res, args in (
            ("llama_backend_init", None, []),
            ("llama_model_default_params", _Params, []),
            ("llama_model_load_from_file", P, [c.c_char_p, _Params]),
            ("llama_context_default_params", _Params, []),
            ("llama_init_from_model", P, [P, _Params]),
            ("llama_set_n_threads", None, [P, c.c_int32, c.c_int32]),
            ("llama_batch_init", _Batch, [c.c_int32, c.c_int32, c.c_int32]),
            ("llama_batch_free", None, [_Batch]),
            ("llama_decode", c.c_int32, [P, _Batch]),
            ("llama_get_logits_ith", c.POINTER(c.c_float), [P, c.c_int32]),
            ("llama_model_get_vocab", P, [P]),
            ("llama_vocab_n_tokens", c.c_int32, [P]),
            (
                "llama_tokenize",
                c.c_int32,
                [P, c.c_char_p, c.c_int32, c.POINTER(c.c_int32), c.c_int32, c.c_bool, c.c_bool],
            ),
            ("llama_vocab_is_eog", c.c_bool, [P, c.c_int32]),
            ("llama_model_chat_template", c.c_char_p, [P, c.c_char_p]),
            ("llama_get_memory", P, [P]),
            ("llama_memory_clear", None, [P, c.c_bool]),
            ("llama_free", None, [P]),
            ("llama_model_free", None, [P]),
        ):
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
        lib.llama_backend_init()
        try:  # builds with dynamically loaded backends (GGML_BACKEND_DL) load them first
            load = lib.ggml_backend_load_all_from_path
        except AttributeError:
            load = None
        if load is not None:
            load.restype, load.argtypes = None, [c.c_char_p]
            load(os.path.dirname(os.path.abspath(path)).encode())
        self.model = lib.llama_model_load_from_file(
            str(model_path).encode(), lib.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cp = lib.llama_context_default_params()
        cp.head[0] = cp.head[1] = cp.head[2] = n_ctx  # n_ctx, n_batch, n_ubatch
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        lib.llama_set_n_threads(self.ctx, n_threads, n_threads)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))

    def decode(self, toks: list[int], n_past: int, all_logits: bool, n_vocab: int):
        lib = self.lib
        batch = lib.llama_batch_init(len(toks), 0, 1)
        try:
            batch.n_tokens = len(toks)
            for i, t in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, n_past + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if all_logits or i == len(toks) - 1 else 0
            rc = lib.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")
        finally:
            lib.llama_batch_free(batch)
        idx = range(len(toks)) if all_logits else [len(toks) - 1]
        return np.stack(
            [
                np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i), (n_vocab,)).copy()
                for i in idx
            ]
        )

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        b = text.encode("utf-8")
        buf = (ctypes.c_int32 * (len(b) + 8))()
        n = self.lib.llama_tokenize(self.vocab, b, len(b), buf, len(buf), False, special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} slots")
        return list(buf[:n])

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, int(token)))

    def chat_template(self) -> str | None:
        t = self.lib.llama_model_chat_template(self.model, None)
        return None if t is None else t.decode("utf-8")

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = self.model = None


class LlamaCpp:
    """One GGUF model loaded in llama.cpp (CPU). The file is first checked against the
    checksums microscale stores in it (:func:`~microscale.export.gguffile.verify_gguf`;
    ``verify=False`` skips that): a damaged file raises
    :class:`~microscale.integrity.CorruptDataError` naming the tensor instead of being run."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_ctx: int = 256,
        n_threads: int | None = None,
        backend: str | None = None,
        verify: bool = True,
    ):
        if verify:
            from microscale.export.gguffile import verify_gguf

            verify_gguf(path)
        self.backend = backend or llama_cpp_available()
        if self.backend is None:
            raise ImportError(
                "no llama.cpp: pip install llama-cpp-python (builds llama.cpp) "
                "or set MICROSCALE_LIBLLAMA=/path/to/libllama.so"
            )
        self.n_ctx = int(n_ctx)
        threads = n_threads or os.cpu_count() or 1
        if self.backend == "llama_cpp":
            from llama_cpp import Llama

            self._llm = Llama(
                model_path=str(path),
                n_ctx=self.n_ctx,
                n_batch=self.n_ctx,
                n_threads=threads,
                logits_all=True,
                verbose=False,
            )
            self.n_vocab = int(self._llm.n_vocab())
        else:
            self._llm = _LibLlama(os.environ["MICROSCALE_LIBLLAMA"], str(path), self.n_ctx, threads)
            self.n_vocab = self._llm.n_vocab

    # ------------------------------------------------------------------ evaluation

    def _decode(self, tokens: Sequence[int], n_past: int, all_logits: bool) -> np.ndarray:
        """Feed ``tokens`` at positions ``n_past...``; logits of every fed position
        (``all_logits``) or of the last one, float32 ``[n, V]``."""
        toks = [int(t) for t in tokens]
        if n_past + len(toks) > self.n_ctx:
            raise ValueError(f"{n_past + len(toks)} tokens exceed n_ctx={self.n_ctx}")
        if self.backend == "llama_cpp":
            self._llm.n_tokens = n_past
            self._llm.eval(toks)
            rows = range(n_past, n_past + len(toks)) if all_logits else [n_past + len(toks) - 1]
            return np.array([self._llm.scores[r] for r in rows], np.float32)
        return self._llm.decode(toks, n_past, all_logits, self.n_vocab)

    def _reset(self) -> None:
        if self.backend == "llama_cpp":
            self._llm.reset()
            self._llm._ctx.kv_cache_clear()
        else:
            self._llm.clear()

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Next-token logits at every position of ``tokens`` (float32 ``[T, V]``)."""
        self._reset()
        return self._decode(tokens, 0, True)

    def prefill(self, tokens: Sequence[int]) -> float:
        """Tokens/s of one prefill of ``tokens`` (one batch, a fresh KV cache, the last
        position's logits only, as a prompt is processed before generation)."""
        self._reset()
        t0 = time.perf_counter()
        self._decode(tokens, 0, False)
        return len(tokens) / (time.perf_counter() - t0)

    def greedy(
        self, tokens: Sequence[int], n: int, *, stop_at_eog: bool = False
    ) -> tuple[list[int], float]:
        """``n`` greedily generated tokens after ``tokens``, and the decode rate in tokens/s
        (the ``n - 1`` single-token steps after the prompt, prefill excluded). With
        ``stop_at_eog``, generation ends after the first token llama.cpp's vocabulary calls
        end-of-generation (its eos, eot or another end token), as llama.cpp's own tools do."""
        self._reset()
        last = self._decode(tokens, 0, False)[-1]
        out, pos = [int(np.argmax(last))], len(tokens)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            if stop_at_eog and self.is_eog(out[-1]):
                break
            last = self._decode(out[-1:], pos, False)[-1]
            pos += 1
            out.append(int(np.argmax(last)))
        dt = time.perf_counter() - t0
        steps = len(out) - 1
        return out, steps / dt if steps > 0 and dt > 0 else float("nan")

    def is_eog(self, token: int) -> bool:
        """Whether llama.cpp's vocabulary ends generation at ``token`` (eos, eot, ...)."""
        if self.backend == "llama_cpp":
            import llama_cpp

            return bool(llama_cpp.llama_vocab_is_eog(self._llm._model.vocab, int(token)))
        return self._llm.is_eog(token)

    def chat_template(self) -> str | None:
        """The file's default chat template as llama.cpp reads it (None: the file has none)."""
        if self.backend == "llama_cpp":
            return self._llm.metadata.get("tokenizer.chat_template")
        return self._llm.chat_template()

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """llama.cpp's tokenization of ``text`` (no BOS); special tokens' text is parsed as
        those tokens with ``special``, as plain text without."""
        if self.backend == "llama_cpp":
            return list(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=special))
        return self._llm.tokenize(text, special)

    def close(self) -> None:
        close = getattr(self._llm, "close", None)
        if close is not None:
            close()
