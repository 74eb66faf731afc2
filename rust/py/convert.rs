//! Rust values to Python objects through serde (pythonize), with JSON's data model: maps become dicts in
//! field order, sequences and tuples become lists, so a result reads as `json.loads` of its JSON would.

use pyo3::prelude::*;
use serde::Serialize;

use super::errors::Error;

/// `value` as Python objects (dicts, lists, ints, strs, bools, None).
///
/// # Errors
/// A `HybridKvError` (a bug) naming `what` if the value does not serialize.
pub fn to_py<'py, T: Serialize>(py: Python<'py>, value: &T, what: &str) -> Result<Bound<'py, PyAny>, Error> {
    let bad = |e: &dyn std::fmt::Display| Error::internal(format!("{what} does not convert: {e}"));
    let value = serde_json::to_value(value).map_err(|e| bad(&e))?;
    pythonize::pythonize(py, &value).map_err(|e| bad(&e))
}
