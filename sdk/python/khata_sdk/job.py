"""One delivery of a job."""

import dataclasses
import json
import typing

from .errors import Fail


class Job:
    """One delivery of a job to this handler.

    ``id`` is stable across every retry; ``attempt`` grows by one on each
    delivery, starting at 1.

    >>> job = Job("j1", "welcome", '{"user_id": 7}')
    >>> job.payload()["user_id"]
    7
    >>> job.key("welcome")
    'j1:welcome'
    """

    def __init__(
        self,
        id: str,
        queue: str,
        payload: str,
        attempt: int = 1,
        max_attempts: int = 1,
        enqueued_at_ms: int = 0,
    ):
        #: The job's id, stable across every retry.
        self.id = id
        #: The queue the job was enqueued on.
        self.queue = queue
        #: This delivery's number: 1 on the first.
        self.attempt = attempt
        #: How many deliveries the job gets before it is dead-lettered.
        self.max_attempts = max_attempts
        #: When the job was enqueued, in milliseconds since the Unix epoch.
        self.enqueued_at_ms = enqueued_at_ms
        self._payload = payload

    def is_last_attempt(self) -> bool:
        """True when a :class:`~khata_sdk.Retry` from this attempt
        dead-letters the job."""
        return self.attempt >= self.max_attempts

    def payload_text(self) -> str:
        """The payload as the JSON text that was enqueued."""
        return self._payload

    def payload(self, cls=None):
        """The payload parsed from JSON; with ``cls`` a dataclass, an
        instance of it.

        A payload that does not parse, or lacks a field of ``cls``, or has
        a field of the wrong type (``str``, ``int``, ``float``, ``bool``,
        ``list``, ``dict`` are checked) is :class:`~khata_sdk.Fail`: the
        same payload will not parse better on the next attempt. Fields of
        the payload that ``cls`` does not name are ignored.

        >>> @dataclasses.dataclass
        ... class Welcome:
        ...     user_id: int
        ...     email: str
        >>> Job("j", "q", '{"user_id": 7, "email": "ada@example.com"}').payload(Welcome)
        Welcome(user_id=7, email='ada@example.com')
        >>> Job("j", "q", '{"user_id": 7}').payload(Welcome)
        Traceback (most recent call last):
        ...
        khata_sdk.errors.Fail: fail: bad payload: missing field `email`
        """
        try:
            value = json.loads(self._payload)
        except json.JSONDecodeError as e:
            raise Fail(f"bad payload: {e}") from None
        if cls is None:
            return value
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"payload(cls): {cls!r} is not a dataclass")
        if not isinstance(value, dict):
            raise Fail(f"bad payload: expected an object, got {_json_type(value)}")
        hints = typing.get_type_hints(cls)
        fields = {}
        for field in dataclasses.fields(cls):
            if field.name not in value:
                if (
                    field.default is dataclasses.MISSING
                    and field.default_factory is dataclasses.MISSING
                ):
                    raise Fail(f"bad payload: missing field `{field.name}`")
                continue
            fields[field.name] = _checked(field.name, value[field.name], hints.get(field.name))
        return cls(**fields)

    def key(self, name: str) -> str:
        """A job-scoped idempotency key, ``<job-id>:<name>``: the same on
        every retry of this job, different for every job.

        >>> Job("01J", "reports", "{}").key("report")
        '01J:report'
        """
        return f"{self.id}:{name}"

    def __repr__(self) -> str:
        return (
            f"Job(id={self.id!r}, queue={self.queue!r}, attempt={self.attempt}, "
            f"max_attempts={self.max_attempts})"
        )


_SIMPLE = {str: "a string", bool: "a boolean", list: "an array", dict: "an object"}


def _checked(name, value, hint):
    """``value`` if it fits the simple type ``hint`` (other hints are not
    checked); else :class:`Fail` naming the field."""
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        expected = "an integer"
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expected = "a number"
    elif hint in _SIMPLE:
        ok = isinstance(value, hint)
        expected = _SIMPLE[hint]
    else:
        return value
    if not ok:
        raise Fail(
            f"bad payload: field `{name}` must be {expected}, got {_json_type(value)}"
        )
    return value


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {json.dumps(value)}"
    if isinstance(value, (int, float)):
        return f"number {json.dumps(value)}"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    if isinstance(value, list):
        return "an array"
    return "an object"
