"""Parameter-sharded private gradients on (data, model) meshes of 8 virtual devices equal one
device, with clipping active, padding masks and Poisson-sampled batches; broken variants
(per-shard clipping, per-device noise) are caught by the same comparisons."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pavejax import privacy as pv
from pavejax.models import BertConfig, BertEncoder, TextClassifier
from tests.test_privacy import FROZEN, _data, _loss, _mlp_params

TIGHT = 0.01  # far below the per-example gradient norms: (almost) every example is clipped
MESHES = [(2, 4), (4, 2)]


def _close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.fixture(scope="module", autouse=True)
def _eight():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices; tests/conftest.py sets them")


def _config(n, b):
    return pv.DPConfig(l2_clip=TIGHT, noise_multiplier=1.0,
                       sampling=pv.SamplingConfig("poisson", dataset_size=n, batch_size=b))


def _poisson_batch(data, cfg, key):
    """A Poisson draw padded to a multiple of 4 (every data-axis size here): masked rows."""
    draw = cfg.sampling.sample(key)
    return pv.pad_batch(pv.take_batch(data, draw.indices), draw.mask, 4)


# ----------------------------------------------------------------------------- problems

def _mlp():
    params = _mlp_params(jax.random.key(0), d_in=8, d_h=16, d_out=4)
    data = _data(jax.random.key(1), 48, d_in=8, classes=4)
    return _loss, params, FROZEN, data, 8  # min_size 8: every kernel and bias is sharded


def _bert():
    bert = dataclasses.replace(BertConfig.tiny(), num_layers=1)  # one layer: half the compile
    graphdef, state = nnx.split(TextClassifier(BertEncoder(bert, rngs=nnx.Rngs(0)), 2,
                                               rngs=nnx.Rngs(1)))
    params = nnx.to_pure_dict(state)
    rng = np.random.default_rng(0)
    n, seq = 32, 8
    lengths = rng.integers(3, seq + 1, n)
    attn = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    data = {"input_ids": jnp.asarray(rng.integers(1, 128, (n, seq)).astype(np.int32) * attn),
            "attention_mask": jnp.asarray(attn),
            "label": jnp.asarray(rng.integers(0, 2, n), jnp.int32)}

    def loss(p, frozen, ex):
        logits = nnx.merge(graphdef, p)(ex["input_ids"][None], ex["attention_mask"][None])[0]
        return -jax.nn.log_softmax(logits.astype(jnp.float32))[ex["label"]]

    return loss, params, None, data, pv.fsdp.DEFAULT_MIN_SIZE


PROBLEMS = {"mlp": _mlp, "bert": _bert}


@pytest.fixture(scope="module")
def problems():
    cache = {}

    def get(name):
        if name not in cache:
            loss, params, frozen, data, min_size = PROBLEMS[name]()
            n = jax.tree.leaves(data)[0].shape[0]
            cfg = _config(n, n // 4)
            batch, mask = _poisson_batch(data, cfg, jax.random.key(11))
            one = jax.jit(lambda p, b, m, k, z: pv.noisy_gradient(
                loss, p, frozen, b, m, k, cfg, noise_multiplier=z))
            cache[name] = (loss, params, frozen, cfg, batch, mask, min_size, one)
        return cache[name]

    return get


def _largest_spec(params, specs):
    """The spec of the leaf of ``params`` with the most elements."""
    leaves = jax.tree.leaves(params)
    i = max(range(len(leaves)), key=lambda j: leaves[j].size)
    return jax.tree.structure(params).flatten_up_to(specs)[i]


# ----------------------------------------------------------------------------- equality

@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_sharded_equals_one_device(problems, name, shape):
    loss, params, frozen, cfg, batch, mask, min_size, one = problems(name)
    assert 0 < int(mask.sum()) < mask.shape[0]  # real rows and padding
    mesh = pv.model_mesh(*shape)
    specs = pv.fsdp_specs(params, mesh, min_size=min_size)
    assert "model" in _largest_spec(params, specs)  # the largest leaf is sharded
    key = jax.random.key(5)
    many = jax.jit(lambda p, b, m, k, z: pv.sharded_noisy_gradient(
        loss, p, frozen, b, m, k, cfg, mesh, param_specs=specs, noise_multiplier=z))
    sharded = pv.shard_params(params, mesh, specs)
    for z in (0.0, 1.0):  # 0: the clipped sum (over b_exp); 1: the release
        g1, i1 = one(params, batch, mask, key, z)
        gm, im = many(sharded, batch, mask, key, z)
        assert int(i1.num_clipped) > 0 and int(im.num_clipped) == int(i1.num_clipped)
        np.testing.assert_allclose(np.asarray(im.norms), np.asarray(i1.norms), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(im.losses), np.asarray(i1.losses), rtol=1e-5,
                                   atol=1e-6)
        _close(gm, g1)
    # the output carries the parameter sharding (checked on the largest leaf)
    flat_g, flat_s = jax.tree.leaves(gm), jax.tree.structure(params).flatten_up_to(specs)
    i = max(range(len(flat_g)), key=lambda j: flat_g[j].size)
    assert flat_g[i].sharding.spec == flat_s[i] and not flat_g[i].sharding.is_fully_replicated
    assert len(flat_g[i].sharding.device_set) == 8
    assert jax.tree.map(lambda x: x.sharding.spec, gm) == specs


def test_noise_is_drawn_per_shard(problems):
    """No device generates random bits of a sharded leaf's full shape: each draws its slice."""
    loss, params, frozen, cfg, batch, mask, min_size, _ = problems("mlp")
    mesh = pv.model_mesh(2, 4)
    specs = pv.fsdp_specs(params, mesh, min_size=min_size)
    f = jax.jit(lambda p, b, m, k: pv.sharded_noisy_gradient(loss, p, frozen, b, m, k, cfg, mesh,
                                                             param_specs=specs))
    text = f.lower(pv.shard_params(params, mesh, specs), batch, mask,
                   jax.random.key(0)).compile().as_text()
    bits = set(re.findall(r"u32\[([0-9,]+)\]", text))
    assert "8,4" in bits  # the slice of the (8, 16) kernel
    assert not {"8,16", "16,4"} & bits


def test_tensor_parallel_specs_equal_one_device(problems):
    """Megatron-style: the first kernel split by columns, the second by rows."""
    loss, params, frozen, cfg, batch, mask, _, one = problems("mlp")
    mesh = pv.model_mesh(2, 4)
    specs = {"dense1": {"kernel": P(None, "model"), "bias": P("model")},
             "dense2": {"kernel": P("model", None), "bias": P()}}
    key = jax.random.key(6)
    g1, i1 = one(params, batch, mask, key, 1.0)
    gm, im = jax.jit(lambda p, b, m, k: pv.sharded_noisy_gradient(
        loss, p, frozen, b, m, k, cfg, mesh, param_specs=specs))(
        pv.shard_params(params, mesh, specs), batch, mask, key)
    _close(gm, g1)
    assert int(im.num_clipped) == int(i1.num_clipped) > 0
    k2 = gm["dense2"]["kernel"]
    assert k2.sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), k2.ndim)


def test_sharded_private_gradient_samples_like_private_gradient():
    loss, params, frozen, data, min_size = _mlp()
    cfg = _config(48, 12)
    mesh = pv.model_mesh(4, 2)
    key = jax.random.key(9)
    g1, i1 = jax.jit(lambda p, d, k: pv.private_gradient(loss, p, frozen, d, k, cfg,
                                                         microbatch_size=4))(params, data, key)
    specs = pv.fsdp_specs(params, mesh, min_size=min_size)
    gm, im = jax.jit(lambda p, d, k: pv.sharded_private_gradient(
        loss, p, frozen, d, k, cfg, mesh, microbatch_size=4, param_specs=specs))(
        pv.shard_params(params, mesh, specs), data, key)
    assert im.mask.shape[0] % 16 == 0 and int(im.mask.sum()) == int(i1.mask.sum())
    assert im.mask.shape[0] // 4 > 4  # more rows per data shard than a microbatch: chunked
    assert int(im.num_clipped) == int(i1.num_clipped) > 0 and not bool(im.overflow)
    _close(gm, g1)


# ----------------------------------------------------------------------------- broken variants

def test_per_shard_clipping_is_caught(problems):
    """Clipping each model shard by the norm of its own slice (instead of the full per-example
    norm) changes the clipped sum and lets an example's joint norm exceed C."""
    loss, params, frozen, cfg, batch, mask, min_size, one = problems("mlp")
    mesh = pv.model_mesh(2, 4)
    n = mesh.shape["model"]
    flat_specs = jax.tree.structure(params).flatten_up_to(
        pv.fsdp_specs(params, mesh, min_size=min_size))
    grads = jax.vmap(jax.grad(loss), in_axes=(None, None, 0))(params, frozen, batch)
    leaves, treedef = jax.tree.flatten(grads)
    dims = [list(s).index("model") + 1 if "model" in s else None for s in flat_specs]
    parts = [jnp.split(g, n, axis=d) if d is not None else [g] * n for g, d in zip(leaves, dims)]
    sq = jnp.stack([sum(jnp.sum(p[k].reshape(p[k].shape[0], -1) ** 2, axis=1) for p in parts)
                    for k in range(n)], axis=1)  # (B, n) squared norm seen by each model shard
    coef = jnp.where(mask[:, None], pv.clip_coefficients(jnp.sqrt(sq), cfg.l2_clip), 0.0)
    clipped = [jnp.concatenate([p[k] * coef[:, k].reshape((-1,) + (1,) * (g.ndim - 1))
                                for k in range(n)], axis=d) if d is not None
               else g * coef[:, 0].reshape((-1,) + (1,) * (g.ndim - 1))
               for g, d, p in zip(leaves, dims, parts)]
    joint = pv.per_example_norms(jax.tree.unflatten(treedef, clipped))
    assert float(jnp.max(joint)) > 1.5 * cfg.l2_clip  # the sensitivity bound is lost
    broken = jax.tree.unflatten(treedef, [jnp.sum(c, axis=0) / cfg.sampling.expected_batch_size
                                          for c in clipped])
    g1, _ = one(params, batch, mask, jax.random.key(0), 0.0)
    with pytest.raises(AssertionError):
        _close(broken, g1, rtol=1e-3)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_per_device_noise_keys_are_caught(problems, shape):
    """Noise drawn on each data-parallel device with its own key and then summed with the
    clipped sums: not the one-device release, and its std is sqrt(n_data) times too large."""
    loss, params, frozen, cfg, batch, mask, min_size, one = problems("mlp")
    mesh = pv.model_mesh(*shape)
    specs = pv.fsdp_specs(params, mesh, min_size=min_size)
    key = jax.random.key(3)
    good = jax.jit(lambda p, b, m, k, z: pv.sharded_noisy_gradient(
        loss, p, frozen, b, m, k, cfg, mesh, param_specs=specs, noise_multiplier=z))
    sharded = pv.shard_params(params, mesh, specs)
    g0, _ = good(sharded, batch, mask, key, 0.0)
    g1, _ = good(sharded, batch, mask, key, 1.0)

    def local(g):  # this device's slice of the clipped mean; noise from a per-device key
        k = jax.random.fold_in(key, jax.lax.axis_index("data"))
        noise = [jax.random.normal(jax.random.fold_in(k, i), x.shape)
                 for i, x in enumerate(jax.tree.leaves(g))]
        std = cfg.noise_multiplier * cfg.l2_clip / cfg.sampling.expected_batch_size
        return jax.tree.map(lambda x, e: x + jax.lax.psum(e, "data") * std, g,
                            jax.tree.unflatten(jax.tree.structure(g), noise))

    bad = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=specs))(g0)
    with pytest.raises(AssertionError):
        _close(bad, g1, rtol=1e-3)
    scale = cfg.noise_multiplier * cfg.l2_clip / cfg.sampling.expected_batch_size

    def std(g):
        return float(np.std(np.concatenate([np.ravel(np.asarray(a) - np.asarray(b)) for a, b in
                                            zip(jax.tree.leaves(g), jax.tree.leaves(g0))]))
                     / scale)

    assert 0.8 < std(g1) < 1.2
    assert 0.8 * np.sqrt(shape[0]) < std(bad) < 1.2 * np.sqrt(shape[0])


# ----------------------------------------------------------------------------- rules and errors

def test_fsdp_specs_rule():
    mesh = pv.model_mesh(2, 4)
    tree = {"emb": jnp.zeros((128, 32)), "up": jnp.zeros((32, 64)), "sq": jnp.zeros((64, 64)),
            "odd": jnp.zeros((100, 30)), "none": jnp.zeros((30, 39)), "small": jnp.zeros((8, 8)),
            "scalar": jnp.zeros(()), "vec": jnp.zeros((2048,))}
    specs = pv.fsdp_specs(tree, mesh)
    assert specs == {"emb": P("model"), "up": P(None, "model"), "sq": P("model"),
                     "odd": P("model"), "none": P(), "small": P(), "scalar": P(),
                     "vec": P("model")}
    assert pv.fsdp_specs(tree, mesh, min_size=1)["small"] == P("model")
    assert pv.fsdp_specs(tree, mesh, axis=("data", "model"))["emb"] == P(("data", "model"))
    assert all(s == P() for s in jax.tree.leaves(
        pv.fsdp_specs(tree, pv.model_mesh(8, 1)), is_leaf=lambda x: isinstance(x, P)))
    placed = pv.shard_params(tree, mesh)
    assert placed["emb"].sharding.spec == P("model")
    assert placed["emb"].addressable_shards[0].data.shape == (32, 32)


def test_clear_errors():
    loss, params, frozen, data, min_size = _mlp()
    cfg = _config(48, 12)
    mesh = pv.model_mesh(4, 2)
    with pytest.raises(ValueError, match="not divisible"):
        pv.sharded_noisy_gradient(loss, params, frozen, jax.tree.map(lambda x: x[:30], data),
                                  None, jax.random.key(0), cfg, mesh)
    with pytest.raises(ValueError, match="does not have"):
        pv.sharded_noisy_gradient(loss, params, frozen, data, None, jax.random.key(0), cfg,
                                  pv.data_mesh(8))
    with pytest.raises(ValueError, match="not a multiple of microbatch_size 8"):
        pv.sharded_noisy_gradient(loss, params, frozen, data, None, jax.random.key(0), cfg,
                                  mesh, microbatch_size=8)  # 12 rows per data shard
    with pytest.raises(ValueError, match="does not have"):
        pv.fsdp_specs(params, pv.data_mesh(8))
    with pytest.raises(ValueError, match="does not divide"):
        pv.shard_params({"w": jnp.zeros((6, 3))}, mesh, {"w": P(None, "model")})
    with pytest.raises(ValueError, match="needs 16 devices"):
        pv.model_mesh(4, 4)
    for bad in ((0, 2), (2, 1.5), (True, 2)):
        with pytest.raises(ValueError, match="positive int"):
            pv.model_mesh(*bad)


@pytest.mark.parametrize("method", ["ghost", "ghost_two_pass"])
def test_ghost_clipping_methods_pass_through(problems, method):
    """The clipping method of the config reaches clipped_sum unchanged and still matches."""
    loss, params, frozen, cfg, batch, mask, min_size, _ = problems("mlp")
    cfg = dataclasses.replace(cfg, clip_method=method)
    mesh = pv.model_mesh(2, 4)
    specs = pv.fsdp_specs(params, mesh, min_size=min_size)
    key = jax.random.key(8)
    g1, i1 = jax.jit(lambda p, b, m, k: pv.noisy_gradient(loss, p, frozen, b, m, k, cfg))(
        params, batch, mask, key)
    gm, im = jax.jit(lambda p, b, m, k: pv.sharded_noisy_gradient(
        loss, p, frozen, b, m, k, cfg, mesh, param_specs=specs))(
        pv.shard_params(params, mesh, specs), batch, mask, key)
    assert int(im.num_clipped) == int(i1.num_clipped) > 0
    _close(gm, g1)
