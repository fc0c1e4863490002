"""``ReedSolomon``: a systematic MDS erasure code for one shape of protection group.

Runs in whichever process holds the pages (trainer for device pages, state manager or
trainer for host parity). Works on the device the pages live on: CUDA tensors never
touch host memory (coefficients and tables are the only host→device traffic).

Index space for erasures: data pages are ``0 .. D-1``, parity pages ``D .. D+H-1``.

What it does not guarantee: integrity of pages it is told are intact (a corrupted
survivor decodes into wrong bytes; use ``verify``), atomicity of in-place writes (a
crash mid-call leaves partially written outputs; the updater's undo buffer and marker
provide crash consistency), or thread safety of concurrent calls on the same pages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch

from leto.erasure import field, horner
from leto.erasure.errors import PageRangeError, PageShapeError, TooManyErasures
from leto.erasure.kernels import Coefficients, GFKernel, by_name, for_device
from leto.erasure.pages import (
    PageInput,
    PageList,
    as_pages,
    group_name,
    padded,
    parity_page_bytes,
    same_device,
)

HORNER_KEPT = 1024  # run shapes whose Horner matrices a code keeps


class ReedSolomon:
    """Code of ``data_pages`` (D) data pages and ``parity_pages`` (H) parity pages.

    ``kernel`` forces an implementation ("reference", "cpu", "cuda"); by default the
    fast one for the pages' device is used.
    """

    def __init__(
        self, data_pages: int = 1024, parity_pages: int = 16, *, kernel: str | None = None
    ):
        if not isinstance(data_pages, int) or not isinstance(parity_pages, int):
            raise TypeError("data_pages and parity_pages must be integers")
        self.data_pages = data_pages
        self.parity_pages = parity_pages
        self._g = field.rs_generator(data_pages, parity_pages)
        self._g.setflags(write=False)
        self._coeffs = Coefficients(self._g)
        self._horner: OrderedDict[tuple[int, int], Coefficients] = OrderedDict()
        self._kernel_name = kernel
        if kernel is not None:
            by_name(kernel)  # fail now on an unknown name

    def __repr__(self) -> str:
        return f"ReedSolomon(data_pages={self.data_pages}, parity_pages={self.parity_pages})"

    # -- introspection -------------------------------------------------------------

    @property
    def coefficients(self) -> Coefficients:
        """The generator's coefficients as kernels take them (their tables cached)."""
        return self._coeffs

    def generator_matrix(self) -> list[list[int]]:
        """The H × D coefficients: parity page j = Σ_i G[j][i] · data page i."""
        return self._g.tolist()

    @property
    def first_root(self) -> int:
        """``b``: the parity checks are at α^b .. α^(b+H-1) (``field.rs_generator``)."""
        return field.first_root(self.parity_pages)

    def parity_checks(self) -> np.ndarray:
        """``C_P``: the H × H parity-page part of the check matrix; ``C_P · S`` turns
        the generator's syndromes ``S = G·d ⊕ p`` into the check sums
        ``Σ_pos α^((b+r)·pos) · e_pos`` of the errors ``e`` (``leto.erasure.locate``)."""
        c = field.check_matrix(self.data_pages + self.parity_pages, self.parity_pages)
        return c[:, self.data_pages :]

    def horner_coefficients(self, col0: int, k: int) -> Coefficients:
        """``M`` of the run of ``k`` data pages from ``col0`` (``leto.erasure.horner``),
        kept with its kernel tables (8 KiB on a GPU at H = 4): an updater's layout has a
        few hundred run shapes; the least recently used beyond ``HORNER_KEPT`` go."""
        key = (col0, k)
        c = self._horner.get(key)
        if c is None:
            c = Coefficients(horner.horner_matrix(self.data_pages, self.parity_pages, col0, k))
            self._horner[key] = c
            if len(self._horner) > HORNER_KEPT:
                self._horner.popitem(last=False)
        else:
            self._horner.move_to_end(key)
        return c

    @staticmethod
    def parity_page_bytes(page_bytes: int) -> int:
        return parity_page_bytes(page_bytes)

    # -- operations ----------------------------------------------------------------

    def encode(self, data: PageInput, *, out: PageInput | None = None, group: object = None):
        """Parity of ``data`` (D pages). Returns a new H × P uint8 tensor on the data's
        device, or writes into ``out`` (H pages of P bytes) and returns it."""
        d = as_pages(data, self.data_pages, "data", group)
        pbytes = parity_page_bytes(d.page_bytes)
        if out is None:
            out = torch.empty((self.parity_pages, pbytes), dtype=torch.uint8, device=d.device)
        p = self._parity_pages(out, pbytes, group)
        same_device(group, d, p)
        self._by_generator(self._kernel(d.device), padded(d), p.pages)
        return out

    def verify(self, data: PageInput, parity: PageInput, *, group: object = None) -> bool:
        """True when ``parity`` is exactly the parity of ``data`` (bytes compared)."""
        d = as_pages(data, self.data_pages, "data", group)
        p = self._parity_pages(parity, parity_page_bytes(d.page_bytes), group)
        same_device(group, d, p)
        fresh = torch.empty((self.parity_pages, p.page_bytes), dtype=torch.uint8, device=d.device)
        self._by_generator(self._kernel(d.device), padded(d), list(fresh))
        return all(torch.equal(fresh[j], p.pages[j]) for j in range(self.parity_pages))

    def update(
        self,
        parity: PageInput,
        first_page: int,
        old: PageInput,
        new: PageInput,
        *,
        group: object = None,
    ) -> None:
        """``parity ⊕= contribution of (old ⊕ new)`` for data pages ``first_page ..``.

        ``old`` and ``new`` are the previous and current contents of a run of
        consecutive data pages. Afterwards ``parity`` equals the encoding of the group
        with ``new`` in place of ``old`` (if it matched the old contents before).
        """
        o = as_pages(old, None, "old", group)
        n = as_pages(new, len(o), "new", group)
        if n.page_bytes != o.page_bytes or n.dtype != o.dtype:
            raise PageShapeError(
                f"protection group {group_name(group)}: old pages are {o.page_bytes} bytes of "
                f"{o.dtype}, new pages {n.page_bytes} bytes of {n.dtype}; they must match"
            )
        self._check_run(first_page, len(o), group)
        p = self._parity_pages(parity, parity_page_bytes(o.page_bytes), group)
        same_device(group, o, n, p)
        self._by_generator(
            self._kernel(o.device),
            padded(o),
            p.pages,
            col_offset=first_page,
            xor_with=padded(n),
            accumulate=True,
        )

    def reconstruct(
        self,
        data: PageInput,
        parity: PageInput,
        erased: Iterable[int],
        *,
        group: object = None,
    ) -> None:
        """Rebuild the ``erased`` pages in place from the others.

        Indices ``0..D-1`` name data pages, ``D..D+H-1`` parity pages. The contents of
        erased pages are ignored; every other page must be intact and consistent.
        More than H erasures raise ``TooManyErasures`` and write nothing.
        """
        D, H = self.data_pages, self.parity_pages
        erased_list = [int(i) for i in erased]
        lost = sorted(set(erased_list))
        bad = [i for i in lost if i < 0 or i >= D + H]
        if bad:
            raise PageRangeError(
                f"protection group {group_name(group)}: erased page index {bad[0]} outside "
                f"0..{D + H - 1} (D={D} data + H={H} parity); nothing was rebuilt"
            )
        if len(lost) != len(erased_list):
            raise PageRangeError(
                f"protection group {group_name(group)}: erased list {erased_list} names a page twice; "
                "nothing was rebuilt"
            )
        d = as_pages(data, D, "data", group)
        p = self._parity_pages(parity, parity_page_bytes(d.page_bytes), group)
        same_device(group, d, p)
        if len(lost) > H:
            n_data = sum(i < D for i in lost)
            raise TooManyErasures(
                group, len(lost), H, f"{n_data} data and {len(lost) - n_data} parity pages"
            )
        if not lost:
            return
        lost_data = [i for i in lost if i < D]
        lost_parity = [i - D for i in lost if i >= D]
        kernel = self._kernel(d.device)
        if lost_data:
            self._decode_data(kernel, d, p, lost_data, lost_parity)
        if lost_parity:
            rows = Coefficients(self._g[lost_parity])
            kernel.matmul(rows, padded(d), [p.pages[j] for j in lost_parity])

    # -- internals -----------------------------------------------------------------

    def _decode_data(
        self, kernel: GFKernel, d: PageList, p: PageList, lost: list[int], lost_parity: list[int]
    ) -> None:
        # With the lost pages taken as zero, the generator gives syndromes
        #   S = G · d'  so that  parity_P ⊕ S_P = G[P][:, lost] · x = A · x
        # for any e surviving parity rows P, hence  x = A⁻¹ · (S_P ⊕ parity_P).
        # Step 1 is an ordinary encode with the cached generator tables; step 2 reads
        # only 2e pages. Only the e×e inverse is computed on the host.
        e = len(lost)
        gone = set(lost_parity)
        rows = [j for j in range(self.parity_pages) if j not in gone][:e]
        a_inv = Coefficients(field.mat_inv(self._g[np.ix_(rows, lost)]))
        data_in = padded(d)
        for i in lost:  # erased contents are garbage and are about to be overwritten
            data_in[i].zero_()
        pbytes = data_in[0].numel()
        syndromes = torch.empty((self.parity_pages, pbytes), dtype=torch.uint8, device=d.device)
        self._by_generator(kernel, data_in, list(syndromes))
        ins = [syndromes[j] for j in rows]
        parity_rows = [p.pages[j] for j in rows]
        if d.page_bytes % 2 == 0:
            kernel.matmul(a_inv, ins, [d.pages[i] for i in lost], xor_with=parity_rows)
            return
        tmp = torch.empty((e, pbytes), dtype=torch.uint8, device=d.device)
        kernel.matmul(a_inv, ins, list(tmp), xor_with=parity_rows)
        for k, i in enumerate(lost):
            d.pages[i].copy_(tmp[k, :-1])

    def _by_generator(self, kernel: GFKernel, inputs, outputs, *, col_offset: int = 0,
                      xor_with=None, accumulate: bool = False) -> None:  # fmt: skip
        """``outputs (⊕)= G[:, col_offset:] · (inputs ⊕ xor_with)``: by the code's Horner
        scheme where the kernel has it (CUDA, at most ``horner.HORNER_ROWS`` parity
        pages, 16-byte vectors), else by the generic table multiply — the same bytes."""
        by_horner = getattr(kernel, "horner", None)
        if by_horner is not None and horner.applies(self.parity_pages):
            m = self.horner_coefficients(col_offset, len(inputs))
            if by_horner(m, inputs, outputs, xor_with=xor_with, accumulate=accumulate):
                return
        kernel.matmul(self._coeffs, inputs, outputs, col_offset=col_offset,
                      xor_with=xor_with, accumulate=accumulate)  # fmt: skip

    def _parity_pages(self, parity: PageInput, pbytes: int, group: object) -> PageList:
        p = as_pages(parity, self.parity_pages, "parity", group)
        if p.page_bytes != pbytes:
            raise PageShapeError(
                f"protection group {group_name(group)}: parity pages are {p.page_bytes} bytes, "
                f"expected {pbytes} for these data pages"
            )
        return p

    def _check_run(self, first: int, count: int, group: object) -> None:
        if not isinstance(first, int) or first < 0 or first + count > self.data_pages:
            raise PageRangeError(
                f"protection group {group_name(group)}: data pages {first}..{first + count - 1} "
                f"are outside 0..{self.data_pages - 1}; parity was not changed"
            )

    def _kernel(self, device: torch.device) -> GFKernel:
        return by_name(self._kernel_name) if self._kernel_name else for_device(device)
