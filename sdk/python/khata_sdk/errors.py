"""How a handler gives up on an attempt, and why an effect was not performed."""


class Error(Exception):
    """How a handler gives up on this attempt: raise :class:`Retry` or
    :class:`Fail`.

    >>> def check(amount):
    ...     if amount <= 0:
    ...         raise Fail(f"amount must be positive, got {amount}")
    """

    #: ``"retry"`` or ``"fail"``, as the WIT ``job-error`` names it.
    kind = ""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def is_retry(self) -> bool:
        """True for :class:`Retry`."""
        return self.kind == "retry"

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class Retry(Error):
    """Transient: the daemon backs off and delivers the job again, until its
    ``max_attempts`` are used up.

    >>> raise Retry("the inventory service is down")  # doctest: +SKIP
    """

    kind = "retry"


class Fail(Error):
    """Permanent: the job goes to the dead-letter queue now.

    >>> raise Fail("bad payload: amount must be positive")  # doctest: +SKIP
    """

    kind = "fail"


class EffectError(Exception):
    """Why the host did not perform an effect; raised by every effect
    function, as one of the subclasses below.

    Left uncaught in a handler, it becomes :class:`Retry` when another
    attempt can succeed (:class:`InProgress`, :class:`Transient`,
    :class:`Fenced`) and :class:`Fail` when it cannot (:class:`Denied`,
    :class:`KeyReused`, :class:`Rejected`, :class:`Invalid`,
    :class:`Uncertain`), with the message ``effect <kind>: <message>``.
    Catch it where a handler knows better::

        try:
            receipt = email.send(key, message)
        except KeyReused as e:
            raise Fail(f"already welcomed with another message: {e.message}")
    """

    #: The WIT name of the variant, such as ``"key-reused"``.
    kind = ""
    #: True when a later attempt may succeed.
    retryable = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def is_retryable(self) -> bool:
        """True for ``in-progress``, ``transient`` and ``fenced``."""
        return self.retryable

    def to_error(self) -> Error:
        """The :class:`Retry` or :class:`Fail` an uncaught effect error
        becomes."""
        message = f"effect {self.kind}: {self.message}"
        return Retry(message) if self.retryable else Fail(message)

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class Denied(EffectError):
    """Not granted to this queue; only a change to jobs.toml helps."""

    kind = "denied"


class KeyReused(EffectError):
    """The key was done before with another request: a bug in the
    handler's keys."""

    kind = "key-reused"


class InProgress(EffectError):
    """A live attempt holds this fence; it will finish or die."""

    kind = "in-progress"
    retryable = True


class Fenced(EffectError):
    """This attempt no longer holds the job's lease."""

    kind = "fenced"
    retryable = True


class Uncertain(EffectError):
    """The outcome of an earlier try is unknown and the queue's
    ``on_uncertain`` policy is ``skip``: a person decides."""

    kind = "uncertain"


class Transient(EffectError):
    """The provider failed in a way that is safe to retry."""

    kind = "transient"
    retryable = True


class Rejected(EffectError):
    """The provider refused; retrying won't help."""

    kind = "rejected"


class Invalid(EffectError):
    """The request itself is malformed."""

    kind = "invalid"


class NoHost(RuntimeError):
    """An effect was called outside a component (in a native unit test):
    there is no daemon to perform it."""


# By the suffix of the class componentize-py generates for each WIT case
# (`EffectError_KeyReused`, ...).
_BY_CASE = {
    "Denied": Denied,
    "KeyReused": KeyReused,
    "InProgress": InProgress,
    "Fenced": Fenced,
    "Uncertain": Uncertain,
    "Transient": Transient,
    "Rejected": Rejected,
    "Invalid": Invalid,
}


def from_wit(value) -> EffectError:
    """The :class:`EffectError` for a generated ``EffectError_*`` value."""
    case = type(value).__name__.removeprefix("EffectError_")
    cls = _BY_CASE.get(case)
    if cls is None:
        raise TypeError(f"not a khata effect error: {value!r}")
    return cls(value.value)
