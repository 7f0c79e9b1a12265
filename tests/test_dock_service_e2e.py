"""The shared dock end to end on loopback: a server subprocess, three developers submitting
through the CLI with their tokens, a user searching from a second process through the client
(every byte sent to the server recorded: the user's spec is never among them), download and
merge of the top two, a withdrawal, and a search again."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from pavejax.release import content_hash, load_release, load_spec
from tests._dock_service import ROOT, RecordingProxy, cli_env, leaked, serve
from tests.test_cli import SMALL_TRAIN, cli, ok_json, real


@real
def test_shared_dock_end_to_end_on_loopback(tmp_path):
    dock = tmp_path / "dock"
    rc, _, err = cli("dock", "init", dock)
    assert rc == 0, err
    tokens = {}
    for dev in ("dev0", "dev1", "dev2"):
        tokens[dev] = ok_json("dock", "token", dock, "--account", dev)["token"]

    with serve(dock) as (server_url, _):
        proxy = RecordingProxy(int(server_url.rsplit(":", 1)[1]))
        url = proxy.url
        try:
            # three developers: train with DP, make a DP-S-PAVE spec in the dock's space (the
            # dock's A key is published), submit spec and model with their own token
            names = {}
            for dev, task in zip(tokens, ("movie", "amazon", "tweets"), strict=True):
                model = tmp_path / f"{dev}-model"
                ok_json("train", "--task", task, "--epsilon", "4", *SMALL_TRAIN,
                        "--out", model)
                spec = ok_json("spec", "--dock", url, "--model", model, "--examples", "16",
                               "--out", tmp_path / f"{dev}-spec")
                assert spec["guarantee"]["kind"] == "dp"
                names[dev] = f"{dev}-{task}"
                out = ok_json("dock", "submit", url, tmp_path / f"{dev}-spec", "--name",
                              names[dev], "--model", model, "--token", tokens[dev])
                assert out["has_model"]
            # a submit without a token, or with another dock's, stores nothing
            rc, _, err = cli("dock", "submit", url, tmp_path / "dev0-spec", "--name", "x",
                             "--token", "pvj_not-a-token")
            assert rc != 0 and "not valid for this dock" in err
            listed = ok_json("dock", "list", url)
            assert [e["name"] for e in listed] == list(names.values())
            with urllib.request.urlopen(url + "/api/v1/learnwares") as resp:
                public = json.loads(resp.read())["learnwares"]
            for e in public:  # what the page and the API publish per learnware
                g = e["guarantee"]
                assert g["kind"] == "dp" and 0 < g["epsilon"] <= 4.0 + 1e-6
                assert e["risk"] and e["ledger_summary"] and e["model_guarantee"]["kind"] == "dp"
                assert e["submitter"] in tokens and e["classes"] == ["negative", "positive"]

            # the user: a non-private spec of their shots, in this process, never sent
            user = tmp_path / "user-spec"
            ok_json("spec", "--dock", url, "--user-task", "nyt", "--shots", "4", "--seq-len",
                    "16", "--out", user)
            assert load_spec(user).info["guarantee"]["kind"] == "none"

            def search(k: int) -> list[dict]:
                start = len(proxy.sent)
                res = subprocess.run([sys.executable, "-m", "pavejax", "dock", "search", url,
                                      str(user), "-k", str(k), "--json"], env=cli_env(),
                                     cwd=ROOT, capture_output=True, text=True, timeout=300)
                assert res.returncode == 0, res.stderr
                sent = proxy.requests_since(start)
                assert sent, "the search made no request"
                for request in sent:  # only reads of the published snapshot
                    assert request.startswith(b"GET /api/v1/snapshot"), request[:200]
                return json.loads(res.stdout)

            first = search(2)
            assert len(first) == 2 and {r["name"] for r in first} <= set(names.values())
            assert first[0]["cosine"] >= first[1]["cosine"]

            # download the top two model releases (verified) and merge them
            downloaded = []
            for r in first:
                out = tmp_path / f"dl-{r['id']}"
                rc, _, err = cli("dock", "download", url, r["name"], "--what", "model",
                                 "--out", out)
                assert rc == 0, err
                dev = next(d for d, n in names.items() if n == r["name"])
                assert content_hash(out) == content_hash(tmp_path / f"{dev}-model")
                downloaded.append(out)
            merged = ok_json("merge", "--base-classes", "negative,positive", "--models",
                             *downloaded, "--op", "wa", "--out", tmp_path / "merged")
            assert merged["out"] == str(tmp_path / "merged")
            _, meta = load_release(tmp_path / "merged")
            assert meta.kind == "merged_model" or meta.kind.startswith("merged")

            # withdraw: another developer may not; the owner may
            top = first[0]["name"]
            owner = next(d for d, n in names.items() if n == top)
            other = next(d for d in tokens if d != owner)
            rc, _, err = cli("dock", "withdraw", url, top, "--token", tokens[other])
            assert rc != 0 and "only the account that submitted it" in err
            rc, out, err = cli("dock", "withdraw", url, top, "--token", tokens[owner])
            assert rc == 0 and "withdrew" in out, err

            again = search(3)
            assert top not in {r["name"] for r in again}
            assert {r["name"] for r in again} == set(names.values()) - {top}

            # nothing the user's spec is made of ever reached the server
            everything = b"".join(proxy.requests_since(0))
            assert b"POST /api/v1/learnwares" in everything  # the recording sees the submits
            assert leaked(everything, load_spec(user).vector) == []
            for record in ((user / "metadata.json").read_bytes(), content_hash(user).encode()):
                assert record not in everything
        finally:
            proxy.close()


@pytest.mark.parametrize("bad", ["http://127.0.0.1:9", "http://127.0.0.1:9/"])
def test_cli_reports_an_unreachable_dock(bad, capsys):
    rc, _, err = cli("dock", "list", bad)
    assert rc != 0 and "cannot reach the dock" in err
