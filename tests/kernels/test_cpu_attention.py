

def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    import os
    import time

    from pagedserve.kernels import cpu_attention

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    lock = __import__("pathlib").Path(_get_build_directory("some_ext", verbose=False)) / "lock"
    lock.touch()
    cpu_attention._remove_stale_lock("some_ext")
    assert lock.exists()  # a build may be running: left alone
    old = time.time() - cpu_attention.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    cpu_attention._remove_stale_lock("some_ext")
    assert not lock.exists()
