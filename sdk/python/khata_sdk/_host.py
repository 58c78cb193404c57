"""The generated bindings, reached lazily so that the package imports
outside a component (for native unit tests) and a component links only the
interfaces its handler uses."""

import importlib

from .errors import NoHost, from_wit


def interface(name: str):
    """The generated module of the WIT interface ``name`` (``kv``, ...)."""
    try:
        return importlib.import_module(f"wit_world.imports.{name}")
    except ImportError as e:
        raise NoHost(
            f"khata_sdk.{name} needs the khata host: it works only inside a "
            f"component built with `python -m khata_sdk.build` from a handler "
            f"that imports khata_sdk.{name} ({e})"
        ) from None


def call(name: str, function: str, *args):
    """Calls ``function`` of interface ``name``; a WIT ``err`` becomes the
    matching :class:`~khata_sdk.EffectError`."""
    module = interface(name)
    from componentize_py_types import Err

    try:
        return getattr(module, function)(*args)
    except Err as e:
        raise from_wit(e.value) from None
