"""GGUF, llama.cpp's one-file layout, by seam (the container itself, read and validated, is
:mod:`microscale.export.gguffile`):

* :mod:`~microscale.export.gguf.tensors`: a weight as a ggml tensor, byte for byte (the
  native NVFP4 / MXFP4 / Q8_0 blocks, ggml's own integer types, floats, the embedding);
* :mod:`~microscale.export.gguf.arch`: what llama.cpp's graph of each architecture reads
  (tensor names, q/k row order, what is refused before any work);
* :mod:`~microscale.export.gguf.vocab`: the tokenizer as llama.cpp's vocabulary, and back;
* :mod:`~microscale.export.gguf.rope`: RoPE scaling as llama.cpp's converter writes it,
  and back;
* :mod:`~microscale.export.gguf.writer`: :func:`~microscale.export.gguf.writer.write_gguf`,
  the file (atomic, checksummed);
* :mod:`~microscale.export.gguf.to_hf`: a GGUF -> an HF folder, or microscale's params;
* :mod:`~microscale.export.gguf.llamacpp`: llama.cpp itself, to run a file.
"""
