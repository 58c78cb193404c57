"""``welcome_email`` in Python: sends a new user one welcome email, ever (the
seed's pattern 1, the existence check). The twin of the Rust
``plugins/welcome_email``: same payload, keys, effects and result.

Grants: ``kv`` and ``email``.
Payload: ``{"user_id": 7, "email": "ada@example.com", "name": "Ada"}``; the
``user_id`` is a non-negative integer or a non-empty string.
Result: ``{"user_id": 7, "message_id": "<...@example.com>", "replayed": false}``;
``replayed`` is true when the mail had been sent already (by an earlier
attempt or an earlier job for the same user) and nothing was sent now.

The existence check is the email fence itself: the message is sent with the
idempotency key ``welcome:<user_id>``, so the host sends it once per user and
replays the recorded receipt on any later call. A kv flag checked *before*
sending must not decide the send: a crash between writing the flag and
sending would lose the email for good. Only after the send is the
Message-ID recorded in kv under ``welcomed:<user_id>``; writing it again on a
replay is harmless.

A second job for the same user with a *different* message is refused by the
fence as ``key-reused`` and fails. If the outcome of an earlier send is
unknown (the daemon died mid-send), the queue's ``on_uncertain`` policy
decides; with the default ``skip`` the job fails with ``uncertain`` for an
operator to resolve.
"""

from dataclasses import dataclass
from typing import Any

from khata_sdk import Fail, Job, KeyReused, email, handler, kv


@dataclass
class Welcome:
    """The payload."""

    user_id: Any
    email: str
    name: str


@handler
def handle(job: Job):
    welcome = job.payload(Welcome)
    user_id = id_text("user_id", welcome.user_id)

    key = f"welcome:{user_id}"
    try:
        receipt = email.send(key, message(welcome))
    except KeyReused as e:
        raise Fail(
            f"user {user_id} was already welcomed with a different message "
            f"(key {key}): {e.message}"
        ) from None

    kv.put(f"welcomed:{user_id}", receipt.message_id)

    return {
        "user_id": welcome.user_id,
        "message_id": receipt.message_id,
        "replayed": receipt.replayed,
    }


def message(welcome: Welcome) -> email.Message:
    """The welcome message. It must be the same on every attempt, or the
    fence would refuse the repeat as ``key-reused``."""
    name = welcome.name.strip()
    if name:
        subject, greeting = f"Welcome, {name}!", f"Hello {name},"
    else:
        subject, greeting = "Welcome!", "Hello,"
    text = (
        f"{greeting}\n\nwelcome aboard! Your account is ready, and we are glad to have you.\n"
    )
    return email.Message(subject, text).to(welcome.email)


def id_text(field: str, value) -> str:
    """An id from the payload as key text: a non-empty string as it is, or a
    non-negative integer in decimal."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    shown = "null" if value is None else repr(value)
    raise Fail(
        f"bad payload: {field} must be a non-empty string or a non-negative integer, got {shown}"
    )
