"""Marking the function a component exports as ``handle``."""

import json

from .errors import EffectError, Error, Fail

_handler = None


def handler(function):
    """Marks ``function`` as this plugin's handler; use it once per plugin.

    The function takes a :class:`~khata_sdk.Job` and returns any value
    ``json.dumps`` accepts; that becomes the job's JSON result. It gives up
    on an attempt by raising :class:`~khata_sdk.Retry` or
    :class:`~khata_sdk.Fail`; an uncaught :class:`~khata_sdk.EffectError`
    retries or fails as its kind says, and any other exception fails the job
    (``Fail``, naming the exception): a bug does not fix itself on retry.

    >>> from khata_sdk import Job, handler
    >>> @handler
    ... def handle(job: Job):
    ...     return job.payload()
    """
    global _handler
    if _handler is not None and _handler is not function:
        raise RuntimeError(
            f"khata_sdk.handler is used twice: on {_handler.__qualname__} and on "
            f"{function.__qualname__}; a plugin has one handler"
        )
    _handler = function
    return function


def registered():
    """The function marked with :func:`handler`, or ``None``."""
    return _handler


def run(function, job):
    """Runs ``function`` on ``job``: the result as JSON text, or the
    :class:`~khata_sdk.Error` the attempt ends with (raised)."""
    try:
        value = function(job)
    except Error:
        raise
    except EffectError as e:
        raise e.to_error() from None
    except Exception as e:
        raise Fail(f"unhandled {type(e).__name__}: {e}") from None
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise Fail(f"the result is not JSON: {e}") from None
