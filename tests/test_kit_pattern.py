"""The GPU kit's byte check (``hybrid_kv.kit.pattern``) on CPU tensors: it must accept exactly the bytes the moves
say and find any other byte, whatever the chunking."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hybrid_kv.kit.pattern import Overlay, byte_pattern, check, fill, rows_pattern, views_of  # noqa: E402


def pools(*sizes: int) -> list[object]:
    return [torch.zeros(n, dtype=torch.uint8) for n in sizes]


def landed(dst: object, src: object, moves: np.ndarray) -> None:
    """Copy each move's bytes as a transfer would (host tensors: plain slices)."""
    for s, d, n in moves.tolist():
        dv = views_of([dst])[0]
        sv = views_of([src])[0]
        dv.flat[d - dv.base : d - dv.base + n] = sv.flat[s - sv.base : s - sv.base + n]


def test_pattern_is_a_function_of_seed_and_address() -> None:
    a = byte_pattern(5, 1 << 40, 4096)
    assert torch.equal(a, byte_pattern(5, 1 << 40, 4096))
    assert torch.equal(a[100:200], byte_pattern(5, (1 << 40) + 100, 100))
    assert (a != byte_pattern(6, 1 << 40, 4096)).float().mean() > 0.98
    assert (a[1:] != a[:-1]).float().mean() > 0.98  # a shifted range differs almost everywhere
    counts = torch.bincount(byte_pattern(5, 1 << 40, 1 << 18).long(), minlength=256).float()
    assert counts.std() / counts.mean() < 0.1  # uniform: about 0.03 for a random byte stream


@pytest.mark.parametrize("chunk", [64, 1000, 1 << 20])
def test_moves_landed_check_clean_and_every_flip_is_found(chunk: int) -> None:
    (src,), (d0, d1) = pools(5000), pools(3000, 2000)
    fill(views_of([src]), 3, chunk)
    dst_views = views_of([d0, d1])
    fill(dst_views, 9, chunk)
    s, a, b = src.data_ptr(), d0.data_ptr(), d1.data_ptr()
    moves = np.array([[s + 10, a + 100, 500], [s + 4000, a + 600, 700], [s + 7, b + 1999, 1]], dtype=np.uint64)
    landed(d0, src, moves[:2])
    landed(d1, src, moves[2:])
    ok = check(dst_views, 9, [Overlay(3, moves)], chunk)
    assert ok.first is None and ok.mismatched == 0 and ok.bytes == 5000 and ok.moved_bytes == 1201
    assert check(views_of([src]), 3, [], chunk).mismatched == 0  # the source is unchanged
    for where, why in ((a + 100, "moved from address"), (a + 1299, "moved from address"), (a + 99, "unchanged")):
        d0[where - a] ^= 1
        bad = check(dst_views, 9, [Overlay(3, moves)], chunk)
        assert bad.mismatched == 1 and why in (bad.first or "") and f"{where:#x}" in (bad.first or "")
        d0[where - a] ^= 1


def test_a_missing_or_misplaced_move_is_found() -> None:
    (src,), (dst,) = pools(4096), pools(4096)
    fill(views_of([src]), 1, 512)
    dv = views_of([dst])
    fill(dv, 2, 512)
    s, d = src.data_ptr(), dst.data_ptr()
    moves = np.array([[s, d + 64, 256]], dtype=np.uint64)
    assert check(dv, 2, [Overlay(1, moves)], 512).mismatched > 250  # never landed
    landed(dst, src, np.array([[s + 1, d + 64, 256]], dtype=np.uint64))  # one byte off at the source
    assert check(dv, 2, [Overlay(1, moves)], 512).mismatched > 250
    landed(dst, src, moves)
    assert check(dv, 2, [Overlay(1, moves)], 512).mismatched == 0
    assert check(dv, 2, [Overlay(4, moves)], 512).mismatched > 250  # bytes of another rank expected


def test_overlapping_or_outside_moves_are_findings() -> None:
    (dst,) = pools(1024)
    dv = views_of([dst])
    fill(dv, 2, 256)
    d = dst.data_ptr()
    overlap = np.array([[1 << 40, d, 100], [1 << 41, d + 50, 100]], dtype=np.uint64)
    assert "overlap" in (check(dv, 2, [Overlay(1, overlap)], 256).first or "")
    outside = np.array([[1 << 40, d + 1000, 100]], dtype=np.uint64)
    assert "outside the pools" in (check(dv, 2, [Overlay(1, outside)], 256).first or "")


def test_rows_pattern_writes_whole_pages_with_the_pattern() -> None:
    pool = torch.zeros((6, 300), dtype=torch.uint8)
    rows = torch.tensor([1, 4], dtype=torch.int64)
    pool.index_copy_(0, rows, rows_pattern(pool, rows, 7))
    base = pool.data_ptr()
    assert torch.equal(pool[4], byte_pattern(7, base + 4 * 300, 300))
    assert int(pool[0].sum()) == 0 and int(pool[5].sum()) == 0
