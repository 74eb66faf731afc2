//! The Python exception hierarchy and the mapping from core errors to it.

use pyo3::prelude::*;
use pyo3::{create_exception, exceptions::PyException};

use crate::core::LayoutError as CoreLayoutError;

create_exception!(
    hybrid_kv,
    HybridKvError,
    PyException,
    "Base class of every hybrid-kv error."
);
create_exception!(
    hybrid_kv,
    LayoutError,
    HybridKvError,
    "A rank's layout cannot be turned into a region table."
);
create_exception!(
    hybrid_kv,
    PlanError,
    HybridKvError,
    "A transfer cannot be planned for the given geometry or ids."
);
create_exception!(
    hybrid_kv,
    HandshakeError,
    HybridKvError,
    "A peer's metadata is malformed or incompatible."
);
create_exception!(
    hybrid_kv,
    TransferError,
    HybridKvError,
    "A NIXL transfer failed, timed out or was refused."
);

/// Wrapper so core errors convert with `?` (the orphan rule forbids `From<LayoutError> for PyErr` elsewhere).
pub struct PyCoreError(pub PyErr);

impl From<PyCoreError> for PyErr {
    fn from(e: PyCoreError) -> PyErr {
        e.0
    }
}

impl From<CoreLayoutError> for PyCoreError {
    fn from(e: CoreLayoutError) -> Self {
        PyCoreError(LayoutError::new_err(e.to_string()))
    }
}

/// Run core work on untrusted input so that a panic (a bug) reaches Python as `error` (a `HybridKvError`
/// subclass) instead of PyO3's `PanicException`, a `BaseException` that `except Exception` lets through.
///
/// The core is built never to panic on any input (bounded, checked arithmetic, fuzzed); this is the guarantee
/// that holds even where that fails. The panic hook still prints the panic to stderr, for the bug report.
pub fn no_panic<T>(error: fn(String) -> PyErr, work: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(error(format!(
            "internal error (a hybrid-kv bug, please report it): {what}"
        )))
    })
}

/// `PlanError(msg)`, for [`no_panic`].
pub fn plan_error(msg: String) -> PyErr {
    PlanError::new_err(msg)
}

/// `HandshakeError(msg)`, for [`no_panic`].
pub fn handshake_error(msg: String) -> PyErr {
    HandshakeError::new_err(msg)
}

/// Register the exception classes on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("HybridKvError", py.get_type::<HybridKvError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    let handshake = py.get_type::<HandshakeError>();
    // Every instance has `findings`: the failed checks where a validation raised it, else none.
    handshake.setattr("findings", pyo3::types::PyTuple::empty(py))?;
    m.add("HandshakeError", handshake)?;
    m.add("TransferError", py.get_type::<TransferError>())?;
    Ok(())
}
