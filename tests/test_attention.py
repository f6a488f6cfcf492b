"""Small-query attention against a direct float64 computation, and its use in a target."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import make_tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_client import _native
from dart_client.models.attention import NAME, small_query_attention
from dart_client.models.native import bf16_bits
from dart_client.models.target import TargetModel

needs_simd = pytest.mark.skipif(
    not _native.decoding_matmul_simd(), reason="DART's CPU kernels need AVX-512 or AVX2+FMA"
)


class Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per head, in float64: softmax(q k^T * scale over the allowed keys) v; (b, n, h, d)."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    past=st.integers(0, 70),
    kv=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 3]),
    kind=st.sampled_from(["float", "bool", "none", "per_head"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_small_query_attention_matches_a_direct_computation(
    n: int, past: int, kv: int, groups: int, kind: str, dtype: torch.dtype, seed: int
) -> None:
    if n == 1 and dtype != torch.bfloat16:
        n = 2  # one query in float32/64 goes to SDPA (tested below)
    g = torch.Generator().manual_seed(seed)
    h, d, length = kv * groups, 8, past + n
    q = torch.randn(1, n, h, d, generator=g).to(dtype).transpose(1, 2)  # as transformers does
    k = torch.randn(1, kv, length, d, generator=g).to(dtype)
    v = torch.randn(1, kv, length, d, generator=g).to(dtype)
    # A random tree-like mask: every query sees the cache, itself and some earlier new keys.
    allowed = torch.ones(n, length, dtype=torch.bool)
    allowed[:, past:] = (torch.rand(n, n, generator=g) < 0.5).tril()
    allowed[:, past:] |= torch.eye(n, dtype=torch.bool)
    if kind == "none":
        allowed[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
        mask = None
        want_mask = allowed.view(1, 1, n, length)
    elif kind == "bool":
        mask = allowed.view(1, 1, n, length)
        want_mask = mask
    elif kind == "per_head":
        per_head = allowed.expand(h, n, length).clone()
        per_head[0, :, 0] = False if past else per_head[0, :, 0]
        mask = torch.zeros(1, h, n, length, dtype=dtype).masked_fill(
            ~per_head, torch.finfo(dtype).min
        )
        want_mask = per_head.view(1, h, n, length)
    else:
        # Longer than the keys, as static caches give it: only the first `length` count.
        wide = torch.cat([allowed, torch.zeros(n, 5, dtype=torch.bool)], dim=1)
        mask = torch.zeros(1, 1, n, length + 5, dtype=dtype).masked_fill(
            ~wide, torch.finfo(dtype).min
        )
        want_mask = allowed.view(1, 1, n, length)
    got, weights = small_query_attention(Attn(groups), q, k, v, mask, scaling=d**-0.5)
    assert weights is None and got.dtype == dtype and got.shape == (1, n, h, d)
    assert got.is_contiguous()
    want = reference(q, k, v, want_mask, d**-0.5)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("n", [1, 65])
def test_one_float32_query_and_long_blocks_go_to_sdpa(n: int) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, 4, n, 8, generator=g)
    k = torch.randn(1, 2, n + 3, 8, generator=g)
    v = torch.randn(1, 2, n + 3, 8, generator=g)
    mask = torch.zeros(1, 1, n, n + 3)
    mask[..., 3:] = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
    got, _ = small_query_attention(Attn(2), q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(Attn(2), q, k, v, mask, scaling=0.3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_target_forward_with_small_query_attention_is_the_sdpa_one(arch: str) -> None:
    """A tree-sized forward over a cache: switched on by TargetModel, the same logits as
    SDPA in float64 (transformers' eager attention is no reference: its softmax runs in
    float32 even for float64 models), switched back by close()."""
    # The CPU kernels' attention: on the CPU whatever DART_TEST_DEVICE says.
    model = make_tiny_target(arch, seed=3, attn="sdpa", device="cpu")
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    target = TargetModel(model)
    assert model.config._attn_implementation == NAME and target.replaced_attention == "sdpa"
    cache = target.new_cache(64)
    first, _ = target.forward(ids[:, :28], torch.arange(28).unsqueeze(0), cache, taps=False)
    rest, _ = target.forward(ids[:, 28:], torch.arange(28, 40).unsqueeze(0), cache, taps=False)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), want, rtol=0, atol=1e-10)
    target.close()
    assert model.config._attn_implementation == "sdpa"
    plain = TargetModel(make_tiny_target(arch, device="cpu"), cpu_kernels=False)
    assert plain.model.config._attn_implementation == "eager"
    assert plain.replaced_attention is None


@needs_simd
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_bf16_tree_forward_gives_one_token_decodings_logits_bit_for_bit(arch: str) -> None:
    """With DART's matmul and attention, every node of a tree gets exactly the logits that
    decoding its path one token at a time gives: what makes greedy DART equal greedy
    decoding on the CPU in bf16, not only up to near-ties."""
    target = TargetModel(make_tiny_target(arch, dtype=torch.bfloat16, seed=12, device="cpu"))
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 300, (1, 23), generator=g)
    nodes = torch.randint(3, 300, (1, 7), generator=g)
    # Node 0 follows the prompt; 1 and 2 follow 0; 3 follows 1; 4 follows 3; 5, 6 follow 2.
    parent = [-1, 0, 0, 1, 3, 2, 5]
    paths = []
    for i in range(7):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = parent[j]
        paths.append(path)
    tree_mask = torch.zeros(7, 7, dtype=torch.bool)
    for i, path in enumerate(paths):
        tree_mask[i, path] = True
    depth = torch.tensor([len(p) - 1 for p in paths])
    cache = target.new_cache(40)
    target.forward(prompt, torch.arange(23).unsqueeze(0), cache, taps=False)
    tree, _ = target.forward(nodes, (23 + depth).unsqueeze(0), cache, tree_mask=tree_mask)
    for i, path in enumerate(paths):
        cache = target.new_cache(40)
        target.forward(prompt, torch.arange(23).unsqueeze(0), cache, taps=False)
        for step, j in enumerate(path):
            pos = torch.tensor([[23 + step]])
            logits, _ = target.forward(nodes[:, j : j + 1], pos, cache, taps=False)
        assert torch.equal(tree[0, i], logits[0, 0]), f"node {i} (path {path})"


#: CPU kernel sets a bf16 target can run on: DART's matmul on AMX tiles, AVX512-BF16 dot
#: products, AVX-512 or AVX2 (with DART's tree attention; all promise tree rows bit-identical
#: to one-token decoding), and the portable path (PyTorch / oneDNN matmuls, float32
#: small-query attention, SDPA for one query), which promises equality only up to near-ties.
KERNEL_BACKENDS = ["amx", "avx512bf16", "avx512", "avx2", "portable"]


def use_kernels(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the bf16 target through ``backend`` (skipping visibly where the CPU lacks it)."""
    from dart_client.models import attention, linear

    if backend == "portable":
        monkeypatch.setattr(attention, "SIMD_KERNELS", False)
        monkeypatch.setattr(linear, "_cpu_matmul", "onednn")
        return
    have = _native.decoding_matmul_backends()
    if backend not in have:
        pytest.skip(f"needs the {backend} kernel: this CPU runs {have}")
    monkeypatch.setattr(linear, "_cpu_matmul", "dart")

    def forced(self: linear.DartMatmul, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty((rows.shape[0], self.out_features), dtype=torch.bfloat16)
        self.packed.matmul(
            rows.view(torch.uint16).numpy(),
            out.view(torch.uint16).numpy(),
            None if bias is None else bf16_bits(bias.to(torch.bfloat16)),
            torch.get_num_threads(),
            backend=backend,
        )
        return out.view(*x.shape[:-1], self.out_features)

    monkeypatch.setattr(linear.DartMatmul, "__call__", forced)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_greedy_dart_on_a_bf16_target_is_its_greedy_decoding_exactly(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tree holds ar_generate's own continuation, so long runs of bf16 nodes are accepted
    and their K/V compacted: DART's output must be AR's, token for token, on DART's kernels;
    on the portable path any divergence must sit on a near-tie of the target's logits."""
    from conftest import (
        PlantedContinuation,
        assert_divergence_is_a_near_tie,
        generate_tracked,
        make_tiny_tokenizer,
    )

    from dart_client import DartModel, ar_generate, dart_generate
    from dart_client.models.head import DartHead

    use_kernels(backend, monkeypatch)
    # A small vocabulary: wider top-2 gaps, so bf16 near-ties (where the portable path may
    # leave AR) are rarer and long agreed stretches are compared.
    vocab = 64
    prompts = 6
    # DART's kernels are the CPU's; the portable path runs where DART_TEST_DEVICE says (a
    # GPU's kernels, too, round a tree forward unlike a one-token one: near-ties there).
    device = "cpu" if backend != "portable" else None
    model = make_tiny_target(
        "qwen3", vocab_size=vocab, dtype=torch.bfloat16, seed=13, device=device
    )
    head = DartHead.random_init(model.config, draft_length=3, seed=2).to(torch.bfloat16)
    dm = DartModel(model, head, tokenizer=make_tiny_tokenizer(vocab))
    accepted, steps, exact = 0, 0, 0
    for seed in range(prompts):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, vocab, (11,), generator=g).tolist()
        want = ar_generate(dm, input_ids=ids, max_new_tokens=40)
        planted = PlantedContinuation(want.tokens, depth=6)
        tokens, got = generate_tracked(dart_generate, dm, planted, input_ids=ids, max_new_tokens=40)
        if backend == "portable":
            diverged = assert_divergence_is_a_near_tie(model, ids, tokens, want.tokens, 4.0)
        else:
            assert tokens == want.tokens, f"prompt {seed}"
            diverged = None
        exact += diverged is None
        # Acceptance over the steps before any divergence (after one, the planted tokens
        # are no longer the continuation).
        end = 1  # the prefill's token
        for length in got.accept_lengths[1:]:
            end += length
            if diverged is not None and end > diverged:
                break
            accepted += length
            steps += 1
    dm.target.close()
    print(f"{backend}: {exact}/{prompts} identical, {steps} steps compared, {accepted} tokens")
    # Runs of 3+ tokens per step: compaction after accepted bf16 nodes really runs.
    assert steps >= 10 and accepted / steps >= 3.0, (steps, accepted)


def test_tree_attention_refuses_arrays_that_do_not_fit() -> None:
    import numpy as np

    q = np.zeros((1, 4, 2, 8), dtype=np.uint16)
    k = np.zeros((1, 2, 5, 8), dtype=np.uint16)
    out = np.zeros((1, 2, 4, 8), dtype=np.uint16)
    _native.tree_attention(q, k, k, out, None, 0.5)
    with pytest.raises(_native.KernelError, match=r"out has shape \[1, 4, 2, 8\]"):
        _native.tree_attention(q, k, k, np.zeros((1, 4, 2, 8), dtype=np.uint16))
    with pytest.raises(_native.KernelError, match="kv_heads dividing"):
        three = np.zeros((1, 3, 5, 8), dtype=np.uint16)
        _native.tree_attention(q, three, three, out)
    with pytest.raises(_native.KernelError, match="value has shape"):
        _native.tree_attention(q, k, np.zeros((1, 2, 4, 8), dtype=np.uint16), out)
    with pytest.raises(_native.KernelError, match="mask has shape"):
        _native.tree_attention(q, k, k, out, np.zeros((1, 1, 2, 4), dtype=np.uint16))
    with pytest.raises(_native.KernelError, match="last dimension must be contiguous"):
        _native.tree_attention(
            np.zeros((1, 4, 8, 2), dtype=np.uint16).transpose(0, 1, 3, 2), k, k, out
        )
    with pytest.raises(_native.KernelError, match="negative or odd stride"):
        _native.tree_attention(q[:, :, ::-1], k, k, out)


@needs_simd
def test_bf16_attention_takes_any_layout() -> None:
    """Keys whose last dimension is strided (another cache's layout) and an expanded mask
    give what contiguous copies give."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 3, 16, generator=g).bfloat16()
    k = torch.randn(1, 2, 16, 9, generator=g).bfloat16().transpose(-1, -2)  # stride(-1) != 1
    v = torch.randn(1, 2, 9, 16, generator=g).bfloat16()
    mask = torch.zeros(1, 1, 1, 9, dtype=torch.bfloat16).expand(1, 1, 3, 9)
    got, _ = small_query_attention(Attn(2), q, k, v, mask, scaling=0.25)
    want, _ = small_query_attention(Attn(2), q, k.contiguous(), v, mask.contiguous(), scaling=0.25)
    assert torch.equal(got, want)


def test_target_tree_forward_on_every_sdpa_backend() -> None:
    """The target's side of #20's backend crash: its tree forward (transformers' SDPA path
    with DART's float tree mask), dynamic and padded to a static bucket, gives the math
    backend's logits on every SDPA backend the test device has."""
    import numpy as np
    from conftest import TEST_DEVICE
    from test_head import _sdpa_backends_here
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dart_client.decoding.static import StaticVerifier
    from dart_client.decoding.verify import Tree, verify_tree

    dtypes = [torch.float32] + ([torch.bfloat16] if TEST_DEVICE == "cuda" else [])
    tried = 0
    for dtype in dtypes:
        model = make_tiny_target("llama", dtype=dtype, attn="sdpa", seed=4)
        target = TargetModel(model, cpu_kernels=False)
        rng = np.random.default_rng(0)
        prompt = torch.tensor([rng.integers(3, 300, size=21).tolist()], device=target.device)
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 11)]
        tree = Tree.build(rng.integers(3, 300, size=11).tolist(), parents)
        outs = {}
        for backend in _sdpa_backends_here(TEST_DEVICE, dtype):
            with sdpa_kernel([backend, SDPBackend.MATH]):
                got = []
                for static in (False, True):
                    cache = target.new_cache(256)
                    positions = torch.arange(21, device=target.device)[None]
                    target.forward(prompt, positions, cache)
                    if static:
                        padded = StaticVerifier(target, cache, 11, graphs=False, buckets=(16,))
                        got.append(padded.forward(tree)[0].float())
                    else:
                        got.append(verify_tree(target, cache, tree)[0].float())
                outs[backend] = got
        reference = outs.pop(SDPBackend.MATH)
        # bf16: a few units of its resolution at the logits' scale (a padded forward and a
        # backend's kernel round differently, and six random layers compound it).
        scale = float(reference[0].abs().max())
        tol = 1e-4 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps * max(scale, 1.0)
        torch.testing.assert_close(reference[1], reference[0], rtol=0, atol=tol)
        for backend, got in outs.items():
            for out, want in zip(got, reference, strict=True):
                torch.testing.assert_close(out, want, rtol=0, atol=tol, msg=str(backend))
            tried += 1
    if not tried:
        pytest.skip(f"only the math SDPA backend runs on {TEST_DEVICE}: nothing to compare")


def test_decoding_pins_cudnn_attention_out_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On cuda, decoding's attention (the target's forward, the heads' layers, the static
    path's graphs) runs with cuDNN's SDPA off (a plan per new sequence length, 50-60 ms
    each on Hopper) and the flash, memory-efficient and math kernels on; on the CPU PyTorch's
    own choice stays; and the target's forward and the head's attention enter it."""
    import dart_client.models.head as head_module
    import dart_client.models.target as target_module
    from dart_client.models.attention import decoding_sdpa
    from dart_client.models.head import DartHead

    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.math_sdp_enabled())
    with decoding_sdpa(torch.device("cuda", 0)):
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled()
        assert cuda.math_sdp_enabled()
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.math_sdp_enabled()) == before
    with decoding_sdpa(torch.device("cpu")):
        assert cuda.cudnn_sdp_enabled() == before[0]

    entered: list[str] = []

    def recording(device: torch.device) -> Any:
        entered.append(device.type)
        return decoding_sdpa(device)

    monkeypatch.setattr(target_module, "decoding_sdpa", recording)
    monkeypatch.setattr(head_module, "decoding_sdpa", recording)
    model = make_tiny_target("llama", seed=3, device="cpu")
    target = TargetModel(model, cpu_kernels=False)
    cache = target.new_cache(16)
    target.forward(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], cache)
    assert entered == ["cpu"]
    head = DartHead.random_init(model.config, draft_length=3, seed=1).double()
    head.bind_embedding(model.get_input_embeddings())
    head(torch.zeros(1, 2, 3 * 64, dtype=torch.float64), torch.tensor([[5, 6]]), head.new_cache(8))
    assert entered == ["cpu", "cpu"]
