"""The state manager's native loss scan (``leto/memory/backends/scan.c``) against a
stand-in for the driver's ``cuPointerGetAttribute``: the same loop the CUDA backend
runs over libcuda (tests/test_backend_cuda.py runs it on the GPU)."""

from __future__ import annotations

import ctypes

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.memory.backends.scan import QUERY, ScanError, Scanner

MAPPED = 19  # any attribute number: the stand-in checks it is passed through
BASE, PAGE = 0x7F00_0000_0000, 2 << 20
SUCCESS, INVALID_VALUE, NOT_INITIALIZED = 0, 1, 3


def stand_in(answers: dict[int, tuple[int, int]], seen: list[int]):
    """``answers``: page index -> (CUresult, mapped); pages not named are mapped."""

    @QUERY
    def query(data, attribute, ptr):
        assert attribute == MAPPED, attribute
        index, rest = divmod(ptr - BASE, PAGE)
        assert rest == 0, f"queried {ptr:#x}, not a page start"
        seen.append(index)
        err, mapped = answers.get(index, (SUCCESS, 1))
        if err == SUCCESS:
            ctypes.c_bool.from_address(data).value = bool(mapped)  # the driver writes a bool
        return err

    return query


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 300).flatmap(
        lambda n: st.tuples(st.just(n), st.sets(st.integers(0, max(n - 1, 0))))
    )
)
def test_scan_finds_exactly_the_unmapped_pages_querying_each_page_once(case):
    n, lost = case
    lost = {i for i in lost if i < n}
    # A lost page answers INVALID_VALUE (nothing mapped in the reservation) or, on some
    # drivers, success with mapped = false: both count.
    answers = {i: (INVALID_VALUE, 0) if i % 2 else (SUCCESS, 0) for i in lost}
    seen: list[int] = []
    scanner = Scanner(stand_in(answers, seen), MAPPED)
    assert scanner.unmapped(BASE, PAGE, n) == sorted(lost)
    assert seen == list(range(n)), "every page queried once, in order"


def test_another_driver_error_names_the_page_and_the_result():
    seen: list[int] = []
    scanner = Scanner(stand_in({7: (NOT_INITIALIZED, 0)}, seen), MAPPED)
    with pytest.raises(ScanError, match="page 7 failed: CUresult 3") as e:
        scanner.unmapped(BASE, PAGE, 20)
    assert (e.value.page, e.value.result) == (7, NOT_INITIALIZED)
    assert seen == list(range(8)), "the scan stops at the error"
