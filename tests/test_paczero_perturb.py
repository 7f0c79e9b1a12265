"""Seeded directions, θ ± εz, per-example two-point differences, update and memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax.paczero import (
    apply_directions,
    clip_differences,
    direction,
    direction_keys,
    per_example_losses,
    perturbed,
    two_point_differences,
)

# One jitted two-point function and one batch shape are shared by the tests: compilation, not
# arithmetic, dominates their run time.
two_point = jax.jit(two_point_differences, static_argnums=(0, 6))
losses = jax.jit(per_example_losses, static_argnums=(0, 4))
N = 8


def params():
    return {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 10,
            "b": jnp.ones((3,), jnp.float32), "n": jnp.array(3, jnp.int32)}


def quad_loss(trainable, frozen, ex):
    d = trainable["w"] - ex["x"] * frozen
    return 0.5 * jnp.sum(d * d) + jnp.sum(trainable["b"] * ex["x"][0])


def test_direction_regenerates_per_leaf_from_the_key(key):
    p = params()
    z1, z2 = direction(key, p), direction(key, p)
    leaves = jax.tree.leaves(p)
    for i, (a, b, leaf) in enumerate(zip(jax.tree.leaves(z1), jax.tree.leaves(z2), leaves,
                                         strict=True)):
        np.testing.assert_array_equal(a, b)
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            want = jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32)
            np.testing.assert_array_equal(a, want)
        else:
            assert int(a) == 0  # integer buffers are never perturbed
    other = direction(jax.random.fold_in(key, 1), p)
    assert not np.allclose(z1["w"], other["w"])


def test_direction_keys_depend_only_on_step(key):
    a = direction_keys(key, 5, 3)
    b = direction_keys(key, 5, 3)
    c = direction_keys(key, 6, 3)
    assert a.shape == (3,)
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
    assert not np.array_equal(jax.random.key_data(a), jax.random.key_data(c))
    want = jax.random.fold_in(jax.random.fold_in(key, 5), 2)
    np.testing.assert_array_equal(jax.random.key_data(a[2]), jax.random.key_data(want))


def test_perturbed_is_theta_plus_scaled_z_and_keeps_dtypes(key):
    p = {"w": jnp.ones((4, 4), jnp.bfloat16), "v": jnp.zeros((3,), jnp.float32)}
    z = direction(key, {"w": jnp.ones((4, 4), jnp.float32), "v": p["v"]})
    out = perturbed(p, key, 0.5)
    assert out["w"].dtype == jnp.bfloat16 and out["v"].dtype == jnp.float32
    np.testing.assert_array_equal(out["v"], 0.5 * z["v"])
    np.testing.assert_array_equal(out["w"], (1.0 + 0.5 * z["w"]).astype(jnp.bfloat16))
    np.testing.assert_array_equal(p["w"], jnp.ones((4, 4), jnp.bfloat16))  # θ untouched


def test_two_point_difference_is_exact_on_a_quadratic(key):
    # ℓ_i(θ) quadratic ⇒ the central difference equals the directional derivative ⟨∇ℓ_i, z⟩.
    p = params()
    x = jax.random.normal(key, (N, 2, 3), jnp.float32)
    g = two_point(quad_loss, p, jnp.float32(1.0), {"x": x}, key, 1e-2, None)
    z = direction(key, p)
    w, b = np.asarray(p["w"], np.float64), np.asarray(p["b"], np.float64)
    zw, zb = np.asarray(z["w"], np.float64), np.asarray(z["b"], np.float64)
    want = [np.sum((w - xi) * zw) + np.sum(zb * xi[0]) for xi in np.asarray(x, np.float64)]
    assert g.dtype == jnp.float32 and g.shape == (N,)
    np.testing.assert_allclose(g, want, rtol=2e-3, atol=2e-3)
    del b


def test_microbatching_with_padding_matches_one_pass(key):
    p = params()
    x = jax.random.normal(key, (N, 2, 3), jnp.float32)
    full = losses(quad_loss, p, jnp.float32(1.0), {"x": x}, None)
    chunked = losses(quad_loss, p, jnp.float32(1.0), {"x": x}, 3)  # 3 chunks, last one padded
    assert chunked.shape == (N,)
    want = [quad_loss(p, 1.0, {"x": xi}) for xi in x]
    np.testing.assert_allclose(full, want, rtol=1e-6)
    np.testing.assert_allclose(chunked, full, rtol=1e-6)
    with pytest.raises(ValueError, match="same leading"):
        per_example_losses(quad_loss, p, 1.0, {"x": x, "y": jnp.zeros(3)})


def test_bf16_weights_give_float32_differences(key):
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a,
                     params())

    def loss(tr, fr, ex):
        return jnp.sum(tr["w"] * ex["x"]).astype(jnp.bfloat16)

    x = jax.random.normal(key, (N, 2, 3), jnp.float32).astype(jnp.bfloat16)
    g = two_point(loss, p, None, {"x": x}, key, 1e-1, None)
    assert g.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(g)))


def test_clip_and_nonfinite_handling(key):
    g = jnp.array([-30.0, -2.0, 0.0, 5.0, 40.0], jnp.float32)
    np.testing.assert_array_equal(clip_differences(g, 25.0), [-25.0, -2.0, 0.0, 5.0, 25.0])

    def loss(tr, fr, ex):
        return jnp.log(ex["x"]) * jnp.sum(tr["w"])

    out = two_point(loss, params(), None, {"x": jnp.array([-1.0, 1.0])}, key, 1e-3, None)
    assert float(out[0]) == 0.0 and np.isfinite(float(out[1]))


def test_apply_directions_is_mean_of_signed_directions(key):
    p = params()
    keys = direction_keys(key, 0, 3)
    coeffs = jnp.array([1.0, -1.0, 1.0], jnp.float32)
    out = apply_directions(p, keys, coeffs, jnp.float32(0.1))
    zs = [direction(k, p) for k in keys]
    for name in ("w", "b"):
        want = np.asarray(p[name]) - 0.1 * sum(
            c * np.asarray(z[name]) for c, z in zip([1, -1, 1], zs, strict=True)) / 3
        np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-6)
    assert int(out["n"]) == 3


def test_zo_step_memory_keeps_no_activations(key):
    # Backprop keeps every layer's activations (batch x width x depth); a ZO step keeps none,
    # so its temporary memory must not grow with the batch beyond one layer's activations.
    width, depth = 128, 4
    p = {f"l{i}": jnp.zeros((width, width), jnp.float32) for i in range(depth)}
    param_bytes = depth * width * width * 4

    def loss(tr, fr, ex):
        h = ex["x"]
        for i in range(depth):
            h = jnp.tanh(h @ tr[f"l{i}"])
        return jnp.sum(h)

    def temp(batch):
        data = {"x": jnp.ones((batch, width), jnp.float32)}
        zo = jax.jit(lambda tr: two_point_differences(loss, tr, None, data, key, 1e-3))
        return zo.lower(p).compile().memory_analysis().temp_size_in_bytes

    small = temp(8)
    grown = temp(512) - small
    activations = 512 * width * 4 * depth  # what backprop would keep at batch 512
    assert grown <= 0.5 * activations, (grown, activations)
    # One transient perturbed copy (θ + εz, overwritten by θ − εz) and no leaf-sized random-bit
    # buffers: well under two copies of θ on top of θ itself, never O(batch).
    assert small <= 2.0 * param_bytes, small / param_bytes


def test_fused_normal_is_bit_identical_to_jax(key):
    # The fused threefry sampler must draw exactly jax.random.normal's numbers (same z for the
    # same public key), for odd multi-dimensional shapes and for other key kinds (fallback).
    from pavejax.paczero.perturb import _normal

    for k, shape in [(key, (33, 65)), (jax.random.fold_in(key, 9), (7,)),
                     (jax.random.key(0, impl="rbg"), (4, 5))]:
        np.testing.assert_array_equal(_normal(k, shape),
                                      jax.random.normal(k, shape, jnp.float32))
