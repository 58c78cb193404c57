"""Log lines into the daemon's log, tagged with the job's id and attempt.

Logging is not an effect in the at-least-once sense: it is not fenced or
deduplicated, so a retried handler logs again. No grant is needed::

    from khata_sdk import log

    log.info("indexing product p1")
"""

from . import _host

#: The levels, by WIT name.
LEVELS = ("trace", "debug", "info", "warn", "error")


def log(level: str, message: str) -> None:
    """Logs ``message`` at ``level``, one of :data:`LEVELS`.

    >>> log("warn", "price went up by 12%")  # doctest: +SKIP
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    wit = _host.interface("log")
    wit.log(wit.Level[level.upper()], message)


def trace(message: str) -> None:
    """Logs ``message`` at trace level."""
    log("trace", message)


def debug(message: str) -> None:
    """Logs ``message`` at debug level."""
    log("debug", message)


def info(message: str) -> None:
    """Logs ``message`` at info level."""
    log("info", message)


def warn(message: str) -> None:
    """Logs ``message`` at warn level."""
    log("warn", message)


def error(message: str) -> None:
    """Logs ``message`` at error level."""
    log("error", message)
