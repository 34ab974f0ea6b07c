"""localdiff's native C kernels, compiled on first use with the system C compiler and loaded with ctypes
(docs/ARCHITECTURE.md, "Native kernels"): :mod:`~localdiff.kernels.int8` (small-M int8 matmul, AMX-INT8 or fp32
FMA), :mod:`~localdiff.kernels.int4` (group-quantized int4 matmul), :mod:`~localdiff.kernels.experts` (bf16 MoE
experts, AMX-BF16), :mod:`~localdiff.kernels.vocab` (the fused vocabulary pass); :mod:`~localdiff.kernels.build`
builds, caches and loads them. Each falls back to torch (a status line says why) when it cannot build or run.

The lowest layer: these modules import no localdiff module but :mod:`localdiff.errors` (tests/project/test_structure.py),
so ``arch``, ``quantize`` and ``decoding`` may import them.
"""
