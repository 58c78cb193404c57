"""Sending email, once per idempotency key. The queue needs the ``email``
grant.

The daemon sends through its configured transport and records each key:
sending again with the same key and message replays the recorded
:class:`Receipt` (``replayed`` is true) and sends nothing. If the daemon
died mid-send, whether the mail left is unknown, and the queue's
``on_uncertain`` policy decides (by default :class:`~khata_sdk.Uncertain`
is raised and the mail is not sent again)::

    from khata_sdk import email

    message = email.Message("Welcome!", "Hello Ada.").to("ada@example.com")
    receipt = email.send("welcome:7", message)
"""

from dataclasses import dataclass, field
from typing import Optional

from . import _host


@dataclass
class Message:
    """An email message: build one with ``Message(subject, text)`` and the
    methods below, each returning the message. Without a sender, the
    daemon's configured ``from`` address is used.

    >>> m = Message("Welcome!", "Hello.").to("ada@example.com").cc("ops@example.com")
    >>> m.to_addresses
    ['ada@example.com']
    """

    subject: str
    text: str
    to_addresses: list = field(default_factory=list)
    cc_addresses: list = field(default_factory=list)
    sender: Optional[str] = None
    html_body: Optional[str] = None

    def to(self, address: str) -> "Message":
        """Adds a recipient."""
        self.to_addresses.append(address)
        return self

    def cc(self, address: str) -> "Message":
        """Adds a copy recipient."""
        self.cc_addresses.append(address)
        return self

    def from_(self, address: str) -> "Message":
        """Sets the sender, instead of the daemon's configured one."""
        self.sender = address
        return self

    def html(self, html: str) -> "Message":
        """Adds an HTML alternative to the text body."""
        self.html_body = html
        return self


@dataclass
class Receipt:
    """What the daemon recorded for a sent message: its Message-ID, and
    whether this call replayed an earlier send."""

    message_id: str
    replayed: bool


def send(key: str, message: Message) -> Receipt:
    """Sends ``message`` once for ``key``; raises
    :class:`~khata_sdk.EffectError` when the host refuses.

    >>> receipt = send("welcome:7", Message("Hi", "Hello.").to("a@example.com"))  # doctest: +SKIP
    """
    wit = _host.interface("email")
    raw = wit.Message(
        to=list(message.to_addresses),
        cc=list(message.cc_addresses),
        from_=message.sender,
        subject=message.subject,
        text=message.text,
        html=message.html_body,
    )
    receipt = _host.call("email", "send", key, raw)
    return Receipt(receipt.message_id, receipt.replayed)
