"""Block-sequential GPTQ: calibrate and quantize a model one decoder block at a time.

The whole-model engine (:class:`~microscale.ptq.engine.Engine`) holds every weight in
float32 and runs the model end to end, so its memory grows with the model (about 16 bytes
per parameter, docs/ptq/real-model.md). A decoder block reads nothing but its input
residual stream, so GPTQ's calibration can walk the blocks instead, as GPTQ's own code and
llm-compressor's sequential pipeline do::

    x_0     = embed(tokens[:, :-1])                   the calibration stream [rows, T, D]
    for block i = 0 .. L-1:
        W_i     = block i's weights                    read now; one block resident
        H_i,l   = 2 X_l^T X_l / n                      X_l: linear l's input, from x_i
        Q_i     = GPTQ(W_i, H_i)                       per fused group, one tensor amax
        x_{i+1} = block_i(x_i; Q_i)     inputs="quantized" (default)
                = block_i(x_i; W_i)     inputs="original"

``inputs`` chooses which stream the next block's Hessians see:

* ``"quantized"``: the stream of the model being built, its earlier blocks already
  quantized (GPTQ's order, llm-compressor's "sequential"). Block ``i``'s GPTQ then
  minimises its output error on the inputs the deployed model gives it, so it compensates
  the earlier blocks' error too. Within a block every linear sees the block's
  full-precision weights (block granularity, not GPTQ's optional "true-sequential"
  sub-layer order).
* ``"original"``: the full-precision model's stream, which is what the whole-model
  engine's :meth:`~microscale.ptq.engine.Engine.input_hessians` computes; the result
  equals that engine's GPTQ.

Memory: one block's float32 weights and their quantized copies, the calibration stream
(``rows x T x D`` float32 per batch, on the host, twice while a block runs: its input and
output), and the block's compiled temporaries; nothing grows with the number of blocks.
The embedding rows are gathered from the source once (a memory-mapped table reads only
the rows the tokens use).

The block runs through the model's own :class:`~microscale.model.Block` (the one block
definition, :mod:`microscale.model.block`) under the bf16 recipe and the engine's attention
chunk, exactly as the engine runs it, and its linears are tapped with
:func:`~microscale.ptq.tap.intercept_linears`. Every block of one kind (local or global)
shares one compiled program.

Weights come from a :class:`BlockSource`: :func:`params_source` (a flat parameter dict in
memory) or :func:`folder_source` (an HF folder of float safetensors, memory-mapped; each
block's tensors are read when its turn comes).

Bad input is refused before any work, in this order: the arguments (``inputs``, ``ptq``,
``attention_chunk``, the callbacks), the calibration batches (int tokens inside the
vocabulary, rows no longer than the model's context ``max_seq_len``), every entry of
``formats`` (a linear layer of the model, a registry format, one per fused group), then
the weights: every tensor the run will read is scanned once for non-finite values (and,
for a folder whose files carry them, checked against its stored CRC-32), in chunks of
:data:`SCAN_CHUNK` bytes so the scan's memory is one chunk, before the first block. A NaN
in block 20 is so named in seconds, not after 19 blocks of GPTQ. The scan's cost is one read
of the weights, measured on the 2-core Xeon (files in the page cache): 3 ms for the
2-block test model (float32), 0.30 s for a SmolLM2-135M-shaped bf16 folder (0.25 GiB,
30 blocks; its clean run takes 212 s, docs/ptq/sequential.md), so about 1.2 s per GiB,
well under 1% of a run. The blocks' own reads check their tensors again when their turn
comes (the file may change in between); that cost was there before.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from microscale.export.hf import hf_param_name, model_config_from_hf
from microscale.export.hfquant import load_json, quant_method
from microscale.export.reader import hf_head_config
from microscale.export.tensorfile import TensorStore
from microscale.formats.spec import REGISTRY, get_format
from microscale.model import (
    Block,
    ModelConfig,
    PrecisionRules,
    apply_rules,
    block_param_shapes,
    fused_groups,
    linear_paths,
)
from microscale.model.block import embed_residual, layer_rope_tables
from microscale.outputs import ExportFolder
from microscale.ptq.tap import intercept_linears
from microscale.ptq.weights import QuantizedWeight, WeightPTQ, quantize_group

__all__ = [
    "INPUTS",
    "SCAN_CHUNK",
    "BlockSource",
    "SequentialGPTQ",
    "folder_source",
    "params_source",
    "sequential_gptq",
]

# What stream the next block's Hessians see (module doc).
INPUTS = ("quantized", "original")

# Bytes of one tensor read at a time by the finiteness scan before the first block.
SCAN_CHUNK = 64 << 20


class BlockSource(Protocol):
    """Where block-sequential PTQ reads a model's weights from, one block at a time.

    A source may also have ``scan()``: check every tensor the run reads (finite values,
    checksums) without holding more than a chunk of it, raising ``ValueError`` naming the
    tensor; :func:`sequential_gptq` calls it before the first block (both sources here
    have it)."""

    @property
    def config(self) -> ModelConfig:
        """The model's configuration."""
        ...

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """The embedding rows of int ``tokens`` ``[...]``: float32 ``[..., d_model]``."""
        ...

    def block(self, i: int) -> dict[str, np.ndarray]:
        """Block ``i``'s parameters by their path inside the block (``attn.q_proj.kernel``,
        ``[in, out]``; ``attn_norm.scale``; ...), float32."""
        ...


@dataclasses.dataclass(frozen=True)
class _ParamsSource:
    config: ModelConfig
    params: Mapping[str, Any]

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(self.params["embed.embedding"], np.float32)[tokens]

    def block(self, i: int) -> dict[str, np.ndarray]:
        head = f"layers.{i}."
        return {
            name: np.asarray(self.params[head + name], np.float32)
            for name in block_param_shapes(self.config)
        }

    def scan(self) -> None:
        for name in _read_names(self.config):
            _scan_tensor(name, np.asarray(self.params[name]), where="params_source")


def params_source(config: ModelConfig, params: Mapping[str, Any]) -> BlockSource:
    """A source over a flat parameter dict in memory (``microscale.export.flat_params``)."""
    return _ParamsSource(config, params)


@dataclasses.dataclass(frozen=True)
class _FolderSource:
    """Each call opens the folder's tensors (memory maps), copies out what it needs and
    drops the maps, so the files' resident pages are those of one block at a time."""

    config: ModelConfig
    path: Path

    def _get(self, store: TensorStore, path: str) -> np.ndarray:
        arr = store.get(hf_param_name(path, self.config.family))
        return arr.T if path.endswith(".kernel") else arr

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        table = self._get(TensorStore(self.path), "embed.embedding")
        return np.asarray(table[tokens], np.float32)  # only the rows the tokens use

    def block(self, i: int) -> dict[str, np.ndarray]:
        store = TensorStore(self.path)
        out = {}
        for name, shape in block_param_shapes(self.config).items():
            arr = np.array(self._get(store, f"layers.{i}.{name}"), np.float32)  # a copy
            if arr.shape != tuple(shape):
                raise ValueError(
                    f"{self.path}: layers.{i}.{name} has shape {arr.shape}; "
                    f"config.json gives {tuple(shape)}"
                )
            out[name] = arr
        return out

    def scan(self) -> None:
        store = TensorStore(self.path)
        for path in _read_names(self.config):
            name = hf_param_name(path, self.config.family)
            info = store.info(name)
            size = info.end - info.begin
            raw = (
                np.memmap(info.file, np.uint8, "r", offset=info.begin, shape=(size,))
                if size
                else np.zeros(0, np.uint8)
            )
            crc = store.checksums.get(name)
            _scan_tensor(name, raw.view(info.np_dtype), where=str(info.file), crc=crc)


def _read_names(cfg: ModelConfig) -> list[str]:
    """The flat paths of every tensor a run reads: the embedding table and the blocks'."""
    names = list(block_param_shapes(cfg))
    return ["embed.embedding"] + [f"layers.{i}.{n}" for i in range(cfg.n_layers) for n in names]


def _scan_tensor(name: str, arr: np.ndarray, *, where: str, crc: str | None = None) -> None:
    """Raise ``ValueError`` naming ``where`` and ``name`` when the float tensor ``arr``
    holds a NaN or infinity, or its bytes' CRC-32 differs from ``crc``; reads
    :data:`SCAN_CHUNK` bytes at a time."""
    flat = arr.reshape(-1)
    floating = np.issubdtype(flat.dtype, np.floating) or "float" in flat.dtype.name
    step = max(1, SCAN_CHUNK // max(1, flat.dtype.itemsize))
    bad, c = 0, 0
    for k in range(0, flat.size, step):
        part = flat[k : k + step]
        if floating:
            bad += int(part.size - np.count_nonzero(np.isfinite(part)))
        if crc is not None:
            c = zlib.crc32(np.ascontiguousarray(part).view(np.uint8).data, c)
    if bad:
        raise ValueError(
            f"{where}: tensor {name!r} holds {bad} non-finite value(s) (NaN or infinity) of "
            f"{flat.size}; refused before any block is quantized"
        )
    if crc is not None and f"{c:08x}" != crc.lower():
        raise ValueError(
            f"{where}: tensor {name!r} fails its checksum (crc32 {c:08x}, stored {crc}): "
            "the file is damaged; refused before any block is quantized"
        )


def folder_source(path: str | os.PathLike) -> BlockSource:
    """A source over an HF folder of float safetensors (plain, not quantized), read
    through memory maps: a block's tensors are read (and checked: checksum, finite
    values) when it is asked for; ``scan()`` checks every tensor the run reads, a chunk
    at a time (:func:`sequential_gptq` calls it before the first block)."""
    path = Path(path)
    cfg_json = load_json(path / ExportFolder.CONFIG)
    method = quant_method(cfg_json, path)
    if method is not None:
        raise ValueError(
            f"{path}: a {method!r} checkpoint is already quantized; block-sequential PTQ "
            "reads float weights (bf16, fp16 or fp32 safetensors)"
        )
    TensorStore(path)  # every header and the index checked before any work
    # a tied config.json beside a head of its own: the untied model, as read_checkpoint reads it
    return _FolderSource(hf_head_config(path, model_config_from_hf(cfg_json)), path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequentialGPTQ:
    """What :func:`sequential_gptq` returns."""

    # Each linear layer's quantized kernel by its full path (``layers.3.attn.q_proj``);
    # empty when a sink took them.
    weights: dict[str, QuantizedWeight]
    # Calibration tokens each Hessian averaged over.
    tokens: int
    # The stream the Hessians saw (INPUTS).
    inputs: str


class _Blocks:
    """One decoder block at a time as an NNX module, with its compiled programs shared
    by the blocks whose structure (local or global) is the same."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self._fns: dict[Any, tuple[Callable, Callable, dict[str, str]]] = {}

    def build(self, i: int, params: Mapping[str, np.ndarray]) -> tuple[Any, dict, Any]:
        """(graphdef, parameters as a pure dict, the rest of the state) of block ``i``
        holding ``params``, under the bf16 recipe."""
        cfg = self.cfg
        abstract = nnx.eval_shape(lambda: Block(cfg, i, rngs=nnx.Rngs(0)))
        graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]
        flat = []
        for path, var in nnx.to_flat_state(state):
            name = ".".join(str(p) for p in path)
            flat.append((path, var.replace(jnp.asarray(params[name], cfg.param_dtype))))
        blk = nnx.merge(graphdef, nnx.from_flat_state(flat), rest)
        apply_rules(blk, PrecisionRules(default="bf16"))
        graphdef, state, rest = nnx.split(blk, nnx.Param, ...)  # type: ignore[misc]
        return graphdef, nnx.to_pure_dict(state), rest

    def programs(self, graphdef) -> tuple[Callable, Callable, dict[str, str]]:
        """(forward, forward with its linears' input Gram matrices ``X^T X``, owners) of
        a block of ``graphdef``: ``(params, rest, x, cos, sin) -> y`` and ``-> (y, {path:
        G})``, one ``G`` per distinct input (q/k/v and gate/up read one); ``owners[path]``
        (filled when the second is first traced) names the layer whose ``G`` is
        ``path``'s."""
        if graphdef not in self._fns:
            owners: dict[str, str] = {}

            def grams(params, rest, x, cos, sin):
                blk = nnx.merge(graphdef, nnx.State(params), rest)
                seen: list[tuple[str, jax.Array]] = []

                def hook(path, call, v):
                    seen.append((path, v))
                    return call(v)

                with intercept_linears(blk, hook):
                    y = blk(x, cos, sin)
                out: dict[str, jax.Array] = {}
                for p, v in seen:  # at trace time: who reads which input
                    owners[p] = next(q for q, w in seen if w is v)
                    if owners[p] == p:
                        v2 = v.reshape(-1, v.shape[-1]).astype(jnp.float32)
                        out[p] = v2.T @ v2
                return y, out

            def forward(params, rest, x, cos, sin):
                return nnx.merge(graphdef, nnx.State(params), rest)(x, cos, sin)

            self._fns[graphdef] = (jax.jit(forward), jax.jit(grams), owners)
        return self._fns[graphdef]


def _block_groups(cfg: ModelConfig, i: int) -> list[tuple[str, ...]]:
    head = f"layers.{i}."
    return [tuple(p[len(head) :] for p in g) for g in fused_groups(cfg) if g[0].startswith(head)]


def _group_format(formats: Mapping[str, str], i: int, group: tuple[str, ...]) -> str:
    paths = [f"layers.{i}.{m}" for m in group]
    missing = [p for p in paths if p not in formats]
    if missing:
        raise ValueError(f"sequential_gptq: formats has no entry for {missing[0]!r}")
    chosen = {formats[p] for p in paths}
    if len(chosen) > 1:
        raise ValueError(
            f"sequential_gptq: the fused group {paths} runs as one GEMM and needs one "
            f"format; formats gives {sorted(chosen)}"
        )
    return chosen.pop()


def _check_formats(formats: Mapping[str, str], cfg: ModelConfig) -> None:
    """Every entry a linear layer of the model and a registry format, every fused group
    of one format, every linear layer given one."""
    if not isinstance(formats, Mapping):
        raise ValueError(
            f"sequential_gptq: formats is a {type(formats).__name__}; expected a mapping "
            "{linear layer path: format name}"
        )
    known = linear_paths(cfg)
    extra = [p for p in formats if p not in set(known)]
    if extra:
        raise ValueError(
            f"sequential_gptq: formats names {extra[0]!r}, not a linear layer of this "
            f"{cfg.n_layers}-block model (e.g. {known[0]!r})"
        )
    for path, name in formats.items():
        try:
            get_format(name)
        except ValueError as e:
            guess = difflib.get_close_matches(str(name), list(REGISTRY), n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            raise ValueError(f"sequential_gptq: formats[{path!r}]: {e}{hint}") from None
    for i in range(cfg.n_layers):
        for group in _block_groups(cfg, i):
            _group_format(formats, i, group)


def _check_batches(batches: Iterable, cfg: ModelConfig) -> list[np.ndarray]:
    out = [np.asarray(b) for b in batches]
    if not out:
        raise ValueError("sequential_gptq: no calibration batches")
    for b in out:
        if b.ndim != 2 or b.shape[1] < 2 or not np.issubdtype(b.dtype, np.integer):
            raise ValueError(
                f"sequential_gptq: a batch of shape {b.shape} and dtype {b.dtype}: "
                "expected int tokens [rows, seq + 1] with seq >= 1"
            )
        if b.min() < 0 or b.max() >= cfg.vocab_size:
            raise ValueError(
                f"sequential_gptq: token ids span {b.min()}..{b.max()}, outside the "
                f"vocabulary 0..{cfg.vocab_size - 1}"
            )
    seq = out[0].shape[1] - 1
    if seq > cfg.max_seq_len:
        raise ValueError(
            f"sequential_gptq: calibration rows of {seq} positions (batches [rows, "
            f"{seq} + 1]) exceed the model's context max_seq_len={cfg.max_seq_len}"
        )
    if len({b.shape for b in out}) > 1:
        raise ValueError(
            f"sequential_gptq: the batches have shapes {sorted({b.shape for b in out})}: "
            "expected one shape"
        )
    return out


def _check_arguments(cfg, inputs, ptq, attention_chunk, progress, sink):
    """`sequential_gptq`'s plain arguments checked; returns the WeightPTQ (its default
    filled in) and ``cfg`` with ``attention_chunk`` applied."""
    if inputs not in INPUTS:
        raise ValueError(f"sequential_gptq: inputs={inputs!r}: expected one of {list(INPUTS)}")
    ptq = WeightPTQ(method="gptq") if ptq is None else ptq
    if not isinstance(ptq, WeightPTQ):
        raise ValueError(f"sequential_gptq: ptq={ptq!r}: expected a WeightPTQ or None")
    for name, fn in (("progress", progress), ("sink", sink)):
        if fn is not None and not callable(fn):
            raise ValueError(f"sequential_gptq: {name}={fn!r}: expected a callable or None")
    if attention_chunk is not None:
        if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int):
            raise ValueError(
                f"sequential_gptq: attention_chunk={attention_chunk!r}: expected a "
                "positive integer or None"
            )
        cfg = dataclasses.replace(cfg, attention_chunk=attention_chunk)
    return ptq, cfg


def sequential_gptq(
    source: BlockSource,
    batches: Iterable,
    formats: Mapping[str, str],
    *,
    inputs: Literal["quantized", "original"] = "quantized",
    ptq: WeightPTQ | None = None,
    attention_chunk: int | None = 128,
    progress: Callable[[int], None] | None = None,
    sink: Callable[[str, QuantizedWeight], None] | None = None,
) -> SequentialGPTQ:
    """GPTQ-quantize every linear layer of ``source``'s model block by block (module
    doc). ``batches``: int token arrays ``[rows, seq + 1]`` (the last position is only a
    target, as in the engine's next-token loss); ``formats``: each linear's format by its
    full path (a fused group's members alike); ``inputs``: ``"quantized"`` or
    ``"original"`` (module doc); ``ptq``: the weight choices (default
    ``WeightPTQ(method="gptq")``: MSE tensor scale, four over six, GPTQ); ``attention_chunk``:
    query positions attended at once (the engine's default, 128; None: the config's);
    ``progress(i)`` is called after block ``i``; ``sink(path, weight)``, when given,
    receives each quantized kernel as soon as its block is done (to write it out) and
    the result keeps none of them, so nothing of the model's size stays resident."""
    ptq, cfg = _check_arguments(source.config, inputs, ptq, attention_chunk, progress, sink)
    tokens = _check_batches(batches, cfg)
    _check_formats(formats, cfg)  # every format known before any work
    scan = getattr(source, "scan", None)
    if scan is not None:  # every weight finite (and intact) before the first block
        scan()
    rows = source.embed(np.stack([b[:, :-1] for b in tokens]))  # one read of the table
    stream = [np.asarray(embed_residual(cfg, jnp.asarray(r))) for r in rows]
    del rows
    n_tok = sum(int(b[:, :-1].size) for b in tokens)
    tables = layer_rope_tables(cfg, jnp.arange(tokens[0].shape[1] - 1))
    blocks = _Blocks(cfg)
    weights: dict[str, QuantizedWeight] = {}
    for i in range(cfg.n_layers):
        graphdef, params, rest = blocks.build(i, source.block(i))
        forward, with_grams, owners = blocks.programs(graphdef)
        cos, sin = tables[i]
        sums: dict[str, np.ndarray] = {}
        outs = []
        for x in stream:
            y, grams = with_grams(params, rest, jnp.asarray(x), cos, sin)
            outs.append(np.asarray(y))
            for p, g in grams.items():
                g = np.asarray(g, np.float64)
                sums[p] = sums[p] + g if p in sums else g
        for h in sums.values():  # H = 2 X^T X / n, in place (the engine's 2.0 * h / n)
            np.multiply(h, 2.0, out=h)
            np.divide(h, n_tok, out=h)
        quantized = {}
        for group in _block_groups(cfg, i):
            kernels = [_kernel(params, m) for m in group]
            hessians = [sums[owners[m]] for m in group]
            qs = quantize_group(kernels, _group_format(formats, i, group), ptq, hessians)
            del hessians, kernels
            for m in {owners[m] for m in group}:
                del sums[m]  # a group's members are the only readers of their inputs
            for m, q in zip(group, qs, strict=True):
                quantized[m] = q
                if sink is None:
                    weights[f"layers.{i}.{m}"] = q
                else:
                    sink(f"layers.{i}.{m}", q)
        if inputs == "quantized":
            for m, q in quantized.items():
                _set_kernel(params, m, q.values)
            outs = [np.asarray(forward(params, rest, jnp.asarray(x), cos, sin)) for x in stream]
        stream = outs
        if progress is not None:
            progress(i)
    return SequentialGPTQ(weights=weights, tokens=n_tok, inputs=inputs)


def _kernel(params: dict, path: str) -> jax.Array:
    node: Any = params
    for part in path.split("."):
        node = node[part]
    return node["kernel"]


def _set_kernel(params: dict, path: str, value: jax.Array) -> None:
    node: Any = params
    for part in path.split("."):
        node = node[part]
    node["kernel"] = jnp.asarray(value, node["kernel"].dtype)
