"""Key-value data in the queue's namespace. The queue needs the ``kv`` grant.

Keys are strings, values are bytes (a ``str`` value is stored as UTF-8).
Each call is one atomic step, and a handler reads its own writes.
Re-running these calls is safe: ``put`` and ``delete`` leave the same state
when repeated, and ``insert_if_absent`` is the existence check that makes a
step happen once::

    from khata_sdk import kv

    if kv.insert_if_absent(f"seen:{job.id}", b"1"):
        ...  # first time here for this job: do the step

Every function raises :class:`~khata_sdk.EffectError` when the host refuses.
"""

import json

from . import _host
from .errors import Fail


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def get(key: str):
    """The value at ``key`` as ``bytes``, or ``None`` when there is none.

    >>> count = int(kv.get("order:count") or b"0")  # doctest: +SKIP
    """
    return _host.call("kv", "get", key)


def get_json(key: str):
    """The value at ``key`` parsed as JSON, or ``None`` when there is none;
    a value that does not parse is :class:`~khata_sdk.Fail`.

    >>> version = kv.get_json("indexed:42")  # doctest: +SKIP
    """
    value = get(key)
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as e:
        raise Fail(f"kv value {key!r} is not the expected JSON: {e}") from None


def put(key: str, value) -> None:
    """Sets ``key`` to ``value`` (``bytes`` or ``str``), replacing any value
    it had.

    >>> kv.put("greeting", "hello")  # doctest: +SKIP
    """
    _host.call("kv", "put", key, _bytes(value))


def put_json(key: str, value) -> None:
    """Sets ``key`` to ``value`` encoded as compact JSON text.

    >>> kv.put_json("user:7", {"name": "Ada"})  # doctest: +SKIP
    """
    put(key, json.dumps(value, separators=(",", ":")))


def insert_if_absent(key: str, value) -> bool:
    """Sets ``key`` to ``value`` only if it has no value: true when this
    call inserted it, false when the key existed (its value is left alone).

    >>> first_time = kv.insert_if_absent("welcomed:7", b"1")  # doctest: +SKIP
    """
    return _host.call("kv", "insert_if_absent", key, _bytes(value))


def delete(key: str) -> bool:
    """Removes ``key``: true when a value was deleted.

    >>> kv.delete("slot:3")  # doctest: +SKIP
    """
    return _host.call("kv", "delete", key)
