//! Moving Rust buffers into numpy arrays without copying them.

use numpy::{IntoPyArray, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

/// A row-major `u64` buffer as a `(len / cols, cols)` numpy array (the buffer is moved, not copied).
pub fn u64_matrix<'py>(py: Python<'py>, flat: Vec<u64>, cols: usize) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let rows = flat.len() / cols;
    flat.into_pyarray(py).reshape([rows, cols])
}
