"""One check decides what may leave the process, for every release and submit path.

``save_release``/``save_spec`` and ``Dock.submit`` call the same functions
(:mod:`pavejax._releasable`), so each refusal is tested on every path: secrets by name (a model
leaf named ``lora_a`` once passed the dock while ``save_release`` refused it), specs made from a
caller-supplied noise key (replayable: the key regenerates the noise), add/remove figures.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax.accounting import Ledger, gaussian_step_event
from pavejax.pave import spec as S
from pavejax.pave.dock import Dock
from pavejax.release import ReleaseError, ReleaseMetadata, save_release, save_spec
from pavejax.spec_types import PaveSpec

N, D_IN, K = 6, 4, 2


def _logits(params, batch, aux):
    return batch["x"] @ params["w"]["kernel"]


def _predicate(path, leaf):
    return path.endswith("kernel")


@pytest.fixture(scope="module")
def toy():
    rng = np.random.default_rng(0)
    params = {"w": {"kernel": jnp.asarray(rng.normal(size=(D_IN, K)), jnp.float32)}}
    backbone = S.Backbone("toy-linear", params, S.backbone_hash(params))
    x = rng.normal(size=(N, D_IN)).astype(np.float32)
    targets = S.hard_targets(rng.integers(0, K, N), K)
    cfg = S.SpecConfig.preset("one_step", rank=1, progress=False, privacy=S.PrivacyConfig(
        noise_multiplier=3.0, sampling="full", accountant="rdp"))

    def make(noise_key=None):
        return S.generate_spec(_logits, backbone, _predicate, {"x": x}, targets,
                               jax.random.key(11), cfg, noise_key=noise_key)

    return make


def _plain_meta():
    return ReleaseMetadata(kind="model", backbone_id="toy", backbone_hash="ab" * 32,
                           mechanism="none", ledger=None, guarantee={"kind": "none"})


@pytest.fixture
def dock(tmp_path):
    with Dock.create(tmp_path / "dock") as d:
        yield d


def test_replayable_spec_is_refused_by_save_spec_and_dock(toy, dock, tmp_path):
    replay = toy(noise_key=jax.random.key(5)).spec
    assert replay.info["replayable"] is True
    with pytest.raises(ReleaseError, match="caller-supplied noise key"):
        save_spec(tmp_path / "spec", replay)
    with pytest.raises(ValueError, match="caller-supplied noise key"):
        dock.submit(replay, name="replayed")
    assert not (tmp_path / "spec").exists() and len(dock) == 0
    # the same marker nested in caller metadata is refused too (the check walks the record)
    fresh = toy().spec
    assert fresh.info["replayable"] is False and "never recorded" in fresh.info["noise_key"]
    with pytest.raises(ValueError, match="replayable"):
        dock.submit(fresh, name="m", metadata={"source": {"replayable": True}})
    # what the error says to do works: a spec without noise_key is released and submitted
    save_spec(tmp_path / "spec", fresh)
    assert dock.submit(fresh, name="fresh") >= 1


def test_replayable_key_really_is_replayable(toy):
    """Why the refusal matters: the same key gives the same noise, so it can be subtracted."""
    a, b = toy(noise_key=jax.random.key(5)), toy(noise_key=jax.random.key(5))
    np.testing.assert_array_equal(a.spec.vector, b.spec.vector)
    c, d = toy(), toy()
    assert np.abs(c.spec.vector - d.spec.vector).max() > 1e-3


@pytest.mark.parametrize("name", ["lora_a", "LoRA_A", "A", "a_key", "secret_index", "rng_state",
                                  "coin_state", "sampling_key"])
def test_secret_names_are_refused_by_both_paths(toy, dock, tmp_path, name):
    spec = toy().spec
    model = {"head": {"kernel": np.ones((3, 2), np.float32)},
             "adapter": {name: np.ones((2, 3), np.float32)}}
    with pytest.raises(ValueError, match="named like a secret"):
        dock.submit(spec, name="m", model=model)
    meta = _plain_meta()
    with pytest.raises(ReleaseError, match="named like a secret"):
        save_release(tmp_path / "r", model, meta)
    with pytest.raises(ValueError, match=f"entry named {name!r}"):
        dock.submit(spec, name="m", metadata={"extra": {name: 1}})
    assert len(dock) == 0 and not (tmp_path / "r").exists()
    # "key" alone is BERT's attention projection, not a secret: allowed on both paths
    model["adapter"] = {"key": {"kernel": np.ones((2, 3), np.float32)}}
    dock.submit(spec, name="m", model=model)
    save_release(tmp_path / "r", model, meta)


def test_prng_key_leaves_are_refused_by_both_paths(toy, dock, tmp_path):
    spec = toy().spec
    model = {"w": np.ones(3, np.float32), "k": jax.random.key(0)}
    with pytest.raises(ValueError, match="PRNG key"):
        dock.submit(spec, name="m", model=model)
    meta = _plain_meta()
    with pytest.raises(ReleaseError, match="PRNG key"):
        save_release(tmp_path / "r", model, meta)


def test_dock_refuses_an_add_remove_spec(toy, dock):
    spec = toy().spec
    ar = Ledger("add_remove", "rdp")
    ar.record(gaussian_step_event(3.0, q=1.0), label="dp-s-pave")
    info = dict(spec.info)
    bad_ledger = PaveSpec(spec.vector, spec.signature, spec.kind,
                          info | {"ledger": ar.to_dict()})
    with pytest.raises(ValueError, match="add/remove neighbouring"):
        dock.submit(bad_ledger, name="m")
    g = dict(info["guarantee"]) | {"epsilon_add_remove": math.pi}
    bad_figure = PaveSpec(spec.vector, spec.signature, spec.kind, info | {"guarantee": g})
    with pytest.raises(ValueError, match="add/remove figure"):
        dock.submit(bad_figure, name="m")
    assert len(dock) == 0
