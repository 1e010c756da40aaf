"""kvtransport.kernel_cache: numba's cache folder is named by a digest of every kernel
source and the package modules they import, so an edit to a module that is compiled into
another module's kernels (numba itself only checks the defining file) starts a fresh cache,
and an edit anywhere else does not."""

import os
import subprocess
import sys
from pathlib import Path

import kvtransport
from kvtransport import kernel_cache

KERNEL = "from numba import njit\nfrom kvtransport.policy import WIDTH\n\n@njit(cache=True)\ndef f(x):\n    return x * WIDTH\n"  # noqa: E501


def _tree(tmp_path):
    """A package laid out like an editable install: kvtransport/ and agents/ side by side."""
    kv, agents = tmp_path / "kvtransport", tmp_path / "agents"
    kv.mkdir()
    agents.mkdir()
    (kv / "__init__.py").write_text("")
    (kv / "policy.py").write_text("from kvtransport.errors import UserError\nWIDTH = 3\n")
    (kv / "errors.py").write_text("class UserError(Exception):\n    pass\n")
    (kv / "cli.py").write_text("import argparse\n")
    (agents / "features.py").write_text(KERNEL)
    return kv


def test_kernel_sources_are_the_kernels_and_what_they_import_transitively(tmp_path):
    kv = _tree(tmp_path)
    files = kernel_cache.kernel_sources(kernel_cache.package_dirs(kv))
    names = [str(p.relative_to(tmp_path)) for p in files]
    assert names == [
        "agents/features.py",
        "kvtransport/errors.py",
        "kvtransport/policy.py",
    ]


def test_kernels_in_a_layer_folder_are_found(tmp_path):
    kv = _tree(tmp_path)
    (kv / "core").mkdir()
    (kv / "core" / "__init__.py").write_text("")
    (kv / "core" / "kern.py").write_text(KERNEL)
    files = kernel_cache.kernel_sources(kernel_cache.package_dirs(kv))
    assert kv / "core" / "kern.py" in files


def test_the_digest_follows_imported_constants_but_not_unrelated_modules(tmp_path):
    kv = _tree(tmp_path)

    def digest():
        dirs = kernel_cache.package_dirs(kv)
        return kernel_cache.source_digest(kernel_cache.kernel_sources(dirs), tmp_path)

    d0 = digest()
    (kv / "cli.py").write_text("import argparse  # edited\n")
    assert digest() == d0  # not compiled into any kernel
    (kv / "policy.py").write_text("from kvtransport.errors import UserError\nWIDTH = 4\n")
    d1 = digest()
    assert d1 != d0 and len(d1) == 16  # the kernel's constant changed: a fresh cache


def test_a_forced_gf_kernel_gets_its_own_cache_folder(tmp_path):
    kv = _tree(tmp_path)
    files = kernel_cache.kernel_sources(kernel_cache.package_dirs(kv))
    plain = kernel_cache.source_digest(files, tmp_path)
    assert kernel_cache.source_digest(files, tmp_path, {"HOME": "/x"}) == plain
    assert kernel_cache.source_digest(files, tmp_path, {"KVTRANSPORT_GF_KERNEL": ""}) == plain
    forced = {
        k: kernel_cache.source_digest(files, tmp_path, {"KVTRANSPORT_GF_KERNEL": k})
        for k in ("bitsliced", "shuffle", "gfni")
    }
    assert len(set(forced.values()) | {plain}) == 4


def test_configure_names_the_folder_reuses_an_inherited_one_and_prunes_old(tmp_path, monkeypatch):
    kv = _tree(tmp_path)
    base = tmp_path / "cache"
    base.mkdir()
    for i, name in enumerate(["0000000000000001", "0000000000000002", "0000000000000003"]):
        (base / name).mkdir()
        os.utime(base / name, (1_000_000 + i, 1_000_000 + i))
    (base / "not-a-digest").mkdir()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(base))  # the user's choice: the base
    target = kernel_cache.configure(kv)
    assert target.parent == base and os.environ["NUMBA_CACHE_DIR"] == str(target)
    left = sorted(p.name for p in base.iterdir())
    assert left == sorted(["0000000000000002", "0000000000000003", target.name, "not-a-digest"])
    assert kernel_cache.configure(kv) == target  # inherited by a child process: kept as is


def test_the_package_caches_its_kernels_under_the_digest_folder():
    folder = Path(os.environ["NUMBA_CACHE_DIR"])  # set when kvtransport was imported
    here = Path(kvtransport.__file__).resolve().parent
    files = kernel_cache.kernel_sources(kernel_cache.package_dirs(here))
    assert folder.name == kernel_cache.source_digest(files, here.parent)
    names = {p.name for p in files}
    assert {"gf256.py", "rlc.py", "features.py", "ddqn.py", "policy_base.py"} <= names
    # a fresh process compiles or loads rlc's kernels there, not next to the sources
    code = "from kvtransport.codecs import rlc; rlc.coding_coefficients(1, 4)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert any(p.name.startswith("rlc.") for p in folder.rglob("*.nbi"))
