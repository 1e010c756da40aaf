"""kvtransport: FEC-protected KV-cache transport for multi-agent LLM handoffs.

The embeddable API (kvtransport.embed.inprocess, kvtransport.embed.partial), loaded on first use so
that ``import kvtransport`` stays cheap::

    kvtransport.send(cache_or_card, to="HOST:PORT", options=kvtransport.SendOptions(
        deadline_ms=300))                            # one transfer's SentResult
    kvtransport.Receiver(listen="HOST:PORT")        # .address, .result(), await it
    kvtransport.receive(listen="HOST:PORT")          # one transfer's DeliveredResult
    kvtransport.send_async(...), kvtransport.receive_async(...)
    kvtransport.partial_cache(result)                # KVCache + presence mask for a model
    kvtransport.race_receive(model, token_ids, listen="HOST:PORT")  # live race: whole cache
    kvtransport.race_daemon(model, token_ids, race_dir="DIR")  # race a receiver daemon's

The sans-I/O protocol core is :mod:`kvtransport.protocol`; the evaluation's library is
:mod:`kvtransport.eval` (the ``eval`` extra). docs/architecture.md ("Public API") lists
the surface; tests/test_public_api.py pins it.
"""

from pathlib import Path as _Path

from kvtransport import kernel_cache as _kernel_cache

__version__ = "0.1.0"

# numba's cache must be pointed at the folder of the current kernel sources before any
# kernel is defined (every kernel lives in a submodule, so this runs first).
_kernel_cache.configure(_Path(__file__).resolve().parent)

_API = {
    "send": "kvtransport.embed.inprocess",
    "send_async": "kvtransport.embed.inprocess",
    "SendOptions": "kvtransport.embed.inprocess",
    "SentResult": "kvtransport.embed.inprocess",
    "receive": "kvtransport.embed.inprocess",
    "receive_async": "kvtransport.embed.inprocess",
    "Receiver": "kvtransport.embed.inprocess",
    "partial_cache": "kvtransport.embed.partial",
    "race_receive": "kvtransport.embed.inprocess",
    "race_daemon": "kvtransport.embed.live_race",
    "DeliveredResult": "kvtransport.daemons.api",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> object:
    """The embeddable API's names, imported on first use (PEP 562)."""
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransport' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
