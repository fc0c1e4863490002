"""The Horner scheme of the code's parity checks (``leto.erasure.horner``): its shift
steps multiply every symbol by α and α⁻¹, its sums and matrix give the codec's parity
change for every run shape with 1-4 parity pages, the codec routes its generator
products through a kernel's ``horner`` (checked on the CPU with a NumPy twin of it), and
on the GPU the codec's Horner kernel gives the table kernel's bytes (encode, update,
verify, rebuild)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leto.erasure import field
from leto.erasure.codec import ReedSolomon
from leto.erasure.horner import horner_matrix, horner_sums, mul_a, mul_a_inv
from leto.erasure.kernels import Coefficients, by_name


def test_the_shift_steps_multiply_every_symbol_by_alpha_and_its_inverse():
    x = np.arange(1 << 16, dtype=np.uint32)
    w = x | (x[::-1] << 16)  # every symbol in both halves of a word
    for step, c in ((mul_a, 2), (mul_a_inv, field.inv(2))):
        got = step(w)
        assert np.array_equal(got & 0xFFFF, field.mul_vec(x, c)), step.__name__
        assert np.array_equal(got >> 16, field.mul_vec(x[::-1], c)), step.__name__


def _run(k: int, seed: int, n: int = 64):
    gen = torch.Generator().manual_seed(seed)
    old = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for _ in range(k)]
    new = [o.clone() for o in old]
    for j, p in enumerate(new):
        if j % 3 != 1:  # some columns unchanged: the scheme still steps over them
            p[:: 1 + j % 5] ^= torch.randint(1, 256, (1,), dtype=torch.uint8, generator=gen)
    return old, new


@pytest.mark.parametrize("h", [1, 2, 3, 4])
@pytest.mark.parametrize("col0,k", [(0, 1), (0, 6), (5, 9), (1017, 7)])
def test_the_sums_and_matrix_give_the_codecs_parity_change(h, col0, k):
    code = ReedSolomon(1024, h, kernel="cpu")
    old, new = _run(k, col0 * 31 + k)
    want = [torch.zeros(64, dtype=torch.uint8) for _ in range(h)]
    code.update(want, col0, old, new)
    got = [torch.zeros(64, dtype=torch.uint8) for _ in range(h)]
    m = Coefficients(horner_matrix(1024, h, col0, k))
    by_name("cpu").matmul(m, horner_sums(h, old, new), got, accumulate=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert any(w.any() for w in want)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [1, 2, 3, 4])
def test_the_cuda_horner_kernel_gives_the_table_kernels_bytes(h, monkeypatch):
    from leto.erasure.kernels.cuda import CudaKernel

    calls = []
    real = CudaKernel.horner

    def counted(self, *a, **kw):
        done = real(self, *a, **kw)
        calls.append(done)
        return done

    monkeypatch.setattr(CudaKernel, "horner", counted)
    D, n = 37, 1 << 16  # 64 KiB pages; D not a multiple of the kernel's 4-page unroll
    gen = torch.Generator().manual_seed(h)
    data = torch.randint(0, 256, (D, n), dtype=torch.uint8, generator=gen)
    cpu, gpu = ReedSolomon(D, h, kernel="cpu"), ReedSolomon(D, h, kernel="cuda")
    want = cpu.encode(data)
    dev = data.cuda()
    got = gpu.encode(dev)
    assert torch.equal(got.cpu(), want), "encode"
    assert gpu.verify(dev, got)
    # An update of a run in the middle of the group.
    new = torch.randint(0, 256, (5, n), dtype=torch.uint8, generator=gen)
    cpu.update(want, 11, data[11:16], new)
    gpu.update(got, 11, dev[11:16], new.cuda())
    assert torch.equal(got.cpu(), want), "update"
    # A rebuild of h lost data pages (its syndromes are an encode).
    dev[11:16] = new.cuda()
    lost = list(range(3, 3 + h))
    saved = dev[lost].clone()
    dev[lost] = 0
    gpu.reconstruct(dev, got, lost)
    assert torch.equal(dev[lost], saved), "reconstruct"
    assert calls and all(calls), calls  # every generator product took the Horner kernel


def test_a_code_keeps_the_matrices_of_its_recent_run_shapes_only(monkeypatch):
    import leto.erasure.codec as codec

    monkeypatch.setattr(codec, "HORNER_KEPT", 3)
    code = ReedSolomon(64, 4)
    first = code.horner_coefficients(0, 5)
    for col0 in range(1, 4):
        code.horner_coefficients(col0, 5)
    assert code.horner_coefficients(3, 5) is code.horner_coefficients(3, 5)  # kept
    assert code.horner_coefficients(0, 5) is not first  # the oldest went, rebuilt equal
    assert np.array_equal(code.horner_coefficients(0, 5).matrix, first.matrix)


class _HornerOnCpu:
    """The CUDA kernel's ``horner`` contract on the CPU (NumPy sums, the C kernel's
    multiply by M), beside its ``matmul``: what the codec's routing sees on a GPU."""

    name = "cpu"

    def __init__(self):
        self.cpu, self.calls = by_name("cpu"), 0

    def matmul(self, *a, **kw):
        return self.cpu.matmul(*a, **kw)

    def horner(self, m, inputs, outputs, *, xor_with=None, accumulate=False):
        self.calls += 1
        new = list(xor_with) if xor_with is not None else [torch.zeros_like(p) for p in inputs]
        t = horner_sums(len(outputs), list(inputs), new)
        if not accumulate:
            for o in outputs:
                o.zero_()
        self.cpu.matmul(m, t, outputs, accumulate=True)
        return True


@pytest.mark.parametrize("h", [1, 2, 3, 4, 5])
def test_the_codec_routes_its_generator_products_through_the_horner_scheme(h, monkeypatch):
    D, n = 23, 256
    gen = torch.Generator().manual_seed(h)
    data = torch.randint(0, 256, (D, n), dtype=torch.uint8, generator=gen)
    plain = ReedSolomon(D, h, kernel="cpu")
    routed = ReedSolomon(D, h)
    fake = _HornerOnCpu()
    monkeypatch.setattr(routed, "_kernel", lambda device: fake)
    want, got = plain.encode(data), routed.encode(data)
    assert torch.equal(got, want), "encode"
    assert routed.verify(data, got)
    new = torch.randint(0, 256, (4, n), dtype=torch.uint8, generator=gen)
    plain.update(want, 9, data[9:13], new)
    routed.update(got, 9, data[9:13], new)
    assert torch.equal(got, want), "update"
    data[9:13] = new
    lost = list(range(2, 2 + h))
    saved = data[lost].clone()
    data[lost] = 0
    routed.reconstruct(data, got, lost)
    assert torch.equal(data[lost], saved), "reconstruct"
    assert fake.calls == (4 if h <= 4 else 0)  # encode, verify, update, the rebuild's syndromes
    monkeypatch.setenv("LETO_HORNER", "0")
    routed.encode(data)
    assert fake.calls == (4 if h <= 4 else 0)  # the tables, as asked
