"""Which optional extra brings which package, and the one-line error when one is missing.

The core install (``pip install kvtransport``) is the data plane: numpy, numba, pyzmq,
safetensors, cryptography. Everything else is an extra (pyproject.toml):

- ``model``: torch, transformers, gguf, accelerate (prefill, answer, demo, to_model_cache);
- ``train``: gymnasium, stable-baselines3 (the DDQN trainer);
- ``eval``: scipy, matplotlib, tqdm, worlddatax (plots, fits, demo tasks, and
  :mod:`kvtransport.eval`, the library under the evaluation scripts);
- ``metrics``: prometheus_client (the daemons' ``--metrics-port``).

Modules outside the data plane import these lazily; the CLI turns a
``ModuleNotFoundError`` of one of them into :func:`missing_extra_message`.
"""

from __future__ import annotations

from types import ModuleType

from kvtransport.errors import UserError

EXTRA_OF = {
    "torch": "model",
    "transformers": "model",
    "gguf": "model",
    "accelerate": "model",
    "gymnasium": "train",
    "stable_baselines3": "train",
    "scipy": "eval",
    "matplotlib": "eval",
    "tqdm": "eval",
    "worlddatax": "eval",
    "prometheus_client": "metrics",
}
"""Top-level module name -> the extra that installs it."""


def extra_for(exc: BaseException) -> str | None:
    """The extra that would fix ``exc`` (a ModuleNotFoundError of an optional package)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    return EXTRA_OF.get(exc.name.split(".")[0])


def missing_extra_message(exc: ModuleNotFoundError) -> str | None:
    """One line naming the extra to install, or None if ``exc`` is no optional package."""
    extra = extra_for(exc)
    if extra is None:
        return None
    return (
        f"this needs the '{extra}' extra (no module named {(exc.name or '').split('.')[0]!r}): "
        f"pip install 'kvtransport[{extra}]'"
    )


def require(module: str) -> ModuleType:
    """Import ``module`` (an optional package), or raise a UserError naming its extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        msg = missing_extra_message(exc)
        if msg is None:
            raise
        raise UserError(msg) from None
