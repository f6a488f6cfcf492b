"""DART's CPU decoding matmul (``dart_kernels::PackedMatrix`` through ``DartMatmul``): the
product of ``F.linear`` within bf16 rounding, rows independent of each other, bad arrays
refused, and the switch between it and oneDNN."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_client import _native
from dart_client.models.linear import DartMatmul, OneDnnMatmul, pack_for_cpu, set_cpu_matmul
from dart_client.models.native import DECODING_ROWS, NATIVE_BF16_GEMM

needs_simd = pytest.mark.skipif(
    not _native.decoding_matmul_simd(),
    reason="the CPU has neither AVX-512 nor AVX2+FMA (the scalar kernel is tested in Rust)",
)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product in float64, before any rounding."""
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


def assert_bf16_rounding_of(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """``got`` (bf16) is ``want`` (float64) rounded to bf16, give or take f32 accumulation:
    within half a bf16 step of the value plus k f32 roundings of the largest partial sum."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.double() - want).abs()
    limit = want.abs() * 2.0**-8 + k * 2.0**-23 * want.abs().max() + 1e-30
    assert bool((err <= limit).all()), float((err - limit).max())


@needs_simd
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 100),
    k=st.integers(1, 90),
    rows=st.integers(1, 40),
    with_bias=st.booleans(),
    batch=st.sampled_from([(), (1,), (2,)]),
    seed=st.integers(0, 2**16),
)
def test_dart_matmul_is_the_product(
    n: int, k: int, rows: int, with_bias: bool, batch: tuple[int, ...], seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(*batch, rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    got = DartMatmul(w)(x, bias)
    assert got.shape == (*batch, rows, n)
    assert_bf16_rounding_of(got, reference(x, w, bias), k)
    # The same product as PyTorch's bf16 kernel, up to one bf16 rounding step either way.
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=2**-7, atol=1e-2)


@needs_simd
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 40), pick=st.integers(0, 39), seed=st.integers(0, 2**16))
def test_a_rows_product_does_not_depend_on_the_other_rows(rows: int, pick: int, seed: int) -> None:
    """What makes a tree's logits equal one-token decoding's: bit for bit."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(77, 130, generator=g).bfloat16()
    x = torch.randn(rows, 130, generator=g).bfloat16()
    mm = DartMatmul(w)
    r = pick % rows
    assert torch.equal(mm(x, None)[r], mm(x[r : r + 1], None)[0])
    # A non-contiguous view of the same rows gives the same bits.
    assert torch.equal(mm(x.T.contiguous().T, None), mm(x, None))


@needs_simd
def test_every_simd_kernel_gives_the_scalar_kernels_bits() -> None:
    """Each backend this CPU runs besides AMX and AVX512-BF16 (which round their own way), on
    one and three threads."""
    own_bits = ("amx", "avx512bf16", "scalar")
    runnable = [b for b in _native.decoding_matmul_backends() if b not in own_bits]
    assert runnable
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 33, generator=g).bfloat16()
    x = torch.randn(13, 33, generator=g).bfloat16()
    b = torch.randn(70, generator=g).bfloat16()
    packed = _native.PackedMatrix(w.view(torch.uint16).numpy())

    def run(backend: str, threads: int) -> np.ndarray:
        out = np.zeros((13, 70), dtype=np.uint16)
        packed.matmul(
            x.view(torch.uint16).numpy(), out, b.view(torch.uint16).numpy(), threads, backend
        )
        return out

    want = run("scalar", 1)
    for backend in runnable:
        for threads in (1, 3):
            assert (run(backend, threads) == want).all(), (backend, threads)


def test_dart_max_cpu_isa_caps_the_kernels_auto_picks() -> None:
    """``DART_MAX_CPU_ISA`` (like oneDNN's ``ONEDNN_MAX_CPU_ISA``) lowers what ``auto`` runs,
    never above what the CPU has; a value naming no backend fails the import, naming it."""
    ladder = ["scalar", "avx2", "avx512", "avx512bf16", "amx"]
    have = ladder.index(_native.decoding_matmul_backends()[0])

    def import_with(value: str) -> subprocess.CompletedProcess[str]:
        code = (
            "from dart_client.models import native; from dart_client import _native; "
            "print(_native.decoding_matmul_backend(), native.SIMD_KERNELS)"
        )
        env = {**os.environ, "DART_MAX_CPU_ISA": value}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )

    for cap in ladder:
        run = import_with(cap.upper() if cap == "avx2" else cap)
        assert run.returncode == 0, run.stderr
        want = ladder[min(have, ladder.index(cap))]
        assert run.stdout.split() == [want, str(want != "scalar")]
    bad = import_with("avx-512")
    assert bad.returncode != 0
    assert 'DART_MAX_CPU_ISA="avx-512"' in bad.stderr and "avx512" in bad.stderr


def test_bad_arrays_are_clear_errors() -> None:
    w = np.zeros((4, 6), dtype=np.uint16)
    packed = _native.PackedMatrix(w)
    assert (packed.out_features, packed.in_features) == (4, 6)
    x = np.zeros((2, 6), dtype=np.uint16)
    with pytest.raises(_native.KernelError, match="x has 5 columns, the matrix 6 inputs"):
        packed.matmul(np.zeros((2, 5), dtype=np.uint16), np.zeros((2, 4), dtype=np.uint16))
    with pytest.raises(_native.KernelError, match=r"out has shape \[2, 3\], expected \[2, 4\]"):
        packed.matmul(x, np.zeros((2, 3), dtype=np.uint16))
    with pytest.raises(_native.KernelError, match="bias has 3 elements, expected 4"):
        packed.matmul(x, np.zeros((2, 4), dtype=np.uint16), np.zeros(3, dtype=np.uint16))
    with pytest.raises(_native.KernelError, match="rows must be between 1"):
        packed.matmul(np.zeros((0, 6), dtype=np.uint16), np.zeros((0, 4), dtype=np.uint16))
    with pytest.raises(_native.KernelError, match="C-contiguous"):
        packed.matmul(np.zeros((6, 2), dtype=np.uint16).T, np.zeros((2, 4), dtype=np.uint16))
    with pytest.raises(_native.KernelError, match="out must be a C-contiguous"):
        packed.matmul(x, np.zeros((4, 2), dtype=np.uint16).T)
    with pytest.raises(_native.KernelError, match="backend"):
        packed.matmul(x, np.zeros((2, 4), dtype=np.uint16), backend="gpu")
    with pytest.raises(_native.KernelError, match="must be between 1"):
        _native.PackedMatrix(np.zeros((0, 6), dtype=np.uint16))
    with pytest.raises(TypeError):
        _native.PackedMatrix(np.zeros((4, 6), dtype=np.float32))


def test_the_cpu_matmul_switch() -> None:
    w = torch.randn(40, 24).bfloat16()
    try:
        set_cpu_matmul("onednn")
        assert pack_for_cpu(w) is None or isinstance(pack_for_cpu(w), OneDnnMatmul)
        if _native.decoding_matmul_simd():
            set_cpu_matmul("dart")
            assert isinstance(pack_for_cpu(w), DartMatmul)
        else:
            with pytest.raises(RuntimeError, match=r"AVX-512 .* or AVX2 with FMA"):
                set_cpu_matmul("dart")
        # fp32 weights never take DART's (bf16) matmul.
        assert not isinstance(pack_for_cpu(w.float()), DartMatmul)
        with pytest.raises(ValueError, match="expected 'auto', 'dart' or 'onednn'"):
            set_cpu_matmul("mkl")  # type: ignore[arg-type]
    finally:
        set_cpu_matmul("auto")


@needs_simd
def test_a_bf16_target_on_dart_matmul_gives_the_logits_of_its_plain_one() -> None:
    from dart_client.models.linear import pack_linear_layers, unpack_linear_layers

    model = make_tiny_target("llama", dtype=torch.bfloat16, seed=11)
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits.float()
        pack_linear_layers(model)
        got = model(ids).logits.float()
    # What multiplied: every layer's packed copy is DART's (read before unpacking drops them).
    kinds = {
        type(packed).__name__
        for module in model.modules()
        for (_, (_, packed)) in module.__dict__.get("_derived_weights", {}).values()
    }
    assert kinds == {"DartMatmul"}
    unpack_linear_layers(model)
    assert not any("_derived_weights" in module.__dict__ for module in model.modules())
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * float(want.abs().max()))


@needs_simd
def test_fused_projections_are_the_layers_products_bit_for_bit() -> None:
    """q/k/v (and gate/up) multiplied as one stacked matrix give each layer's own product
    bits (every output column is computed on its own); a hook on one of them, a prompt-sized
    block, or unswitched layers decline (None), and a prompt-sized block packs nothing."""
    from dart_client.models.linear import fused_projection, pack_linear_layers

    model = make_tiny_target("llama", dtype=torch.bfloat16, seed=12)
    attn = model.model.layers[0].self_attn
    names = ("q_proj", "k_proj", "v_proj")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        x = torch.randn(3, 5, attn.q_proj.in_features, generator=g).bfloat16()
        assert fused_projection(attn, names, x) is None  # not switched by pack_linear_layers
        pack_linear_layers(model)
        fused = fused_projection(attn, names, x)
        assert fused is not None
        alone = torch.cat([getattr(attn, name)(x) for name in names], -1)
        assert torch.equal(fused.view(torch.int16), alone.view(torch.int16))
        handle = attn.k_proj.register_forward_pre_hook(lambda *a: None)
        assert fused_projection(attn, names, x) is None
        handle.remove()
        if NATIVE_BF16_GEMM:
            mlp = model.model.layers[1].mlp
            prompt = torch.randn(1, DECODING_ROWS + 1, mlp.gate_proj.in_features).bfloat16()
            assert fused_projection(mlp, ("gate_proj", "up_proj"), prompt) is None
            mlp.gate_proj(prompt)  # PyTorch's kernel on the layer's own weight
            assert "_derived_weights" not in mlp.__dict__
    with torch.enable_grad():
        assert fused_projection(attn, names, x.requires_grad_()) is None


@pytest.mark.parametrize(
    ("backend", "feature"), [("amx", "AMX-BF16"), ("avx512bf16", "AVX512-BF16")]
)
def test_a_bf16_instruction_kernel_is_the_product_row_by_row_or_a_clear_error(
    backend: str, feature: str
) -> None:
    """AMX tiles and AVX512-BF16 dot products round their sums their own way, so the check is
    the product within bf16 rounding plus every row's bits equal to the row alone (rows at
    both ends of the kernels' passes: 16 per AMX tile, 8 per dot-product pass); without the
    instructions, an error naming them."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 96, generator=g).bfloat16()
    x = torch.randn(37, 96, generator=g).bfloat16()
    b = torch.randn(70, generator=g).bfloat16()
    packed = _native.PackedMatrix(w.view(torch.uint16).numpy())

    def product(rows: torch.Tensor, threads: int = 1) -> torch.Tensor:
        out = np.zeros((rows.shape[0], 70), dtype=np.uint16)
        packed.matmul(
            rows.view(torch.uint16).numpy(), out, b.view(torch.uint16).numpy(), threads, backend
        )
        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)

    if backend not in _native.decoding_matmul_backends():
        with pytest.raises(_native.KernelError, match=feature):
            product(x)
        return
    got = product(x, threads=2)
    assert_bf16_rounding_of(got, reference(x, w, b), 96)
    for r in (0, 7, 8, 15, 16, 31, 36):
        assert torch.equal(got[r], product(x[r : r + 1])[0]), r
