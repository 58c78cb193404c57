"""Write khata job handlers in Python.

A handler is a function from a :class:`Job` to a JSON-serializable result,
marked with :func:`handler`. It runs inside a WebAssembly sandbox and can
touch the world only through the effect modules of this package, each a
host function of the daemon::

    from khata_sdk import Job, handler, index

    @handler
    def handle(job: Job):
        product = job.payload()
        outcome = index.upsert_json("products", product["id"], product,
                                    product["updated_at_ms"])
        return {"id": product["id"], "outcome": outcome}

Build it into a component with ``python -m khata_sdk.build handler.py -o
handler.wasm`` and copy the file into the daemon's ``plugins_dir``.

At least once, effects once
---------------------------

Delivery is at-least-once: a job may run again after a crash, a timeout or
a retry, and any line of a handler may run more than once. The daemon makes
the *effects* happen once instead:

- External effects (:func:`khata_sdk.email.send`,
  :func:`khata_sdk.http.send`) take an idempotency key that names the
  effect, such as ``order-charge-42`` or ``job.key("welcome")``. The same
  key with the same request replays the recorded result (``replayed`` is
  true) instead of repeating the effect; the same key with another request
  is refused with :class:`KeyReused`. Derive keys from what identifies the
  effect, never from the time, randomness or the attempt.
- Embedded effects are idempotent by construction: ``kv.put`` writes a
  value, ``kv.insert_if_absent`` is the existence check, ``index.upsert``
  is versioned.
- Every effect is refused with :class:`Fenced` once the attempt has lost
  the job's lease.

Map of the package
------------------

- :class:`Job`: one delivery of a job; its payload and attempt number.
- :class:`Retry`, :class:`Fail`: how a handler gives up on an attempt.
- :class:`EffectError` and its subclasses: why the host did not perform an
  effect. Uncaught, it retries or fails the attempt as its
  :meth:`EffectError.is_retryable` says.
- :func:`handler`: marks the function the component exports as ``handle``.
- ``khata_sdk.kv``, ``khata_sdk.index``, ``khata_sdk.email``,
  ``khata_sdk.http``, ``khata_sdk.log``: the effects.
- ``khata_sdk.build``: builds a handler into a component.

A component imports only the host interfaces whose modules the handler
imports (the build reads the handler's ``import`` statements): a handler
that never imports ``khata_sdk.http`` does not import it, and its queue
needs no ``http`` grant.

The package imports outside a component too, so that handler logic can be
unit-tested with plain Python; the effect functions raise
:class:`NoHost` there.
"""

from .errors import (
    Denied,
    EffectError,
    Error,
    Fail,
    Fenced,
    InProgress,
    Invalid,
    KeyReused,
    NoHost,
    Rejected,
    Retry,
    Transient,
    Uncertain,
)
from .job import Job
from ._run import handler

__all__ = [
    "Denied",
    "EffectError",
    "Error",
    "Fail",
    "Fenced",
    "InProgress",
    "Invalid",
    "Job",
    "KeyReused",
    "NoHost",
    "Rejected",
    "Retry",
    "Transient",
    "Uncertain",
    "handler",
]
