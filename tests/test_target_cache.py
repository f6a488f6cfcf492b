"""The target's preallocated K/V cache: tree compaction, stacked and per layer."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_client.models.target import TargetCache


def fill(cache: TargetCache, kv_shapes: list[tuple[int, int]], n: int, seed: int) -> list:
    """Append ``n`` positions of random K/V to every layer; returns each layer's (K, V)."""
    g = torch.Generator().manual_seed(seed)
    written = []
    for layer, (heads, dim) in zip(cache.layers, kv_shapes, strict=True):
        k = torch.randn((1, heads, n, dim), generator=g, dtype=torch.float64)
        v = torch.randn((1, heads, n, dim), generator=g, dtype=torch.float64)
        layer.update(k, v)
        written.append((k, v))
    return written


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    prefix=st.integers(0, 12),
    tree=st.integers(1, 16),
    uniform=st.booleans(),
    stacked=st.booleans(),
)
def test_keep_moves_the_accepted_nodes_in_every_layer(
    data: st.DataObject, prefix: int, tree: int, uniform: bool, stacked: bool
) -> None:
    layers = 4
    # A layer with other K/V heads sends the whole cache to per-layer compaction.
    shapes = [(3, 8)] * layers if uniform else [(3, 8), (3, 8), (2, 8), (3, 8)]
    cache = TargetCache(layers, capacity=prefix + tree + 3, stacked=stacked)
    before = fill(cache, shapes, prefix, seed=1)
    nodes = fill(cache, shapes, tree, seed=2)
    kept = sorted(data.draw(st.sets(st.integers(0, tree - 1), min_size=1, max_size=tree)))
    cache.keep(prefix, kept, torch.device("cpu"))

    assert cache.length == prefix + len(kept)
    if stacked:
        assert cache.storage is not None and cache.storage.complete is uniform
    else:
        assert cache.storage is None
    for layer, (k0, v0), (k1, v1) in zip(cache.layers, before, nodes, strict=True):
        want_k = torch.cat((k0, k1[:, :, kept]), dim=2)
        want_v = torch.cat((v0, v1[:, :, kept]), dim=2)
        assert torch.equal(layer.keys, want_k)
        assert torch.equal(layer.values, want_v)


def test_stacked_layers_share_one_block() -> None:
    cache = TargetCache(3, capacity=10)
    fill(cache, [(2, 4)] * 3, 5, seed=0)
    block = cache.storage.block
    assert block is not None and block.shape == (3, 2, 1, 2, 10, 4)
    for i, layer in enumerate(cache.layers):
        assert layer._k.data_ptr() == block[i, 0].data_ptr()
        assert layer._v.data_ptr() == block[i, 1].data_ptr()


def test_values_of_another_width_keep_their_own_buffers() -> None:
    cache = TargetCache(2, capacity=6)
    for layer in cache.layers:
        layer.update(torch.zeros((1, 2, 3, 4)), torch.ones((1, 2, 3, 5)))
    assert cache.storage.block is None and not cache.storage.complete
    cache.keep(0, [0, 2], torch.device("cpu"))
    assert cache.length == 2
    assert torch.equal(cache.layers[1].values, torch.ones((1, 2, 2, 5)))


def test_a_target_on_one_device_stacks_its_cache() -> None:
    from conftest import make_tiny_target

    from dart_client.models.target import TargetModel

    target = TargetModel(make_tiny_target("llama", layers=4).to("cpu"), cpu_kernels=False)
    try:
        assert target.layer_devices() == {torch.device("cpu")}
        assert target.new_cache(8).storage is not None
        # Layers spread over devices (a device map): no block, one buffer per layer.
        two = {torch.device("cpu"), torch.device("meta")}
        target.layer_devices = lambda: two  # type: ignore[method-assign]
        assert target.new_cache(8).storage is None
    finally:
        target.close()
