"""oneDNN-packed linear layers of a target: same products, reversible, guarded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import make_tiny_target, make_tiny_tokenizer
from torch import nn

from dart_client import DartModel, ar_generate, dart_generate
from dart_client.models.head import DartHead
from dart_client.models.linear import (
    cpu_packing_available,
    pack_linear_layers,
    unpack_linear_layers,
)
from dart_client.models.native import SIMD_KERNELS
from dart_client.models.target import TargetModel

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


#: dtypes this CPU packs (fp32 wherever oneDNN runs; bf16 with DART's matmul on AVX-512/AVX2,
#: else oneDNN's with AVX-512 or AVX-NE-CONVERT).
PACKED_DTYPES = [d for d in (torch.bfloat16, torch.float32) if cpu_packing_available(d)]


def packed_dtype(dtype: torch.dtype) -> None:
    """Skip (visibly) a test of packing ``dtype`` weights on a CPU that has no such kernel."""
    if dtype not in PACKED_DTYPES:
        pytest.skip(f"no packed CPU matmul for {dtype} on this CPU / torch build")


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_target_computes_what_the_plain_one_does(dtype: torch.dtype) -> None:
    packed_dtype(dtype)
    model = make_tiny_target("qwen3", dtype=dtype, seed=4)
    ids = torch.randint(3, 300, (1, 17), generator=torch.Generator().manual_seed(0))
    want = logits(model, ids)
    want_one = logits(model, ids[:, :1])
    report = pack_linear_layers(model)
    assert report.skipped is None
    assert report.layers == len(linears(model)) == 6 * 7 + 1
    got = logits(model, ids)
    # Packed copies were built and used (one per layer, cached on its parent module).
    cached = [
        value
        for module in model.modules()
        for (kind, _), (_, value) in module.__dict__.get("_derived_weights", {}).items()
        if kind.startswith("linear")
    ]
    assert len(cached) == report.layers and all(p is not None for _, p in cached)
    # One row (a decoding step): PyTorch's kernel under oneDNN packing (bit-identical); DART's
    # matmul for bf16 on AVX-512/AVX2 CPUs, the same product up to bf16 rounding.
    one = logits(model, ids[:, :1])
    if dtype == torch.float32 or not SIMD_KERNELS:
        assert torch.equal(one, want_one)
    else:
        torch.testing.assert_close(one, want_one, rtol=0, atol=0.03 * float(want_one.abs().max()))
    tol = 0.03 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, want, rtol=0, atol=tol * float(want.abs().max()))
    assert unpack_linear_layers(model) == report.layers
    assert not any("forward" in m.__dict__ for m in linears(model))
    torch.testing.assert_close(logits(model, ids), want, rtol=0, atol=0)


@needs_onednn
def test_packed_layers_follow_in_place_weight_updates() -> None:
    model = make_tiny_target("llama", dtype=torch.float32, seed=5)
    pack_linear_layers(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = logits(model, ids)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # a stale packed copy would keep the old product
    after = logits(model, ids)
    torch.testing.assert_close(after, 2 * before, rtol=1e-4, atol=1e-4)


def test_float64_and_short_memory_are_left_alone() -> None:
    fp64 = make_tiny_target("llama", seed=6)
    report = pack_linear_layers(fp64)
    assert report.layers == 0 and "bf16/fp32" in (report.skipped or "")
    assert not any("forward" in m.__dict__ for m in linears(fp64))
    if not PACKED_DTYPES:
        pytest.skip("no packed CPU matmul on this CPU / torch build: no memory guard to test")
    packable = make_tiny_target("llama", dtype=PACKED_DTYPES[0], seed=6)
    report = pack_linear_layers(packable, max_memory_fraction=0.0)
    assert report.layers == 0 and report.weight_bytes > 0
    assert "MiB" in (report.skipped or "")
    assert not any("forward" in m.__dict__ for m in linears(packable))


def test_training_a_packed_model_still_reaches_its_weights() -> None:
    """Under autograd the live weights are used, so gradients flow as without packing."""
    model = make_tiny_target("llama", dtype=torch.float32, seed=7)
    pack_linear_layers(model)
    model(torch.tensor([[4, 5, 6]])).logits.sum().backward()
    assert all(m.weight.grad is not None for m in linears(model))


@needs_onednn
def test_target_model_packs_by_default_and_close_restores() -> None:
    packed_dtype(torch.bfloat16)
    model = make_tiny_target("qwen3", dtype=torch.bfloat16, seed=8)
    target = TargetModel(model)
    assert target.packing.layers == len(linears(model))
    plain = TargetModel(make_tiny_target("qwen3", dtype=torch.bfloat16), cpu_kernels=False)
    assert plain.packing.layers == 0
    target.close()
    assert target.packing.layers == 0
    assert not any("forward" in m.__dict__ for m in linears(model))


@pytest.mark.usefixtures("one_thread")
def test_greedy_dart_on_a_packed_bf16_target_equals_its_ar() -> None:
    """Packing changes no semantics: DART and AR share the packed bf16 layers; the tree holds
    AR's own continuation, so long runs of packed bf16 nodes are accepted. With DART's matmul
    (a row's bits never depend on the rows beside it) the outputs are identical; with
    oneDNN's, any divergence must sit on a near-tie of the target's logits."""
    from conftest import PlantedContinuation, assert_divergence_is_a_near_tie, generate_tracked

    packed_dtype(torch.bfloat16)
    model = make_tiny_target("llama", dtype=torch.bfloat16, seed=9)
    head = DartHead.random_init(model.config, draft_length=3, seed=1).to(torch.bfloat16)
    dm = DartModel(model, head, tokenizer=make_tiny_tokenizer())
    assert dm.target.packing.layers > 0
    accepted = steps = 0
    for seed in range(3):
        prompt = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(seed))
        ids = prompt.tolist()
        want = ar_generate(dm, input_ids=ids, max_new_tokens=24).tokens
        planted = PlantedContinuation(want, depth=6)
        got, result = generate_tracked(dart_generate, dm, planted, input_ids=ids, max_new_tokens=24)
        if SIMD_KERNELS:
            assert got == want, f"prompt {seed}"
        elif assert_divergence_is_a_near_tie(model, ids, got, want, 4.0) is not None:
            continue
        accepted += sum(result.accept_lengths[1:])
        steps += result.steps
    dm.target.close()
    assert steps >= 5 and accepted / steps >= 3.0, (steps, accepted)


def test_kernel_benchmark_times_both_kernel_sets_and_leaves_the_decoding_ones_on() -> None:
    from dart_client.apps.bench.kernels import markdown, measure

    model = make_tiny_target("llama", dtype=torch.float32, seed=10)
    target = TargetModel(model)
    result = measure(target, [1, 4], context=12, repeats=2)
    assert set(result) == {"plain", "onednn"}  # fp32: DART's matmul is bf16 only
    assert all(set(v) == {1, 4} and min(v.values()) > 0 for v in result.values())
    assert "| 4 |" in markdown(result)
    assert target.model.config._attn_implementation == "dart_small_query"
    assert all("forward" in m.__dict__ for m in linears(model)) == (target.packing.layers > 0)


def test_gradients_reach_the_input_of_a_packed_frozen_model() -> None:
    """Frozen packed weights, an input that needs a gradient (a prompt embedding being tuned,
    a model being probed): the packed kernels have no backward, so F.linear takes over."""
    if not PACKED_DTYPES:
        pytest.skip("no packed CPU matmul on this CPU / torch build")
    for dtype in PACKED_DTYPES:
        model = make_tiny_target("llama", dtype=dtype, seed=14).requires_grad_(False)
        assert pack_linear_layers(model).layers > 0
        embeds = model.get_input_embeddings()(torch.tensor([[4, 5, 6]])).requires_grad_(True)
        model(inputs_embeds=embeds).logits.float().sum().backward()
        assert embeds.grad is not None and bool(embeds.grad.abs().sum() > 0)


@pytest.mark.skipif(
    not SIMD_KERNELS, reason="DART's bf16 decoding matmul needs AVX-512 or AVX2+FMA"
)
@pytest.mark.parametrize("native_bf16_gemm", [True, False])
def test_a_prefill_takes_pytorchs_matmul_and_a_tree_takes_the_decoding_one(
    monkeypatch: pytest.MonkeyPatch, native_bf16_gemm: bool
) -> None:
    """Where PyTorch multiplies bf16 natively, the decoding kernel is slower than PyTorch's
    on a prompt's long block: blocks of more than DECODING_ROWS rows go to F.linear, trees
    and single tokens to the kernel. Elsewhere every block goes to the kernel. Both compute
    what the plain model does."""
    from dart_client.models import linear
    from dart_client.models.native import DECODING_ROWS

    monkeypatch.setattr(linear, "NATIVE_BF16_GEMM", native_bf16_gemm)

    rows_seen: list[int] = []
    kernel = linear.DartMatmul.__call__

    def spy(self: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows_seen.append(x.numel() // x.shape[-1])
        return kernel(self, x, bias)

    monkeypatch.setattr(linear.DartMatmul, "__call__", spy)
    model = make_tiny_target("llama", dtype=torch.bfloat16, seed=2)
    g = torch.Generator().manual_seed(1)
    for n in (1, DECODING_ROWS, DECODING_ROWS + 1, 3 * DECODING_ROWS):
        ids = torch.randint(3, 300, (1, n), generator=g)
        unpack_linear_layers(model)
        want = logits(model, ids)
        pack_linear_layers(model)
        rows_seen.clear()
        got = logits(model, ids)
        # The block's projections run on the kernel exactly when it is decoding-sized (or
        # always, without native bf16 GEMMs).
        on_kernel = n <= DECODING_ROWS or not native_bf16_gemm
        assert (n in rows_seen) == on_kernel, (n, rows_seen)
        if native_bf16_gemm:
            assert max(rows_seen, default=0) <= DECODING_ROWS, (n, rows_seen)
        # bf16 rounding through every layer: the tolerance the other whole-model checks use.
        torch.testing.assert_close(got, want, rtol=0, atol=0.03 * float(want.abs().max()))
