"""Credentials out of the server's logs: API keys, tokens in query strings, Authorization headers.

A key sent where it does not belong (``?api_key=sandlot_…``: refused, but the access log
writes the request line as it came) must not end up in a log file that more people read
than hold keys. :class:`RedactingFilter` rewrites each record before it is written:

- anything that looks like a key (``sandlot_`` and what follows) keeps only the prefix that
  ``sandlot api-keys list`` shows (enough to find the key to revoke);
- query parameters named like a credential (``key``, ``api_key``, ``token``, ``password``, …)
  and the values of a terminal's ``env=NAME=VALUE`` lose their value;
- ``Authorization`` headers, however printed, lose their credentials.

:func:`log_config` is ``sandlot serve``'s uvicorn logging with the filter on every handler;
:func:`install` puts it on the loggers that see request lines, for an app served some other
way. This module must not import the Manager, backends or FastAPI.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["RedactingFilter", "install", "log_config", "redact"]

REDACTED = "[redacted]"

# Each pattern leaves its own output alone: a record can pass several filters (its logger's
# and each handler's), and a second pass must not mangle the first one's work.
_KEY = re.compile(r"(sandlot_[A-Za-z0-9_-]{6})[A-Za-z0-9_-]+")
_QUERY = re.compile(
    r"(?i)((?:^|[?&;\s])(?:[a-z0-9_.-]*(?:key|token|secret|password|passwd|auth|signature)"
    r"[a-z0-9_.-]*|sig|credentials?)=)[^&#\s\"']*"
)
_ENV = re.compile(r"(?i)((?:^|[?&;\s])env=[^&#\s\"'=%]*(?:=|%3D))[^&#\s\"']*")
_SCHEME = r"(?:bearer|basic|token|digest)"
_AUTHORIZATION = re.compile(
    r"(?i)((?:proxy-)?authorization['\"]?\s*[:=,]\s*(?:b?['\"])?+)"
    rf"(?:({_SCHEME})\s+)?(?!\[redacted\])(?!{_SCHEME}\s)[^\s'\",)}}\]]+"
)


def redact(text: str) -> str:
    """``text`` with every credential it shows replaced."""
    if not text:
        return text
    text = _AUTHORIZATION.sub(
        lambda m: f"{m.group(1)}{m.group(2) + ' ' if m.group(2) else ''}{REDACTED}", text
    )
    text = _QUERY.sub(lambda m: m.group(1) + REDACTED, text)
    text = _ENV.sub(lambda m: m.group(1) + REDACTED, text)
    return _KEY.sub(lambda m: f"{m.group(1)}...{REDACTED}", text)


def _clean(value: object) -> object:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, bool | int | float) or value is None:
        return value
    shown = str(value)
    cleaned = redact(shown)
    # An object whose text shows a credential is replaced by its redacted text.
    return value if cleaned == shown else cleaned


class RedactingFilter(logging.Filter):
    """A logging filter that redacts credentials from each record's message, arguments and
    traceback (it never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        else:
            record.msg = _clean(record.msg)
        args = record.args
        if isinstance(args, tuple):
            # Formatters such as uvicorn's access formatter unpack the arguments, so they
            # stay a tuple of the same length.
            record.args = tuple(_clean(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {k: _clean(v) for k, v in args.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_LOGGERS = ("uvicorn.access", "uvicorn.error", "sandlot", "sandlot.server", "sandlot.client")


def install() -> None:
    """Redact on the loggers that see request lines and keys (once per process)."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(RedactingFilter())


def log_config() -> dict[str, Any]:
    """uvicorn's logging configuration with credentials redacted on every handler, and
    sandlot's own log lines (INFO and up) on the same standard error."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"redact": {"()": f"{__name__}.RedactingFilter"}}
    for handler in config["handlers"].values():
        handler["filters"] = ["redact"]
    config["loggers"]["sandlot"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config
