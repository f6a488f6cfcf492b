"""What the callers of DART's native CPU kernels (``dart_client._native``) share."""

from __future__ import annotations

import numpy as np
import torch

from dart_client import _native

#: Whether DART's SIMD CPU kernels (matmul, tree attention) run on this CPU: AMX, AVX-512
#: F/BW/VL, or AVX2 with FMA (each computes a row the same way whatever rows surround it).
#: Asked once; the per-layer paths read this flag.
SIMD_KERNELS: bool = _native.decoding_matmul_simd()

#: The most rows (a draft tree's nodes, a few draft positions) DART's decoding kernels take
#: where PyTorch multiplies bf16 natively (:data:`NATIVE_BF16_GEMM`): longer blocks (a
#: prompt's prefill) go to PyTorch's kernels, which are faster there. A greedy DART step and
#: an autoregressive one both stay within it, so they compute each row the same way.
DECODING_ROWS = 64

#: Whether PyTorch's bf16 GEMM beats DART's matmul on long blocks here: where it runs on
#: AMX tiles, or on AVX512-BF16 while DART's matmul is capped below it (``avx512``). On CPUs
#: without them (AVX2 only, AVX-512 without BF16) it converts in software and DART's matmul
#: is faster at every length, so it takes prompts too (docs/benchmarks.md, "CPUs without
#: AVX-512"); so it does on AVX512-BF16 CPUs without AMX, where DART's dot-product kernel
#: prefilled 128-2000 tokens 3-12% faster than oneDNN's (a Zen 4 EPYC, performance notes).
NATIVE_BF16_GEMM: bool = _native.decoding_matmul_backend() in ("amx", "avx512") and bool(
    getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 CPU tensor as a numpy uint16 view of its bits (numpy has no bf16), without a
    copy unless its last dimension is strided or a stride is negative (the kernels read rows
    and refuse negative strides)."""
    # is_contiguous first: the common case, and the cheapest check on this per-layer path.
    if not t.is_contiguous() and (t.stride(-1) != 1 or min(t.stride()) < 0):
        t = t.contiguous()
    return t.view(torch.uint16).numpy()


def from_bits(bits: np.ndarray) -> torch.Tensor:
    """The bf16 tensor whose bits a kernel wrote into a new uint16 array (shared, no copy):
    the inverse of :func:`bf16_bits`, and cheaper than allocating the output in torch."""
    return torch.from_numpy(bits).view(torch.bfloat16)
