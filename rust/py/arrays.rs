//! Moving Rust buffers into numpy arrays without copying them, and filling numpy arrays in place.

use numpy::ndarray::ArrayView2;
use numpy::{IntoPyArray, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::errors::Error;
use crate::core::DescTable;

/// A row-major `u64` buffer as a `(len / cols, cols)` numpy array (the buffer is moved, not copied).
pub fn u64_matrix<'py>(py: Python<'py>, flat: Vec<u64>, cols: usize) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let rows = flat.len() / cols;
    flat.into_pyarray(py).reshape([rows, cols])
}

/// A read-only `(rows, 5)` uint64 view of `table`'s strided rows, without copying them: the array's base is
/// `owner`, which keeps them alive.
///
/// `owner` must hold `table` unchanged for as long as it lives (a frozen object holding it behind an `Arc`,
/// as `PeerPlan` does). A coalesced DeepSeek-V3 remote table is 7,747 rows (310 KB): copying them out was a
/// sixth of building a peer's tables.
pub fn strided_view<'py>(owner: &Bound<'py, PyAny>, table: &DescTable) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let flat: &[u64] = bytemuck::cast_slice(&table.rows);
    let view = ArrayView2::from_shape((table.rows.len(), 5), flat).map_err(|e| Error::internal(e.to_string()))?;
    // SAFETY: the array points into `table.rows` and holds `owner` as its base object, which keeps `table`
    // alive and unchanged (the caller's contract) until numpy drops the array; it is made read-only before
    // Python sees it, and numpy never lets an array that does not own its memory become writeable again.
    let array = unsafe { PyArray2::borrow_from_array(&view, owner.clone()) };
    array.readwrite().make_nonwriteable();
    Ok(array)
}

/// A descriptor table's flat expansion as an `(N, 3)` uint64 array `(addr, len, device)`.
///
/// Allocated by numpy (which asks for huge pages on large arrays) and filled in place with the GIL released:
/// first-touch page faults of a fresh Rust `Vec` cost more than the writes themselves at millions of
/// descriptors.
pub fn flat_descs<'py>(py: Python<'py>, table: &DescTable) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let out = py
        .import("numpy")?
        .call_method1("empty", ((table.len() as usize, 3), "uint64"))?
        .cast_into::<PyArray2<u64>>()?;
    {
        let mut view = out.readwrite();
        let flat = view.as_slice_mut()?;
        py.detach(|| table.write_flat(flat));
    }
    Ok(out)
}

/// Expand descriptor rows into flat `(N, 3)` uint64 rows `(addr, len, device)`, in descriptor-id order
/// (strided row 0's descriptors first), as NIXL takes them when it has no strided form.
///
/// Args:
///     rows (numpy.ndarray): uint64 `(N, 5)` strided rows `(addr, len, device, stride, count)`, or `(N, 3)`
///         rows (returned as a copy).
/// Raises:
///     ValueError: not 3 or 5 columns, no rows, a strided row of count 0, a descriptor that ends past 2^64,
///         or more descriptors than int32 ids index (the message names the row and the limit).
#[pyfunction]
pub fn expand_rows<'py>(py: Python<'py>, rows: PyReadonlyArray2<'py, u64>) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let cols = rows.shape()[1];
    let flat: Vec<u64> = match rows.as_slice() {
        Ok(s) => s.to_vec(),
        Err(_) => rows.as_array().iter().copied().collect(),
    };
    let table = py
        .detach(move || DescTable::from_rows(&flat, cols))
        .map_err(Error::value_error)?;
    flat_descs(py, &table)
}
