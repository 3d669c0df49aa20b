"""numba kernels over raw ggml blocks (private; import only through :mod:`aioexperts._compute.fused`).

Every module here imports numba at import time, so importing one raises ``ImportError`` when numba
is missing; :mod:`aioexperts._compute.fused` catches that and serves the numpy kernels instead.

Per ggml type, three entry points, all over the raw bytes of one 2-D tensor viewed as
``(rows, row_bytes)`` uint8 (F16/BF16: uint16 ``(rows, cols)``):

* ``matvec_<type>(raw, x, out)``: ``out = W @ x`` for one token, decoding each block in registers
  and dotting it with ``x`` (the float32 weights never exist in memory);
* ``matmat_<type>(raw, xt, out)``: ``out = xt @ W.T`` for a small batch, decoding a group of rows
  once into a small buffer and multiplying it with every token;
* ``dequant_<type>(raw, out)``: exact dequantization, bit for bit ``gguf.quants.dequantize``;

and, in :mod:`.int8`, ``matvec_int8_<type>`` for the quantized types: ``x`` quantized to 8 bits,
integer dot products (llama.cpp's CPU scheme); in :mod:`.rows`, ``matrows_<type>``: float
products of 1..16 tokens (Q4_K, Q8_0), each token's row bit for bit its one-token result.

Modules: :mod:`.common` (f16 and e8m0 scales, prefetch, sums of ``x``, the blocked product),
:mod:`.simd` (vector intrinsics: dot products of 16/32 codes, table lookups), :mod:`.floats` (F16,
BF16), :mod:`.legacy` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), :mod:`.kquants` (Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K), :mod:`.codebook` (IQ4_NL, IQ4_XS, MXFP4), :mod:`.int8`. F32 needs no kernel: BLAS
multiplies a zero-copy view of its bytes.
"""
