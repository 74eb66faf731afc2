//! `check_transfer_ids`: the transport's check of a transfer's descriptor ids, one call per transfer
//! (`core::id_pairs`). NumPy took 30-70 us per transfer for the same checks (a dozen array operations).

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

use super::errors::Error;
use crate::core::id_pairs::{first_bad_ids, BadIds, TableView};

/// A contiguous 1-D array's elements, or a `ValueError` naming it.
fn slice<'a, T: numpy::Element>(a: &'a PyReadonlyArray1<'_, T>, what: &str) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| Error::value_error(format!("{what} must be a C-contiguous 1-D array")).into())
}

/// The first problem with a transfer's descriptor ids, or `None` when they are fine.
///
/// Each table is given as its rows' exclusive ends in flat ids (`numpy.cumsum` of the row counts) and its
/// rows' descriptor lengths. Every local id must be below the local table's size; with `remote`
/// (`(ends, lens, ids)` of the peer's table), every remote id below its size, as many remote ids as local
/// ones, and each pair's descriptors the same length.
///
/// Returns:
///     None, or `(what, position)`: `what` is `"local"` / `"remote"` (an id out of range at `position`),
///     `"count"` (the arrays differ in length) or `"length"` (the pair at `position` differs in length).
/// Raises:
///     ValueError: an array is not C-contiguous, or a table's `ends` and `lens` differ in length.
#[pyfunction]
#[pyo3(signature = (local_ends, local_lens, local_ids, remote=None))]
#[allow(clippy::type_complexity)]
pub fn check_transfer_ids(
    py: Python<'_>,
    local_ends: PyReadonlyArray1<'_, u64>,
    local_lens: PyReadonlyArray1<'_, u64>,
    local_ids: PyReadonlyArray1<'_, i32>,
    remote: Option<(
        PyReadonlyArray1<'_, u64>,
        PyReadonlyArray1<'_, u64>,
        PyReadonlyArray1<'_, i32>,
    )>,
) -> PyResult<Option<(&'static str, usize)>> {
    let local = TableView {
        ends: slice(&local_ends, "local ends")?,
        lens: slice(&local_lens, "local lens")?,
    };
    let lids = slice(&local_ids, "local ids")?;
    let (remote, rids) = match &remote {
        Some((ends, lens, ids)) => (
            Some(TableView {
                ends: slice(ends, "remote ends")?,
                lens: slice(lens, "remote lens")?,
            }),
            slice(ids, "remote ids")?,
        ),
        None => (None, &[][..]),
    };
    let found = py.detach(|| first_bad_ids(local, lids, remote, rids));
    Ok(match found {
        None => None,
        Some(BadIds::Shape) => {
            return Err(Error::value_error("a table's ends and lens must have the same length").into())
        }
        Some(BadIds::LocalOutOfRange(k)) => Some(("local", k)),
        Some(BadIds::RemoteOutOfRange(k)) => Some(("remote", k)),
        Some(BadIds::Count) => Some(("count", 0)),
        Some(BadIds::LengthMismatch(k)) => Some(("length", k)),
    })
}
