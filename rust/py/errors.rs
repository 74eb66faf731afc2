//! The one error path from the core to Python: every core error becomes an [`Error`] (its exception class as
//! a [`Kind`], its message, its handshake findings), and `impl From<Error> for PyErr` is the only place an
//! exception is constructed.
//!
//! Which class an error is raised as is decided by pure functions ([`Kind::of_layout`], [`Kind::of_plan`],
//! [`Kind::of_scenario`], [`Kind::of_handshake`]) that a plain `cargo test` checks; the rule is the root
//! cause, wherever the error surfaced:
//!
//! - an invalid layout (a rank's own tensors) is a `LayoutError`, also inside a plan or a scenario;
//! - a handshake payload that does not decode, or a peer that is incompatible, is a `HandshakeError` with
//!   the failed checks in `findings`;
//! - everything else that cannot be planned, including a bad `mode` (`"pull"`/`"push"`, wherever it is given:
//!   `PeerPlan`'s argument or an engine info's `transfer_mode`) and a malformed scenario, is a `PlanError`;
//! - an argument of the wrong Python type is a `TypeError`; an argument of the right type with a malformed value
//!   that is not a layout, a plan or a payload (e.g. descriptor rows handed to `expand_rows`) is a `ValueError`;
//! - a bug (a panic caught by [`no_panic`], a result that does not serialize) is the base `HybridKvError`.
//!
//! `LayoutError` and `PlanError` are also `ValueError`s (a layout, ids, a mode are arguments), so a caller that
//! knows nothing of hybrid-kv catches them as bad arguments; both are made at module init with two bases.
//!
//! The exceptions only the Python layers raise (`TransferError`, ...) derive from `HybridKvError` in
//! `python/hybrid_kv/errors.py`, so the hierarchy is one.
// Built without `python` only for `cargo test`, which uses part of it.
#![cfg_attr(not(feature = "python"), allow(dead_code))]

use crate::core::handshake::{Finding, HandshakeError as CoreHandshakeError};
use crate::core::plan::PlanError as CorePlanError;
use crate::core::scenario::ScenarioError;
use crate::core::LayoutError as CoreLayoutError;

/// The Python exception class an [`Error`] is raised as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `hybrid_kv.LayoutError`: a rank's layout cannot be turned into a region table.
    Layout,
    /// `hybrid_kv.PlanError`: a transfer (or scenario) cannot be planned, or a bad `mode`.
    Plan,
    /// `hybrid_kv.HandshakeError`: a payload does not decode, or the peer is incompatible.
    Handshake,
    /// `TypeError`: an argument of the wrong Python type.
    Type,
    /// `ValueError`: an argument of the right type whose value is malformed (e.g. descriptor rows).
    Value,
    /// `hybrid_kv.HybridKvError`: a hybrid-kv bug (a caught panic, a result that does not serialize).
    Internal,
}

impl Kind {
    /// A layout error is a `LayoutError`.
    pub fn of_layout(_: &CoreLayoutError) -> Kind {
        Kind::Layout
    }

    /// A planning error is a `PlanError`, except an invalid local layout found while planning.
    pub fn of_plan(e: &CorePlanError) -> Kind {
        match e {
            CorePlanError::Layout(l) => Kind::of_layout(l),
            _ => Kind::Plan,
        }
    }

    /// A scenario error is a `PlanError`, except a rank's invalid layout (directly or inside a plan).
    pub fn of_scenario(e: &ScenarioError) -> Kind {
        match e {
            ScenarioError::Layout { source, .. } => Kind::of_layout(source),
            ScenarioError::Plan { source, .. } => Kind::of_plan(source),
            ScenarioError::Json(_)
            | ScenarioError::Invalid(_)
            | ScenarioError::OverLimit { .. }
            | ScenarioError::Deployment(_) => Kind::Plan,
        }
    }

    /// Every handshake error is a `HandshakeError`.
    pub fn of_handshake(_: &CoreHandshakeError) -> Kind {
        Kind::Handshake
    }
}

/// An error on its way to Python: the class, the message, and the failed handshake checks (if any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// The exception class.
    pub kind: Kind,
    /// The message (names the value and the limit).
    pub message: String,
    /// The failed handshake checks, set on the exception as `findings`.
    pub findings: Vec<Finding>,
}

impl Error {
    /// An error of `kind` with `message` and no findings.
    pub fn new(kind: Kind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
            findings: Vec::new(),
        }
    }

    /// A `PlanError`.
    pub fn plan(message: impl Into<String>) -> Error {
        Error::new(Kind::Plan, message)
    }

    /// A `LayoutError`.
    pub fn layout(message: impl Into<String>) -> Error {
        Error::new(Kind::Layout, message)
    }

    /// A `HandshakeError` without findings.
    pub fn handshake(message: impl Into<String>) -> Error {
        Error::new(Kind::Handshake, message)
    }

    /// A `TypeError`.
    pub fn type_error(message: impl Into<String>) -> Error {
        Error::new(Kind::Type, message)
    }

    /// A `ValueError`.
    pub fn value_error(message: impl Into<String>) -> Error {
        Error::new(Kind::Value, message)
    }

    /// A `HybridKvError` for a bug.
    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(Kind::Internal, message)
    }

    /// The same error with `prefix: ` before its message (findings kept).
    pub fn context(mut self, prefix: impl std::fmt::Display) -> Error {
        self.message = format!("{prefix}: {}", self.message);
        self
    }

    /// The error a bad transfer mode raises, wherever the mode is given.
    pub fn bad_mode(mode: &str) -> Error {
        Error::plan(format!("mode must be \"pull\" or \"push\", got {mode:?}"))
    }
}

impl From<CoreLayoutError> for Error {
    fn from(e: CoreLayoutError) -> Error {
        Error::new(Kind::of_layout(&e), e.to_string())
    }
}

impl From<CorePlanError> for Error {
    fn from(e: CorePlanError) -> Error {
        Error::new(Kind::of_plan(&e), e.to_string())
    }
}

impl From<ScenarioError> for Error {
    fn from(e: ScenarioError) -> Error {
        Error::new(Kind::of_scenario(&e), e.to_string())
    }
}

impl From<CoreHandshakeError> for Error {
    fn from(e: CoreHandshakeError) -> Error {
        Error {
            kind: Kind::of_handshake(&e),
            message: e.to_string(),
            findings: e.findings().to_vec(),
        }
    }
}

/// The message a caught panic is reported with.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("internal error (a hybrid-kv bug, please report it): {what}")
}

/// Run core work on untrusted input so that a panic (a bug) reaches Python as an exception of `kind` (a
/// `HybridKvError` subclass) instead of PyO3's `PanicException`, a `BaseException` that `except Exception`
/// lets through.
///
/// The core is built never to panic on any input (bounded, checked arithmetic, fuzzed); this is the guarantee
/// that holds even where that fails. The panic hook still prints the panic to stderr, for the bug report.
pub fn no_panic<T>(kind: Kind, work: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
        .unwrap_or_else(|payload| Err(Error::new(kind, panic_message(payload.as_ref()))))
}

#[cfg(feature = "python")]
pub use python::*;

#[cfg(feature = "python")]
mod python {
    use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
    use pyo3::prelude::*;
    use pyo3::sync::PyOnceLock;
    use pyo3::types::{PyDict, PyType};
    use pyo3::{create_exception, types::PyTuple};

    use super::{Error, Kind};

    create_exception!(
        hybrid_kv,
        HybridKvError,
        PyException,
        "Base class of every hybrid-kv error."
    );
    create_exception!(
        hybrid_kv,
        HandshakeError,
        HybridKvError,
        "A peer's metadata is malformed or incompatible."
    );

    /// `hybrid_kv.LayoutError`: a `HybridKvError` and a `ValueError` (a layout is an argument), made at module init.
    static LAYOUT_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    /// `hybrid_kv.PlanError`: a `HybridKvError` and a `ValueError` (ids, modes and geometry are arguments).
    static PLAN_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

    const LAYOUT_DOC: &str = "A rank's layout cannot be turned into a region table (also a ValueError).";
    const PLAN_DOC: &str = "A transfer cannot be planned for the given geometry, ids or mode (also a ValueError).";

    /// A class deriving from both `HybridKvError` and `ValueError`, in module `hybrid_kv`.
    fn value_error_class(py: Python<'_>, name: &str, doc: &str) -> PyResult<Py<PyType>> {
        let bases = (py.get_type::<HybridKvError>(), py.get_type::<PyValueError>());
        let dict = PyDict::new(py);
        dict.set_item("__module__", "hybrid_kv")?;
        dict.set_item("__doc__", doc)?;
        let class = py.get_type::<PyType>().call1((name, bases, dict))?;
        Ok(class.cast_into::<PyType>()?.unbind())
    }

    /// An exception of one of the two made classes (the base class if the module was never initialized).
    fn made(cell: &PyOnceLock<Py<PyType>>, message: String) -> PyErr {
        Python::attach(|py| match cell.get(py) {
            Some(t) => PyErr::from_type(t.bind(py).clone(), message),
            None => HybridKvError::new_err(message),
        })
    }

    /// A finding as a Python tuple `(check, local, remote, detail)`.
    pub type PyFinding = (String, String, String, String);

    /// The tuple form of a finding.
    pub fn finding_tuple(f: &crate::core::handshake::Finding) -> PyFinding {
        (f.check.clone(), f.local.clone(), f.remote.clone(), f.detail.clone())
    }

    /// The one place a core error becomes a Python exception.
    impl From<Error> for PyErr {
        fn from(e: Error) -> PyErr {
            let err = match e.kind {
                Kind::Layout => made(&LAYOUT_ERROR, e.message),
                Kind::Plan => made(&PLAN_ERROR, e.message),
                Kind::Handshake => HandshakeError::new_err(e.message),
                Kind::Type => PyTypeError::new_err(e.message),
                Kind::Value => PyValueError::new_err(e.message),
                Kind::Internal => HybridKvError::new_err(e.message),
            };
            if !e.findings.is_empty() {
                let findings: Vec<PyFinding> = e.findings.iter().map(finding_tuple).collect();
                Python::attach(|py| {
                    // Best effort: the message already carries every finding.
                    let _ = err.value(py).setattr("findings", findings);
                });
            }
            err
        }
    }

    /// Register the exception classes on the module.
    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        let py = m.py();
        m.add("HybridKvError", py.get_type::<HybridKvError>())?;
        let layout = LAYOUT_ERROR.get_or_try_init(py, || value_error_class(py, "LayoutError", LAYOUT_DOC))?;
        m.add("LayoutError", layout.bind(py))?;
        let plan = PLAN_ERROR.get_or_try_init(py, || value_error_class(py, "PlanError", PLAN_DOC))?;
        m.add("PlanError", plan.bind(py))?;
        let handshake = py.get_type::<HandshakeError>();
        // Every instance has `findings`: the failed checks where a validation raised it, else none.
        handshake.setattr("findings", PyTuple::empty(py))?;
        m.add("HandshakeError", handshake)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::plan::Side;

    fn layout() -> CoreLayoutError {
        CoreLayoutError::KernelBlockNotDividing { kernel: 5, logical: 12 }
    }

    #[test]
    fn a_layout_error_is_a_layout_error_wherever_it_surfaces() {
        assert_eq!(Error::from(layout()).kind, Kind::Layout);
        assert_eq!(Error::from(CorePlanError::Layout(layout())).kind, Kind::Layout);
        let in_scenario = ScenarioError::Layout {
            side: "decode",
            rank: 1,
            source: layout(),
        };
        assert_eq!(Error::from(in_scenario).kind, Kind::Layout);
        let in_scenario_plan = ScenarioError::Plan {
            context: "decode rank 0".into(),
            source: CorePlanError::Layout(layout()),
        };
        let e = Error::from(in_scenario_plan);
        assert_eq!(e.kind, Kind::Layout);
        assert_eq!(
            e.message,
            "decode rank 0: kernel block size 5 does not divide logical block size 12"
        );
    }

    #[test]
    fn planning_and_scenario_errors_are_plan_errors() {
        let plan = CorePlanError::GroupCount {
            side: Side::Local,
            got: 2,
            expected: 3,
        };
        assert_eq!(Kind::of_plan(&plan), Kind::Plan);
        let wrapped = ScenarioError::Plan {
            context: "request 0".into(),
            source: plan,
        };
        assert_eq!(Kind::of_scenario(&wrapped), Kind::Plan);
        for e in [
            ScenarioError::Json("x".into()),
            ScenarioError::Invalid("x".into()),
            ScenarioError::Deployment("x".into()),
            ScenarioError::OverLimit {
                field: "decode.tp_size".into(),
                value: 1025,
                limit: 1024,
            },
        ] {
            assert_eq!(Error::from(e).kind, Kind::Plan);
        }
        let mode = Error::bad_mode("sideways");
        assert_eq!(
            (mode.kind, mode.message.as_str()),
            (Kind::Plan, "mode must be \"pull\" or \"push\", got \"sideways\"")
        );
    }

    #[test]
    fn handshake_errors_carry_their_findings() {
        let f = Finding::new("compat_hash", "a", "b", "");
        let e = Error::from(CoreHandshakeError::Incompatible(vec![f.clone()])).context("peer rank 1");
        assert_eq!(e.kind, Kind::Handshake);
        assert_eq!(e.findings, vec![f]);
        assert!(e
            .message
            .starts_with("peer rank 1: incompatible peer, 1 handshake check(s) failed"));
        let malformed = Error::from(CoreHandshakeError::Malformed("x".into()));
        assert_eq!((malformed.kind, malformed.findings.len()), (Kind::Handshake, 0));
    }

    #[test]
    fn a_panic_becomes_an_error_of_the_given_kind() {
        let e = no_panic::<()>(Kind::Plan, || panic!("boom")).unwrap_err();
        assert_eq!(e.kind, Kind::Plan);
        assert_eq!(e.message, "internal error (a hybrid-kv bug, please report it): boom");
        assert_eq!(no_panic(Kind::Plan, || Ok(7)), Ok(7));
    }
}
