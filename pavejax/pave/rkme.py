"""RKME: the reduced kernel mean embedding specification (the learnware baseline).

The kernel mean embedding of a data set ``X = {x_1..x_n}`` under the RBF kernel
``k(x, y) = exp(-gamma ||x - y||^2)`` is ``Phi = (1/n) sum_i k(x_i, .)``. RKME summarises it by a
reduced set ``Phi~ = sum_j beta_j k(z_j, .)`` of ``m`` points, fit by minimising

    ||Phi~ - Phi||_H^2 = beta^T K_ZZ beta - 2 beta^T K_ZX 1/n + const,

alternating the two blocks as the learnware package's ``RKMETableSpecification`` does (same
defaults: gamma=0.1, m=100, 3 alternating steps, Z step size 0.1):

1. ``Z`` initialised by k-means (k-means++ seeding from ``config.seed``, then Lloyd iterations);
2. ``beta`` by the simplex-constrained QP ``min 1/2 b^T K_ZZ b - c^T b, b >= 0, 1^T b = 1`` with
   ``c = K_ZX 1/n`` (:func:`solve_simplex_qp`: FISTA with adaptive restart and a sort-based
   simplex projection, in float64), or by the package's closed form
   ``(K_ZZ + 1e-5 I)^{-1} c`` when ``nonnegative_beta=False`` (then ``beta`` need not sum to 1);
3. ``steps`` times: one gradient step on ``Z`` (step ``step_size``), then ``beta`` again.

Identification ranks specs by ``MMD^2(Phi~_1, Phi~_2) = b1 K11 b1 - 2 b1 K12 b2 + b2 K22 b2``
(:func:`mmd2`, :func:`mmd2_matrix`; smaller is more similar, :func:`similarity_scores` returns
``-MMD^2``).

Deliberate differences from the package: the Z step uses the exact gradient of the objective
(the package's hand-written gradient halves the Z-Z term); k-means is full-batch Lloyd in JAX
rather than scikit-learn's MiniBatchKMeans; data with NaN/inf is refused rather than
mean-imputed. When ``n <= reduced_size`` no reduction is possible: the spec is the exact
empirical embedding ``Z = X``, ``beta = 1/n`` (MMD^2 to the data is 0), i.e. ``m`` is clipped
to ``n``.

Text: pass L2-normalised sentence embeddings, e.g. :func:`pavejax.models.sentence_embedding`
(all-MiniLM-L6-v2 mean pooling then L2 normalisation, as sentence-transformers does). On unit
vectors ``||x - y||^2 <= 4`` so with gamma=0.1 every kernel value lies in ``[e^-0.4, 1]``: a wide
kernel whose MMD^2 values are small (about 1e-3), which is why distances use HIGHEST matmul
precision (no TF32) and the QP runs in float64.

Sharp edges: RKME carries no differential-privacy guarantee. With ``n <= reduced_size`` ``Z``
*is* the data; with ``n > reduced_size`` a k-means cluster holding one point starts at that
point and the small Z steps move it only slightly, so ``Z`` can sit next to raw examples.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "RKMEConfig",
    "RKMESpec",
    "SimplexQPResult",
    "fit_rkme",
    "mmd2",
    "mmd2_matrix",
    "mmd2_to_data",
    "project_simplex",
    "rbf_kernel",
    "similarity_scores",
    "solve_simplex_qp",
]

FORMAT = "pavejax.rkme/1"
_HI = jax.lax.Precision.HIGHEST  # TF32 matmuls would swamp MMD^2 values of order 1e-3
_RIDGE = 1e-5  # the package's ridge in the closed-form beta


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_float(name: str, value: Any, *, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class RKMEConfig:
    """How to fit an RKME spec; the defaults are the learnware package's.

    Attributes:
      gamma: RBF bandwidth in ``exp(-gamma ||x - y||^2)`` (units: 1 / squared feature units).
      reduced_size: ``m``, the number of reduced-set points (clipped to ``n``).
      steps: alternating (Z step, beta solve) rounds after the initial beta solve.
      step_size: gradient step on ``Z``.
      nonnegative_beta: beta on the simplex by QP (True) or the ridge closed form (False).
      seed: k-means++ seeding seed; fitting is deterministic given it.
      kmeans_iters: Lloyd iterations after seeding.
      qp_tol: stop the QP when the gradient mapping's max-norm is below this.
      qp_max_iter: cap on QP iterations.
    """

    gamma: float = 0.1
    reduced_size: int = 100
    steps: int = 3
    step_size: float = 0.1
    nonnegative_beta: bool = True
    seed: int = 0
    kmeans_iters: int = 20
    qp_tol: float = 1e-9
    qp_max_iter: int = 20_000

    def __post_init__(self) -> None:
        _check_float("gamma", self.gamma, positive=True)
        _check_float("step_size", self.step_size, positive=False)
        _check_float("qp_tol", self.qp_tol, positive=True)
        _check_int("reduced_size", self.reduced_size, 1)
        _check_int("steps", self.steps, 0)
        _check_int("seed", self.seed, 0)
        _check_int("kmeans_iters", self.kmeans_iters, 0)
        _check_int("qp_max_iter", self.qp_max_iter, 1)
        if not isinstance(self.nonnegative_beta, bool):
            raise ValueError(f"nonnegative_beta must be a bool, got {self.nonnegative_beta!r}")


def _as_matrix(x: Any, what: str) -> np.ndarray:
    a = np.asarray(x)
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"{what} must hold real numbers, got dtype {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"{what} must be 2-D (n, d), got shape {a.shape}; flatten each "
                         f"example first, e.g. x.reshape(len(x), -1)")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"{what} is empty (shape {a.shape}); RKME needs at least one point "
                         f"with at least one feature")
    a = a.astype(np.float32)
    finite = np.isfinite(a)
    if not finite.all():
        row = int(np.argmin(finite.all(axis=1)))
        raise ValueError(f"{what} has {int(a.size - finite.sum())} NaN/inf entries (first in "
                         f"row {row}); RKME needs finite features: drop or impute those rows")
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class RKMESpec:
    """A fitted RKME: ``Phi~ = sum_j beta_j k(z_j, .)`` with ``k`` the RBF kernel of ``gamma``.

    Attributes:
      z: (m, d) float32 reduced-set points (read-only).
      beta: (m,) float32 weights; on the simplex when fit with ``nonnegative_beta=True``.
      gamma: RBF bandwidth; only specs with the same gamma and d are comparable.
      num_points: ``n``, the size of the data summarised (``m <= n``).
    """

    z: np.ndarray
    beta: np.ndarray
    gamma: float
    num_points: int

    def __post_init__(self) -> None:
        z = _as_matrix(self.z, "RKME z")
        beta = np.asarray(self.beta)
        if beta.shape != (z.shape[0],):
            raise ValueError(f"RKME beta must have shape ({z.shape[0]},) to match z, "
                             f"got {beta.shape}")
        beta = beta.astype(np.float32)
        if not np.isfinite(beta).all():
            raise ValueError("RKME beta has NaN/inf entries; refit the spec")
        _check_float("gamma", self.gamma, positive=True)
        _check_int("num_points", self.num_points, z.shape[0])
        for a in (z, beta):
            a.setflags(write=False)
        object.__setattr__(self, "z", z)
        object.__setattr__(self, "beta", beta)
        object.__setattr__(self, "gamma", float(self.gamma))

    @property
    def reduced_size(self) -> int:
        """``m``, the number of reduced-set points."""
        return self.z.shape[0]

    @property
    def dim(self) -> int:
        """``d``, the feature dimension."""
        return self.z.shape[1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe record (lists of floats; float32 values round-trip exactly)."""
        return {"format": FORMAT, "gamma": self.gamma, "num_points": self.num_points,
                "z": self.z.tolist(), "beta": self.beta.tolist()}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> RKMESpec:
        """Inverse of :meth:`to_dict`; validates the record."""
        if obj.get("format") != FORMAT:
            raise ValueError(f"not an RKME record: format {obj.get('format')!r}, "
                             f"expected {FORMAT!r}")
        missing = {"gamma", "num_points", "z", "beta"} - set(obj)
        if missing:
            raise ValueError(f"RKME record lacks fields {sorted(missing)}")
        return cls(np.asarray(obj["z"], np.float32), np.asarray(obj["beta"], np.float32),
                   obj["gamma"], obj["num_points"])


def rbf_kernel(x: jax.Array, y: jax.Array, gamma: float | jax.Array) -> jax.Array:
    """``K[i, j] = exp(-gamma ||x_i - y_j||^2)``: (n, d), (m, d) -> (n, m), in ``x``'s dtype.

    Squared distances are expanded with a HIGHEST-precision matmul and clamped at 0. Jittable.
    """
    sq = (jnp.sum(x * x, axis=1)[:, None] + jnp.sum(y * y, axis=1)[None, :]
          - 2 * jnp.matmul(x, y.T, precision=_HI))
    return jnp.exp(-jnp.asarray(gamma, sq.dtype) * jnp.maximum(sq, 0))


def _quad(a: jax.Array, k: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum("i,ij,j->", a, k, b, precision=_HI)


def project_simplex(y: jax.Array) -> jax.Array:
    """Euclidean projection of ``y`` (m,) onto ``{x >= 0, sum x = 1}`` (sort-based, exact).

    ``x = max(y - tau, 0)`` with ``tau`` from the sorted cumulative sums. Jittable; dtype of ``y``.
    """
    u = jnp.sort(y)[::-1]
    css = jnp.cumsum(u)
    j = jnp.arange(1, y.shape[0] + 1, dtype=y.dtype)
    rho = jnp.sum(u - (css - 1) / j > 0)  # the condition holds on a prefix, never empty
    tau = (css[rho - 1] - 1) / rho.astype(y.dtype)
    return jnp.maximum(y - tau, 0)


class SimplexQPResult(NamedTuple):
    """Solution of :func:`solve_simplex_qp`: ``x`` (m,), objective value, final gradient-mapping
    max-norm (``residual``) and iterations used."""

    x: jax.Array
    objective: jax.Array
    residual: jax.Array
    iterations: jax.Array


def _top_eigenvalue_bound(a: jax.Array, squarings: int = 5) -> jax.Array:
    """An upper bound on the largest |eigenvalue| of symmetric ``a``, within a factor
    ``rank^(2^-(squarings+1))`` (1.075 for rank 100): the Schatten norm
    ``(tr a^(2p))^(1/2p) = ||a^p||_F^(1/p)`` with ``p = 2^squarings``, by repeated squaring with
    renormalisation. Used instead of ``eigvalsh``, which is slow on CPU for small matrices."""
    tiny = float(jnp.finfo(a.dtype).tiny)
    fro = jnp.maximum(jnp.linalg.norm(a), tiny)
    a, log_norm = a / fro, jnp.log(fro)
    for _ in range(squarings):
        a = jnp.matmul(a, a, precision=_HI)
        fro = jnp.maximum(jnp.linalg.norm(a), tiny)
        a, log_norm = a / fro, 2 * log_norm + jnp.log(fro)
    return jnp.exp(log_norm / 2**squarings)


@functools.partial(jax.jit, static_argnames=("max_iter",))
def solve_simplex_qp(k: jax.Array, c: jax.Array, *, tol: float = 1e-9,
                     max_iter: int = 20_000) -> SimplexQPResult:
    """``argmin_x 1/2 x^T K x - c^T x`` subject to ``x >= 0, 1^T x = 1``; ``K`` (m, m) PSD.

    FISTA with gradient-based adaptive restart. The step is ``1/L`` with ``L`` an upper bound
    (within 8% for m <= 100) on the top eigenvalue of ``P K P``, ``P`` the centring projector:
    the simplex projection ignores gradient components along the all-ones vector, so only
    ``P K P`` matters, and for kernel matrices (a big constant part) its top eigenvalue is far
    below ``K``'s. Stops when the gradient mapping ``L (y - x_next)`` has max-norm ``<= tol``
    or after ``max_iter`` iterations. Runs in the inputs' dtype: call under
    ``jax.enable_x64(True)`` with float64 inputs for tight tolerances. Jitted.
    """
    m = c.shape[0]
    if k.shape != (m, m):
        raise ValueError(f"K must be ({m}, {m}) to match c, got {k.shape}")
    dt = k.dtype
    p = jnp.eye(m, dtype=dt) - jnp.full((m, m), 1 / m, dt)
    lip = _top_eigenvalue_bound(jnp.matmul(p, jnp.matmul(k, p, precision=_HI), precision=_HI))
    lip = jnp.maximum(lip, float(jnp.finfo(dt).eps) * jnp.maximum(1, jnp.max(jnp.abs(k))))

    def step(s):
        x, y, t, it, _ = s
        grad = jnp.matmul(k, y, precision=_HI) - c
        x_next = project_simplex(y - grad / lip)
        res = lip * jnp.max(jnp.abs(y - x_next))
        t_next = (1 + jnp.sqrt(1 + 4 * t * t)) / 2
        restart = jnp.dot(y - x_next, x_next - x, precision=_HI) > 0
        y_next = jnp.where(restart, x_next, x_next + ((t - 1) / t_next) * (x_next - x))
        return x_next, y_next, jnp.where(restart, jnp.ones_like(t), t_next), it + 1, res

    x0 = jnp.full((m,), 1 / m, dt)
    init = (x0, x0, jnp.ones((), dt), jnp.zeros((), jnp.int32), jnp.full((), jnp.inf, dt))
    x, _, _, it, res = jax.lax.while_loop(lambda s: (s[3] < max_iter) & (s[4] > tol), step, init)
    obj = _quad(x, k, x) / 2 - jnp.dot(c, x, precision=_HI)
    return SimplexQPResult(x, obj, res, it)


@functools.partial(jax.jit, static_argnames=("m", "iters"))
def _kmeans(x: jax.Array, w: jax.Array, key: jax.Array, m: int, iters: int) -> jax.Array:
    """k-means++ seeding then Lloyd on weighted points (weight 0 marks padding): (m, d)."""
    valid = w > 0
    sqn = jnp.sum(x * x, axis=1)

    def sqdist(cs):  # (n, k)
        d = sqn[:, None] - 2 * jnp.matmul(x, cs.T, precision=_HI) + jnp.sum(cs * cs, axis=1)[None]
        return jnp.maximum(d, 0)

    keys = jax.random.split(key, m)
    uniform = jnp.where(valid, 0.0, -jnp.inf)
    first = jax.random.categorical(keys[0], uniform)
    centres = jnp.zeros((m, x.shape[1]), x.dtype).at[0].set(x[first])

    def seed(i, carry):
        cs, d2 = carry
        p = d2 * w
        # all remaining mass 0 (fewer distinct points than m): fall back to uniform picks
        logits = jnp.where(jnp.sum(p) > 0, jnp.log(p), uniform)
        pick = x[jax.random.categorical(keys[i], logits)]
        return cs.at[i].set(pick), jnp.minimum(d2, sqdist(pick[None])[:, 0])

    centres, _ = jax.lax.fori_loop(1, m, seed, (centres, sqdist(x[first][None])[:, 0]))

    def lloyd(_, cs):
        assign = jax.nn.one_hot(jnp.argmin(sqdist(cs), axis=1), m, dtype=x.dtype) * w[:, None]
        mass = jnp.sum(assign, axis=0)[:, None]
        sums = jnp.matmul(assign.T, x, precision=_HI)
        return jnp.where(mass > 0, sums / jnp.maximum(mass, float(jnp.finfo(x.dtype).tiny)), cs)

    return jax.lax.fori_loop(0, iters, lloyd, centres)


@functools.partial(jax.jit, static_argnames=("nonnegative", "max_iter"))
def _solve_beta(z, x, w, gamma, tol, *, nonnegative: bool, max_iter: int) -> jax.Array:
    kzz = rbf_kernel(z, z, gamma)
    c = jnp.matmul(rbf_kernel(z, x, gamma), w, precision=_HI)
    if nonnegative:
        return solve_simplex_qp(kzz, c, tol=tol, max_iter=max_iter).x
    return jnp.linalg.solve(kzz + _RIDGE * jnp.eye(z.shape[0], dtype=z.dtype), c)


def _objective(z, beta, x, w, gamma) -> jax.Array:
    """``||Phi~ - Phi||^2`` minus the constant ``w^T K_XX w``."""
    cross = jnp.matmul(rbf_kernel(z, x, gamma), w, precision=_HI)
    return _quad(beta, rbf_kernel(z, z, gamma), beta) - 2 * jnp.dot(beta, cross, precision=_HI)


@jax.jit
def _z_step(z, beta, x, w, gamma, step_size) -> jax.Array:
    return z - step_size * jax.grad(_objective)(z, beta, x, w, gamma)


def _beta_f64(z: jax.Array, x64: np.ndarray, w64: np.ndarray, cfg: RKMEConfig) -> np.ndarray:
    """The beta solve in float64 (cast back to float32): K_ZZ is nearly singular for wide
    kernels and the QP's optimality conditions need more than float32's 7 digits."""
    with jax.enable_x64(True):
        z64, x64, w64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (z, x64, w64))
        beta = _solve_beta(z64, x64, w64, cfg.gamma, cfg.qp_tol,
                           nonnegative=cfg.nonnegative_beta, max_iter=cfg.qp_max_iter)
        return np.asarray(beta).astype(np.float32)


def fit_rkme(x: Any, config: RKMEConfig = RKMEConfig()) -> RKMESpec:
    """Fit the RKME of data ``x`` (n, d) (see the module docstring for the algorithm).

    Returns an :class:`RKMESpec` with ``m = min(config.reduced_size, n)`` points; when
    ``n <= reduced_size`` it is the exact embedding ``Z = X``, ``beta = 1/n``. Deterministic given
    ``config.seed``. ``x`` is padded to a power-of-two row count (zero weight) so data sets of
    similar size share compiled code. Raises ``ValueError``/``TypeError`` for non-2-D, empty,
    non-numeric or non-finite data.
    """
    if not isinstance(config, RKMEConfig):
        raise TypeError(f"config must be an RKMEConfig, got {type(config).__name__}")
    xs = _as_matrix(x, "x")
    n = xs.shape[0]
    if n <= config.reduced_size:
        return RKMESpec(xs, np.full((n,), 1 / n, np.float32), config.gamma, n)
    n_pad = max(8, 1 << (n - 1).bit_length())
    x64 = np.pad(xs.astype(np.float64), ((0, n_pad - n), (0, 0)))
    w64 = np.where(np.arange(n_pad) < n, 1 / n, 0.0)
    xp, w = jnp.asarray(x64.astype(np.float32)), jnp.asarray(w64.astype(np.float32))
    z = _kmeans(xp, w, jax.random.key(config.seed), config.reduced_size, config.kmeans_iters)
    beta = _beta_f64(z, x64, w64, config)
    for _ in range(config.steps):
        z = _z_step(z, jnp.asarray(beta), xp, w, config.gamma, config.step_size)
        beta = _beta_f64(z, x64, w64, config)
    return RKMESpec(np.asarray(z), beta, config.gamma, n)


def _check_specs(specs: Sequence[RKMESpec], what: str) -> list[RKMESpec]:
    if isinstance(specs, RKMESpec) or not specs:
        raise ValueError(f"{what} must be a non-empty sequence of RKMESpec")
    for s in specs:
        if not isinstance(s, RKMESpec):
            raise TypeError(f"{what} must hold RKMESpec, got {type(s).__name__}")
    return list(specs)


def _stack(specs: list[RKMESpec]) -> tuple[jax.Array, jax.Array]:
    """Specs as (S, M, d) points and (S, M) weights, zero-weight padded to a common M (a power
    of two >= 8, so that markets of specs with various m share compiled code)."""
    big = max(8, 1 << (max(s.reduced_size for s in specs) - 1).bit_length())
    z = np.zeros((len(specs), big, specs[0].dim), np.float32)
    b = np.zeros((len(specs), big), np.float32)
    for i, s in enumerate(specs):
        z[i, :s.reduced_size], b[i, :s.reduced_size] = s.z, s.beta
    return jnp.asarray(z), jnp.asarray(b)


def _require_comparable(specs: Sequence[RKMESpec]) -> None:
    gammas = {s.gamma for s in specs}
    dims = {s.dim for s in specs}
    if len(gammas) > 1:
        raise ValueError(f"RKME specs with different gamma ({sorted(gammas)}) are not "
                         f"comparable: refit them with one RKMEConfig.gamma")
    if len(dims) > 1:
        raise ValueError(f"RKME specs of different feature dimensions ({sorted(dims)}) are not "
                         f"comparable: embed all data with the same feature extractor")


@jax.jit
def _mmd2_core(za, ba, zb, bb, gamma) -> jax.Array:
    def self_term(z, b):
        return _quad(b, rbf_kernel(z, z, gamma), b)

    n_b, m_b, d = zb.shape
    flat = zb.reshape(n_b * m_b, d)

    def cross_row(zb_row):  # one left spec against all right specs: (n_b,)
        z, b = zb_row
        kern = rbf_kernel(z, flat, gamma).reshape(z.shape[0], n_b, m_b)
        return jnp.einsum("i,ijk,jk->j", b, kern, bb, precision=_HI)

    cross = jax.lax.map(cross_row, (za, ba))
    return (jax.vmap(self_term)(za, ba)[:, None] - 2 * cross
            + jax.vmap(self_term)(zb, bb)[None, :])


def mmd2_matrix(user_specs: Sequence[RKMESpec], dev_specs: Sequence[RKMESpec]) -> jax.Array:
    """``MMD^2`` between every user spec and every developer spec: (n_users, n_devs) float32.

    ``>= 0`` up to float32 rounding (about 1e-7 for unit-scale kernels). One jitted call: specs
    of different ``m`` are zero-weight padded (exact: padded points carry weight 0), users are
    mapped sequentially and developers batched, so memory is ``O(m^2 n_devs)``. Raises
    ``ValueError`` for mixed gamma or dimension.
    """
    users, devs = _check_specs(user_specs, "user_specs"), _check_specs(dev_specs, "dev_specs")
    _require_comparable(users + devs)
    (za, ba), (zb, bb) = _stack(users), _stack(devs)
    return _mmd2_core(za, ba, zb, bb, users[0].gamma)


def mmd2(spec_a: RKMESpec, spec_b: RKMESpec) -> float:
    """``MMD^2 = b_a K_aa b_a - 2 b_a K_ab b_b + b_b K_bb b_b`` between two specs (symmetric)."""
    return float(mmd2_matrix([spec_a], [spec_b])[0, 0])


def similarity_scores(user_spec: RKMESpec, specs: Sequence[RKMESpec]) -> jax.Array:
    """``-MMD^2(user_spec, spec_i)`` for each spec: (n_specs,) float32, higher = more similar."""
    return -mmd2_matrix([user_spec], specs)[0]


@jax.jit
def _mmd2_to_data_core(z, beta, x, gamma) -> jax.Array:
    n = x.shape[0]
    w = jnp.full((n,), 1 / n, x.dtype)
    row_means = jax.lax.map(lambda xi: jnp.dot(rbf_kernel(xi[None], x, gamma)[0], w,
                                                precision=_HI), x, batch_size=256)
    return _objective(z, beta, x, w, gamma) + jnp.dot(w, row_means, precision=_HI)


def mmd2_to_data(spec: RKMESpec, x: Any) -> float:
    """``||Phi~ - Phi_X||_H^2`` between a spec and the empirical embedding of ``x`` (n, d).

    ``O(n^2 d)`` time, ``O(256 n)`` memory for the data-data term. Raises like :func:`fit_rkme`
    for bad data, and ``ValueError`` when ``x``'s dimension differs from the spec's.
    """
    xs = _as_matrix(x, "x")
    if xs.shape[1] != spec.dim:
        raise ValueError(f"x has {xs.shape[1]} features but the spec has {spec.dim}")
    return float(_mmd2_to_data_core(jnp.asarray(spec.z), jnp.asarray(spec.beta),
                                    jnp.asarray(xs), spec.gamma))
