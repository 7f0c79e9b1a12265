"""Coordinate specs: a public common subspace ``U`` for PAVE specifications (Eq. 18).

A PAVE spec is the stack of trained LoRA ``B`` factors, one ``(r, d_out)`` block per adapted
kernel (``delta W = A B`` with the secret ``A`` of shape ``(d_in, r)``). A :class:`Subspace`
fixes, per adapted kernel, a public matrix ``U`` of shape ``(d_out, k)`` with orthonormal
columns and restricts every ``B`` to ``B = C U^T``: the spec trains and releases only the
coordinates ``C = B U`` of shape ``(r, k)``. In the paper's notation (``B = F(D) A^T`` with
``F(D) = U H(D)``) this is the release ``C(D) = U^T B(D)``, the common specification subspace
of Section 3 that makes the intrinsic sketch guarantee (Theorem 3.5, ``rho`` proportional to
``r k``) a computable number (:mod:`pavejax.accounting.intrinsic`).

Kinds (all public, data-independent of the market):

* ``None`` in :class:`~pavejax.pave.spec.SpecConfig` (``U = I`` on every adapted kernel): the
  specs of before, bit for bit.
* :func:`layer_selection`: ``U = I`` on a chosen subset of the adapted kernels, nothing
  elsewhere (those kernels keep ``B = 0``).
* :func:`random_projection`: per kernel, ``U`` from the QR decomposition of a Gaussian matrix
  drawn from a public seed.
* :func:`calibrated`: per kernel, the top-``k`` eigenvectors of the second moment of the
  per-example full-weight gradients ``g_i`` (output side, ``sum_i g_i^T g_i``) on public data.
  At ``B = 0`` a centred, label-name keyed head predicts uniformly, so the public data need
  targets that carry no private information: zero-shot predictions or public random labels
  (:func:`random_targets`). Full-weight gradients do not involve ``A``, so such a ``U`` can be
  published with the backbone.

``U`` is distributed as data, never recomputed by each party: a dock stores it
(``Dock.create(..., subspace=U)``) and everyone loads it from there, because two machines'
linear algebra libraries may round a recomputed basis differently. Its :attr:`Subspace.hash`
(sha256 of the paths, shapes and float32 bytes) enters every spec's signature, so a spec made
in another subspace is refused by every comparison.

Privacy. DP-S-PAVE on coordinates is DP-SGD on ``C``: each example's gradient with respect to
``C`` is its gradient with respect to ``B`` projected on ``U`` (``g_B U``), clipped jointly to
``C_clip`` and noised in the ``k``-dimensional coordinates. The sensitivity is unchanged
(``2 C_clip`` under replace-one), so the accounting, the ledger and the guarantee are those of
the full spec; the noise has ``r k`` instead of ``r d_out`` coordinates per kernel.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pavejax import lora
from pavejax.pave._loss import soft_cross_entropy

__all__ = ["KINDS", "Subspace", "calibrated", "layer_selection", "random_projection",
           "random_targets"]

KINDS = ("layers", "random", "calibrated", "custom")
_FORMAT = "pavejax.subspace.v1"
_ORTHO_TOL = 1e-4


class Subspace:
    """Per adapted kernel, an orthonormal public basis ``U (d_out, k)`` (or the identity).

    Build with :func:`layer_selection`, :func:`random_projection` or :func:`calibrated`, or
    directly from ``bases`` ``{path: U or None}`` (None: identity, ``k = d_out``) and
    ``out_dims`` ``{path: d_out}``. Immutable; equal (and hashable) by :attr:`hash`.
    """

    def __init__(self, bases: Mapping[str, np.ndarray | None], out_dims: Mapping[str, int], *,
                 kind: str = "custom", info: Mapping[str, Any] | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(bases, Mapping) or not bases:
            raise ValueError("a subspace needs at least one adapted path: bases must be a "
                             "non-empty {path: U or None} mapping")
        if set(bases) != set(out_dims):
            raise ValueError(f"bases and out_dims must name the same paths, got "
                             f"{sorted(bases)} and {sorted(out_dims)}")
        clean: dict[str, np.ndarray | None] = {}
        dims: dict[str, int] = {}
        for p in sorted(bases):
            d = out_dims[p]
            if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 1:
                raise ValueError(f"out_dims[{p!r}] must be an int >= 1, got {d!r}")
            dims[p] = int(d)
            u = bases[p]
            if u is None:
                clean[p] = None
                continue
            u = np.array(u, dtype=np.float32, copy=True)
            if u.ndim != 2 or u.shape[0] != d or not 1 <= u.shape[1] <= d:
                raise ValueError(f"the basis at {p!r} must be (d_out={d}, k) with 1 <= k <= "
                                 f"{d}, got shape {u.shape}")
            if not np.isfinite(u).all():
                raise ValueError(f"the basis at {p!r} has NaN/inf entries")
            gram = u.astype(np.float64).T @ u.astype(np.float64)
            err = float(np.abs(gram - np.eye(u.shape[1])).max())
            if err > _ORTHO_TOL:
                raise ValueError(f"the basis at {p!r} is not orthonormal (max |U^T U - I| = "
                                 f"{err:.2e}); orthonormalise it (e.g. numpy.linalg.qr)")
            u.setflags(write=False)
            clean[p] = u
        self._bases, self._dims = clean, dims
        self.kind = kind
        self.info = json.loads(json.dumps(dict(info or {}), sort_keys=True, allow_nan=False))
        h = hashlib.sha256(_FORMAT.encode())
        for p in sorted(clean):
            u = clean[p]
            h.update(f"{p}|{dims[p]}|{'identity' if u is None else u.shape[1]}\n".encode())
            if u is not None:
                h.update(np.ascontiguousarray(u).tobytes())
        self._hash = h.hexdigest()

    # -------------------------------------------------------------- description

    @property
    def hash(self) -> str:
        """sha256 (hex) of the paths, shapes and float32 bytes of every basis."""
        return self._hash

    @property
    def paths(self) -> tuple[str, ...]:
        """The adapted kernels the subspace keeps, sorted (spec blocks follow this order)."""
        return tuple(sorted(self._bases))

    def basis(self, path: str) -> np.ndarray | None:
        """``U`` at ``path`` (read-only float32 ``(d_out, k)``), or None for the identity."""
        return self._bases[path]

    def k(self, path: str) -> int:
        """Number of coordinates per rank-row at ``path`` (``d_out`` for the identity)."""
        u = self._bases[path]
        return self._dims[path] if u is None else int(u.shape[1])

    def out_dim(self, path: str) -> int:
        return self._dims[path]

    @property
    def total_k(self) -> int:
        """``sum_l k_l``: a spec of rank r has ``r * total_k`` coordinates."""
        return sum(self.k(p) for p in self.paths)

    def describe(self) -> dict[str, Any]:
        """JSON-safe record for specs and releases (no arrays)."""
        return {"kind": self.kind, "hash": self.hash,
                "k": {p: self.k(p) for p in self.paths}, "info": self.info}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Subspace) and other.hash == self.hash

    def __hash__(self) -> int:
        return hash(self._hash)

    def __repr__(self) -> str:
        ks = sorted({self.k(p) for p in self.paths})
        return (f"Subspace(kind={self.kind!r}, layers={len(self.paths)}, k={ks}, "
                f"hash={self.hash[:12]})")

    # -------------------------------------------------------------- maps

    def coordinate_shapes(self, rank: int) -> dict[str, tuple[int, int]]:
        """``{path: (rank, k)}``: the trainable coordinates of a rank-``rank`` spec."""
        return {p: (int(rank), self.k(p)) for p in self.paths}

    def lift(self, C: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """``B = C U^T`` per path (jittable; the identity passes ``C`` through)."""
        out = {}
        for p in self.paths:
            u = self._bases[p]
            out[p] = C[p] if u is None else C[p] @ jnp.asarray(u, C[p].dtype).T
        return out

    def project(self, B: Mapping[str, Any]) -> dict[str, Any]:
        """``C = B U`` per path of the subspace (jittable; the identity passes ``B`` through)."""
        out = {}
        for p in self.paths:
            u = self._bases[p]
            out[p] = B[p] if u is None else B[p] @ jnp.asarray(u, B[p].dtype)
        return out

    def check_params(self, params: Any, predicate: lora.Predicate) -> None:
        """Raise ValueError unless every path is an adapted kernel of ``params`` under
        ``predicate`` with the recorded ``d_out``."""
        adapted = set(lora.select_paths(params, predicate))
        missing = [p for p in self.paths if p not in adapted]
        if missing:
            raise ValueError(f"the subspace names kernels that the predicate does not adapt: "
                             f"{missing[:3]}; build the subspace for this backbone and predicate")
        leaves = lora.named_leaves(params)
        for p in self.paths:
            d_out = lora.matrix_shape(np.shape(leaves[p]))[1]
            if d_out != self._dims[p]:
                raise ValueError(f"the subspace was built for d_out = {self._dims[p]} at {p!r} "
                                 f"but this backbone has {d_out}: it belongs to another backbone")

    # -------------------------------------------------------------- storage

    def save(self, directory: str | Path) -> Path:
        """Write ``subspace.json`` and ``subspace.npz`` into ``directory`` (created)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        names = {p: f"u{i}" for i, p in enumerate(self.paths)}
        arrays = {names[p]: u for p, u in self._bases.items() if u is not None}
        with open(directory / "subspace.npz", "wb") as f:
            np.savez(f, **arrays)
        meta = {"format": _FORMAT, "kind": self.kind, "info": self.info, "hash": self.hash,
                "paths": {p: {"array": names[p] if self._bases[p] is not None else None,
                              "out_dim": self._dims[p]} for p in self.paths}}
        (directory / "subspace.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> Subspace:
        """Read what :meth:`save` wrote; refuses files whose recomputed hash differs."""
        directory = Path(directory)
        try:
            meta = json.loads((directory / "subspace.json").read_text())
            with np.load(directory / "subspace.npz") as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError) as e:
            raise ValueError(f"no readable subspace in {directory} ({e})") from None
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{directory}/subspace.json is not a pavejax subspace")
        bases = {p: None if v["array"] is None else arrays[v["array"]]
                 for p, v in meta["paths"].items()}
        dims = {p: int(v["out_dim"]) for p, v in meta["paths"].items()}
        out = cls(bases, dims, kind=meta["kind"], info=meta.get("info"))
        if out.hash != meta.get("hash"):
            raise ValueError(f"the subspace in {directory} does not match its recorded hash "
                             f"(altered or corrupt files); restore it from its source")
        return out


# ------------------------------------------------------------------ constructors


def _adapted_out_dims(params: Any, predicate: lora.Predicate) -> dict[str, int]:
    leaves = lora.named_leaves(params)
    paths = lora.select_paths(params, predicate)
    if not paths:
        raise ValueError("the predicate selects no adaptable kernel of params")
    return {p: lora.matrix_shape(np.shape(leaves[p]))[1] for p in paths}


def _check_k(k: Any, dims: Mapping[str, int]) -> int:
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    small = {p: d for p, d in dims.items() if d < k}
    if small:
        p, d = next(iter(small.items()))
        raise ValueError(f"k = {k} exceeds d_out = {d} at {p!r}; choose k <= {min(dims.values())}")
    return int(k)


def _canonical(u: np.ndarray) -> np.ndarray:
    """Fix each column's sign (largest-magnitude entry positive): a basis that depends only on
    the subspace's inputs, not on the sign conventions of the decomposition."""
    idx = np.argmax(np.abs(u), axis=0)
    signs = np.sign(u[idx, np.arange(u.shape[1])])
    signs[signs == 0] = 1.0
    return u * signs


def layer_selection(params: Any, predicate: lora.Predicate,
                    keep: Sequence[str] | Callable[[str], bool]) -> Subspace:
    """``U = I`` on the adapted kernels named by ``keep`` (paths, or a ``path -> bool``
    function), nothing elsewhere."""
    dims = _adapted_out_dims(params, predicate)
    chosen = [p for p in dims if keep(p)] if callable(keep) else list(keep)
    unknown = [p for p in chosen if p not in dims]
    if unknown:
        raise ValueError(f"{unknown[:3]} are not adapted kernels; choose among {sorted(dims)[:4]}")
    if not chosen:
        raise ValueError("the layer selection keeps no kernel")
    return Subspace({p: None for p in chosen}, {p: dims[p] for p in chosen}, kind="layers",
                    info={"layers": sorted(chosen)})


def random_projection(params: Any, predicate: lora.Predicate, k: int, seed: int = 0) -> Subspace:
    """Per adapted kernel, ``U`` = the Q factor of a standard Gaussian ``(d_out, k)`` matrix
    drawn by NumPy's PCG64 from ``seed`` and the path (public, data-independent)."""
    dims = _adapted_out_dims(params, predicate)
    k = _check_k(k, dims)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    bases = {}
    for p, d in dims.items():
        rng = np.random.default_rng([seed, zlib.crc32(p.encode())])
        q, _ = np.linalg.qr(rng.standard_normal((d, k)))
        bases[p] = _canonical(q)
    return Subspace(bases, dims, kind="random", info={"k": k, "seed": seed})


def random_targets(n: int, num_classes: int, seed: int = 0) -> np.ndarray:
    """One-hot public random labels ``(n, num_classes)`` float32 from ``seed``: targets for
    calibration data that carry no information about anyone's task."""
    if n < 1 or num_classes < 2:
        raise ValueError(f"need n >= 1 and num_classes >= 2, got {n} and {num_classes}")
    y = np.random.default_rng(seed).integers(0, num_classes, n)
    return np.eye(num_classes, dtype=np.float32)[y]


def _moments_fn(logits_fn, params, paths):
    """Jitted ``(batch, mask, aux) -> {path: sum_b g_b^T g_b}`` (d_out, d_out), where g_b is the
    per-example gradient (d_in, d_out) of the soft cross-entropy w.r.t. the kernel."""

    leaves = lora.named_leaves(params)
    shapes = {p: lora.matrix_shape(np.shape(leaves[p])) for p in paths}

    def example_loss(w, ex, aux):
        merged = jax.tree_util.tree_map_with_path(
            lambda kp, leaf: w.get(lora.path_string(kp), leaf), params)
        x = {k: v[None] for k, v in ex.items() if k != "__target"}
        return soft_cross_entropy(logits_fn(merged, x, aux), ex["__target"][None])[0]

    @jax.jit
    def moments(batch, mask, aux):
        sel = {p: leaves[p] for p in paths}
        g = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, None))(sel, batch, aux)
        out = {}
        for p, v in g.items():
            v = v.reshape((v.shape[0],) + shapes[p]) * mask[:, None, None].astype(v.dtype)
            out[p] = jnp.einsum("bio,bip->op", v, v, precision=jax.lax.Precision.HIGHEST)
        return out

    return moments, shapes


def _gradient_moments(fn, shapes, inputs, targets, aux, microbatch):
    data = {k: np.asarray(v) for k, v in inputs.items()}
    data["__target"] = np.asarray(targets, np.float32)
    n = len(data["__target"])
    total = {p: np.zeros((d_out, d_out)) for p, (_, d_out) in shapes.items()}
    for i in range(0, n, microbatch):
        part = {k: v[i:i + microbatch] for k, v in data.items()}
        real = len(part["__target"])
        part = {k: np.concatenate([v, np.repeat(v[:1], microbatch - real, 0)])
                for k, v in part.items()}
        out = fn(part, np.arange(microbatch) < real, aux)
        for p in total:
            total[p] += np.asarray(out[p], np.float64)
    return total


def calibrated(logits_fn: Callable, params: Any, predicate: lora.Predicate,
               inputs: Mapping[str, Any], targets: np.ndarray, k: int, *, aux: Any = None,
               more: Sequence[tuple[Mapping[str, Any], np.ndarray, Any]] = (),
               microbatch: int = 16, info: Mapping[str, Any] | None = None) -> Subspace:
    """Per adapted kernel, the top-``k`` output-side directions of the per-example full-weight
    gradients on PUBLIC data: the eigenvectors of ``sum_i g_i^T g_i`` with the ``k`` largest
    eigenvalues (float64, canonical signs).

    Args:
      logits_fn: ``(params, batch, aux) -> (b, K)`` logits (the spec's ``g o f``).
      params: the backbone's params (the spec's ``B = 0`` point: no LoRA, no ``A``).
      predicate: the spec's predicate (the adapted kernels).
      inputs: public inputs (dict of arrays, leading axis n). Never market or private data:
        the subspace is published.
      targets: ``(n, K)`` probability rows: zero-shot predictions or :func:`random_targets`.
      k: coordinates per kernel.
      aux: passed to ``logits_fn`` (e.g. the label-space head).
      more: further ``(inputs, targets, aux)`` groups whose gradient moments are added (e.g.
        the same public texts under the head of each public label set).
      info: public facts recorded with the subspace (e.g. the data's name and size).
    """
    dims = _adapted_out_dims(params, predicate)
    k = _check_k(k, dims)
    if isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1:
        raise ValueError(f"microbatch must be an int >= 1, got {microbatch!r}")
    mom, total_n = None, 0
    fn, shapes = _moments_fn(logits_fn, params, sorted(dims))
    for inp, targ, ax in ((inputs, targets, aux), *more):
        t = np.asarray(targ, np.float32)
        if t.ndim != 2 or t.shape[0] < 1 or not np.isfinite(t).all():
            raise ValueError(f"targets must be finite (n, K) probability rows, got shape "
                             f"{t.shape}")
        for name, v in inp.items():
            if np.shape(v)[:1] != (t.shape[0],):
                raise ValueError(f"inputs[{name!r}] has {np.shape(v)[:1]} examples, targets "
                                 f"{t.shape[0]}")
        part = _gradient_moments(fn, shapes, inp, t, ax, microbatch)
        mom = part if mom is None else {p: mom[p] + part[p] for p in mom}
        total_n += int(t.shape[0])
    bases = {}
    for p, m in mom.items():
        if not np.isfinite(m).all():
            raise ValueError(f"non-finite gradients at {p!r} on the calibration data")
        w, v = np.linalg.eigh((m + m.T) / 2.0)
        order = np.argsort(w)[::-1][:k]
        if not w[order[-1]] > 1e-9 * max(float(w[order[0]]), 0.0):
            raise ValueError(f"the calibration gradients at {p!r} span fewer than k = {k} "
                             f"directions; use more (or more varied) public data or a smaller k")
        bases[p] = _canonical(v[:, order])
    record = {"k": k, "num_examples": total_n, **dict(info or {})}
    return Subspace(bases, dims, kind="calibrated", info=record)
