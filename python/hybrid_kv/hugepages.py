"""Host memory on transparent huge pages, for the KV pools NIXL moves.

Between processes on one host UCX moves DRAM with CMA (``process_vm_readv``), whose cost per byte depends
on how many pages it must look up and pin: over 4 KiB pages a 256 MiB READ ran at about 45 % of a memcpy of
the same bytes here, over 2 MiB pages at 65-95 % (``benches/transfer_throughput.py``). NumPy asks for huge
pages on large arrays; torch's CPU allocator does not, and KV pools are torch tensors. Two remedies:

* allocate the pool on huge pages from the start: :func:`zeros` advises ``MADV_HUGEPAGE`` before the first
  touch, so every fault maps a huge page (no extra cost; the presets' pools are allocated this way);
* or, for memory already faulted in on 4 KiB pages, :func:`advise_huge_pages` with ``collapse=True``
  (``MADV_COLLAPSE``, Linux 6.1+) copies it into huge pages now, contents unchanged. That costs about one
  copy of the region at 0.5-2.5 GiB/s here, once, which is why the transport only does it when asked
  (``Endpoint(huge_pages="collapse")``).

Both calls are advice: they never change what the memory holds, and a kernel that refuses them (older
kernels, THP disabled, no free huge pages) leaves the memory as it was; the report says what happened. This
module needs neither NIXL nor torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["HugePageReport", "advise_huge_pages", "huge_page_size", "zeros"]

log = logging.getLogger("hybrid_kv.hugepages")

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_PMD_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_DEFAULT_HUGE = 2 << 20


@dataclass(frozen=True)
class HugePageReport:
    """What ``advise_huge_pages`` did.

    Attributes:
        advised: bytes advised ``MADV_HUGEPAGE`` (whole huge pages inside the regions).
        collapsed: bytes the kernel collapsed into huge pages now (``MADV_COLLAPSE`` succeeded).
        seconds: time taken.
        refused: the first refusal (``"madvise(...): <errno text>"``), empty when none.
    """

    advised: int
    collapsed: int
    seconds: float
    refused: str = ""


def huge_page_size() -> int:
    """The transparent huge page size of this kernel (2 MiB on x86-64), or 2 MiB when unknown."""
    try:
        with open(_PMD_SIZE) as f:
            return int(f.read().strip()) or _DEFAULT_HUGE
    except (OSError, ValueError):
        return _DEFAULT_HUGE


def _libc_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def zeros(nbytes: int) -> npt.NDArray[np.uint8]:
    """A zeroed ``uint8`` host buffer of ``nbytes`` on huge pages, aligned to a huge page.

    It is a fresh anonymous mapping (never memory a heap reused, which would already be faulted in on 4 KiB
    pages), advised ``MADV_HUGEPAGE`` and then written once per huge page, so every page is a huge page
    before it is returned (the kernel zeroes it, as ``torch.zeros`` would); the array keeps the mapping alive.
    ``torch.from_numpy(zeros(n))`` gives a tensor on it, without a copy.
    """
    if nbytes <= 0:
        raise ValueError(f"a pool needs a positive size, got {nbytes} bytes")
    huge = huge_page_size()
    # Private anonymous memory (a shared mapping would be shmem, whose huge pages are a separate setting).
    mapping = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mapping)
    start = ctypes.addressof(view)
    del view  # release the buffer export
    offset = -start % huge
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    buf = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset)
    # Fault every huge page in by a write now: a first *read* would map the shared zero page instead, and the
    # write after it could then copy onto 4 KiB pages.
    buf[::huge] = 0
    return buf


def advise_huge_pages(regions: npt.NDArray[np.uint64], *, collapse: bool = True) -> HugePageReport:
    """Advise (and collapse) every whole huge page inside the ``(N, 3)`` ``(addr, len, dev)`` host regions.

    Partial huge pages at a region's ends are left alone, so no byte outside the regions is touched.
    Never raises for a refusal; see ``HugePageReport.refused``.
    """
    t0 = time.perf_counter()
    madvise = _libc_madvise()
    if madvise is None:
        return HugePageReport(0, 0, 0.0, f"huge pages are Linux-only ({sys.platform})")
    huge = huge_page_size()
    advised = collapsed = 0
    refused = ""
    for addr, length, _ in np.asarray(regions, dtype=np.uint64).tolist():
        start = -(-int(addr) // huge) * huge
        end = (int(addr) + int(length)) // huge * huge
        if end <= start:
            continue
        for advice, name in ((_MADV_HUGEPAGE, "MADV_HUGEPAGE"), (_MADV_COLLAPSE, "MADV_COLLAPSE")):
            if advice == _MADV_COLLAPSE and not collapse:
                continue
            if madvise(start, end - start, advice) == 0:
                if advice == _MADV_HUGEPAGE:
                    advised += end - start
                else:
                    collapsed += end - start
            elif not refused:
                err = ctypes.get_errno()
                refused = f"madvise({start:#x}, {end - start}, {name}): {os.strerror(err)}"
    report = HugePageReport(advised, collapsed, time.perf_counter() - t0, refused)
    log.debug(
        "huge pages: %d MiB advised, %d MiB collapsed in %.1f ms%s",
        advised >> 20,
        collapsed >> 20,
        report.seconds * 1e3,
        f" ({refused})" if refused else "",
    )
    return report
