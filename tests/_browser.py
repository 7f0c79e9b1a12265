"""Headless Chromium for tests: the DOM a page renders (``--dump-dom``) and a screenshot of it.

Chromium is Debian's ``chromium`` package (``/usr/bin/chromium``, or ``chromium`` /
``chromium-browser`` on ``PATH``). Each call starts a fresh browser with its own temporary
profile; as root it runs with ``--no-sandbox`` (Chromium's sandbox refuses root). Screenshots
and other files worth keeping after a run go to :func:`artifact_dir`.
"""

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from tests._services import require_or_skip

__all__ = ["artifact_dir", "chromium_path", "dump_dom", "require_or_skip", "screenshot"]

REPO_ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def chromium_path() -> str | None:
    """The Chromium executable, or None when there is none."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


def artifact_dir() -> Path:
    """Where tests leave files for people to look at: ``$PAVEJAX_TEST_ARTIFACTS``, else
    ``test-artifacts/`` at the repository root; created when missing."""
    path = Path(os.environ.get("PAVEJAX_TEST_ARTIFACTS") or REPO_ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _run_chromium(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run headless Chromium with ``args``; kill its whole process group on timeout."""
    binary = chromium_path()
    if binary is None:
        raise RuntimeError("no Chromium: install the Debian package 'chromium'")
    with tempfile.TemporaryDirectory(prefix="pavejax-chromium-") as profile:
        command = [binary, "--headless=new", "--disable-gpu", "--no-first-run",
                   "--disable-dev-shm-usage", f"--user-data-dir={profile}"]
        if os.geteuid() == 0:
            command.append("--no-sandbox")
        command += args
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace",
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise RuntimeError(f"Chromium timed out after {timeout} s: {' '.join(args)}\n"
                               f"{_tail(stderr)}") from None
        finally:
            try:  # renderer and GPU helpers outlive the browser process now and then
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if proc.returncode != 0:
        raise RuntimeError(f"Chromium exited with {proc.returncode}: {' '.join(args)}\n"
                           f"{_tail(stderr)}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def dump_dom(url: str, timeout: float = 60) -> str:
    """The DOM of ``url`` after it loads and its scripts run, serialised as HTML."""
    return _run_chromium(["--dump-dom", url], timeout).stdout


def screenshot(url: str, path: str | os.PathLike, size: tuple[int, int] = (1280, 900),
               timeout: float = 60) -> Path:
    """Save a PNG of ``url`` rendered in a ``size`` (width, height) window to ``path``."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    result = _run_chromium([f"--screenshot={path}", f"--window-size={size[0]},{size[1]}",
                            "--hide-scrollbars", url], timeout)
    if not path.exists() or path.stat().st_size == 0:
        raise RuntimeError(f"Chromium wrote no screenshot to {path}\n{_tail(result.stderr)}")
    return path
