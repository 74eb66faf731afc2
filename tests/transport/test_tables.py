"""Pure checks of descriptor tables, id validation, notification framing and error pickling."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_kv._core import expand_rows
from hybrid_kv.transport import CheckedTable, Transfer, TransferError, check_ids
from hybrid_kv.transport import notifications as notif


def test_expand_rows_matches_flat_order() -> None:
    rows = np.array([[1000, 16, 0, 64, 3], [5000, 8, 1, 8, 2]], dtype=np.uint64)
    expect = [[1000, 16, 0], [1064, 16, 0], [1128, 16, 0], [5000, 8, 1], [5008, 8, 1]]
    assert expand_rows(rows).tolist() == expect
    assert expand_rows(rows).dtype == np.uint64
    assert expand_rows(np.array(expect, dtype=np.uint64)).tolist() == expect  # (N, 3) rows: a copy
    assert expand_rows(rows[::-1]).tolist() == expect[3:] + expect[:3]  # a non-contiguous view


def test_expand_rows_names_the_bad_row_and_the_limit() -> None:
    with pytest.raises(ValueError, match="3 or 5 columns, got 4"):
        expand_rows(np.zeros((2, 4), dtype=np.uint64))
    with pytest.raises(ValueError, match="descriptor row 1 has count 0"):
        expand_rows(np.array([[0, 8, 0, 8, 1], [0, 8, 0, 8, 0]], dtype=np.uint64))
    with pytest.raises(
        ValueError, match=r"row 0 \(addr 0, len 1, stride 18446744073709551615, count 2\) ends past 2\^64"
    ):
        expand_rows(np.array([[0, 1, 0, 2**64 - 1, 2]], dtype=np.uint64))
    with pytest.raises(ValueError, match="over the limit of 2147483647"):
        expand_rows(np.array([[0, 1, 0, 1, 2**31]], dtype=np.uint64))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2**40), st.integers(1, 4096), st.integers(1, 8192), st.integers(1, 20)),
        min_size=1,
        max_size=6,
    )
)
def test_expand_rows_sizes_and_lengths(spec: list[tuple[int, int, int, int]]) -> None:
    rows = np.array([[a, n, 0, s, c] for a, n, s, c in spec], dtype=np.uint64)
    table = CheckedTable("t", rows)
    flat = expand_rows(rows)
    assert table.size == flat.shape[0] == sum(c for *_, c in spec)
    ids = np.arange(table.size, dtype=np.int32)
    assert (table.lengths(ids) == flat[:, 1]).all()


def test_check_ids_names_the_id_and_the_limit() -> None:
    table = CheckedTable("whole", np.array([[0, 256, 0, 256, 8]], dtype=np.uint64))
    with pytest.raises(TransferError, match=r"local descriptor id 8 out of range for table 'whole' of 8 descriptors"):
        check_ids(np.array([1, 8, 9], dtype=np.int32), table, "local")
    with pytest.raises(TransferError, match=r"id -1 out of range"):
        check_ids(np.array([-1], dtype=np.int64), table, "remote")
    with pytest.raises(TransferError, match="non-empty"):
        check_ids(np.array([], dtype=np.int32), table, "local")
    out = check_ids(np.array([7, 0], dtype=np.int64), table, "local")
    assert out.dtype == np.int32 and out.flags.c_contiguous


def test_bad_tables_are_rejected() -> None:
    with pytest.raises(ValueError, match="3 or 5 columns"):
        CheckedTable("x", np.zeros((2, 4), dtype=np.uint64))
    with pytest.raises(ValueError, match="count 0"):
        CheckedTable("x", np.array([[0, 8, 0, 8, 0]], dtype=np.uint64))
    with pytest.raises(ValueError, match="integer dtype"):
        CheckedTable("x", np.zeros((1, 3), dtype=np.float64))


def test_notification_round_trip() -> None:
    n = notif.parse(notif.done_message("req:7", 1, 3))
    assert n == notif.Notice("done", "req:7", index=1, count=3)
    f = notif.parse(notif.fail_message("a:b%c", "deadline: 2 s"))
    assert f is not None and (f.kind, f.request_id, f.reason) == ("fail", "a:b%c", "deadline: 2 s")
    assert notif.parse(b"someone else's message") is None
    assert notif.parse(b"\xff\xfe") is None


def test_transfer_error_pickles_with_its_fields() -> None:
    t = Transfer(0, "whole", "whole", np.array([1], np.int32), np.array([2], np.int32))
    err = pickle.loads(pickle.dumps(TransferError("boom", request_id="r1", failed=[t])))
    assert str(err) == "boom" and err.request_id == "r1" and err.failed[0].local_key == "whole"
