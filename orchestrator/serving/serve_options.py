"""`polyspec serve`'s flags checked and turned into the server's options, without torch: a
mistaken flag (a missing TLS key, an unreadable token file, a busy port, a damaged job store,
a state dir another server holds) is one line within a second, before any model loads."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sqlite3

from polyspec.orchestrator.serving.jobs import DamagedStore, JobStore
from polyspec.orchestrator.serving.security import Limits, Tenants
from polyspec.workers.core.errors import ConfigError

LOCK_NAME = "serve.lock"  # in the state dir: held (flock) by the one server using it


def _read_file(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as handle:
            content = handle.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if not content.strip():
        raise ConfigError(f"{what} {path} is empty")
    return content


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "polyspec")


class StateDirLock:
    """An exclusive lock on a state dir for this process: `<state-dir>/serve.lock`, held with flock.
    The kernel drops it when the process ends, however it ends (SIGKILL included), so a crash
    never leaves a stale lock; two servers on one state dir would run the same pending job items
    twice."""

    def __init__(self, state_dir: str) -> None:
        path = os.path.join(state_dir, LOCK_NAME)
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
            try:
                self.fd, self.created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), True
            except FileExistsError:
                self.fd, self.created = os.open(path, os.O_RDWR), False
        except OSError as exc:
            raise ConfigError(f"cannot use state dir {state_dir}: {exc.strerror or exc}") from None
        self.path = path
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 32, 0).decode("ascii", "replace").strip()
            os.close(self.fd)
            who = f"process {holder}" if holder.isdigit() else "another process"
            raise ConfigError(f"state dir {state_dir} is in use by another polyspec serve ({who}); "
                              "give each server its own --state-dir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self, tidy: bool = False) -> None:
        """Unlock; `tidy`: a server that never started leaves the state dir as it found it (the
        file is removed while still locked, so no other server can take the lock on it meanwhile)."""
        if tidy and self.created:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        os.close(self.fd)


def check_bindable(host: str, port: int) -> None:
    """A clear one-line error before gRPC tries (and logs its own multi-line complaint)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise ConfigError(f"cannot listen on {host}:{port}: unknown host") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve_options(args, config) -> dict:
    """The keyword arguments of `serve._serve` from the flags and `config` (the ChainConfig they name),
    every mistake a one-line ConfigError: files, the TLS pair, limits, the state dir, the address."""
    tenants = Tenants.from_files(args.auth_token_file, args.tenants_file)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    tls = (_read_file(args.tls_key, "TLS key"), _read_file(args.tls_cert, "TLS certificate")) if args.tls_cert else None
    # each limit flag's dest is its Limits field; a flag not given keeps the default
    limits = Limits(**{name: getattr(args, name) for name in Limits.__dataclass_fields__ if getattr(args, name) is not None})
    if args.served_model_name is not None and any(not name.strip() for name in args.served_model_name):
        raise ConfigError("--served-model-name must not be empty")
    state_dir = args.state_dir or default_state_dir()
    lock = StateDirLock(state_dir)  # before the store is opened: a second server never touches it
    try:
        store = JobStore(state_dir)
    except DamagedStore as exc:  # before any model loads: one line, exit 2, the file as it was
        lock.release(tidy=True)
        raise ConfigError(str(exc)) from None
    except (OSError, sqlite3.Error) as exc:
        lock.release(tidy=True)
        raise ConfigError(f"cannot use state dir {state_dir}: {exc}") from None
    host = args.host or config.server.host
    port = config.server.port if args.port is None else args.port
    options = {
        "config": config,
        "host": host,
        "port": port,
        "store": store,
        "state_lock": lock,
        "tenants": tenants,
        "limits": limits,
        "tls": tls,
        "tls_files": (args.tls_cert, args.tls_key) if tls else None,
        "metrics_port": args.metrics_port,
        "http_port": args.http_port,
        "grace_s": args.grace,
        "auth_reflection": args.auth_reflection,
        "auth_metrics": args.auth_metrics,
        "served_model_names": args.served_model_name,
        "reprofile": args.reprofile,
        "exact_only": args.exact_only,
    }
    try:
        if options["exact_only"] and not config.approximate.lossless:
            raise ConfigError(f"--exact-only, but the config's approximate.mode is {config.approximate.mode}: "
                              "remove that section or serve without --exact-only")
        check_bindable(host, port)
    except ConfigError:
        store.close()
        lock.release(tidy=True)
        raise
    return options
