"""``leto.native.cached_bytes``: a run-time build product (an NVRTC binary of
leto.gpu_kernels) made once per machine and read back by later processes."""

import os

from leto import native


def test_made_once_then_read_back_and_a_changed_input_makes_it_anew(tmp_path, monkeypatch):
    monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path))
    made = []

    def make(tag):
        def f():
            made.append(tag)
            return f"binary {tag}".encode()

        return f

    assert native.cached_bytes("k", b"source 1", make(1)) == b"binary 1"
    assert native.cached_bytes("k", b"source 1", make(2)) == b"binary 1"  # read back
    assert native.cached_bytes("k", b"source 2", make(3)) == b"binary 3"  # another key
    assert made == [1, 3]
    # One file per key, no temporary file left behind.
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["k", "k"]


def test_a_cache_that_cannot_be_written_still_gives_the_bytes(tmp_path, monkeypatch):
    root = tmp_path / "ro"
    root.mkdir()
    os.chmod(root, 0o500)
    monkeypatch.setenv(native.ENV_BUILD_DIR, str(root))
    try:
        if os.access(root, os.W_OK):  # (root ignores the mode: a file in its place)
            monkeypatch.setenv(native.ENV_BUILD_DIR, str(tmp_path / "file" / "below"))
            (tmp_path / "file").write_text("not a folder")
        calls = []
        for _ in range(2):
            got = native.cached_bytes("k", b"src", lambda: calls.append(1) or b"made")
            assert got == b"made"
        assert len(calls) == 2  # nothing kept: made each time, no error
    finally:
        os.chmod(root, 0o700)
