//! Reading a request's block ids (one sequence of Python ints per KV-cache group) into Rust.
//!
//! Ids arrive as Python lists from the scheduler; at 4-5 ns per int through PyO3's generic extraction that
//! was most of a long request's planning time, so exact-`int` list items take a direct path (two FFI calls
//! per id, no reference counting). Anything else (int subclasses, numpy integers, tuples, arrays) takes the
//! generic path, which may run Python code (`__index__`).

use pyo3::prelude::*;
use pyo3::types::PyList;

use super::errors::PlanError;

/// Block ids per group from a sequence of sequences of ints; a negative id is a `PlanError` naming it.
pub fn block_ids(ids: &Bound<'_, PyAny>, side: &str) -> PyResult<Vec<Vec<u64>>> {
    let groups: Vec<Bound<'_, PyAny>> = match ids.cast::<PyList>() {
        Ok(list) => list.iter().collect(),
        Err(_) => ids.try_iter()?.collect::<PyResult<_>>()?,
    };
    groups
        .iter()
        .enumerate()
        .map(|(g, group)| {
            let negative = |b: i64| {
                PlanError::new_err(format!(
                    "{side} block id {b} of group {g} is out of range: block ids are non-negative"
                ))
            };
            let mut out = Vec::new();
            let rest: Vec<Bound<'_, PyAny>> = match group.cast::<PyList>() {
                Ok(list) => {
                    let read = exact_ints(list, &mut out).map_err(negative)?;
                    list.iter().skip(read).collect()
                }
                Err(_) => group.try_iter()?.collect::<PyResult<_>>()?,
            };
            for item in rest {
                let b: i64 = item.extract()?;
                out.push(u64::try_from(b).map_err(|_| negative(b))?);
            }
            Ok(out)
        })
        .collect()
}

/// Push the leading items of `list` that are exact Python ints fitting in `i64` onto `out` and return how
/// many were read (the generic path takes the rest, and raises the right error for an int too large);
/// `Err` with the first negative id.
#[cfg(not(any(Py_GIL_DISABLED, PyPy, GraalPy, Py_LIMITED_API)))]
fn exact_ints(list: &Bound<'_, PyList>, out: &mut Vec<u64>) -> Result<usize, i64> {
    use pyo3::ffi;
    let n = list.len();
    out.reserve(n);
    let ptr = list.as_ptr();
    for i in 0..n {
        // SAFETY: the GIL is held for the whole loop (the caller holds a `Bound`) and `i < len`: no Python
        // code runs between the length read and here (PyLong_AsLongLong on an exact int calls none, and an
        // error ends the loop), so the list cannot have shrunk and the borrowed item stays alive.
        let value = unsafe {
            let item = ffi::PyList_GET_ITEM(ptr, i as ffi::Py_ssize_t);
            if ffi::PyLong_CheckExact(item) == 0 {
                return Ok(i);
            }
            let v = ffi::PyLong_AsLongLong(item);
            if v == -1 && !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
                return Ok(i);
            }
            v
        };
        out.push(u64::try_from(value).map_err(|_| value)?);
    }
    Ok(n)
}

/// Builds without a stable list layout read every item through the generic path.
#[cfg(any(Py_GIL_DISABLED, PyPy, GraalPy, Py_LIMITED_API))]
fn exact_ints(_list: &Bound<'_, PyList>, _out: &mut Vec<u64>) -> Result<usize, i64> {
    Ok(0)
}
