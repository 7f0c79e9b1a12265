"""The ``pavejax`` command line: every subcommand through ``--help`` (privacy wording) and a small
real run on real MiniLM and real text (seq 16, a few dozen examples, a few steps).

The lifecycle runs once per module: two DP-Merging models of ``movie``, a dock with their
DP-S-PAVE specs, a user spec of ``nyt`` shots, a weight-average merge, PACZero adaptations.
Privacy numbers are checked against dp-accounting directly and closed forms, not against the
commands' own output.
"""

import contextlib
import dataclasses
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event, rdp
from scipy import stats

from pavejax.cli import build_parser, main

DELTA = 1e-5
SMALL_TRAIN = ["--train-size", "48", "--test-size", "32", "--steps", "3", "--batch-size", "8",
               "--seq-len", "16"]
ADAPT = ["--pool-size", "32", "--dev-size", "16", "--test-size", "32", "--subsets", "4"]


def real(test):
    """A small real run: needs the installed assets; seconds to tens of seconds each."""
    return pytest.mark.assets(pytest.mark.slow(test))


def cli(*args) -> tuple[int, str, str]:
    """Run ``pavejax *args`` in this process; returns (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse errors and --help
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def ok_json(*args) -> dict:
    rc, out, err = cli(*args, "--json")
    assert rc == 0, err
    return json.loads(out)


def _flat(text: str) -> str:
    # argparse wraps lines (also after hyphens): compare on one normalised line
    return " ".join(re.sub(r"-\s+", "-", text).split()).lower()


# --- help -------------------------------------------------------------------------------------

HELP_PHRASES = {
    "train": ["replacing one training example", "are public", "delta", "against anyone who sees",
              "--epsilon", "not covered", "never written"],
    "spec": ["replacing one spec example", "replace-one", "delta", "not private",
             "a key is read from the dock and never written", "against everyone"],
    "merge": ["post-processing", "disjoint", "parallel composition", "same neighbouring "
              "relation", "delta"],
    "adapt": ["mutual information", "prior 1/2", "membership in a secret candidate subset",
              "not the pool's content", "assumed to know the whole pool", "dev split",
              "(--epsilon, --delta)-dp for one pool example replaced"],
    "ledger": ["neighbouring relation", "replace-one", "dataset sizes", "delta", "conditional",
               "nats"],
    "audit": ["neighbouring", "delta", "claimed epsilon", "audit fixture",
              "must never be used", "exit status 3"],
    "dock": ["secret key of a", "lend it only"],
}


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("assets", "train", "spec", "dock", "merge", "adapt", "ledger", "audit", "demo"):
        assert re.search(rf"^\s+{name}\s", out, re.M), f"{name} missing from --help"


@pytest.mark.parametrize("command", sorted(HELP_PHRASES))
def test_subcommand_help_explains_privacy(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = _flat(capsys.readouterr().out)
    for phrase in HELP_PHRASES[command]:
        assert phrase.lower() in text, f"{command} --help lacks {phrase!r}"


def test_without_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "pavejax", "--help"], capture_output=True,
                       text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and "audit" in r.stdout


def test_bad_flags_are_refused_before_any_work():
    rc, _, err = cli("train", "--task", "movie", "--epsilon", "-1", "--out", "x")
    assert rc == 2 and "must be a number > 0" in err
    rc, _, err = cli("audit", "--mechanism", "dp-sgd", "--epsilon", "2", "--trials", "4")
    assert rc == 1 and "--trials must be >= 8" in err
    rc, _, err = cli("audit", "--mechanism", "dp-sgd", "--epsilon", "inf")
    assert rc == 1 and "--epsilon must be a finite number" in err
    rc, _, err = cli("spec", "--dock", "d", "--model", "m", "--user-task", "nyt", "--out", "o")
    assert rc == 2 and "not allowed with argument" in err
    ns = build_parser().parse_args(["merge", "--base-classes", "a,b", "--models", "x", "--out",
                                    "o"])
    assert ns.op == "ties"


# --- the lifecycle, once per module -----------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def models(work):
    """Two DP-Merging models of movie with identical flags (fresh secret noise each)."""
    out = {}
    for name in ("m1", "m2"):
        out[name] = ok_json("train", "--task", "movie", "--epsilon", "4", *SMALL_TRAIN,
                            "--out", work / name)
    return out


@pytest.fixture(scope="module")
def dock(work, models):
    d = work / "dock"
    rc, out, err = cli("dock", "init", d)
    assert rc == 0 and "secret" in out, err
    specs = {}
    for name in ("m1", "m2"):
        specs[name] = ok_json("spec", "--dock", d, "--model", work / name, "--examples", "16",
                              "--out", work / f"s_{name}")
        # m2 gives no metadata: its class names come from its model release
        meta = ["--metadata", '{"classes": ["negative", "positive"]}'] if name == "m1" else []
        rc, out, err = cli("dock", "submit", d, work / f"s_{name}", "--name", name, "--model",
                           work / name, *meta)
        assert rc == 0 and "submitted" in out, err
    specs["user"] = ok_json("spec", "--dock", d, "--user-task", "nyt", "--shots", "4",
                            "--seq-len", "16", "--out", work / "s_user")
    return d, specs


@pytest.fixture(scope="module")
def merged(work, models):
    return ok_json("merge", "--base-classes", "negative,positive", "--models", work / "m1",
                   work / "m2", "--op", "wa", "--eval-task", "nyt", "--eval-size", "32",
                   "--out", work / "merged")


@pytest.fixture(scope="module")
def adapted(work, merged):
    return {mech: ok_json("adapt", "--model", work / "merged", "--task", "nyt", "--mechanism",
                          mech, *extra, "--steps", "6", *ADAPT, "--out", work / f"a_{mech}")
            for mech, extra in (("zpl", []), ("mi", ["--mi-budget", "0.05"]), ("mezo", []),
                                ("dpzo", ["--epsilon", "3", "--dp-batch", "8"]))}


def _release(path: Path):
    from pavejax.release import load_release

    return load_release(path)


def _rdp_epsilon(events, delta: float) -> float:
    acc = rdp.RdpAccountant()
    for e in events:
        acc.compose(e)
    return acc.get_epsilon(delta)


def _pld_replace_one_epsilon(events, delta: float) -> float:
    import dp_accounting as dpa

    acc = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE,
                                value_discretization_interval=1e-4)
    for e in events:
        acc.compose(e)
    return acc.get_epsilon(delta)


def _dp_sam_same_event(meta) -> dp_event.DpEvent:
    # "same" mode: one Poisson draw feeds the ascent and the descent query (DP-Merging paper);
    # two Gaussian queries of multiplier z on one batch are one Gaussian of multiplier z / sqrt 2
    # (mu-GDP composition), the form dp-accounting's PLD analyses under Poisson sampling
    h = meta.hyperparameters
    g = dp_event.GaussianDpEvent(h["noise_multiplier"] / math.sqrt(2))
    step = dp_event.PoissonSampledDpEvent(h["sampling_rate"], g)
    return dp_event.SelfComposedDpEvent(step, h["steps"])


@real
def test_train_writes_a_dp_model_release(work, models):
    tensors, meta = _release(work / "m1")
    assert meta.kind == "model" and meta.extra["classes"] == ["negative", "positive"]
    assert tensors["kernel"].shape == (384, 2) and tensors["bias"].shape == (2,)
    g = meta.guarantee
    # the release states its size, so its figure is replace-one (add/remove would be void)
    assert g["kind"] == "dp" and g["relation"] == "replace_one" and g["delta"] == DELTA
    assert g["accountant"] == "pld" and meta.extra["data"]["num_train"] == 48
    assert meta.hyperparameters["sampling_rate"] == pytest.approx(8 / 48)
    # the claimed epsilon is dp-accounting's replace-one PLD epsilon of the "same" event
    independent = _pld_replace_one_epsilon([_dp_sam_same_event(meta)], DELTA)
    assert g["epsilon"] == pytest.approx(independent, rel=1e-6)
    assert 3.9 < g["epsilon"] <= 4.0 + 1e-6  # calibrated to the target
    assert meta.risk["tv_bound"] == pytest.approx(
        (math.expm1(g["epsilon"]) + 2 * DELTA) / (math.exp(g["epsilon"]) + 1))
    assert 0.0 <= models["m1"]["test_accuracy"] <= 1.0
    # identical flags, fresh secret noise: the two releases differ
    other, _ = _release(work / "m2")
    assert np.abs(np.asarray(tensors["kernel"]) - np.asarray(other["kernel"])).max() > 1e-4
    assert "seed" not in meta.hyperparameters and meta.extra["data"]["seed"] == 0


@real
def test_train_without_noise_is_labelled_not_private(work, models):
    ok_json("train", "--task", "movie", "--epsilon", "inf", *SMALL_TRAIN, "--out",
            work / "m_inf")
    _, meta = _release(work / "m_inf")
    assert meta.guarantee["kind"] == "none" and "epsilon" not in meta.guarantee
    assert meta.hyperparameters["noise_multiplier"] == 0.0
    rc, out, _ = cli("ledger", work / "m_inf")
    assert rc == 0 and "guarantee: none" in out and "epsilon at delta 1e-05: pld inf, rdp inf" \
        in out


@real
def test_spec_model_and_user_side_in_the_dock_space(work, dock):
    from pavejax.pave.dock import Dock
    from pavejax.release import load_spec

    d, specs = dock
    spec = load_spec(work / "s_m1")
    with Dock.open(d) as opened:
        sig = opened.signature
        key_hex = (d / "secret" / "a_key").read_text().strip()
        import jax
        key_bytes = np.asarray(jax.random.key_data(opened.a_key())).tobytes()
    assert spec.kind == "model" and spec.signature == sig and sig.rank == 8
    g = spec.info["guarantee"]
    assert g["kind"] == "dp" and g["relation"] == "replace_one"
    # one full-batch Gaussian step, replace-one (sensitivity 2C vs noise sigma C): RDP of a
    # Gaussian with noise multiplier sigma / 2
    sigma = spec.info["noise_multiplier"]
    assert g["epsilon"] == pytest.approx(
        _rdp_epsilon([dp_event.GaussianDpEvent(sigma / 2)], DELTA), rel=1e-6)
    assert g["epsilon"] <= 4.0 + 1e-6 and specs["m1"]["num_examples"] == 16
    assert "epsilon_add_remove" not in g and "n = 16" in g["public"]
    # the spec data are the model's training examples: model and spec compose (replace-one,
    # the model's PLD accountant; the spec is a Gaussian of noise multiplier sigma)
    _, model_meta = _release(work / "m1")
    both = _pld_replace_one_epsilon([_dp_sam_same_event(model_meta),
                                     dp_event.GaussianDpEvent(sigma)], DELTA)
    composed = spec.info["composed_with_model"]
    assert composed["relation"] == "replace_one" and "epsilon_add_remove" not in composed
    assert composed["epsilon"] == pytest.approx(both, rel=1e-6)
    assert spec.info["noise_key"].startswith("fresh")  # the noise key is secret, never recorded
    user = load_spec(work / "s_user")
    assert user.kind == "user" and user.info["guarantee"]["kind"] == "none"
    assert user.info["config"]["example_clip"] == 0.05  # the shots are clipped at --clip
    assert specs["user"]["num_examples"] == 8 and user.signature == sig
    for f in (work / "s_m1").rglob("*"):  # secrets never enter a release
        if f.is_file():
            data = f.read_bytes()
            assert key_hex.encode() not in data and key_bytes not in data
    # the same model again: fresh noise, another vector
    again = ok_json("spec", "--dock", d, "--model", work / "m1", "--examples", "16", "--out",
                    work / "s_m1_again")
    assert again["guarantee"]["epsilon"] == pytest.approx(g["epsilon"])
    assert np.abs(load_spec(work / "s_m1_again").vector - spec.vector).max() > 1e-6


@real
def test_coordinate_dock_from_the_command_line(work, models, dock):
    """A dock with a public random subspace: its specs release r x k coordinates per kernel,
    carry the subspace's hash, and a whole-block spec is refused."""
    from pavejax.pave.dock import Dock
    from pavejax.release import load_spec

    d = work / "coord_dock"
    rc, out, err = cli("dock", "init", d, "--subspace", "random:4:1", "--layers", "5")
    assert rc == 0 and "Coordinate subspace" in out, err
    model = ok_json("spec", "--dock", d, "--model", work / "m1", "--examples", "16", "--out",
                    work / "c_m1")
    user = ok_json("spec", "--dock", d, "--user-task", "nyt", "--shots", "2", "--seq-len", "16",
                   "--out", work / "c_user")
    assert model["dim"] == user["dim"] == 8 * 4 * 2  # rank 8, k 4, query and value of layer 5
    assert model["layers"] == [5] and model["guarantee"]["kind"] == "dp"
    with Dock.open(d) as opened:
        h = opened.subspace.hash
    assert load_spec(work / "c_m1").signature.subspace == h
    rc, out, err = cli("dock", "submit", d, work / "c_m1", "--name", "m1")
    assert rc == 0, err
    rc, out, err = cli("dock", "search", d, work / "c_user", "-k", "1", "--json")
    assert rc == 0 and json.loads(out)[0]["name"] == "m1", err
    rc, out, err = cli("dock", "submit", d, work / "s_m1", "--name", "whole")  # whole blocks
    assert rc == 1 and "subspace" in err
    rc, _, err = cli("dock", "init", work / "bad", "--subspace", "random")
    assert rc == 1 and "random:K" in err


@real
def test_dock_commands_search_list_show(work, dock):
    d, _ = dock
    rc, out, err = cli("dock", "search", d, work / "s_user", "-k", "2", "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [r["rank"] for r in rows] == [1, 2] and {r["name"] for r in rows} == {"m1", "m2"}
    assert rows[0]["cosine"] >= rows[1]["cosine"]
    # noise-aware ranking: the scores of pavejax.pave.noise_aware over the stored specs
    from pavejax.pave.dock import Dock
    from pavejax.pave.noise_aware import noise_aware_scores, spec_noise_std
    from pavejax.release import load_spec
    rc, out, err = cli("dock", "search", d, work / "s_user", "-k", "2", "--score", "debiased",
                       "--json")
    assert rc == 0, err
    ranked = json.loads(out)
    stored = Dock.open(d)
    specs = [stored.load_spec(r["id"]) for r in ranked]
    want = noise_aware_scores(load_spec(work / "s_user").vector,
                              np.stack([s.vector for s in specs]),
                              np.array([spec_noise_std(s) for s in specs]), "debiased")[0]
    assert all(spec_noise_std(s) > 0 for s in specs)  # both are DP-S-PAVE specs
    np.testing.assert_allclose([r["debiased"] for r in ranked], want, rtol=1e-5)
    assert ranked[0]["debiased"] >= ranked[1]["debiased"]
    rc, out, err = cli("dock", "search", d, work / "s_user", "--score", "posterior")
    assert rc == 0 and "| posterior |" in out.splitlines()[0], err
    rc, out, _ = cli("dock", "list", d)
    assert rc == 0 and "m1" in out and "m2" in out and "dp eps=" in out
    rc, out, _ = cli("dock", "show", d, "m2")
    shown = json.loads(out)
    assert rc == 0 and shown["has_model"] is True
    assert shown["metadata"]["classes"] == ["negative", "positive"]
    rc, _, err = cli("dock", "show", d, "nobody")
    assert rc == 1 and "no learnware 'nobody'" in err


@real
def test_spec_refuses_another_space_than_the_dock(work, dock):
    d, _ = dock
    rc, _, err = cli("spec", "--dock", d, "--user-task", "nyt", "--rank", "4", "--out",
                     work / "never")
    assert rc == 1 and "--rank 4 differs from the dock's 8" in err
    assert not (work / "never").exists()


@real
def test_merge_weight_average_and_composed_ledger(work, merged):
    m1, meta1 = _release(work / "m1")
    m2, _ = _release(work / "m2")
    out, meta = _release(work / "merged")
    # weight averaging of two task vectors from one base is the plain mean of the models
    np.testing.assert_allclose(out["kernel"], (np.asarray(m1["kernel"]) + m2["kernel"]) / 2,
                               rtol=1e-6, atol=1e-7)
    assert meta.kind == "merged_model" and meta.extra["classes"] == ["negative", "positive"]
    g = meta.guarantee
    assert g["kind"] == "dp" and len(g["per_source"]) == 2
    both = _pld_replace_one_epsilon([_dp_sam_same_event(meta1), _dp_sam_same_event(_release(
        work / "m2")[1])], DELTA)
    assert g["epsilon"] == pytest.approx(both, rel=1e-6)
    assert g["epsilon_if_disjoint"] == pytest.approx(meta1.guarantee["epsilon"], rel=1e-6)
    assert g["epsilon"] > g["epsilon_if_disjoint"]
    assert 0.0 <= merged["test_accuracy"] <= 1.0


@real
def test_merge_refuses_another_label_space(work, models):
    rc, _, err = cli("merge", "--base-classes", "positive,negative", "--models", work / "m1",
                     "--out", work / "never")
    assert rc == 1 and "only models of one label space" in err


@real
def test_adapt_zpl_and_mi_ledgers(work, merged, adapted):
    _, meta = _release(work / "a_zpl")
    g = meta.guarantee
    assert g["kind"] == "pac_mi" and g["mutual_information_nats"] == 0.0
    assert g["mia_posterior_bound"] == 0.5  # zero information: the prior
    # what is protected: membership in the secret subset; the pool's content is not
    assert "membership in the secret candidate subset" in g["protects"]
    assert "content is not protected" in g["protects"] and "know the whole pool" in g["against"]
    # ZPL charges 0 nats per release: every release is on the ledger, at 0 nats
    assert sum(e["count"] for e in meta.ledger["mi_entries"]) == 6
    assert all(e["nats"] == 0 for e in meta.ledger["mi_entries"]) and meta.ledger["entries"] == []
    assert meta.extra["upstream"]["guarantee"] == _release(work / "merged")[1].guarantee
    _, meta = _release(work / "a_mi")
    mi, p = meta.guarantee["mutual_information_nats"], meta.guarantee["mia_posterior_bound"]
    assert 0.0 <= mi <= 0.05 + 1e-12
    # p solves KL(Bern(p) || Bern(1/2)) = mi (closed form of the KL)
    kl = p * math.log(2 * p) + (1 - p) * math.log(2 * (1 - p)) if p < 1 else math.log(2)
    assert kl == pytest.approx(mi, abs=1e-9)
    assert 0.0 <= adapted["mi"]["test_accuracy"] <= 1.0
    _, meta = _release(work / "a_mezo")
    assert meta.guarantee["kind"] == "none" and meta.ledger is None
    _, meta = _release(work / "a_dpzo")
    g, h = meta.guarantee, meta.hyperparameters
    assert g["kind"] == "dp" and g["relation"] == "replace_one" and \
        2.9 < g["epsilon"] <= 3.0 + 1e-6
    # 6 Poisson-subsampled Gaussian releases at q = 8/32 (replace-one PLD, dp-accounting)
    step = dp_event.PoissonSampledDpEvent(8 / 32, dp_event.GaussianDpEvent(
        h["noise_multiplier"]))
    assert g["epsilon"] == pytest.approx(
        _pld_replace_one_epsilon([dp_event.SelfComposedDpEvent(step, 6)], DELTA), rel=1e-6)


@real
def test_adapt_resumes_from_its_checkpoint_dir(work, merged, tmp_path):
    args = ["adapt", "--model", work / "merged", "--task", "nyt", "--mechanism", "mi",
            "--mi-budget", "0.05", "--steps", "4", *ADAPT, "--checkpoint-dir", tmp_path / "ck"]
    first = ok_json(*args, "--out", tmp_path / "a1")
    saved = {p.name: (p / "meta" / "metadata").read_bytes()
             for p in (tmp_path / "ck").iterdir() if p.name.isdigit()}
    # the last checkpoint is the run's final state (an MI run may stop early on its budget)
    assert max(map(int, saved)) == first["steps"] and first["guarantee"]["kind"] == "pac_mi"
    # The finished run is resumed, not redone: a fresh run would draw other OS-seeded secrets
    # and noise. Same tensors, same metadata but its time (ledger included), no new checkpoint
    # step. (Orbax file names and timestamps differ, so the content hashes do.)
    ok_json(*args, "--out", tmp_path / "a2")
    (t1, m1), (t2, m2) = _release(tmp_path / "a1"), _release(tmp_path / "a2")
    assert sorted(t1) == sorted(t2)
    assert all(np.asarray(t1[k]).tobytes() == np.asarray(t2[k]).tobytes() for k in t1)
    assert dataclasses.replace(m1, created=m2.created) == m2 and m1.ledger["mi_entries"]
    assert {p.name: (p / "meta" / "metadata").read_bytes()
            for p in (tmp_path / "ck").iterdir() if p.name.isdigit()} == saved
    rc, _, err = cli(*args, "--lr", "0.5", "--out", tmp_path / "a3")
    assert rc == 1 and "config.learning_rate" in err and not (tmp_path / "a3").exists()


@real
def test_adapt_refusals(work, merged):
    rc, _, err = cli("adapt", "--model", work / "merged", "--task", "nyt", "--mechanism", "mi",
                     "--out", work / "never")
    assert rc == 1 and "needs --mi-budget" in err
    rc, _, err = cli("adapt", "--model", work / "merged", "--task", "bbc", "--out",
                     work / "never")
    assert rc == 1 and "adapt a model of this label space" in err
    rc, _, err = cli("adapt", "--model", work / "s_user", "--task", "nyt", "--out",
                     work / "never")
    assert rc == 1 and "not a model" in err


@real
def test_ledger_prints_and_verifies(work, dock, merged, adapted, tmp_path):
    rc, out, err = cli("ledger", work / "merged")
    assert rc == 0, err
    g = _release(work / "merged")[1].guarantee
    assert f"epsilon {g['epsilon']:.4g} at delta 1e-05" in out and "(verified)" in out
    report = ok_json("ledger", work / "m1", "--delta", "1e-3")
    assert report["ledger"]["delta"] == 1e-3 and report["guarantee"]["kind"] == "dp"
    # a smaller delta costs more epsilon
    assert report["ledger"]["epsilon"]["pld"] < report["guarantee"]["epsilon"]
    # RDP has no analysis of Poisson sampling under replace-one: no figure, and the reason
    assert report["ledger"]["epsilon"]["rdp"] is None
    assert "replace-one" in report["ledger"]["unsupported"]["rdp"]
    rc, out, _ = cli("ledger", work / "a_zpl")
    assert rc == 0 and "mutual information 0 nats" in out and "upstream" in out
    rc, out, err = cli("ledger", work / "s_user")
    assert rc == 0 and "non-private" in out and "A itself is never released" in out
    # a modified release is refused
    import shutil
    copy = tmp_path / "tampered"
    shutil.copytree(work / "m1", copy)
    meta = json.loads((copy / "metadata.json").read_text())
    meta["guarantee"]["epsilon"] = 0.1
    (copy / "metadata.json").write_text(json.dumps(meta))
    rc, _, err = cli("ledger", copy)
    assert rc == 1 and "modified or corrupted" in err
    rc, _, err = cli("ledger", tmp_path)
    assert rc == 1 and "not a pavejax release" in err


# --- audits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("broken, relation, status", [(False, "replace_one", 0),
                                                     (True, "add_remove", 3)])
def test_audit_dp_sgd(broken, relation, status):
    rc, out, err = cli("audit", "--mechanism", "dp-sgd", "--epsilon", "2", "--trials", "2000",
                       "--relation", relation, *(["--broken"] if broken else []), "--json")
    assert rc == status, err
    r = json.loads(out)
    claimed = r["game"]["claimed_epsilon"]
    # one Gaussian step, full batch: the PLD epsilon of the calibrated noise is the target
    assert claimed == pytest.approx(2.0, abs=2e-3) and r["relation"] == relation
    assert (r["game"]["epsilon_lower"] > claimed) is broken
    assert r["noise_multiplier_used"] == pytest.approx(
        r["noise_multiplier_claimed"] / (8 if broken else 1))
    # closed form of the Gaussian mechanism (Balle & Wang 2018): sensitivity 1 (add/remove) or
    # 2 (replace-one) in units of C; the calibrated noise meets delta at epsilon 2, tightly
    sens, sigma = (2.0 if relation == "replace_one" else 1.0), r["noise_multiplier_claimed"]

    def delta_at(eps):
        a, b = sens / (2 * sigma), eps * sigma / sens
        return stats.norm.cdf(a - b) - math.exp(eps) * stats.norm.cdf(-a - b)

    assert delta_at(2.0) <= DELTA * 1.01 and delta_at(1.95) > DELTA


@pytest.mark.slow
def test_audit_dp_s_pave_catches_the_broken_variant():
    rc, out, err = cli("audit", "--mechanism", "dp-s-pave", "--epsilon", "2", "--trials", "800",
                       "--broken")
    assert rc == 3, err
    claimed = float(re.search(r"claimed epsilon\s+([\d.]+)", out).group(1))
    lower = float(re.search(r"audit epsilon \(>=, 95%\)\s+([\d.]+)", out).group(1))
    assert claimed == pytest.approx(2.0, abs=1e-3) and lower > claimed
    assert "VIOLATION" in out and "BROKEN variant" in out
