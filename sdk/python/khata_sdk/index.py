"""Versioned documents in named collections of the embedded index. The
queue needs the ``index`` grant for each collection.

``upsert`` keeps the newest version: a document older than (or as old as)
the stored one changes nothing, so replays and out-of-order deliveries are
harmless::

    from khata_sdk import index

    outcome = index.upsert_json("products", p["id"], p, p["updated_at_ms"])
    # "inserted", "updated", "unchanged" or "stale"

Every function raises :class:`~khata_sdk.EffectError` when the host refuses.
"""

import json

from . import _host
from .errors import Fail

#: What an upsert did, by WIT name.
OUTCOMES = ("inserted", "updated", "unchanged", "stale")


def upsert(collection: str, id: str, document: str, version: int) -> str:
    """Stores ``document`` (JSON text) as ``id`` in ``collection`` at
    ``version``, unless a version at least as new is stored already.
    Returns the outcome's WIT name: ``"inserted"``, ``"updated"``,
    ``"unchanged"`` or ``"stale"``.

    >>> index.upsert("products", "p1", '{"name":"Tea"}', 1700000000000)  # doctest: +SKIP
    'inserted'
    """
    outcome = _host.call("index", "upsert", collection, id, document, version)
    return outcome.name.lower()


def upsert_json(collection: str, id: str, document, version: int) -> str:
    """:func:`upsert` with ``document`` serialized as compact JSON."""
    return upsert(collection, id, json.dumps(document, separators=(",", ":")), version)


def changed(outcome: str) -> bool:
    """True when the upsert changed what is stored (inserted or updated)."""
    return outcome in ("inserted", "updated")


def remove(collection: str, id: str, version: int) -> bool:
    """Removes ``id`` from ``collection`` as of ``version``: true when a
    document was removed."""
    return _host.call("index", "remove", collection, id, version)


def get(collection: str, id: str):
    """The document ``id`` of ``collection`` as JSON text, or ``None``."""
    return _host.call("index", "get", collection, id)


def get_json(collection: str, id: str):
    """The document ``id`` of ``collection`` parsed, or ``None``; a document
    that does not parse is :class:`~khata_sdk.Fail`."""
    text = get(collection, id)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise Fail(f"index document {collection}/{id} is not JSON: {e}") from None
