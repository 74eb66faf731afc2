//! Reading a request's block ids (one sequence of Python ints per KV-cache group) into Rust.
//!
//! Ids arrive as Python lists from the scheduler; at 4-5 ns per int through PyO3's generic extraction that
//! was most of a long request's planning time, so exact-`int` list items take a direct path (two FFI calls
//! per id, no reference counting). Anything else (int subclasses, numpy integers, tuples, arrays) takes the
//! generic path, which may run Python code (`__index__`).
//!
//! Ids are untrusted: the groups and each group must be sequences (sets, dicts, iterators, generators,
//! strings and scalars are refused: their order is not the request's or they are not ids at all), an id
//! must be an integer (not a bool or a float) in `[0, 2**63)`, and a sequence may not list more than a
//! bounded number of items (a `range` or a numpy broadcast view claims billions without holding them), so
//! reading never allocates more than the bound. Every error names the side, the group and the value.

use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyDict, PyList, PyString, PyTuple};

use super::errors::Error;
use crate::core::scenario::bounds::MAX_GROUPS;

/// Most block ids one group of one request may list (16M blocks: far more than any pool's contexts need).
pub const MAX_IDS_PER_GROUP: usize = 1 << 24;

/// Longest rendering of a bad value in an error message.
const SHOWN_CHARS: usize = 60;

/// Block ids per group from a sequence of sequences of ints.
///
/// # Errors
/// `TypeError` naming the value when `ids` or a group is not a sequence, or an id is not an integer;
/// `PlanError` naming the id when it is negative or not below 2**63, or naming the count when `ids` lists
/// more than [`MAX_GROUPS`] groups or a group more than [`MAX_IDS_PER_GROUP`] ids.
pub fn block_ids(ids: &Bound<'_, PyAny>, side: &str) -> PyResult<Vec<Vec<u64>>> {
    let groups: Vec<Bound<'_, PyAny>> = match ids.cast::<PyList>() {
        Ok(list) => {
            bounded(list.len(), MAX_GROUPS, || format!("{side} ids list"), "groups")?;
            list.iter().collect()
        }
        Err(_) => items(ids, MAX_GROUPS, || format!("{side} ids"), "groups")?,
    };
    groups
        .iter()
        .enumerate()
        .map(|(g, group)| {
            let negative = |b: i64| out_of_range(side, g, &b.to_string());
            let mut out = Vec::new();
            let what = || format!("{side} ids: group {g}");
            let rest: Vec<Bound<'_, PyAny>> = match group.cast::<PyList>() {
                Ok(list) => {
                    bounded(list.len(), MAX_IDS_PER_GROUP, what, "block ids")?;
                    let read = exact_ints(list, &mut out).map_err(negative)?;
                    list.iter().skip(read).collect()
                }
                Err(_) => items(group, MAX_IDS_PER_GROUP, what, "block ids")?,
            };
            out.reserve(rest.len());
            for item in rest {
                out.push(block_id(&item, side, g)?);
            }
            Ok(out)
        })
        .collect()
}

/// `PlanError` when a sequence of `len` items is longer than `limit`.
fn bounded(len: usize, limit: usize, what: impl FnOnce() -> String, items: &str) -> PyResult<()> {
    if len > limit {
        return Err(Error::plan(format!("{} lists {len} {items}, over the limit of {limit}", what())).into());
    }
    Ok(())
}

/// The items of `seq`, which must be a sequence of at most `limit` items.
///
/// A sequence here has a length and item access and is not a string, bytes or a mapping: sets, dicts,
/// iterators, generators and scalars are refused (`TypeError` naming the value). At most `limit + 1` items
/// are read whatever the object's `__len__` claims.
fn items<'py>(
    seq: &Bound<'py, PyAny>,
    limit: usize,
    what: impl Fn() -> String,
    items: &str,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let textual = seq.is_instance_of::<PyString>() || seq.is_instance_of::<PyBytes>();
    let refused = textual || seq.is_instance_of::<PyByteArray>() || seq.is_instance_of::<PyDict>();
    let sized = !refused && (seq.is_instance_of::<PyTuple>() || seq.hasattr("__getitem__")?);
    let len = if sized { seq.len().ok() } else { None };
    let Some(len) = len else {
        let must = if items == "groups" {
            "must be a sequence of groups"
        } else {
            "must be a sequence of block ids"
        };
        return Err(Error::type_error(format!("{} {must}, got {}", what(), typed(seq))).into());
    };
    bounded(len, limit, &what, items)?;
    let out: Vec<Bound<'py, PyAny>> = seq.try_iter()?.take(limit + 1).collect::<PyResult<_>>()?;
    bounded(out.len(), limit, what, items)?;
    Ok(out)
}

/// One id from the generic path: an integer (not a bool) in `[0, 2**63)`.
fn block_id(item: &Bound<'_, PyAny>, side: &str, g: usize) -> PyResult<u64> {
    let not_integer = || {
        PyErr::from(Error::type_error(format!(
            "{side} block id {} ({}) of group {g} is not an integer",
            shown(item),
            type_name(item)
        )))
    };
    if item.is_instance_of::<PyBool>() {
        return Err(not_integer());
    }
    match item.extract::<i64>() {
        Ok(b) => u64::try_from(b).map_err(|_| out_of_range(side, g, &b.to_string())),
        Err(e) if e.is_instance_of::<PyOverflowError>(item.py()) => Err(out_of_range(side, g, &shown(item))),
        Err(_) => Err(not_integer()),
    }
}

/// `PlanError` for an id outside `[0, 2**63)`.
fn out_of_range(side: &str, g: usize, id: &str) -> PyErr {
    Error::plan(format!(
        "{side} block id {id} of group {g} is out of range: block ids are below 2**63 and non-negative"
    ))
    .into()
}

/// The value as an error message shows it: `str()` (`repr()` for strings), cut to [`SHOWN_CHARS`]; a long
/// container is shown by its length, and a value that cannot be rendered by its type.
fn shown(v: &Bound<'_, PyAny>) -> String {
    if !v.is_instance_of::<PyString>() {
        if let Ok(n) = v.len() {
            if n > SHOWN_CHARS / 4 {
                return format!("of {n} items");
            }
        }
    }
    let text = if v.is_instance_of::<PyString>() {
        v.repr()
    } else {
        v.str()
    };
    let Ok(text) = text else {
        return format!("<{}>", type_name(v));
    };
    let text = text.to_string_lossy();
    match text.char_indices().nth(SHOWN_CHARS) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.into_owned(),
    }
}

/// `type value`, e.g. `set {1, 2}`.
fn typed(v: &Bound<'_, PyAny>) -> String {
    format!("{} {}", type_name(v), shown(v))
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map_or_else(|_| "object".into(), |n| n.to_string_lossy().into_owned())
}

/// Push the leading items of `list` that are exact Python ints fitting in `i64` onto `out` and return how
/// many were read (the generic path takes the rest, and raises the right error for an int too large);
/// `Err` with the first negative id.
///
/// Version-specific builds read list items directly (`PyList_GET_ITEM`, a field read); limited-API (abi3)
/// builds call `PyList_GetItem` instead, a stable-ABI function (see [`list_item`]). Free-threaded, PyPy
/// and GraalPy builds compile this out: their lists and ints may change under us or have another layout.
#[cfg(not(any(Py_GIL_DISABLED, PyPy, GraalPy)))]
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
            let item = list_item(ptr, i as ffi::Py_ssize_t);
            if item.is_null() || ffi::PyLong_CheckExact(item) == 0 {
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

/// Item `i` of a list, borrowed: a direct field read where the list layout is known at build time.
///
/// # Safety
/// The GIL is held, `list` is a list and `0 <= i < len(list)`.
#[cfg(not(any(Py_GIL_DISABLED, PyPy, GraalPy, Py_LIMITED_API)))]
#[inline(always)]
unsafe fn list_item(list: *mut pyo3::ffi::PyObject, i: pyo3::ffi::Py_ssize_t) -> *mut pyo3::ffi::PyObject {
    // SAFETY: the caller's contract.
    unsafe { pyo3::ffi::PyList_GET_ITEM(list, i) }
}

/// Item `i` of a list, borrowed, through the stable ABI (limited-API builds): `PyList_GetItem` checks the
/// index and returns null (with `IndexError` set, cleared here) when it is out of range.
///
/// # Safety
/// The GIL is held and `list` is a list.
#[cfg(all(Py_LIMITED_API, not(any(Py_GIL_DISABLED, PyPy, GraalPy))))]
#[inline(always)]
unsafe fn list_item(list: *mut pyo3::ffi::PyObject, i: pyo3::ffi::Py_ssize_t) -> *mut pyo3::ffi::PyObject {
    // SAFETY: the caller's contract; a null result leaves no error set.
    unsafe {
        let item = pyo3::ffi::PyList_GetItem(list, i);
        if item.is_null() {
            pyo3::ffi::PyErr_Clear();
        }
        item
    }
}

/// Builds whose lists or ints may change under us (free-threaded) or have another layout (PyPy, GraalPy)
/// read every item through the generic path.
#[cfg(any(Py_GIL_DISABLED, PyPy, GraalPy))]
fn exact_ints(_list: &Bound<'_, PyList>, _out: &mut Vec<u64>) -> Result<usize, i64> {
    Ok(0)
}
