//! Moving Rust buffers into numpy arrays without copying them, and filling numpy arrays in place.

use numpy::{IntoPyArray, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

use crate::core::DescTable;

/// A row-major `u64` buffer as a `(len / cols, cols)` numpy array (the buffer is moved, not copied).
pub fn u64_matrix<'py>(py: Python<'py>, flat: Vec<u64>, cols: usize) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let rows = flat.len() / cols;
    flat.into_pyarray(py).reshape([rows, cols])
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
