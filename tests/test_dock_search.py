"""Exact cosine top-k search: NumPy reference, ties, streaming, sharding, bfloat16, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax.pave.search import (
    build_index,
    normalize_rows,
    search_index,
    sharded_top_k_cosine,
    top_k_cosine,
)
from pavejax.privacy import data_mesh


def reference(matrix, queries, k):
    """Slow NumPy float64 reference: full stable sort by (-cos, row index)."""
    m = np.asarray(matrix, np.float64)
    q = np.atleast_2d(np.asarray(queries, np.float64))
    mn = np.linalg.norm(m, axis=1)
    cos = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ m.T
    cos = np.where(mn > 0, cos / np.where(mn > 0, mn, 1.0), 0.0)
    idx = np.stack([np.lexsort((np.arange(m.shape[0]), -row))[:k] for row in cos])
    return np.take_along_axis(cos, idx, axis=1), idx


def random_case(n=203, d=48, q=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)).astype(np.float32),
            rng.standard_normal((q, d)).astype(np.float32))


def with_ties(matrix):
    m = matrix.copy()
    m[50] = 2.0 * m[7]       # same direction as row 7: equal cosine, must come after it
    m[120] = 0.5 * m[7]
    m[9] = 0.0               # zero row: cosine 0 with everything
    return m


def test_dense_matches_numpy_reference():
    m, q = random_case()
    cos, idx = top_k_cosine(m, q, 7)
    ref_cos, ref_idx = reference(m, q, 7)
    assert cos.shape == idx.shape == (4, 7) and idx.dtype == np.int64
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(cos, ref_cos, atol=2e-6)


def test_hand_computed_ties_go_to_lower_index():
    e1, e2 = np.eye(3, dtype=np.float32)[:2]
    m = np.stack([e1, e2, 2 * e1, -e1, np.zeros(3, np.float32)])
    cos, idx = top_k_cosine(m, e1, 5)
    np.testing.assert_array_equal(idx, [[0, 2, 1, 4, 3]])
    np.testing.assert_allclose(cos, [[1, 1, 0, 0, -1]], atol=1e-7)


def test_k_larger_than_n_is_clipped():
    m, q = random_case(n=5)
    cos, idx = top_k_cosine(m, q, 50)
    assert idx.shape == (4, 5)
    np.testing.assert_array_equal(np.sort(idx, axis=1), np.tile(np.arange(5), (4, 1)))


@pytest.mark.parametrize("chunk_size", [1, 16, 64, 203, 1000])
def test_chunked_equals_unchunked(chunk_size):
    m, q = random_case()
    m = with_ties(m)
    q[0] = m[7]
    dense = top_k_cosine(m, q, 9)
    chunked = top_k_cosine(m, q, 9, chunk_size=chunk_size)
    np.testing.assert_array_equal(chunked[1], dense[1])
    np.testing.assert_allclose(chunked[0], dense[0], atol=1e-6)
    np.testing.assert_array_equal(dense[1], reference(m, q, 9)[1])
    assert list(dense[1][0, :3]) == [7, 50, 120]


def test_streams_from_a_memmap_and_over_the_memory_budget(tmp_path):
    m, q = random_case(n=300)
    mm = np.memmap(tmp_path / "specs.f32", np.float32, "w+", shape=m.shape)
    mm[:] = m
    mm.flush()
    ro = np.memmap(tmp_path / "specs.f32", np.float32, "r", shape=m.shape)
    index = build_index(ro, memory_budget=m.nbytes // 3)
    assert index.placement == "stream" and index.chunk_size < 300
    assert isinstance(index.rows, np.memmap)          # no host copy of a float32 memmap
    cos, idx = search_index(index, q, 6)
    np.testing.assert_array_equal(idx, reference(m, q, 6)[1])


def test_sharded_equals_unsharded_on_8_devices():
    assert jax.device_count() == 8
    m, q = random_case(n=203)                        # 203 rows: not a multiple of 8
    m = with_ties(m)
    q[1] = m[7]
    mesh = data_mesh()
    for k in (1, 30, 203):                           # 30 > 203 / 8 rows per shard
        cos, idx = sharded_top_k_cosine(m, q, k, mesh)
        dense = top_k_cosine(m, q, k)
        np.testing.assert_array_equal(idx, dense[1])
        np.testing.assert_allclose(cos, dense[0], atol=1e-6)
    index = build_index(m, mesh=mesh)
    assert index.placement == "sharded" and len(index.rows.sharding.device_set) == 8


def test_bfloat16_storage_is_close_and_halves_the_bytes():
    m, q = random_case(n=300, d=64)
    dense = build_index(m)
    half = build_index(m, dtype="bfloat16")
    assert half.rows.dtype == jnp.bfloat16
    assert half.rows.nbytes * 2 == dense.rows.nbytes
    c32, i32 = search_index(dense, q, 10)
    c16, i16 = search_index(half, q, 10)
    assert c16.dtype == np.float32
    # bf16 keeps 8 mantissa bits: each rounded product errs by ~2**-9 relative
    np.testing.assert_allclose(c16, c32, atol=2e-2)
    np.testing.assert_array_equal(i16[:, 0], i32[:, 0])
    one_c, one_i = search_index(half, q[2], 10)          # a single query takes another path
    assert one_i.shape == (1, 10)
    np.testing.assert_array_equal(one_i[0], i16[2])
    np.testing.assert_allclose(one_c[0], c16[2], atol=1e-6)


def test_repeated_search_reuses_the_device_matrix():
    m, q = random_case()
    index = build_index(m)
    assert isinstance(index.rows, jax.Array) and index.placement == "dense"
    a = search_index(index, q, 3)
    b = search_index(index, q[:1], 3)
    np.testing.assert_array_equal(a[1][:1], b[1])


def test_normalize_rows_numpy_and_jax():
    x = np.array([[3.0, 4.0], [0.0, 0.0], [-1.0, 0.0]], np.float32)
    want = np.array([[0.6, 0.8], [0.0, 0.0], [-1.0, 0.0]], np.float32)
    np.testing.assert_allclose(normalize_rows(x), want, rtol=1e-6)
    out = normalize_rows(jnp.asarray(x))
    assert isinstance(out, jax.Array)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


def test_bad_inputs_are_refused_with_messages():
    m, q = random_case(n=20, d=8)
    bad = m.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN/inf entries in rows"):
        build_index(bad)
    index = build_index(m)
    nan_q = q.copy()
    nan_q[0, 0] = np.inf
    with pytest.raises(ValueError, match="queries contain NaN"):
        search_index(index, nan_q, 2)
    with pytest.raises(ValueError, match="all zeros"):
        search_index(index, np.zeros(8, np.float32), 2)
    with pytest.raises(ValueError, match=r"shape \(Q, 8\)"):
        search_index(index, np.ones(9, np.float32), 2)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        search_index(index, q, 0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_index(m, dtype="float16")
    with pytest.raises(ValueError, match="not both"):
        build_index(m, chunk_size=4, mesh=data_mesh())
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        build_index(m, chunk_size=0)
    with pytest.raises(TypeError, match="must be floating"):
        build_index(m.astype(np.int32))
