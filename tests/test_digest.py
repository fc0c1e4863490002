"""verifiers.digest: the leaf-tree SHA-256 of a tensor's raw bytes.

The oracle is written out here from hashlib alone (one block at a time, in order), so a
wrong leaf boundary, or a leaf hashed twice or skipped,
gives a different digest. The GPU tests check the leaf kernel (its padding, leaf
boundaries, unaligned views) against the same oracle.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verifiers import Recorder, read_run
from verifiers import digest as D


def oracle(data: bytes) -> str:
    leaves = b"".join(
        hashlib.sha256(data[i : i + D.BLOCK]).digest() for i in range(0, len(data), D.BLOCK)
    )
    return hashlib.sha256(leaves).hexdigest()


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("n", [0, 1, D.BLOCK - 1, D.BLOCK, D.BLOCK + 1, 3 * D.BLOCK + 17])
def test_digest_matches_the_block_oracle_at_block_boundaries(n):
    t = random_bytes(n, n)
    assert D.digest(t) == oracle(as_bytes(t))


@given(st.integers(0, 3 * D.BLOCK - 1))
@settings(max_examples=12, deadline=None)
def test_one_flipped_bit_anywhere_changes_the_digest(pos):
    t = random_bytes(3 * D.BLOCK, 7)
    before = D.digest(t)
    t[pos] ^= 1
    assert D.digest(t) != before
    assert D.digest(t) == oracle(as_bytes(t))


def test_dtype_shape_and_non_contiguous_views_hash_their_row_major_bytes():
    x = torch.randn(64, 33, dtype=torch.float32).t()  # not contiguous
    assert D.digest(x) == oracle(as_bytes(x))
    assert D.digest(torch.tensor(1.5, dtype=torch.bfloat16)) == oracle(
        torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    )


def test_a_record_is_timed_before_hashing_and_older_trace_versions_are_refused(tmp_path):
    times = iter([100.0, 200.0])
    with Recorder(tmp_path, 0, clock=lambda: next(times)) as rec:
        obj = rec.record(0, 1.0, {"p": torch.ones(4)})
    assert obj["wall_time"] == 100.0 and obj["digest_s"] >= 0
    old = dict(obj, v=1, iteration=1)
    with open(tmp_path / "rank0.trace.jsonl", "a") as f:
        f.write(json.dumps(old) + "\n")
    trace = read_run(tmp_path).traces[0]
    assert sorted(trace.records) == [0]
    assert any("trace version 1" in n for n in trace.notes)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n",
    [0, 1, 55, 56, 63, 64, D.BLOCK - 9, D.BLOCK, D.BLOCK + 1, 5 * D.BLOCK + 119, (300 << 20) + 3],
)
@pytest.mark.parametrize("offset", [0, 1, 4])
def test_cuda_leaves_hash_on_the_gpu_to_the_oracles_digest(n, offset):
    # The kernel's padding at every remainder that takes one block or two (55, 56, 63, 0),
    # leaf boundaries, and views that start 1 and 4 bytes into their storage (the
    # byte-wise loads; 0 takes the 16-byte loads).
    cpu = random_bytes(n + offset, n + 1)
    src = cpu.cuda()
    gpu = torch.zeros_like(src)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # keeps the current stream busy, so the write below
    gpu.copy_(src)  # is still queued when the digest's kernel is launched
    assert D.digest(gpu[offset:]) == D.digest(cpu[offset:]) == oracle(as_bytes(cpu[offset:]))


@pytest.mark.gpu
def test_a_flipped_bit_in_the_last_leaf_changes_the_cuda_digest():
    t = random_bytes(3 * D.BLOCK + 70, 5).cuda()
    before = D.digest(t)
    t[-1] ^= 0x40
    assert D.digest(t) != before
    assert D.digest(t) == oracle(as_bytes(t))


def test_prepare_starts_every_hashing_thread_ahead_and_changes_no_digest():
    # What a parked shadow runs (verifiers.plugin installs it as a shadow warm-up): after
    # it the first digest starts no thread.
    import threading

    D.prepare(torch.device("cpu"))
    names = [t.name for t in threading.enumerate() if t.name.startswith("leto-digest")]
    assert len(names) == D._pool_size, names
    D.prepare(torch.device("cpu"))  # idempotent: no second set of threads
    again = [t.name for t in threading.enumerate() if t.name.startswith("leto-digest")]
    assert sorted(again) == sorted(names)
    data = random_bytes(3 * D.BLOCK + 5, 11)
    assert D.digest(data) == oracle(as_bytes(data))


def test_the_verifiers_plugin_installs_the_digest_warm_up_for_shadows():
    import verifiers.plugin  # noqa: F401 - registers at import
    from leto import plugins

    assert D.prepare in plugins._shadow_warmups


@pytest.mark.gpu
def test_prepare_loads_the_leaf_kernel_once():
    index = torch.cuda.current_device()
    D.prepare(torch.device("cuda"))  # no index: the current device's kernel
    fn = D._kernels[index]
    D.prepare(torch.device("cuda", index))
    assert D._kernels[index] is fn, "loaded again"
    src = random_bytes(D.BLOCK + 7, 3)
    assert D.digest(src.cuda()) == oracle(as_bytes(src))
