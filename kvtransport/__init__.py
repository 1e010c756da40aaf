"""kvtransport: FEC-protected KV-cache transport for multi-agent LLM handoffs."""

from pathlib import Path as _Path

from kvtransport import kernel_cache as _kernel_cache

__version__ = "0.1.0"

# numba's cache must be pointed at the folder of the current kernel sources before any
# kernel is defined (every kernel lives in a submodule, so this runs first).
_kernel_cache.configure(_Path(__file__).resolve().parent)
