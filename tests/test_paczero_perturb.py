"""Seeded directions, θ ± εz, per-example two-point differences, update and memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax.paczero import (
    ZOConfig,
    apply_directions,
    clip_differences,
    direction,
    direction_keys,
    init,
    mirror_point,
    per_example_losses,
    perturbed,
    pseudo_gradient,
    step,
    two_point_differences,
    update_from_mirror,
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
    # Same-shaped leaves are drawn together (one lax.map per shape): still leaf by leaf.
    many = {"big": jnp.zeros((8, 8)), **{f"s{j}": jnp.zeros((2, 3)) for j in range(3)}}
    for i, z in enumerate(jax.tree.leaves(jax.jit(direction)(key, many))):
        shape = jax.tree.leaves(many)[i].shape
        np.testing.assert_array_equal(
            z, jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32))


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


def _mlp(width=128, depth=4):
    p = {f"l{i}": jnp.zeros((width, width), jnp.float32) for i in range(depth)}

    def loss(tr, fr, ex):
        h = ex["x"]
        for i in range(depth):
            h = jnp.tanh(h @ tr[f"l{i}"])
        return jnp.sum(h)

    return p, loss


def _bytes(compiled):
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)


def test_zo_step_memory_is_inference_plus_one_copy(key):
    # Backprop keeps every layer's activations (batch x width x depth); a ZO step keeps none.
    # The whole jitted step with its state donated (θ + εz drawn in the loop, the forward,
    # the mirror written over it in place, the forward, the update over θ's buffers) needs
    # inference memory plus one copy of θ, and never a second copy.
    width, depth, batch = 128, 4, 64
    p, loss = _mlp(width, depth)
    param_bytes = depth * width * width * 4
    data = {"x": jnp.ones((batch, width))}

    def forward(b):
        return jax.jit(lambda tr, d: per_example_losses(loss, tr, None, d)).lower(
            p, {"x": jnp.ones((b, width))}).compile()

    grown = forward(512).memory_analysis().temp_size_in_bytes - \
        forward(8).memory_analysis().temp_size_in_bytes
    assert grown <= 0.5 * 512 * width * 4 * depth, grown  # what backprop would keep
    inference = _bytes(forward(batch))
    cfg = ZOConfig("mezo", steps=10, learning_rate=1e-3)
    state = init(cfg, p, batch, key=key, public_key=jax.random.key(7))
    compiled = jax.jit(lambda s, d, k: step(cfg, loss, s, d, k), donate_argnums=0).lower(
        state, data, key).compile()
    assert compiled.memory_analysis().alias_size_in_bytes >= param_bytes  # θ updated in place
    assert _bytes(compiled) <= inference + 1.1 * param_bytes, (_bytes(compiled), inference)


def test_step_update_is_the_mirror_update_of_two_point_differences(key):
    # The pure step's MeZO update equals the one-function pieces composed by hand: the
    # two-point differences at the step's public key, their pool mean, update_from_mirror.
    p, loss = _mlp(16, 2)
    p = jax.tree.map(lambda a: a + 0.1, p)
    x = jax.random.normal(key, (N, 16), jnp.float32)
    cfg = ZOConfig("mezo", steps=4, learning_rate=0.05, perturbation_scale=1e-2, l2_clip=1e9)
    state = init(cfg, p, N, key=key, public_key=jax.random.key(3))
    out, _, stats = jax.jit(lambda s, k: step(cfg, loss, s, {"x": x}, k))(state, key)
    z_key = direction_keys(jax.random.key(3), 0, 1)[0]
    g, mirror = two_point_differences(loss, p, None, {"x": x}, z_key, 1e-2, return_mirror=True)
    np.testing.assert_allclose(stats["release"][0], jnp.mean(g), rtol=1e-5)
    want = update_from_mirror(p, mirror, jnp.mean(g), jnp.float32(0.05), jnp.float32(1e-2))
    for a, b in zip(jax.tree.leaves(out.trainable), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(mirror["l0"], perturbed(p, z_key, -1e-2)["l0"], atol=1e-7)


def test_update_from_mirror_follows_the_regenerated_direction(key):
    # (θ − mirror)/ε equals z up to float rounding, so the cheap update equals the one that
    # draws z again, to a relative error far below the step itself.
    p = {"w": jax.random.normal(key, (64, 32), jnp.float32) * 0.05,
         "b": jnp.ones((32,), jnp.float32), "n": jnp.array(3, jnp.int32)}
    k = direction_keys(key, 7, 1)
    eps, lr, y = jnp.float32(1e-3), jnp.float32(1e-2), jnp.array([-1.0], jnp.float32)
    mirror = mirror_point(p, perturbed(p, k[0], eps))
    cheap = update_from_mirror(p, mirror, y, lr, eps)
    exact = apply_directions(p, k, y, lr)
    for name in ("w", "b"):
        step = np.asarray(exact[name]) - np.asarray(p[name])
        err = np.abs(np.asarray(cheap[name]) - np.asarray(exact[name]))
        assert err.max() <= 2e-3 * np.abs(step).max(), name
    assert int(cheap["n"]) == 3


def test_donated_step_is_bit_identical_to_the_undonated_one(key):
    # Donation only recycles buffers: three steps with a donating jit and a plain jit of the
    # same step give the same bits, for K = 1 (mirror update) and K = 2 (regenerated z).
    p, loss = _mlp(16, 2)
    x = jax.random.normal(key, (N, 16), jnp.float32)
    for k in (1, 2):
        cfg = ZOConfig("mezo", steps=3, learning_rate=0.05, l2_clip=10.0, num_directions=k)

        def one(s, kk, cfg=cfg):
            return step(cfg, loss, s, {"x": x}, kk)[0]

        trajectories = []
        for fn in (jax.jit(one, donate_argnums=0), jax.jit(one)):
            s = init(cfg, jax.tree.map(lambda a: a + 0.1, p), N, key=jax.random.key(8),
                     public_key=jax.random.key(7))  # donated with the state
            for t in range(3):
                s = fn(s, jax.random.fold_in(key, t))
            trajectories.append(jax.tree.map(np.asarray, s.trainable))
        for a, b in zip(*map(jax.tree.leaves, trajectories), strict=True):
            np.testing.assert_array_equal(a, b)
        assert not np.allclose(trajectories[0]["l0"], 0.1)


def test_pseudo_gradient_is_the_mean_signed_direction(key):
    p = params()
    keys = direction_keys(key, 5, 3)
    coeffs = jnp.array([0.5, -1.0, 2.0], jnp.float32)
    g = pseudo_gradient(p, keys, coeffs)
    zs = [direction(k, p) for k in keys]
    for name in ("w", "b"):
        want = sum(c * np.asarray(z[name]) for c, z in zip([0.5, -1.0, 2.0], zs, strict=True)) / 3
        np.testing.assert_allclose(g[name], want, rtol=1e-5, atol=1e-6)
    assert g["n"].dtype == jnp.int32 and int(g["n"]) == 0


def test_fused_normal_is_bit_identical_to_jax(key):
    # The fused threefry sampler must draw exactly jax.random.normal's numbers (same z for the
    # same public key), for odd multi-dimensional shapes and for other key kinds (fallback).
    from pavejax.paczero.perturb import _normal

    for k, shape in [(key, (33, 65)), (jax.random.fold_in(key, 9), (7,)),
                     (jax.random.key(0, impl="rbg"), (4, 5))]:
        np.testing.assert_array_equal(_normal(k, shape),
                                      jax.random.normal(k, shape, jnp.float32))
