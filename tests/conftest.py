"""Shared pytest fixtures.

Model fixtures are session-scoped: the real model loads once per test run (about 2 s from
the cached safetensors copy; the very first run converts the GGUF, about 20 s). Tests that
use them carry ``@pytest.mark.model``. torch runs on one thread in tests, so parallel
suites on a 2-core machine do not fight over cores.

To add a fixture: put it here if several test files need it (keep it cheap, or
session-scoped and documented), otherwise in the test file that uses it.
"""

import atexit
import os
import shutil
import tempfile

import pytest

# Keys, control sockets and replay records of everything the tests start (in this process and in the
# daemons they spawn, which inherit the environment) stay in a private directory of this
# run: the default key file is made there on first use, never in the user's home.
_PRIVATE = tempfile.mkdtemp(prefix="kvt-test-")
os.environ.setdefault("KVT_KEY_FILE", os.path.join(_PRIVATE, "key"))
os.environ.setdefault("KVT_RUN_DIR", os.path.join(_PRIVATE, "run"))
os.environ.setdefault("KVT_STATE_DIR", os.path.join(_PRIVATE, "state"))
atexit.register(shutil.rmtree, _PRIVATE, True)


@pytest.fixture(scope="session")
def smollm():
    """The default model (SmolLM2-135M-Instruct) as a kvtransport.model.LoadedModel.

    ``model, tokenizer = smollm`` unpacks it; ``smollm.model_id`` names it. Shared by
    every test in the session: do not mutate it (switch attention implementations or set
    layer masks only inside a try/finally or a context manager that restores them).
    """
    from kvtransport.model import load_model

    return load_model(threads=1)
