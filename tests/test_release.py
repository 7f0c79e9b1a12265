"""Release format: round trips, integrity, version and backbone checks, resharding, no secrets."""

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pavejax import lora
from pavejax.accounting import Ledger, gaussian_step_event
from pavejax.release import (
    ReleaseError,
    ReleaseIntegrityError,
    ReleaseMetadata,
    content_hash,
    load_release,
    load_spec,
    save_release,
    save_spec,
)
from pavejax.spec_types import PaveSpec, SpecMismatchError, SpecSignature

BACKBONE = "ab" * 32
OTHER_BACKBONE = "ef" * 32
NONE = {"kind": "none"}


def _signature(**changes):
    sig = SpecSignature("tiny-mlp", BACKBONE, 2, ("l0/kernel", "l1/kernel"), (4, 6), "cd" * 32,
                        "gaussian")
    return dataclasses.replace(sig, **changes)


def _spec(**info):
    vec = np.linspace(-1.0, 1.0, 10, dtype=np.float32)
    return PaveSpec(vec, _signature(), "user", {"mechanism": "pave", "guarantee": NONE, **info})


def _meta(**changes):
    fields = dict(kind="model", backbone_id="tiny-mlp", backbone_hash=BACKBONE, mechanism="none",
                  ledger=None, guarantee=NONE)
    return ReleaseMetadata(**(fields | changes))


def _dp_ledger():
    # full-batch steps: replace-one RDP analyses them in milliseconds
    ledger = Ledger("replace_one", accountant="rdp")
    ledger.record(gaussian_step_event(6.0, q=1.0), count=20, label="dp-sgd")
    return ledger


def _independent_hash(root):
    """The documented hash recomputed from scratch: sorted paths, each with its file's sha256."""
    h = hashlib.sha256(b"pavejax.release.content.v1\0")
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.name != "CONTENT_HASH")
    for rel in files:
        name = rel.encode()
        h.update(len(name).to_bytes(8, "little") + name
                 + hashlib.sha256((root / rel).read_bytes()).digest())
    return h.hexdigest()


# ------------------------------------------------------------------------------ specs


def test_spec_round_trip_is_exact_and_hash_is_documented_one(tmp_path):
    spec = _spec(config={"rank": 2, "seed": 3})
    digest = save_spec(tmp_path / "spec", spec)
    assert digest == _independent_hash(tmp_path / "spec") == content_hash(tmp_path / "spec")
    assert (tmp_path / "spec" / "CONTENT_HASH").read_text().splitlines()[0] == digest
    back = load_spec(tmp_path / "spec", expect_signature=_signature())
    np.testing.assert_array_equal(back.vector, spec.vector)
    assert back.signature == spec.signature and back.kind == "user"
    assert dict(back.info) == dict(spec.info)
    _, meta = load_release(tmp_path / "spec")
    assert meta.kind == "spec" and meta.rank == 2 and meta.a_hash == "cd" * 32
    assert meta.adapted_layers == ("l0/kernel", "l1/kernel")
    assert meta.hyperparameters == {"rank": 2, "seed": 3}


def test_dp_spec_keeps_its_ledger_and_refuses_an_understated_epsilon(tmp_path):
    ledger = _dp_ledger()
    eps = ledger.epsilon(1e-5)
    spec = _spec(mechanism="dp-s-pave", ledger=ledger.to_dict(),
                 guarantee={"kind": "dp", "epsilon": eps, "delta": 1e-5})
    save_spec(tmp_path / "ok", spec)
    _, meta = load_release(tmp_path / "ok")
    assert Ledger.from_dict(meta.ledger) == ledger
    assert meta.guarantee["epsilon"] == eps and meta.mechanism == "dp-s-pave"
    with pytest.raises(ReleaseError, match="ledger gives"):
        save_spec(tmp_path / "low", spec,
                  guarantee={"kind": "dp", "epsilon": 0.9 * eps, "delta": 1e-5})
    assert not (tmp_path / "low").exists()
    with pytest.raises(ReleaseError, match="relation 'replace-one'"):
        save_spec(tmp_path / "rel", spec, guarantee={"kind": "dp", "epsilon": eps, "delta": 1e-5,
                                                     "relation": "replace-one"})


def test_add_remove_figures_are_refused_because_sizes_are_public(tmp_path):
    """A release states its sizes (n, rates, counts), which add/remove neighbours differ in: no
    add/remove ledger or figure may enter one, whichever way it is stated."""
    ar = Ledger("add_remove", accountant="rdp")
    ar.record(gaussian_step_event(1.5, q=0.1), count=20, label="dp-sgd")
    eps = ar.epsilon(1e-5)
    spec = _spec(mechanism="dp-s-pave", ledger=ar.to_dict(),
                 guarantee={"kind": "dp", "epsilon": eps, "delta": 1e-5})
    with pytest.raises(ReleaseError, match="add/remove neighbouring: releases state their "
                                           "dataset sizes"):
        save_spec(tmp_path / "ar", spec)
    ro = _dp_ledger()
    for extra in ({"relation": "add_remove"}, {"epsilon_add_remove": 0.5}):
        g = {"kind": "dp", "epsilon": ro.epsilon(1e-5), "delta": 1e-5, **extra}
        with pytest.raises(ReleaseError, match="add/remove figure"):
            save_release(tmp_path / "g", {"w": np.ones(3, np.float32)},
                         _meta(mechanism="dp-sgd", ledger=ro, guarantee=g))
    assert not (tmp_path / "ar").exists() and not (tmp_path / "g").exists()
    # a ledger of mutual-information charges only is relation-free and may be released
    mi = Ledger("add_remove")
    mi.record_mi(0.1)
    save_release(tmp_path / "mi", {"w": np.ones(3, np.float32)},
                 _meta(mechanism="paczero-mi", ledger=mi,
                       guarantee={"kind": "pac_mi", "mutual_information_nats": 0.1}))


def test_spec_needs_a_stated_guarantee(tmp_path):
    spec = PaveSpec(np.ones(10, np.float32), _signature(), "model", {})
    with pytest.raises(ReleaseError, match="states its guarantee"):
        save_spec(tmp_path / "s", spec)
    with pytest.raises(ReleaseError, match="needs its ledger"):
        save_spec(tmp_path / "s", spec, guarantee={"kind": "dp", "epsilon": 1.0, "delta": 1e-5},
                  mechanism="dp-s-pave")
    with pytest.raises(ReleaseError, match="name the spec's mechanism"):
        save_spec(tmp_path / "s", spec, guarantee={"kind": "dp", "epsilon": 1.0, "delta": 1e-5},
                  ledger=_dp_ledger())


@pytest.mark.parametrize("field, value", [("rank", 3), ("a_hash", "00" * 32),
                                          ("backbone_hash", OTHER_BACKBONE)])
def test_load_spec_refuses_another_parameter_space(tmp_path, field, value):
    save_spec(tmp_path / "s", _spec())
    with pytest.raises(SpecMismatchError, match=field):
        load_spec(tmp_path / "s", expect_signature=_signature(**{field: value}))


def test_adapter_signature_checked_from_metadata_fields(tmp_path):
    meta = _meta(kind="adapter", adapted_layers=("l0/kernel", "l1/kernel"), rank=2,
                 a_init="gaussian", a_hash="cd" * 32)
    save_release(tmp_path / "r", {"B": {"l0/kernel": np.ones((2, 2), np.float32)}}, meta)
    load_release(tmp_path / "r", expect_signature=_signature())
    with pytest.raises(SpecMismatchError, match="a_init"):
        load_release(tmp_path / "r", expect_signature=_signature(a_init="kaiming_uniform"))


# ------------------------------------------------------------------------------ integrity


def _tensor_file(root):
    return max((p for p in (root / "tensors").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def test_a_flipped_tensor_byte_is_caught_and_named(tmp_path):
    save_release(tmp_path / "r", {"w": np.arange(256, dtype=np.float32)}, _meta())
    target = _tensor_file(tmp_path / "r")
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    target.write_bytes(bytes(raw))
    rel = target.relative_to(tmp_path / "r").as_posix()
    with pytest.raises(ReleaseIntegrityError, match=f"modified or corrupted.*changed: .*{rel}"):
        load_release(tmp_path / "r")


def test_edited_metadata_and_added_files_are_caught(tmp_path):
    save_release(tmp_path / "r", {"w": np.ones(3, np.float32)}, _meta())
    path = tmp_path / "r" / "metadata.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps(record | {"mechanism": "dp-sgd"}))
    with pytest.raises(ReleaseIntegrityError, match="changed: .*metadata.json"):
        load_release(tmp_path / "r")
    save_release(tmp_path / "s", {"w": np.ones(3, np.float32)}, _meta())
    (tmp_path / "s" / "tensors" / "extra.bin").write_bytes(b"x")
    with pytest.raises(ReleaseIntegrityError, match="added: .*tensors/extra.bin"):
        load_release(tmp_path / "s")


@pytest.mark.parametrize("version, message", [(2, "newer .*upgrade pavejax"),
                                              ("1", "unknown release format version"),
                                              (0, "unknown release format version")])
def test_format_version_is_checked(tmp_path, version, message):
    save_release(tmp_path / "r", {"w": np.ones(3, np.float32)}, _meta())
    path = tmp_path / "r" / "metadata.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"format_version": version}))
    with pytest.raises(ReleaseError, match=message):
        load_release(tmp_path / "r")


def test_backbone_mismatch_names_both_hashes(tmp_path):
    save_release(tmp_path / "r", {"w": np.ones(3, np.float32)}, _meta())
    load_release(tmp_path / "r", expect_backbone_hash=BACKBONE)
    with pytest.raises(ReleaseError, match=f"a release for another backbone.*{BACKBONE}.*"
                                           f"{OTHER_BACKBONE}"):
        load_release(tmp_path / "r", expect_backbone_hash=OTHER_BACKBONE)


def test_not_a_release(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ReleaseError, match="not a pavejax release"):
        load_release(tmp_path / "d")


# ------------------------------------------------------------------------------ writing


def test_overwrite_rules_and_atomicity(tmp_path):
    save_release(tmp_path / "r", {"w": np.ones(3, np.float32)}, _meta())
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_release(tmp_path / "r", {"w": np.zeros(3, np.float32)}, _meta())
    save_release(tmp_path / "r", {"w": np.full(3, 7.0, np.float32)}, _meta(), overwrite=True)
    np.testing.assert_array_equal(load_release(tmp_path / "r")[0]["w"], [7.0, 7.0, 7.0])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a pavejax release"):
        save_release(tmp_path / "mine", {"w": np.ones(3, np.float32)}, _meta(), overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "r"]  # no temporaries left


def test_no_local_path_in_the_release(tmp_path):
    save_release(tmp_path / "r", {"w": np.ones(3, np.float32)}, _meta())
    for p in (tmp_path / "r").rglob("*"):
        if p.is_file():
            assert str(tmp_path).encode() not in p.read_bytes(), p


# ------------------------------------------------------------------------------ metadata


def test_metadata_round_trip_and_json_only(tmp_path):
    meta = _meta(kind="adapter", adapted_layers=["l0/kernel"], rank=4, a_init="gaussian",
                 a_hash="12" * 32, mechanism="dp-sam", ledger=_dp_ledger(),
                 guarantee={"kind": "dp", "epsilon": 50.0, "delta": 1e-5},
                 hyperparameters={"lr": 1e-3, "steps": 20}, risk={"mia_advantage": 0.1})
    assert ReleaseMetadata.from_dict(json.loads(json.dumps(meta.to_dict()))) == meta
    assert meta.ledger == _dp_ledger().to_dict()
    with pytest.raises(ReleaseError, match="JSON-serialisable"):
        _meta(hyperparameters={"lr": np.float32(0.1)})
    with pytest.raises(ReleaseError, match="JSON-serialisable"):
        _meta(risk={"bound": float("nan")})
    with pytest.raises(ReleaseError, match="unknown fields"):
        ReleaseMetadata.from_dict(meta.to_dict() | {"surprise": 1})


@pytest.mark.parametrize("changes, message", [
    ({"guarantee": {"kind": "dp", "epsilon": 1.0, "delta": 1e-5}}, "needs its ledger"),
    ({"guarantee": {"kind": "none", "epsilon": 1.0}}, "must not state an epsilon"),
    ({"guarantee": {"epsilon": 1.0}}, "non-empty string 'kind'"),
    ({"ledger": _dp_ledger(), "guarantee": {"kind": "dp", "epsilon": 1.0}}, "delta"),
    ({"ledger": _dp_ledger(), "guarantee": {"kind": "sketch_rdp", "epsilon": 1.0}},
     "list its conditions"),
    ({"ledger": _dp_ledger(), "guarantee": {"kind": "sketch_rdp", "conditions": ["A secret"],
                                            "certified": True}}, "conditional"),
    ({"ledger": {"format": "other"}}, "not a valid Ledger"),
    ({"a_hash": "not-a-hash"}, "64 lowercase hex"),
    ({"kind": "spec"}, "must name its low-rank space"),
    ({"rank": 0}, "rank must be an int >= 1"),
    ({"backbone_hash": ""}, "backbone_hash"),
    ({"format_version": 2}, "writes release format version 1"),
])
def test_metadata_validation(changes, message):
    with pytest.raises(ReleaseError, match=message):
        _meta(**changes)


def test_ledger_must_be_passed_explicitly():
    with pytest.raises(TypeError, match="ledger"):
        ReleaseMetadata(kind="model", backbone_id="x", backbone_hash=BACKBONE, mechanism="none",
                        guarantee=NONE)


# ------------------------------------------------------------------------------ secrets


@pytest.mark.parametrize("tensors", [
    {"A": np.ones((4, 2), np.float32)},
    {"factors": {"lora_A": np.ones((4, 2), np.float32)}},
    {"layers/0/query/lora_A.weight": np.ones((2, 4), np.float32)},
    {"w": np.ones(2, np.float32), "a_key": np.ones(2, np.uint32)},
    {"w": np.ones(2, np.float32), "secret_index": np.ones(1, np.int32)},
])
def test_secret_names_are_refused_in_tensors(tmp_path, tensors):
    with pytest.raises(ReleaseError, match="release the a_hash instead"):
        save_release(tmp_path / "r", tensors, _meta())
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("field, value", [
    ("extra", {"a_key": [1, 2]}), ("hyperparameters", {"secret_index": 3}),
    ("extra", {"state": {"mechanism_rng": 7}}), ("risk", {"secret": "x"}),
])
def test_secret_names_are_refused_in_metadata(tmp_path, field, value):
    with pytest.raises(ReleaseError, match="release the a_hash instead"):
        save_release(tmp_path / "r", {"w": np.ones(2, np.float32)}, _meta(**{field: value}))


def test_prng_keys_are_refused(tmp_path, key):
    with pytest.raises(ReleaseError, match="PRNG key"):
        save_release(tmp_path / "r", {"w": np.ones(2, np.float32), "k": key}, _meta())


def _all_bytes(root):
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def test_byte_scan_of_an_adapter_release_finds_no_secret(tmp_path, getkey):
    key = getkey()  # a split key: its 8 data bytes look random (key(0) is all zeros)
    assert len(set(np.asarray(jax.random.key_data(key)).tobytes())) > 4
    params = {"l0": {"kernel": jnp.ones((16, 12))}, "l1": {"kernel": jnp.ones((12, 8))}}
    cfg = lora.LoraConfig(rank=4)
    B, A = lora.init_lora(key, params, lambda p, _: p.endswith("kernel"), cfg)
    B = {p: jax.random.normal(jax.random.fold_in(key, 99 + i), b.shape)
         for i, (p, b) in enumerate(sorted(B.items()))}
    meta = _meta(kind="adapter", adapted_layers=tuple(B), rank=4, a_init="gaussian",
                 a_hash=lora.a_hash(A))
    save_release(tmp_path / "r", {"B": B}, meta)
    blob = _all_bytes(tmp_path / "r")
    secrets = [np.asarray(jax.random.key_data(key)).tobytes()]
    for a in A.values():
        a = np.asarray(a, np.float32)
        secrets += [a.tobytes(), a[0].tobytes(), a[3].tobytes(), a[-1].tobytes(),
                    a[:, 0].copy().tobytes()]
    assert not [s for s in secrets if s in blob]
    # The scan can see: the released B, its rows, and the a_hash are present in the bytes ...
    for b in B.values():
        b = np.asarray(b, np.float32)
        assert b.tobytes() in blob and b[1].tobytes() in blob
    assert lora.a_hash(A).encode() in blob
    # ... and A smuggled in under an innocent name is found by the same scan.
    save_release(tmp_path / "leak", {"B": B, "extra_factor": A}, meta)
    leak = _all_bytes(tmp_path / "leak")
    assert all(np.asarray(a, np.float32).tobytes() in leak for a in A.values())


# ------------------------------------------------------------------------------ sharding


@pytest.mark.parametrize("devices, spec", [(1, P()), (8, P("data")), (8, P())])
def test_restore_onto_a_mesh(tmp_path, devices, spec):
    w = np.arange(64, dtype=np.float32).reshape(16, 4)
    b = np.arange(4, dtype=np.float32)
    saved_on = jax.make_mesh((8,), ("data",))  # written sharded over 8 devices
    save_release(tmp_path / "r", {"w": jax.device_put(w, NamedSharding(saved_on, P("data"))),
                                  "b": b}, _meta())
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    target = {"w": jax.ShapeDtypeStruct(w.shape, jnp.float32, sharding=NamedSharding(mesh, spec)),
              "b": jax.ShapeDtypeStruct(b.shape, jnp.float32, sharding=NamedSharding(mesh, P()))}
    out, _ = load_release(tmp_path / "r", target=target)
    assert out["w"].sharding == NamedSharding(mesh, spec)
    assert len(out["w"].sharding.device_set) == devices
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
    np.testing.assert_array_equal(np.asarray(out["b"]), b)
    # The same through ``sharding=`` alone (structure and shapes read from the release).
    out, _ = load_release(tmp_path / "r", sharding=NamedSharding(mesh, P()))
    assert out["w"].sharding == NamedSharding(mesh, P())
    np.testing.assert_array_equal(np.asarray(out["w"]), w)


def test_restore_onto_a_wrong_target_says_so(tmp_path):
    save_release(tmp_path / "r", {"w": np.ones((4, 2), np.float32)}, _meta())
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(ReleaseError, match="saved structure"):
        load_release(tmp_path / "r",
                     target={"v": jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=dev)})


def test_merged_model_release_restores_a_working_model(tmp_path, key):
    from flax import nnx

    from pavejax.models import BertConfig, BertEncoder

    graphdef, state = nnx.split(BertEncoder(BertConfig.tiny(), rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    B, A = lora.init_lora(key, params, lambda p, _: p.endswith("query/kernel"),
                          lora.LoraConfig(rank=2))
    B = {p: jnp.full(b.shape, 0.1) for p, b in B.items()}
    merged = lora.apply_lora(params, B, A, lora.LoraConfig(rank=2))
    meta = _meta(kind="merged_model", mechanism="dp-sam", ledger=_dp_ledger(),
                 guarantee={"kind": "dp", "epsilon": 100.0, "delta": 1e-5})
    save_release(tmp_path / "m", merged, meta)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), params)
    back, meta_back = load_release(tmp_path / "m", target=target, expect_backbone_hash=BACKBONE)
    assert meta_back == meta
    model = nnx.merge(graphdef, back)  # the restored pytree is the module's own structure
    kernel = model.layers[0].attention.query.kernel[...]
    assert kernel.sharding == dev
    np.testing.assert_array_equal(np.asarray(kernel),
                                  np.asarray(merged["layers"][0]["attention"]["query"]["kernel"]))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(merged), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
