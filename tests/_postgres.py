"""A throwaway PostgreSQL server for tests: a temporary data directory, a free loopback port.

``postgres_available()`` says why no server can be started (None when one can);
``postgres_server()`` starts one and stops it, removing its directory, on exit::

    reason = postgres_available()
    if reason:
        require_or_skip(reason)
    with postgres_server() as pg:
        url = pg.create_database("dock")

The binaries come from ``PATH`` when ``initdb``, ``pg_ctl`` and ``postgres`` sit there together,
else from the newest ``/usr/lib/postgresql/<version>/bin`` (Debian's ``postgresql`` package).
PostgreSQL refuses to run as root, so as root the server runs as the system user ``postgres``.
"""

import contextlib
import dataclasses
import glob
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pavejax.service.loadtest import free_port
from tests._services import require_or_skip

__all__ = ["PostgresServer", "postgres_available", "postgres_server", "require_or_skip"]

_TOOLS = ("initdb", "pg_ctl", "postgres")
_SERVER_USER = "postgres"
_PORT_TRIES = 5


def _version_key(bindir: str) -> tuple[int, ...]:
    version = Path(bindir).parent.name
    return tuple(int(part) for part in re.findall(r"\d+", version))


def postgres_bindir() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, or None."""
    on_path = shutil.which("pg_ctl")
    if on_path:
        bindir = Path(on_path).resolve().parent
        if all(os.access(bindir / tool, os.X_OK) for tool in _TOOLS):
            return bindir
    candidates = [d for d in glob.glob("/usr/lib/postgresql/*/bin")
                  if all(os.access(os.path.join(d, tool), os.X_OK) for tool in _TOOLS)]
    return Path(max(candidates, key=_version_key)) if candidates else None


def _server_user() -> pwd.struct_passwd | None:
    """The account the server runs as: None for the current one, ``postgres`` when root."""
    return pwd.getpwnam(_SERVER_USER) if os.geteuid() == 0 else None


def postgres_available() -> str | None:
    """None when :func:`postgres_server` can start a server here, else the reason it cannot."""
    if postgres_bindir() is None:
        return ("no PostgreSQL server binaries (initdb, pg_ctl, postgres) on PATH or in "
                "/usr/lib/postgresql/*/bin; install the Debian package 'postgresql'")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(_SERVER_USER)
        except KeyError:
            return (f"running as root and no system user {_SERVER_USER!r} to run PostgreSQL "
                    "as (PostgreSQL refuses root)")
    try:
        import psycopg  # noqa: F401
    except ImportError as err:
        return f"psycopg (PostgreSQL client for Python) cannot be imported: {err}"
    return None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclasses.dataclass
class PostgresServer:
    """A running server: connect as ``postgres`` (trust authentication) on ``127.0.0.1:port``."""

    port: int
    datadir: Path
    logfile: Path

    def url(self, dbname: str = "postgres") -> str:
        """The libpq URL of database ``dbname``."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """Create database ``name``; returns its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def log(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        return _tail(self.logfile, lines)


class _Runner:
    """Runs the PostgreSQL tools, as ``postgres`` when we are root."""

    def __init__(self, bindir: Path, cwd: Path):
        self.bindir, self.cwd = bindir, cwd
        self.user = _server_user()

    def run(self, tool: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        kwargs = {}
        if self.user is not None:
            kwargs = dict(user=self.user.pw_uid, group=self.user.pw_gid, extra_groups=[])
        env = dict(os.environ, LC_ALL="C", LANG="C")
        if self.user is not None:
            env.update(HOME=self.user.pw_dir, USER=self.user.pw_name, LOGNAME=self.user.pw_name)
        return subprocess.run([str(self.bindir / tool), *args], cwd=self.cwd, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, **kwargs)


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """Start a PostgreSQL server in a temporary directory; stop it and remove the directory on
    exit. Raises RuntimeError, with the tail of the log, when it does not start."""
    reason = postgres_available()
    if reason:
        raise RuntimeError(reason)
    bindir = postgres_bindir()
    tmp = Path(tempfile.mkdtemp(prefix="pavejax-pg-"))
    datadir, logfile = tmp / "data", tmp / "server.log"
    runner = _Runner(bindir, tmp)
    started = False
    try:
        if runner.user is not None:
            os.chown(tmp, runner.user.pw_uid, runner.user.pw_gid)
        init = runner.run("initdb", "-D", str(datadir), "-A", "trust", "-U", "postgres",
                          "--no-sync", "-E", "UTF8")
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed ({init.returncode}):\n"
                               f"{init.stdout[-2000:]}\n{init.stderr[-2000:]}")
        for _ in range(_PORT_TRIES):
            logfile.unlink(missing_ok=True)  # judge each try by its own log
            port = free_port()
            options = (f"-c listen_addresses=127.0.0.1 -p {port} "
                       f"-c unix_socket_directories={tmp} -c fsync=off -c max_connections=200")
            start = runner.run("pg_ctl", "-D", str(datadir), "-l", str(logfile), "-w",
                               "-t", "60", "-o", options, "start")
            started = start.returncode == 0
            if started:
                break
            log = _tail(logfile)
            if "could not bind" not in log and "already in use" not in log:
                break
        if not started:
            raise RuntimeError(f"PostgreSQL did not start (pg_ctl: {start.returncode}):\n"
                               f"{start.stdout[-1000:]}{start.stderr[-1000:]}\n"
                               f"--- {logfile.name} ---\n{_tail(logfile)}")
        yield PostgresServer(port=port, datadir=datadir, logfile=logfile)
    finally:
        try:
            if started or (datadir / "postmaster.pid").exists():
                stop = runner.run("pg_ctl", "-D", str(datadir), "-w", "-t", "60", "-m", "fast",
                                  "stop", timeout=90)
                if stop.returncode != 0:
                    runner.run("pg_ctl", "-D", str(datadir), "-m", "immediate", "stop",
                               timeout=90)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
