"""kvtransport.kernel_cache: a kernel module is kept no older than the modules compiled
into it, so numba's per-file cache stamp changes when any of them does."""

import os

from kvtransport.codecs import blockrs, gf256, rlc, tinymt32

from kvtransport import kernel_cache


def _at(path, ns):
    path.write_text("x = 1\n")
    os.utime(path, ns=(ns, ns))
    return str(path)


def test_an_older_module_is_moved_up_to_its_newest_dependency(tmp_path):
    user = _at(tmp_path / "rlc.py", 1_000_000_000_000)
    old = _at(tmp_path / "tinymt32.py", 900_000_000_000)
    new = _at(tmp_path / "gf256.py", 2_000_000_000_000)
    assert kernel_cache.depends_on(user, old, new)
    assert os.stat(user).st_mtime_ns == 2_000_000_000_000
    assert not kernel_cache.depends_on(user, old, new)  # now up to date: untouched
    assert os.stat(user).st_mtime_ns == 2_000_000_000_000


def test_a_newer_module_and_missing_files_are_left_alone(tmp_path):
    user = _at(tmp_path / "rlc.py", 3_000_000_000_000)
    dep = _at(tmp_path / "gf256.py", 2_000_000_000_000)
    assert not kernel_cache.depends_on(user, dep)
    assert os.stat(user).st_mtime_ns == 3_000_000_000_000
    assert not kernel_cache.depends_on(user, str(tmp_path / "gone.py"))
    assert not kernel_cache.depends_on(str(tmp_path / "gone.py"), dep)


def test_the_codec_modules_are_no_older_than_what_they_compile_in():
    # importing them ran depends_on: the order holds in this checkout right now
    def mtime(m):
        return os.stat(m.__file__).st_mtime_ns

    assert mtime(rlc) >= max(mtime(gf256), mtime(tinymt32))
    assert mtime(blockrs) >= max(mtime(gf256), mtime(rlc))
