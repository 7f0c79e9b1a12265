"""The learnware dock: store, refusals, secret key, search, and crash/concurrency safety."""

import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from pavejax.lora import LoraConfig, init_lora
from pavejax.pave.dock import SCORE_TEMPERATURE, Dock, DockError
from pavejax.privacy import data_mesh
from pavejax.spec_types import PaveSpec, SpecMismatchError, SpecSignature

ROOT = Path(__file__).resolve().parents[1]
SIG = SpecSignature("toy-backbone", "b" * 64, 2, ("l0/kernel", "l1/kernel"), (12, 8), "a" * 64,
                    "gaussian")


def spec(vec, kind="model", sig=SIG, **info):
    return PaveSpec(np.asarray(vec, np.float32), sig, kind=kind, info=info)


def rand_spec(seed, kind="model"):
    return spec(np.random.default_rng(seed).standard_normal(SIG.dim), kind)


@pytest.fixture
def dock(tmp_path):
    d = Dock.create(tmp_path / "dock")
    yield d
    d.close()


def run_python(code, *args, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code),
                             *map(str, args)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


PRELUDE = f"""
import sys, numpy as np
from pavejax.pave import dock as dock_mod
from pavejax.pave.dock import Dock
from pavejax.spec_types import PaveSpec, SpecSignature
SIG = SpecSignature.from_dict({json.dumps(SIG.to_dict())})
def rand_spec(seed):
    return PaveSpec(np.random.default_rng(seed).standard_normal(SIG.dim).astype(np.float32), SIG)
"""


# ------------------------------------------------------------------ create / open / secret


def test_create_open_and_directory_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="create one with Dock.create"):
        Dock.open(tmp_path / "nothing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DockError, match="not a pavejax dock"):
        Dock.open(tmp_path / "plain")
    (tmp_path / "plain" / "file.txt").write_text("x")
    with pytest.raises(DockError, match="not an empty directory nor a dock"):
        Dock.create(tmp_path / "plain")
    Dock.create(tmp_path / "d", signature=SIG).close()
    with pytest.raises(FileExistsError, match="exist_ok=True"):
        Dock.create(tmp_path / "d")
    with Dock.create(tmp_path / "d", exist_ok=True) as d:
        assert d.signature == SIG
    with pytest.raises(SpecMismatchError, match="rank: 2 vs 4"):
        Dock.create(tmp_path / "d", signature=dataclasses.replace(SIG, rank=4), exist_ok=True)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(DockError, match="corrupt"):
        Dock.open(tmp_path / "bad")
    other = tmp_path / "other" / "index.sqlite"
    other.parent.mkdir()
    sqlite3.connect(other).execute("CREATE TABLE meta (key TEXT, value TEXT)").connection.commit()
    with pytest.raises(DockError, match="corrupt|not a pavejax dock"):
        Dock.open(other.parent)


def test_secret_key_is_private_and_never_stored_elsewhere(dock):
    dock.submit(rand_spec(0), name="m", model={"w": np.ones(3, np.float32)})
    key_file = dock.path / "secret" / "a_key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    seed_hex = key_file.read_text().strip()
    assert len(bytes.fromhex(seed_hex)) == 32
    for f in dock.path.rglob("*"):
        if f.is_file() and f != key_file:
            data = f.read_bytes()
            assert seed_hex.encode() not in data and bytes.fromhex(seed_hex) not in data, f
    k1, k2 = dock.a_key(), Dock.open(dock.path).a_key()
    np.testing.assert_array_equal(jax.random.key_data(k1), jax.random.key_data(k2))
    params = {"l0": {"kernel": np.zeros((5, 6), np.float32)}}
    _, a = init_lora(k1, params, lambda p, _: p.endswith("kernel"), LoraConfig(rank=2))
    assert a["l0/kernel"].shape == (5, 2)


def test_secret_folder_and_key_file_are_owner_only_whatever_the_umask(tmp_path):
    # Under umask 0 the modes on disk are exactly those Dock.create asks for (a restrictive
    # umask would hide a too-open request): the secret folder 0700, the key file 0600.
    old = os.umask(0)
    try:
        Dock.create(tmp_path / "dock").close()
    finally:
        os.umask(old)
    assert (tmp_path / "dock" / "secret").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "dock" / "secret" / "a_key").stat().st_mode & 0o777 == 0o600


def test_two_docks_have_different_keys(tmp_path):
    with Dock.create(tmp_path / "a") as a, Dock.create(tmp_path / "b") as b:
        assert not np.array_equal(jax.random.key_data(a.a_key()), jax.random.key_data(b.a_key()))
    (tmp_path / "a" / "secret" / "a_key").write_text("short")
    with pytest.raises(DockError, match="missing or corrupt"):
        Dock.open(tmp_path / "a").a_key()


# ------------------------------------------------------------------ submit and read back


def test_submit_roundtrip_of_spec_model_and_index_row(dock):
    model = {"layers": {0: {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
                        1: {"w": np.ones(2, np.float32)}},
             "head": [np.float32(2.5), (np.int32(7), None)]}
    info = {"ledger_summary": {"epsilon": 3.0, "delta": 1e-5}, "fit_target": "model_pred"}
    s = spec(np.arange(1, SIG.dim + 1), **info)
    i = dock.submit(s, name="first", model=model, metadata={"classes": ["neg", "pos"]})
    j = dock.submit(rand_spec(1), name="second")
    assert (i, j) == (1, 2) and len(dock) == 2
    entry = dock.get("first")
    assert entry.id == 1 and entry.metadata == {"classes": ["neg", "pos"]}
    assert (entry.backbone_id, entry.backbone_hash, entry.rank) == (SIG.backbone_id,
                                                                    SIG.backbone_hash, 2)
    assert entry.layers == SIG.layers and entry.a_hash == SIG.a_hash and entry.has_model
    assert entry.ledger_summary == {"epsilon": 3.0, "delta": 1e-5}
    assert entry.spec_info["fit_target"] == "model_pred"
    assert abs(entry.created - __import__("time").time()) < 600
    np.testing.assert_array_equal(entry.spec.vector, s.vector)
    assert entry.spec.signature == SIG and dock.get(2).has_model is False
    back = dock.load_model(1)
    assert set(back["layers"]) == {0, 1}                    # int keys survive
    np.testing.assert_array_equal(back["layers"][0]["w"], model["layers"][0]["w"])
    assert isinstance(back["head"], list) and isinstance(back["head"][1], tuple)
    assert back["head"][1][1] is None and back["head"][0] == np.float32(2.5)
    assert back["head"][1][0].dtype == np.int32
    like = jax.tree.map(np.zeros_like, model)
    jax.tree.map(np.testing.assert_array_equal, dock.load_model(1, like=like), model)
    assert [e.name for e in dock.list()] == ["first", "second"]
    dock.remove("first")
    assert len(dock) == 1 and not (dock.path / "tensors" / "1").exists()
    with pytest.raises(KeyError, match="no learnware 'first'"):
        dock.get("first")
    with pytest.raises(ValueError, match="without a model"):
        dock.load_model(2)
    assert dock.submit(rand_spec(2), name="third") == 3     # ids are never reused


def test_guarantee_becomes_the_ledger_summary(dock):
    g = {"kind": "dp", "epsilon": 2.0, "delta": 1e-6}
    dock.submit(spec(np.ones(SIG.dim), mechanism="dp-s-pave", guarantee=g), name="dp")
    assert dock.get("dp").ledger_summary == {"mechanism": "dp-s-pave", **g}


@pytest.mark.parametrize("field,value", [("backbone_hash", "c" * 64), ("rank", 4),
                                         ("a_hash", "d" * 64),
                                         ("layers", ("l0/kernel", "l2/kernel"))])
def test_mismatched_specs_are_refused_naming_the_field(dock, field, value):
    dock.submit(rand_spec(0), name="ok")                    # locks the signature
    other = dataclasses.replace(SIG, **{field: value})
    with pytest.raises(SpecMismatchError, match=field):
        dock.submit(spec(np.ones(other.dim), sig=other), name="bad")
    with pytest.raises(SpecMismatchError, match=field):
        dock.search(spec(np.ones(other.dim), kind="user", sig=other))
    assert len(dock) == 1 and dock.signature == SIG


def test_nan_specs_and_bad_submissions_are_refused(dock):
    with pytest.raises(ValueError, match="NaN/inf"):
        spec(np.full(SIG.dim, np.nan))
    forged = rand_spec(0)
    object.__setattr__(forged, "vector", np.full(SIG.dim, np.nan, np.float32))
    with pytest.raises(ValueError, match="NaN/inf"):
        dock.submit(forged, name="nan")
    dock.submit(rand_spec(1), name="ok")
    with pytest.raises(ValueError, match="NaN/inf"):
        dock.search(forged)
    with pytest.raises(ValueError, match="kind 'user'"):
        dock.submit(rand_spec(2, kind="user"), name="user")
    with pytest.raises(ValueError, match="NaN/inf"):
        dock.submit(rand_spec(3), name="m", model={"w": np.array([1.0, np.inf], np.float32)})
    with pytest.raises(ValueError, match="JSON"):
        dock.submit(rand_spec(4), name="m", metadata={"x": object()})
    with pytest.raises(ValueError, match="already in the dock; choose another name"):
        dock.submit(rand_spec(5), name="ok")
    with pytest.raises(TypeError, match="PaveSpec"):
        dock.submit(np.ones(SIG.dim), name="raw")
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        dock.search(rand_spec(6, "user"), k=0)
    assert len(dock) == 1 and sorted(os.listdir(dock.path / "tensors")) == ["1"]


# ------------------------------------------------------------------ search


def toy_market(dock, rng, n_per_task=3):
    """Two tasks = two directions in spec space; developer specs scattered around them."""
    tasks = rng.standard_normal((2, SIG.dim))
    names = []
    for t in range(2):
        for j in range(n_per_task):
            v = tasks[t] + 0.6 * rng.standard_normal(SIG.dim)
            names.append(f"task{t}-dev{j}")
            dock.submit(spec(v), name=names[-1], metadata={"task": t})
    return tasks


def test_toy_market_identification_picks_the_right_task(dock):
    rng = np.random.default_rng(0)
    tasks = toy_market(dock, rng)
    users = [spec(tasks[t] + 0.8 * rng.standard_normal(SIG.dim), "user") for t in (0, 1, 0, 1)]
    results = dock.search(users, k=3)
    for u, t, r in zip(users, (0, 1, 0, 1), results, strict=True):
        assert [dock.get(i).metadata["task"] for i in r.ids] == [t, t, t]
        assert all(n.startswith(f"task{t}") for n in r.names)
        assert np.all(np.diff(r.cosines) <= 0)
        np.testing.assert_allclose(r.scores, 1 / (1 + np.exp(-r.cosines / SCORE_TEMPERATURE)),
                                   rtol=1e-6)
        # cosines are those of the stored vectors (float64 reference)
        np.testing.assert_allclose(r.cosines, [u.cosine(dock.load_spec(i))
                                               for i in r.ids], atol=1e-6)


def test_search_edge_cases_and_placements(dock):
    empty = dock.search(rand_spec(0, "user"), k=3)
    assert empty.ids == () and empty.cosines.shape == (0,)
    toy_market(dock, np.random.default_rng(1))
    q = rand_spec(7, "user")
    full = dock.search(q, k=100)
    assert len(full.ids) == 6                                # k clipped to the dock size
    for kw in ({"chunk_size": 4}, {"mesh": data_mesh()}, {"dtype": "bfloat16"}):
        r = dock.search(q, k=6, **kw)
        assert r.ids[0] == full.ids[0]
        np.testing.assert_allclose(r.cosines, full.cosines, atol=1e-2 if kw.get("dtype") else 1e-6)


def test_cache_follows_changes_made_by_another_connection(dock):
    q = rand_spec(9, "user")
    dock.submit(rand_spec(1), name="a")
    assert dock.search(q, k=5).names == ("a",)
    with Dock.open(dock.path) as other:
        other.submit(spec(q.vector), name="twin")
        other.remove("a")
    r = dock.search(q, k=5)
    assert r.names == ("twin",) and r.cosines[0] == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------ processes


def test_persistence_across_processes(tmp_path):
    path = tmp_path / "dock"
    p = run_python("""
        d = Dock.create(sys.argv[1])
        for i in range(4):
            d.submit(rand_spec(i), name=f"m{i}", metadata={"i": i})
        print("ok")
    """, path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    with Dock.open(path) as d:
        assert len(d) == 4 and d.signature == SIG
        for i in range(4):
            target = np.random.default_rng(i).standard_normal(SIG.dim)
            r = d.search(spec(target, "user"), k=2)
            assert r.names[0] == f"m{i}" and r.cosines[0] == pytest.approx(1.0, abs=1e-6)


def test_concurrent_submits_from_two_processes(tmp_path):
    path = tmp_path / "dock"
    Dock.create(path).close()
    code = """
        import os, time
        from pathlib import Path
        d = Dock.open(sys.argv[1])
        w = int(sys.argv[2])
        barrier = Path(sys.argv[1]).parent
        (barrier / f"ready-{w}").touch()
        while not all((barrier / f"ready-{v}").exists() for v in (1, 2)):
            time.sleep(0.01)
        dock_mod._HOOKS["after_tensors"] = lambda: time.sleep(0.05)  # widen the race window
        print(",".join(str(d.submit(rand_spec(100 * w + i), name=f"w{w}-{i}")) for i in range(5)))
    """
    procs = [run_python(code, path, w) for w in (1, 2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        outs += [int(x) for x in out.strip().split(",")]
    assert sorted(outs) == list(range(1, 11))
    with Dock.open(path) as d:
        assert len(d) == 10 and len({e.name for e in d.list()}) == 10
        for e in d.list():
            w, i = map(int, e.name[1:].split("-"))
            np.testing.assert_array_equal(d.load_spec(e.id).vector,
                                          rand_spec(100 * w + i).vector)


STAGES = {"after_insert": [], "after_tensors": [".tmp-"], "after_rename": ["2"]}


def test_submit_killed_midway_leaves_no_half_entry(tmp_path):
    """SIGKILL at three points inside submit (one process per point, run side by side)."""
    procs = {}
    for stage in STAGES:
        with Dock.create(tmp_path / stage) as d:
            d.submit(rand_spec(0), name="before")
        procs[stage] = run_python("""
            import time
            def pause():
                print("paused", flush=True)
                time.sleep(600)
            dock_mod._HOOKS[sys.argv[2]] = pause
            Dock.open(sys.argv[1]).submit(rand_spec(1), name="victim",
                                          model={"w": np.ones(4, np.float32)})
        """, tmp_path / stage, stage)
    try:
        for stage, p in procs.items():
            assert p.stdout.readline().strip() == "paused", p.stderr.read()
            extra = sorted(set(os.listdir(tmp_path / stage / "tensors")) - {"1"})
            assert [x[:len(w)] for x, w in zip(extra, STAGES[stage], strict=True)] == \
                STAGES[stage], (stage, extra)            # the victim got this far
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=60)
    for stage in STAGES:
        with Dock.open(tmp_path / stage) as d:
            assert [e.name for e in d.list()] == ["before"], stage
            assert os.listdir(tmp_path / stage / "tensors") == ["1"]   # orphans collected
            assert d.submit(rand_spec(2), name="victim") == 2
            assert d.search(rand_spec(2, "user"), k=1).names == ("victim",)
