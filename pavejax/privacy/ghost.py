"""Ghost clipping: per-example gradient norms and the clipped sum without per-example gradients.

The per-example loss ``loss_fn(trainable, frozen, example)`` is traced once into a jaxpr and
every operation that meets a trainable parameter and the example (a *boundary*: a dense
``x @ W``, an embedding lookup ``table[ids]``, a bias add, a norm's scale...) is found. One
batched forward pass then records each boundary's example-dependent inputs ``x`` (the
activations) and one backward pass, taken with respect to a zero "tap" added to each boundary's
output and *not* with respect to the parameters, gives each boundary's per-example output
gradients ``g``. From ``(x, g)``:

* **dense** (``dot_general`` with the weight on one side): the per-example weight gradient is
  ``x_iᵀ g_i`` (T positions). Its squared norm is either the ghost norm
  ``Σ_ts (x_i x_iᵀ)_ts (g_i g_iᵀ)_ts`` (cost ∝ T²(d_in + d_out)) or the materialised
  ``‖x_iᵀ g_i‖²`` (cost ∝ T·d_in·d_out), whichever is cheaper for that layer ("mixed ghost
  norm"). Factored LoRA (``(x A) B``) is two such layers, so ``B``'s norm is exact.
* **embedding** (``gather`` of rows ``ids`` from a 2-D table): ``Σ_ts [id_t = id_s] <g_t, g_s>``;
  the ``V × d`` per-example table is never built.
* **anything else** (biases, norm scales, position tables, a parameter used twice as with tied
  embeddings, a parameter inside a ``scan``...): the per-example gradient of that leaf is
  materialised, from the saved ``(x, g)`` of its boundaries only (no second pass over the
  network). This is exact for every primitive JAX can differentiate; it costs memory
  ``B × leaf size``, which is small for the leaves that end up here in transformers.

The clipped sum ``Σ_i c_i ∇loss_i`` is then a book-keeping contraction of the saved ``x`` with
the scaled ``c_i g_i`` (``method="ghost"``: one forward, one backward to the activations, one
weight-gradient contraction; about the cost of a non-private step), or a second full
forward/backward of the loss weighted by ``c_i`` (``method="ghost_two_pass"``: less memory, since
the output gradients are reduced to norms as they are produced, more time).

Exactness: norms and sums are the same quantities as the materialised (vmap) path, in a
different float summation order; ``tests/test_ghost.py`` checks them against it on BERT, Llama
and factored LoRA with tight clipping, padding and Poisson batches.

Sharp edges:
  * Only joint clipping (``clipping="joint"``); per-layer clipping needs the vmap path.
  * ``sparse_rows`` is not needed (embedding tables are handled as such) and is ignored.
  * A parameter must enter the loss through JAX primitives (any model written in JAX does);
    ``custom_vjp`` functions and control flow (``scan``/``cond``/``while``) that take a
    parameter together with the example are treated as one boundary and their parameters are
    materialised per example: correct, but without the memory saving for those leaves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

PyTree = Any

_P, _E, _C = "P", "E", "C"
# Call-like primitives whose body is inlined when a parameter and the example both enter it.
_INLINE = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
           "remat2"}
# Boundary ops whose parameter gradient does not depend on the example operand's value.
_ADDITIVE = {"add", "sub", "add_any"}
# Parameter-only unary ops that keep the L2 norm of a gradient (a pure re-layout or cast).
_NORM_KEEPING = {"convert_element_type", "transpose", "reshape", "copy", "copy_p", "squeeze",
                 "expand_dims"}


@dataclasses.dataclass
class _Node:
    prim: Any
    params: dict
    ins: list          # ints (refs) or _Lit
    outs: list         # ints (refs)
    kind: str          # P, E, C or B (boundary)
    out_avals: list


@dataclasses.dataclass(frozen=True)
class _Lit:
    val: Any


@dataclasses.dataclass
class _Plan:
    """The traced per-example loss, flattened: nodes, tags and the per-leaf norm rules."""

    nodes: list
    tags: dict
    consts: dict                  # ref -> value (jaxpr constants)
    leaf_refs: list
    frozen_refs: list
    example_refs: list
    out_ref: Any
    boundaries: list              # node indices
    rules: dict                   # leaf index -> ("dot", node, side) | ("embed", node) | ("mat",)
    leaf_boundaries: dict         # leaf index -> set of boundary node indices it reaches
    avals: dict                   # ref -> abstract value (per example)


class _Builder:
    def __init__(self):
        self.nodes: list[_Node] = []
        self.tags: dict[int, str] = {}
        self.consts: dict[int, Any] = {}
        self.avals: dict[int, Any] = {}
        self._next = 0

    def new(self, tag, aval):
        r = self._next
        self._next += 1
        self.tags[r] = tag
        self.avals[r] = aval
        return r

    def tag_of(self, a):
        return _C if isinstance(a, _Lit) else self.tags[a]

    def flatten(self, jaxpr, const_vals, in_refs):
        env = {}
        for v, c in zip(jaxpr.constvars, const_vals):
            r = self.new(_C, v.aval)
            self.consts[r] = c
            env[v] = r
        for v, r in zip(jaxpr.invars, in_refs):
            env[v] = r

        def read(a):
            if isinstance(a, jcore.Literal):
                return _Lit(a.val)
            return env[a]

        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            tags = {self.tag_of(a) for a in ins}
            name = eqn.primitive.name
            if _P in tags and _E in tags and name in _INLINE:
                inner, inner_consts = _inner_jaxpr(eqn)
                if inner is not None:
                    outs = self.flatten(inner, inner_consts, [self._as_ref(a) for a in ins])
                    for v, r in zip(eqn.outvars, outs):
                        env[v] = r
                    continue
            if _E in tags:
                kind, out_tag = (("B" if _P in tags else _E), _E)
            elif _P in tags:
                kind, out_tag = _P, _P
            else:
                kind, out_tag = _C, _C
            outs = [self.new(out_tag, v.aval) for v in eqn.outvars]
            self.nodes.append(_Node(eqn.primitive, eqn.primitive.get_bind_params(eqn.params),
                                    ins, outs, kind, [v.aval for v in eqn.outvars]))
            for v, r in zip(eqn.outvars, outs):
                env[v] = r
        return [self._as_ref(read(a)) for a in jaxpr.outvars]

    def _as_ref(self, a):
        if isinstance(a, _Lit):
            r = self.new(_C, None)
            self.consts[r] = a.val
            return r
        return a


def _inner_jaxpr(eqn):
    p = eqn.params
    for key in ("jaxpr", "call_jaxpr"):
        j = p.get(key)
        if j is None:
            continue
        if isinstance(j, jcore.ClosedJaxpr):
            return j.jaxpr, j.consts
        if isinstance(j, jcore.Jaxpr):
            return j, []
    return None, None


def _vma(v):
    try:
        aval = jax.typeof(v)
    except TypeError:
        return frozenset()
    mat = getattr(aval, "manual_axis_type", None)          # jax >= 0.10
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def _match_vma(vals):
    """Inside a ``shard_map`` with ``check_vma``: mark invariant operands as varying where other
    operands vary (what ``jax.numpy`` does implicitly; raw primitives require it)."""
    vmas = [_vma(v) for v in vals]
    union = frozenset().union(*vmas)
    if not union:
        return vals
    return [jax.lax.pcast(v, tuple(sorted(union - m)), to="varying") if union - m else v
            for v, m in zip(vals, vmas)]


def _like_vma(x, others):
    """``x`` marked varying over the manual axes that ``others`` vary over (in a shard_map)."""
    union = frozenset().union(*[_vma(v) for v in others])
    return jax.lax.pcast(x, tuple(sorted(union)), to="varying") if union else x


def _bind(node, vals):
    out = node.prim.bind(*_match_vma(vals), **node.params)
    return list(out) if node.prim.multiple_results else [out]


def _read(env, consts, a):
    if isinstance(a, _Lit):
        return a.val
    if a in env:
        return env[a]
    return consts[a]


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


def _dot_rule(node, ref, tags):
    """(side of the weight, ok) for a dot_general whose weight is ``ref``."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    if lb or rb:
        return None
    a, b = node.ins
    if a == ref and not isinstance(b, _Lit) and tags.get(b) == _E:
        return 0
    if b == ref and not isinstance(a, _Lit) and tags.get(a) == _E:
        return 1
    return None


def _embed_rule(node, ref, tags, avals):
    if node.prim.name != "gather" or node.ins[0] != ref:
        return False
    idx = node.ins[1]
    if isinstance(idx, _Lit) or tags.get(idx) != _E:
        return False
    dn = node.params["dimension_numbers"]
    table = avals[ref]
    ids = avals[idx]
    if len(table.shape) != 2 or ids.shape[-1:] != (1,):
        return False
    return (tuple(dn.collapsed_slice_dims) == (0,) and tuple(dn.start_index_map) == (0,)
            and tuple(dn.offset_dims) == (len(ids.shape) - 1,)
            and not tuple(getattr(dn, "operand_batching_dims", ()))
            and tuple(node.params["slice_sizes"]) == (1, table.shape[1]))


def build_plan(loss_fn, trainable, frozen, example) -> _Plan:
    """Traces ``loss_fn`` on one example (abstractly) and classifies every parameter leaf."""
    leaves, treedef = jax.tree.flatten(trainable)
    fr_leaves, fr_def = jax.tree.flatten(frozen)
    ex_leaves, ex_def = jax.tree.flatten(example)

    def flat_loss(lv, fv, ev):
        out = loss_fn(jax.tree.unflatten(treedef, lv), jax.tree.unflatten(fr_def, fv),
                      jax.tree.unflatten(ex_def, ev))
        return jnp.asarray(out)

    def spec(x):
        # Arrays and tracers are passed as they are, so that the trace keeps their type (inside
        # a shard_map, which manual axes they vary over); anything else becomes a spec.
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            return x
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))

    closed = jax.make_jaxpr(flat_loss)([spec(x) for x in leaves], [spec(x) for x in fr_leaves],
                                       [spec(x) for x in ex_leaves])
    b = _Builder()
    leaf_refs = [b.new(_P, None) for _ in leaves]
    frozen_refs = [b.new(_C, None) for _ in fr_leaves]
    example_refs = [b.new(_E, None) for _ in ex_leaves]
    jx = closed.jaxpr
    n_l, n_f = len(leaves), len(fr_leaves)
    for r, v in zip(leaf_refs + frozen_refs + example_refs, jx.invars):
        b.avals[r] = v.aval
    (out_ref,) = b.flatten(jx, closed.consts, leaf_refs + frozen_refs + example_refs)
    assert len(jx.invars) == n_l + n_f + len(ex_leaves)
    if b.tags.get(out_ref) != _E:
        raise ValueError("ghost clipping: the loss does not depend on the example; nothing to "
                         "clip per example.")
    if b.avals[out_ref].shape != ():
        raise ValueError(f"loss_fn must return a scalar per example, got shape "
                         f"{b.avals[out_ref].shape}.")
    consumers: dict[int, list[int]] = {}
    for i, n in enumerate(b.nodes):
        for a in n.ins:
            if not isinstance(a, _Lit):
                consumers.setdefault(a, []).append(i)
    boundaries = [i for i, n in enumerate(b.nodes) if n.kind == "B"]
    rules, leaf_boundaries = {}, {}
    for li, ref in enumerate(leaf_refs):
        # Every boundary this leaf reaches through parameter-only nodes.
        reach, stack, seen = set(), [ref], set()
        while stack:
            r = stack.pop()
            if r in seen:
                continue
            seen.add(r)
            for ni in consumers.get(r, []):
                n = b.nodes[ni]
                if n.kind == "B":
                    reach.add(ni)
                elif n.kind == _P:
                    stack.extend(n.outs)
        if ref == out_ref:
            raise ValueError("ghost clipping: the loss returns a trainable leaf directly.")
        leaf_boundaries[li] = reach
        rules[li] = _leaf_rule(b, consumers, ref)
        if rules[li][0] == "mat":
            rules[li] = _elementwise_rule(b, consumers, ref) or rules[li]
        if rules[li][0] == "mat":
            rules[li] = _multi_rule(b, consumers, ref) or rules[li]
    return _Plan(b.nodes, b.tags, b.consts, leaf_refs, frozen_refs, example_refs, out_ref,
                 boundaries, rules, leaf_boundaries, b.avals)


def _leaf_rule(b, consumers, ref):
    """Follows a single-consumer chain of norm-keeping ops to one dense or embedding boundary."""
    r, chain = ref, []
    for _ in range(64):
        cons = consumers.get(r, [])
        if len(cons) != 1:
            return ("mat",)
        n = b.nodes[cons[0]]
        single = len(n.outs) == 1 and n.ins[0] == r and all(
            isinstance(a, _Lit) or a == r for a in n.ins)
        if n.kind == _P and n.prim.name in _NORM_KEEPING and single:
            chain.append(cons[0])
            r = n.outs[0]
            continue
        if n.kind == _P and n.prim.name == "broadcast_in_dim" and single and (
                math.prod(b.avals[n.outs[0]].shape) == math.prod(b.avals[r].shape)):
            chain.append(cons[0])
            r = n.outs[0]
            continue
        if n.kind != "B":
            return ("mat",)
        if n.prim.name == "dot_general":
            side = _dot_rule(n, r, b.tags)
            if side is not None and sum(1 for a in n.ins if a == r) == 1:
                return ("dot", cons[0], side, tuple(chain))
        if _embed_rule(n, r, b.tags, b.avals):
            return ("embed", cons[0])
        return ("mat",)
    return ("mat",)


_CHAIN_OPS = _NORM_KEEPING | {"broadcast_in_dim"}


def _elementwise_rule(b, consumers, ref):
    """A leaf reaching one ``mul``/``add``/``sub`` with the example through reshapes, casts and
    broadcasts (biases, norm scales): ``("ew", node, operand index, chain)``; its per-example
    gradient is the output gradient (times the other operand for ``mul``) summed back over the
    broadcast axes, computed directly."""
    r, chain = ref, []
    for _ in range(64):
        cons = consumers.get(r, [])
        if len(cons) != 1:
            return None
        n = b.nodes[cons[0]]
        if n.kind == _P and n.prim.name in _CHAIN_OPS and len(n.outs) == 1 and (
                n.ins[0] == r and all(isinstance(a, _Lit) or a == r for a in n.ins)):
            chain.append(cons[0])
            r = n.outs[0]
            continue
        if n.kind != "B" or n.prim.name not in ("mul", "add", "sub") or len(n.ins) != 2:
            return None
        pos = [i for i, a in enumerate(n.ins) if a == r]
        other = n.ins[1 - pos[0]] if len(pos) == 1 else None
        if other is None or isinstance(other, _Lit) or b.tags.get(other) != _E:
            return None
        out = tuple(n.out_avals[0].shape)
        for shape in (tuple(b.avals[other].shape), tuple(b.avals[r].shape)):
            # Equal shapes, or size-1 axes that the primitive broadcasts implicitly.
            if len(shape) != len(out) or any(d not in (1, o) for d, o in zip(shape, out)):
                return None
        return ("ew", cons[0], pos[0], tuple(chain))
    return None


def _ew_norms(plan, rule, saved, grads):
    """Per-example squared norms for an ``("ew", ...)`` leaf, pulled back along its chain."""
    _, ni, pos, chain = rule
    node = plan.nodes[ni]
    g = grads[ni][0].astype(jnp.float32)
    if node.prim.name == "mul":
        (other,) = saved[ni]
        g = g * other.astype(jnp.float32)
    elif node.prim.name == "sub" and pos == 1:
        g = -g
    p_shape = tuple(plan.avals[node.ins[pos]].shape)
    axes = tuple(i + 1 for i, d in enumerate(p_shape) if d == 1 and g.shape[i + 1] != 1)
    if axes:                                     # the primitive broadcast size-1 axes
        g = jnp.sum(g, axis=axes, keepdims=True)
    for ci in reversed(chain):
        n = plan.nodes[ci]
        in_shape = tuple(plan.avals[n.ins[0]].shape)
        bsz = g.shape[0]
        if n.prim.name == "broadcast_in_dim":
            bd = tuple(n.params["broadcast_dimensions"])
            out_shape = tuple(n.params["shape"])
            keep = [d for d in range(len(out_shape)) if d not in bd]
            g = jnp.sum(g, axis=tuple(d + 1 for d in keep))
            ones = tuple(i + 1 for i, d in enumerate(in_shape)
                         if d == 1 and out_shape[bd[i]] != 1)
            if ones:
                g = jnp.sum(g, axis=ones, keepdims=True)
            g = g.reshape((bsz,) + in_shape)
        elif n.prim.name == "transpose":
            perm = tuple(n.params["permutation"])
            inv = tuple(int(i) for i in np.argsort(perm))
            g = jnp.transpose(g, (0,) + tuple(i + 1 for i in inv))
        else:                                    # reshapes and casts keep the values
            g = g.reshape((bsz,) + in_shape)
    return jnp.sum(g * g, axis=tuple(range(1, g.ndim)))


def _multi_rule(b, consumers, ref):
    """A 2-D leaf used by several dense/embedding boundaries (e.g. tied input and output
    embeddings), reached through casts, copies and transposes only: ``("multi", terms)`` with
    one ``(node, kind, side, swap)`` per use, or None (materialise)."""
    aval = b.avals.get(ref)
    if aval is None or len(aval.shape) != 2:
        return None
    terms, stack = [], [(ref, False)]
    while stack:
        r, swapped = stack.pop()
        cons = consumers.get(r, [])
        if not cons:
            return None
        for ni in cons:
            n = b.nodes[ni]
            if n.kind == _P and n.prim.name in ("convert_element_type", "copy", "copy_p"):
                stack.append((n.outs[0], swapped))
            elif n.kind == _P and n.prim.name == "transpose" and tuple(
                    n.params["permutation"]) == (1, 0):
                stack.append((n.outs[0], not swapped))
            elif n.kind == "B" and n.prim.name == "dot_general":
                side = _dot_rule(n, r, b.tags)
                if side is None or sum(1 for a in n.ins if a == r) != 1:
                    return None
                (lc, rc), _ = n.params["dimension_numbers"]
                cw = tuple(lc if side == 0 else rc)
                if len(cw) != 1:
                    return None
                # K_W = Xᵀ G in the layout (contracting dim, free dim); (A, B) = (X, G) when W's
                # contracting dim comes first, else (G, X); a transpose of the leaf swaps again.
                terms.append((ni, "dot", side, (cw[0] != 0) != swapped))
            elif n.kind == "B" and not swapped and _embed_rule(n, r, b.tags, b.avals):
                terms.append((ni, "embed", None, False))
            else:
                return None
    return ("multi", tuple(terms)) if len(terms) > 1 else None


# ----------------------------------------------------------------------------------------------
# Evaluation


def _param_env(plan: _Plan, leaves, fr_leaves):
    """Values of every parameter-only and constant node (no example involved)."""
    env = dict(zip(plan.leaf_refs, leaves))
    env.update(zip(plan.frozen_refs, fr_leaves))
    for n in plan.nodes:
        if n.kind in (_P, _C):
            vals = _bind(n, [_read(env, plan.consts, a) for a in n.ins])
            env.update(zip(n.outs, vals))
    return env


def _forward_one(plan: _Plan, penv, ex_leaves, taps):
    """Per-example loss with taps added to boundary outputs; returns (loss, saved inputs)."""
    env = dict(penv)
    env.update(zip(plan.example_refs, ex_leaves))
    saved = {}
    for i, n in enumerate(plan.nodes):
        if n.kind not in (_E, "B"):
            continue
        vals = [_read(env, plan.consts, a) for a in n.ins]
        outs = _bind(n, vals)
        if n.kind == "B":
            # An addition's parameter gradient does not depend on the other operand: nothing to
            # keep (for a bias that is a whole activation less held until the clip factors).
            saved[i] = [] if n.prim.name in _ADDITIVE else [
                v for a, v in zip(n.ins, vals) if not isinstance(a, _Lit) and plan.tags[a] == _E]
            outs = [o + t.astype(o.dtype) if t is not None else o for o, t in zip(outs, taps[i])]
        env.update(zip(n.outs, outs))
    return env[plan.out_ref], saved


def _example_vals(plan, node, env, stored):
    """The operands of a boundary node: parameters from ``env``, example operands from
    ``stored`` (zeros for an addition, whose parameter gradient does not depend on them)."""
    it = iter(stored)
    vals = []
    for a in node.ins:
        if not isinstance(a, _Lit) and plan.tags[a] == _E:
            if node.prim.name in _ADDITIVE:
                av = plan.avals[a]
                vals.append(jnp.zeros(av.shape, av.dtype))
            else:
                vals.append(next(it))
        else:
            vals.append(_read(env, plan.consts, a))
    return vals


def _bind_batched(plan, node, penv, saved_i, bsz):
    """A boundary node evaluated on a batch of saved example inputs (parameters unbatched)."""
    def one(*stored):
        return _bind(node, _example_vals(plan, node, penv, stored))

    if not saved_i:
        return jax.vmap(one, axis_size=bsz)()
    return jax.vmap(one)(*saved_i)


def _dot_xg(node, side, x, g):
    """The activation X (B, T, d_in) and output gradient G (B, T, d_out) of a dense boundary,
    with the per-example weight gradient ``X_iᵀ G_i`` (contracting dims x free dims)."""
    (lc, rc), _ = node.params["dimension_numbers"]
    xc = tuple(rc if side == 0 else lc)          # contracting dims of the activation
    xnd = x.ndim - 1
    xf = tuple(d for d in range(xnd) if d not in xc)
    nxf = len(xf)
    gnd = g.ndim - 1
    # dot_general output: (lhs free..., rhs free...). The activation is lhs iff side == 1.
    if side == 1:
        gperm = tuple(range(gnd))                          # (x free..., w free...)
    else:
        nwf = gnd - nxf
        gperm = tuple(range(nwf, gnd)) + tuple(range(nwf))
    bsz = x.shape[0]
    X = jnp.transpose(x, (0,) + tuple(d + 1 for d in xf + xc))
    t = math.prod(X.shape[1:1 + nxf])
    X = X.reshape(bsz, t, -1).astype(jnp.float32)
    G = jnp.transpose(g, (0,) + tuple(d + 1 for d in gperm)).reshape(bsz, t, -1)
    return X, G.astype(jnp.float32)


def _dot_norms(node, side, x, g, grams=None):
    """Per-example squared norms of the weight gradient of a dense boundary. x, g batched.
    ``grams`` memoises ``X Xᵀ`` of activations shared by several layers (query/key/value)."""
    X, G = _dot_xg(node, side, x, g)
    t, d_in, d_out = X.shape[1], X.shape[2], G.shape[2]
    if t * (d_in + d_out) <= d_in * d_out:
        (lc, rc), _ = node.params["dimension_numbers"]
        key = (id(x), tuple(rc if side == 0 else lc))
        if grams is not None and key in grams:
            xx = grams[key][1]
        else:
            xx = jnp.einsum("btd,bsd->bts", X, X)
            if grams is not None:
                grams[key] = (x, xx)             # x kept so that its id stays unique
        gg = jnp.einsum("bte,bse->bts", G, G)
        return jnp.einsum("bts,bts->b", xx, gg)
    k = jnp.einsum("btd,bte->bde", X, G)
    return jnp.einsum("bde,bde->b", k, k)


def _gram(a, b):
    """(B, T, S) inner products of the rows of two factors; a factor is a dense (B, T, m) array
    or ``("ids", ids (B, T), m)`` standing for the one-hot rows of a lookup."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return (a[1][:, :, None] == b[1][:, None, :]).astype(jnp.float32)
    if isinstance(a, tuple):
        return jnp.swapaxes(_gram(b, a), 1, 2)
    if isinstance(b, tuple):                      # <a_t, onehot(id_s)> = a[t, id_s]
        return jnp.take_along_axis(a, b[1][:, None, :], axis=2)
    return jnp.einsum("btm,bsm->bts", a, b)


def _multi_norms(plan, terms, saved, grads):
    """Squared norm of Σ_e A_eᵀ B_e per example (all uses of one 2-D leaf, cross terms kept)."""
    factors = []
    for ni, kind, side, swap in terms:
        node = plan.nodes[ni]
        (x,) = saved[ni]
        if kind == "dot":
            X, G = _dot_xg(node, side, x, grads[ni][0])
            factors.append((G, X) if swap else (X, G))
        else:
            rows = plan.avals[node.ins[0]].shape[0]
            ids, G = _embed_ids_g(node, rows, x, grads[ni][0])
            factors.append((("ids", ids, rows), G))
    total = 0.0
    for e in range(len(factors)):
        for f in range(e, len(factors)):
            (ae, be), (af, bf) = factors[e], factors[f]
            term = jnp.einsum("bts,bts->b", _gram(ae, af), _gram(be, bf))
            total = total + (term if e == f else 2.0 * term)
    return total


def _embed_ids_g(node, table_rows, ids, g):
    """Row ids (B, T) and row gradients (B, T, d) of a lookup, after the lookup's own rule for
    out-of-range ids (clip, or drop for fill)."""
    bsz = ids.shape[0]
    ids = ids.reshape(bsz, -1)
    G = g.reshape(bsz, ids.shape[1], -1).astype(jnp.float32)
    mode = str(node.params.get("mode", "")).upper()
    if "CLIP" in mode or "PROMISE" in mode:
        ids = jnp.clip(ids, 0, table_rows - 1)
    else:
        valid = (ids >= 0) & (ids < table_rows)
        G = jnp.where(valid[..., None], G, 0.0)
        ids = jnp.where(valid, ids, -1)
    return ids, G


def _embed_norms(node, table_rows, ids, g):
    """Per-example squared norms of an embedding table's gradient (rows looked up by ids)."""
    ids, G = _embed_ids_g(node, table_rows, ids, g)
    same = ids[:, :, None] == ids[:, None, :]
    gg = jnp.einsum("bte,bse->bts", G, G)
    return jnp.sum(jnp.where(same, gg, 0.0), axis=(1, 2))


def _plan_for(loss_fn, trainable, frozen, batch):
    example = jax.tree.map(lambda x: x[0], batch)
    return build_plan(loss_fn, trainable, frozen, example)


def ghost_norms_and_taps(plan: _Plan, leaves, fr_leaves, ex_batched):
    """One forward and one backward-to-activations pass: (losses, saved x, output grads g)."""
    penv = _param_env(plan, leaves, fr_leaves)
    bsz = ex_batched[0].shape[0]
    taps = {}
    for i in plan.boundaries:
        n = plan.nodes[i]
        taps[i] = [_like_vma(jnp.zeros((bsz,) + tuple(av.shape), av.dtype), ex_batched)
                   if _is_float(av) else None for av in n.out_avals]

    def fwd(taps):
        return jax.vmap(lambda ex, tp: _forward_one(plan, penv, ex, tp))(ex_batched, taps)

    losses, vjp_fn, saved = jax.vjp(fwd, taps, has_aux=True)
    (grads,) = vjp_fn(jnp.ones_like(losses))
    return penv, losses, saved, grads


def per_leaf_sq_norms(plan: _Plan, leaves, penv, saved, grads):
    """Per-example squared gradient norm of every trainable leaf -> list of (B,) arrays."""
    out = [None] * len(leaves)
    mat = []
    grams = {}
    for li in range(len(leaves)):
        rule = plan.rules[li]
        if not plan.leaf_boundaries[li]:
            out[li] = None                           # the loss does not use this leaf
            continue
        if rule[0] == "dot":
            _, ni, side, _ = rule
            node = plan.nodes[ni]
            (x,) = saved[ni]
            out[li] = _dot_norms(node, side, x, grads[ni][0], grams)
        elif rule[0] == "embed":
            _, ni = rule
            node = plan.nodes[ni]
            (ids,) = saved[ni]
            rows = plan.avals[node.ins[0]].shape[0]
            out[li] = _embed_norms(node, rows, ids, grads[ni][0])
        elif rule[0] == "multi":
            out[li] = _multi_norms(plan, rule[1], saved, grads)
        elif rule[0] == "ew":
            out[li] = _ew_norms(plan, rule, saved, grads)
        else:
            mat.append(li)
    if mat:
        sq = _materialised_sq_norms(plan, leaves, penv, saved, grads, mat)
        for li, s in zip(mat, sq):
            out[li] = s
    bsz = next(iter(jax.tree.leaves(grads))).shape[0]
    return [jnp.zeros((bsz,), jnp.float32) if s is None else s for s in out]


def _materialised_sq_norms(plan, leaves, penv, saved, grads, mat):
    """Per-example gradients of the leaves ``mat``, from the saved (x, g) of their boundaries."""
    nodes = sorted(set().union(*[plan.leaf_boundaries[li] for li in mat]))
    fr_vals = [penv[r] for r in plan.frozen_refs]
    mat_leaves = [leaves[li] for li in mat]

    def q(sub, saved_i, grads_i):
        full = list(leaves)
        for li, v in zip(mat, sub):
            full[li] = v
        env = _param_env(plan, [jax.lax.stop_gradient(v) if k not in mat else v
                                for k, v in enumerate(full)], fr_vals)
        total = jnp.float32(0.0)
        for ni in nodes:
            node = plan.nodes[ni]
            outs = _bind(node, _example_vals(plan, node, env, saved_i[ni]))
            for o, gi in zip(outs, grads_i[ni]):
                if gi is not None and _is_float(o):
                    total = total + jnp.sum(o.astype(jnp.float32)
                                            * jax.lax.stop_gradient(gi).astype(jnp.float32))
        return total

    sub_saved = {ni: saved[ni] for ni in nodes}
    sub_grads = {ni: grads[ni] for ni in nodes}
    per_ex = jax.vmap(jax.grad(q), in_axes=(None, 0, 0))(mat_leaves, sub_saved, sub_grads)
    return [jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1, g.ndim)))
            for g in per_ex]


def _dot_weight_grad(plan, rule, x, cg, leaf):
    """Σ_i X_iᵀ (c_i G_i) of a dense leaf, in the leaf's layout: one contraction over the batch
    and sequence axes, then the weight's own axis order, then back along the leaf's chain of
    re-layouts and casts."""
    _, ni, side, chain = rule
    node = plan.nodes[ni]
    X, G = _dot_xg(node, side, x, cg)
    k = jnp.einsum("btd,bte->de", X, G)
    w_ref = node.ins[0] if side == 0 else node.ins[1]
    w_shape = tuple(plan.avals[w_ref].shape)
    (lc, rc), _ = node.params["dimension_numbers"]
    cw = tuple(lc if side == 0 else rc)
    wf = tuple(d for d in range(len(w_shape)) if d not in cw)
    order = cw + wf
    k = k.reshape(tuple(w_shape[d] for d in order))
    k = jnp.transpose(k, tuple(int(i) for i in np.argsort(order)))
    for ci in reversed(chain):
        n = plan.nodes[ci]
        in_aval = plan.avals[n.ins[0]]
        if n.prim.name == "transpose":
            k = jnp.transpose(k, tuple(int(i) for i in np.argsort(n.params["permutation"])))
        else:
            k = k.reshape(tuple(in_aval.shape))
    return k.astype(leaf.dtype)


def weighted_sum(plan: _Plan, leaves, fr_leaves, saved, grads, coefs):
    """Σ_i coefs_i ∇loss_i by book-keeping: dense leaves by one contraction of the saved
    activations with the scaled output gradients, every other leaf through its boundaries' vjps
    with the scaled output gradients."""
    fr_vals = list(fr_leaves)
    direct, handled = {}, set()
    for li, rule in plan.rules.items():
        if rule[0] == "dot" and plan.leaf_boundaries[li] == {rule[1]}:
            ni = rule[1]
            (x,) = saved[ni]
            g = grads[ni][0]
            cg = g * coefs.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)
            direct[li] = _dot_weight_grad(plan, rule, x, cg, leaves[li])
            handled.add(ni)

    def s(lv):
        env = _param_env(plan, lv, fr_vals)
        total = jnp.float32(0.0)
        for ni in plan.boundaries:
            if ni in handled:
                continue
            outs = _bind_batched(plan, plan.nodes[ni], env, saved[ni], coefs.shape[0])
            for o, gi in zip(outs, grads[ni]):
                if gi is not None and _is_float(o):
                    c = coefs.reshape((-1,) + (1,) * (gi.ndim - 1)).astype(gi.dtype)
                    total = total + jnp.sum(o * jax.lax.stop_gradient(gi * c)).astype(
                        jnp.float32)
        return total

    rest = jax.grad(s)(list(leaves))
    return [direct.get(li, g) for li, g in enumerate(rest)]


def _bcast(v, like):
    return v.reshape(v.shape + (1,) * (like.ndim - 1))


def _sanitise(keep, tree):
    """Zeroes the rows of float arrays where ``keep`` is False (so that 0 * NaN never occurs)."""
    def one(v):
        if v is None or not jnp.issubdtype(v.dtype, jnp.floating):
            return v
        return jnp.where(_bcast(keep, v), v, jnp.zeros((), v.dtype))
    return jax.tree.map(one, tree, is_leaf=lambda v: v is None)


class GhostPass(NamedTuple):
    """One forward and one backward-to-activations pass over a (micro)batch.

    losses: (B,) per-example losses (float32). norms: (B,) joint per-example gradient norms.
    clipped_sum: ``clipped_sum(coef, keep)`` -> ``Σ_i coef_i ∇loss_i`` (pytree like
    ``trainable``); rows with ``keep`` False must have ``coef`` 0 and are zeroed first.
    """

    losses: jax.Array
    norms: jax.Array
    clipped_sum: Any


def ghost_pass(loss_fn, trainable, frozen, batch, *, two_pass: bool = False) -> GhostPass:
    """The ghost norms of one (micro)batch and the function that forms the clipped sum from
    the clip coefficients (book-keeping, or a second pass with ``two_pass``). The clipping
    rule itself lives in :mod:`pavejax.privacy.clipping`."""
    plan = _plan_for(loss_fn, trainable, frozen, batch)
    leaves, treedef = jax.tree.flatten(trainable)
    fr_leaves = jax.tree.leaves(frozen)
    ex_leaves = jax.tree.leaves(batch)
    penv, losses, saved, grads = ghost_norms_and_taps(plan, leaves, fr_leaves, ex_leaves)
    sq = per_leaf_sq_norms(plan, leaves, penv, saved, grads)
    norms = jnp.sqrt(sum(sq[1:], sq[0])) if sq else jnp.zeros_like(losses, jnp.float32)
    losses = losses.astype(jnp.float32)

    def clipped(coef, keep):
        if two_pass:
            finite = jnp.isfinite(norms) & jnp.isfinite(losses)
            return _two_pass_sum(loss_fn, trainable, frozen, batch, coef, finite)
        total = weighted_sum(plan, leaves, fr_leaves, _sanitise(keep, saved),
                             _sanitise(keep, grads), coef)
        return jax.tree.unflatten(treedef, [t.astype(x.dtype) for t, x in zip(total, leaves)])

    return GhostPass(losses, norms, clipped)


def _two_pass_sum(loss_fn, trainable, frozen, batch, coef, finite):
    """Second pass: the gradient of ``Σ_i coef_i loss_i`` (one batched forward and backward).

    A non-finite row would turn ``0 * NaN`` into NaN inside the batched backward, so when any
    row is not finite the sum is taken example by example instead, each gradient guarded."""

    def weighted(t):
        losses = jax.vmap(loss_fn, in_axes=(None, None, 0))(t, frozen, batch)
        return jnp.sum(coef.astype(jnp.float32) * losses.astype(jnp.float32))

    def fast(_):
        return jax.grad(weighted)(trainable)

    def safe(_):
        def body(acc, xs):
            ex, c, ok = xs
            g = jax.grad(loss_fn)(trainable, frozen, ex)
            g = jax.tree.map(lambda v: jnp.where(ok, v * c.astype(v.dtype),
                                                 jnp.zeros((), v.dtype)), g)
            return jax.tree.map(jnp.add, acc, g), None

        zero = jax.tree.map(jnp.zeros_like, trainable)
        acc, _ = jax.lax.scan(body, zero, (batch, coef, finite))
        return acc

    return jax.lax.cond(jnp.all(finite), fast, safe, None)
