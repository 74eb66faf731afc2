//! One read-only numpy array per shared local table: the strided rows of a table that several `PeerPlan`s of a
//! rank hold (the coalesced base table, built once per rank in the core) are copied out once, and every plan
//! returns that same array.
//!
//! A coalesced DeepSeek-V3 base table is 7,747 rows (310 KB); copying it again for every peer engine was a tenth
//! of building that peer's tables, and the transport preps a table it has already prepped only once
//! (`transport/agent.py`), which it can tell by the array being the same object.

use std::sync::{Arc, Mutex, PoisonError, Weak};

use numpy::PyArray2;
use pyo3::prelude::*;

use super::arrays::u64_matrix;
use crate::core::DescTable;

/// Most arrays one rank keeps: one per shared table its plans hold (one per local sub-block count a peer asks
/// for, which the core bounds at 4); entries of dropped tables go first, then the oldest.
const MAX_SHARED: usize = 8;

/// A weak handle on a shared table and the array made from it.
type Entry = (Weak<DescTable>, Py<PyArray2<u64>>);

/// The cache of one rank's shared tables.
#[derive(Default)]
pub struct SharedRows(Mutex<Vec<Entry>>);

impl SharedRows {
    /// `table`'s strided `(rows, 5)` rows. A table held elsewhere too (shared by plans) is returned as one
    /// read-only array, made on first use; a table only this caller holds as a fresh writable array.
    pub fn rows<'py>(&self, py: Python<'py>, table: &Arc<DescTable>) -> PyResult<Bound<'py, PyArray2<u64>>> {
        if Arc::strong_count(table) < 2 {
            return u64_matrix(py, table.to_strided(), 5);
        }
        let lock = || self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let same = |w: &Weak<DescTable>| std::ptr::eq(w.as_ptr(), Arc::as_ptr(table));
        if let Some((_, hit)) = lock().iter().find(|(w, _)| same(w)) {
            return Ok(hit.bind(py).clone());
        }
        let array = u64_matrix(py, table.to_strided(), 5)?;
        array.call_method1("setflags", (false,))?; // shared: nobody may write into it
        let mut entries = lock();
        entries.retain(|(w, _)| w.strong_count() > 0);
        if entries.len() >= MAX_SHARED {
            entries.remove(0);
        }
        entries.push((Arc::downgrade(table), array.clone().unbind()));
        Ok(array)
    }
}
