"""One pass of per-example gradients over a spec data set, shared by the PAVE benchmarks.

A one-step spec from ``B = 0`` is a function of per-data-set gradient sums: at ``B = 0`` the
merged weights are the backbone's, and the per-example gradient of ``B`` on an adapted kernel
``W`` is ``scale * A^T g_i`` with ``g_i`` the per-example gradient of ``W``. So one backward pass
per example gives the spec of every rank, every draw of ``A`` and every clip norm at once. The
benchmarks check this fast path against :func:`pavejax.pave.spec.generate_spec`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pavejax import lora
from pavejax.pave import spec as S
from pavejax.pave.text import TextSpecBackbone
from pavejax.privacy import clip_coefficients, per_example_norms


def over_market(fn, market) -> tuple[list, list]:
    """``fn(texts, targets, classes)`` on every developer (its training inputs, soft targets
    from its own model) and every user (the few shots, one-hot labels): the spec data sets of
    the identification recipe. Returns (per developer, per user)."""
    devs = [fn(list(d.train.inputs), S.soft_targets(d.logits(list(d.train.inputs))), d.classes)
            for d in market.developers]
    users = [fn(list(u.few_shot.inputs), S.hard_targets(u.few_shot.labels, len(u.classes)),
                u.classes) for u in market.users]
    return devs, users


def weight_grads_fn(tb: TextSpecBackbone, paths: Sequence[str]):
    """``f(head, batch) -> {path: (b, d_in, d_out)}``: per-example gradients of the cross-entropy
    to ``batch["__target"]`` with respect to the kernels at ``paths`` (un-jitted: callers jit the
    function that uses it)."""
    params, logits_fn, wanted = tb.backbone.params, tb.logits_fn, set(paths)

    def example_loss(w, head, ex):
        merged = jax.tree_util.tree_map_with_path(
            lambda kp, leaf: w.get(lora.path_string(kp), leaf), params)
        x = {k: v[None] for k, v in ex.items() if k != "__target"}
        return S.soft_cross_entropy(logits_fn(merged, x, head), ex["__target"][None])[0]

    def grads(head, batch):
        sel = {p: w for p, w in lora.named_leaves(params).items() if p in wanted}
        g = jax.vmap(jax.grad(example_loss), in_axes=(None, None, 0))(sel, head, batch)
        return {p: v.reshape((v.shape[0],) + lora.matrix_shape(v.shape[1:])) for p, v in g.items()}

    return grads


def microbatches(tb: TextSpecBackbone, texts: Sequence[str], targets: np.ndarray,
                 size: int) -> Iterator[tuple[dict[str, np.ndarray], jax.Array, int]]:
    """``(batch, mask, real)`` of fixed ``size`` (the last one padded with copies of its first
    row, masked out), so that one compiled function serves every data set."""
    enc = tb.encode(list(texts))
    enc["__target"] = np.asarray(targets, np.float32)
    for i in range(0, len(texts), size):
        part = {k: v[i:i + size] for k, v in enc.items()}
        real = len(part["__target"])
        part = {k: np.concatenate([v, np.repeat(v[:1], size - real, 0)]) for k, v in part.items()}
        yield part, jnp.arange(size) < real, real


def clipped_sums(gb: dict, mask: jax.Array, clip: float) -> tuple[dict, jax.Array]:
    """Sum over the microbatch of per-example ``B`` gradients ``gb`` ({path: (b, r, d_out)})
    clipped jointly to ``clip`` with the DP engine's coefficients, and the per-example norms."""
    norms = per_example_norms(gb)
    coef = jnp.where(mask & jnp.isfinite(norms), clip_coefficients(norms, clip), 0.0)
    return {p: jnp.einsum("b,bro->ro", coef, v) for p, v in gb.items()}, norms


class ClippedSpecs:
    """``"one_step_clipped"`` spec vectors, ``-(sum_i clip(g_i)) / n`` concatenated over sorted
    paths, for several secret ``A`` (each its own rank) from one pass of per-example gradients.

    ``a_list``: ``{path: (d_in, r)}`` dicts over the same paths (from :func:`lora.init_lora`)."""

    def __init__(self, tb: TextSpecBackbone, a_list: Sequence[dict], clip: float = 1.0,
                 microbatch: int = 16):
        self.tb, self.microbatch = tb, microbatch
        self.paths = sorted(a_list[0])
        grads = weight_grads_fn(tb, self.paths)
        a_list = list(a_list)

        @jax.jit
        def sums(head, batch, mask):
            g = grads(head, batch)
            out = []
            for A in a_list:
                gb = {p: jnp.einsum("ir,bio->bro", A[p], g[p],
                                    precision=jax.lax.Precision.HIGHEST) for p in self.paths}
                out.append(jnp.concatenate([v.ravel() for _, v in
                                            sorted(clipped_sums(gb, mask, clip)[0].items())]))
            return out

        self._sums = sums

    def __call__(self, texts: Sequence[str], targets: np.ndarray,
                 classes: Sequence[str]) -> list[np.ndarray]:
        """One float32 spec vector per ``A`` of ``a_list``."""
        head, total = self.tb.head(classes), None
        for batch, mask, _ in microbatches(self.tb, texts, targets, self.microbatch):
            part = [np.asarray(v, np.float64) for v in self._sums(head, batch, mask)]
            total = part if total is None else [t + v for t, v in zip(total, part, strict=True)]
        return [(-t / len(texts)).astype(np.float32) for t in total]


class ClippedPrefixSums:
    """Clipped per-example gradient sums of ``B`` (one secret ``A``) over every prefix length of
    ``ns`` of a data set, from one pass of per-example gradients.

    Clipping is per example (joint over the adapted kernels, the DP engine's coefficients), so
    the clipped sum over the first n examples is the sum of the first n clipped gradients: one
    pass over the largest set gives the spec data sums of every smaller n exactly. ``A``:
    ``{path: (d_in, r)}`` (from :func:`lora.init_lora`), ``scale`` its LoRA scale."""

    def __init__(self, tb: TextSpecBackbone, A: dict, clip: float = 1.0, microbatch: int = 16,
                 scale: float = 1.0):
        self.tb, self.microbatch = tb, microbatch
        self.paths = sorted(A)
        grads = weight_grads_fn(tb, self.paths)

        @jax.jit
        def clipped(head, batch, mask):
            g = grads(head, batch)
            gb = {p: scale * jnp.einsum("ir,bio->bro", A[p], g[p],
                                        precision=jax.lax.Precision.HIGHEST) for p in self.paths}
            norms = per_example_norms(gb)
            coef = jnp.where(mask & jnp.isfinite(norms), clip_coefficients(norms, clip), 0.0)
            flat = jnp.concatenate([gb[p].reshape(gb[p].shape[0], -1) for p in self.paths], 1)
            return coef[:, None] * flat, norms

        self._clipped = clipped

    def __call__(self, texts: Sequence[str], targets: np.ndarray, classes: Sequence[str],
                 ns: Sequence[int]) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """({n: clipped sum (float64, concatenated over sorted paths) of the first n examples}
        for every n of ``ns`` with n <= len(texts), per-example gradient norms before clipping).

        Raises:
          ValueError: an n of ``ns`` is not positive.
        """
        if any(int(n) < 1 for n in ns):
            raise ValueError(f"prefix lengths must be positive, got {list(ns)}")
        wanted = sorted({int(n) for n in ns if int(n) <= len(texts)})
        head, out, norms = self.tb.head(classes), {}, []
        total, seen = None, 0
        for batch, mask, real in microbatches(self.tb, texts, targets, self.microbatch):
            rows, nrm = self._clipped(head, batch, mask)
            rows = np.asarray(rows, np.float64)[:real]
            norms.append(np.asarray(nrm)[:real])
            if total is None:
                total = np.zeros(rows.shape[1])
            for n in wanted:  # a prefix that ends inside this microbatch
                if seen < n <= seen + real:
                    out[n] = total + rows[:n - seen].sum(axis=0)
            total = total + rows.sum(axis=0)
            seen += real
        return out, np.concatenate(norms)
