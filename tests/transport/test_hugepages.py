"""Registered DRAM is backed by transparent huge pages (CMA over 4 KiB pages ran at about half a
memcpy). Checked in the kernel's own accounting (``/proc/self/smaps``), not by timing."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch

from hybrid_kv.hugepages import advise_huge_pages, huge_page_size

MIB = 1 << 20


def huge_bytes(addr: int, length: int) -> int:
    """``AnonHugePages`` of the mappings overlapping ``[addr, addr + length)``."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                overlaps = lo < addr + length and addr < hi
            elif line.startswith("AnonHugePages:") and overlaps:
                total += int(line.split()[1]) * 1024
    return total


def thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not thp_available(), reason="transparent huge pages are disabled on this kernel")
def test_a_torch_pool_is_collapsed_into_huge_pages_with_its_bytes_unchanged() -> None:
    pool = torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8)  # faulted in on 4 KiB pages
    before = pool.clone()
    addr = pool.data_ptr()
    assert huge_bytes(addr, pool.numel()) < 8 * MIB, "torch's allocator asks for no huge pages"
    report = advise_huge_pages(np.array([[addr, pool.numel(), 0]], dtype=np.uint64))
    huge = huge_page_size()
    whole = (addr + pool.numel()) // huge * huge - -(-addr // huge) * huge
    assert report.advised == whole and report.collapsed == whole, report
    assert huge_bytes(addr, pool.numel()) >= whole - huge
    assert torch.equal(pool, before)


def test_no_byte_outside_a_region_is_advised() -> None:
    huge = huge_page_size()
    buf = np.zeros(4 * huge, dtype=np.uint8)
    start = -(-buf.ctypes.data // huge) * huge + 100  # not aligned: the first partial page is skipped
    report = advise_huge_pages(np.array([[start, 2 * huge, 0]], dtype=np.uint64))
    assert report.advised == huge, report  # only the one whole huge page inside the region
    small = advise_huge_pages(np.array([[buf.ctypes.data, huge // 2, 0]], dtype=np.uint64))
    assert (small.advised, small.collapsed) == (0, 0)


def test_unmapped_addresses_are_refused_not_raised() -> None:
    huge = huge_page_size()
    m = mmap.mmap(-1, 8 * huge)
    view = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(view)
    del view
    m.close()  # the range is unmapped now
    report = advise_huge_pages(np.array([[addr, 8 * huge, 0]], dtype=np.uint64))
    assert report.advised == 0 and "madvise" in report.refused, report


@pytest.mark.skipif(not thp_available(), reason="transparent huge pages are disabled on this kernel")
def test_an_endpoint_backs_its_dram_registration_with_huge_pages() -> None:
    from hybrid_kv.transport import Endpoint

    for mode in ("collapse", "advise", "off"):
        pool = torch.ones(16 * MIB, dtype=torch.uint8)  # faulted in on 4 KiB pages
        addr, n = pool.data_ptr(), pool.numel()
        reg = np.array([[addr, n, 0]], dtype=np.uint64)
        table = np.array([[addr, MIB, 0, MIB, 16]], dtype=np.uint64)
        with Endpoint(f"hp-{mode}", reg, {"whole": table}, listen=None, huge_pages=mode) as ep:
            report = ep.huge_pages
            if mode == "off":
                # Nothing advised (the pool may still sit on huge pages if the allocator handed back memory an
                # earlier test advised, so the kernel's accounting proves nothing here).
                assert report is None
            else:
                assert report is not None and report.advised > 0, report
                assert report.collapsed == (report.advised if mode == "collapse" else 0), report
                assert huge_bytes(addr, n) >= report.collapsed
    with pytest.raises(ValueError, match="huge_pages must be 'off', 'advise' or 'collapse', got 'yes'"):
        Endpoint("hp-bad", reg, {"whole": table}, listen=None, huge_pages="yes")


@pytest.mark.skipif(not thp_available(), reason="transparent huge pages are disabled on this kernel")
def test_pools_from_zeros_are_on_huge_pages_from_the_first_touch() -> None:
    from hybrid_kv.hugepages import zeros

    buf = zeros(32 * MIB)
    assert not buf.any() and buf.ctypes.data % huge_page_size() == 0
    assert huge_bytes(buf.ctypes.data, buf.size) >= 32 * MIB
    buf.fill(7)
    assert huge_bytes(buf.ctypes.data, buf.size) >= 32 * MIB
