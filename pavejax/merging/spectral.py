"""Spectral merge operators on 2-D leaves: TSV-M (task singular vectors).

Same signature and tracing rules as :mod:`pavejax.merging.operators`:
``op(base, task_vectors, *, <keywords>)`` with stacked task vectors (leaves of shape
(T, *leaf.shape)) or a list of pytrees; returns merged parameters. ``scaling`` may be traced
(jit, vmap).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pavejax.merging.operators import _stacked, apply_task_vector

PyTree = Any


def _polar(x: jax.Array) -> jax.Array:
    """Orthogonal polar factor ``P Q^T`` of ``x = P S Q^T``."""
    p, _, qt = jnp.linalg.svd(x, full_matrices=False)
    return p @ qt


@jax.jit
def _tsv_leaf(taus: jax.Array) -> jax.Array:
    t, m, n = taus.shape
    r = min(m, n)
    k = r // t
    u, s, vt = jnp.linalg.svd(taus.astype(jnp.float32), full_matrices=False)  # (T,m,r) (T,r)
    u_cat = jnp.zeros((m, r), jnp.float32)
    s_cat = jnp.zeros((r,), jnp.float32)
    v_cat = jnp.zeros((r, n), jnp.float32)
    for i in range(t):  # task i fills block [i k, (i + 1) k) of the zero-initialised factors
        u_cat = u_cat.at[:, i * k:(i + 1) * k].set(u[i, :, :k])
        s_cat = s_cat.at[i * k:(i + 1) * k].set(s[i, :k])
        v_cat = v_cat.at[i * k:(i + 1) * k, :].set(vt[i, :k, :])
    return (_polar(u_cat) * s_cat[None, :]) @ _polar(v_cat)


def tsv_m(base: PyTree, task_vectors: PyTree, *, scaling: float | jax.Array = 1.0) -> PyTree:
    """TSV-M (fusion_bench ``compute_and_sum_svd_mem_reduction``), per 2-D leaf (m, n).

    Each task keeps its top ``k = min(m, n) // T`` singular triplets, placed in task blocks of
    zero-initialised (m, r), (r,) and (r, n) factors; U and V^T are replaced by their
    orthogonal polar factors; ``tau_m = U_perp diag(S) V_perp^T``. Other leaves get the mean
    of the task vectors. Result ``w0 + scaling * tau_m`` (default 1.0). SVDs run in float32;
    the operator is transpose-equivariant, so kernel layout does not matter. A leaf with
    ``min(m, n) < T`` keeps no component (k = 0) and stays at w0.
    """
    tvs = _stacked(base, task_vectors)

    def leaf(t: jax.Array) -> jax.Array:
        return _tsv_leaf(t) if t.ndim == 3 else jnp.mean(t, 0)

    return apply_task_vector(base, jax.tree.map(leaf, tvs), scaling)

