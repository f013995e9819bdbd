"""Where sandlot keeps its state, and the settings read from the environment.

``$SANDLOT_HOME`` (default ``~/.local/share/sandlot``) holds the SQLite database, the
receipt-signing keys, and each backend's state under ``backends/<name>/``. A directory that
cannot be made or written is an :class:`~sandlot.errors.InvalidRequest` naming the setting to
change. This module imports nothing from sandlot but its errors.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from sandlot.errors import InvalidRequest

__all__ = ["backend_dir", "cache_dir", "default_database_url", "home", "receipt_log_id"]


def home(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The state directory: ``explicit``, else ``$SANDLOT_HOME``, else ``~/.local/share/sandlot``.

    Created (mode 0700) if missing.

    Raises:
        InvalidRequest: The directory cannot be made (a file is in the way, no permission).
    """
    if explicit is not None:
        path, setting = Path(explicit), "--home or SANDLOT_HOME"
    elif os.environ.get("SANDLOT_HOME"):
        path, setting = Path(os.environ["SANDLOT_HOME"]), "SANDLOT_HOME"
    else:
        data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        path, setting = Path(data) / "sandlot", "SANDLOT_HOME"
    path = path.expanduser().absolute()
    _make_dir(path, f"the state directory {path}", f"set {setting} to a writable directory", 0o700)
    return path


def _make_dir(path: Path, what: str, fix: str, mode: int = 0o777) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=mode)
    except OSError as e:
        why = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror or str(e)
        msg = f"cannot use {what} ({why}); {fix}"
        raise InvalidRequest(msg) from e


def backend_dir(home_dir: Path, backend: str) -> Path:
    """A backend's own state directory under the home."""
    path = home_dir / "backends" / backend
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def cache_dir() -> Path:
    """Built artifacts shared by every home on the host (root filesystems, guest images).

    ``$SANDLOT_CACHE``, else ``~/.cache/sandlot``; entries are keyed by a hash of their inputs,
    so sharing them between homes and CI runs is safe.
    """
    raw = os.environ.get("SANDLOT_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sandlot"
    )
    path = Path(raw).expanduser().absolute()
    _make_dir(path, f"the cache directory {path}", "set SANDLOT_CACHE to a writable directory")
    return path


def default_database_url(home_dir: Path) -> str:
    """``$SANDLOT_DATABASE_URL``, else the SQLite file in the home."""
    return os.environ.get("SANDLOT_DATABASE_URL") or f"sqlite:///{home_dir / 'sandlot.db'}"


def receipt_log_id(home_dir: Path) -> str:
    """The name of this home's receipt log, made on first use and kept in the home.

    Each home signs with its own key, so each writes its own log: homes (and hosts) sharing one
    database keep separate, independently verifiable chains instead of contending for one.
    """
    path = home_dir / "receipt-log-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    host = socket.gethostname().replace(" ", "-") or "host"
    log_id = f"{host}.sandlot/{secrets.token_hex(4)}/receipts"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(log_id + "\n")
    # Two processes starting at once: the first rename wins, and both read what won.
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()
