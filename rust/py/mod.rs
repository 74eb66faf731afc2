//! The thin PyO3 layer: argument conversion, GIL release, numpy output and exception mapping. No logic.

mod arrays;
mod errors;
mod handshake;
mod plan;
mod region;

use pyo3::prelude::*;

/// The native module `hybrid_kv._core`.
#[pymodule(gil_used = false)]
mod _core {
    use super::*;

    #[pymodule_export]
    use super::region::PyRegionTable;

    #[pymodule_export]
    use super::plan::{handshake_target_ranks, plan_scenario, PyPeerPlan, PyPlan, PyRankTransfer};

    #[pymodule_export]
    use super::handshake::{
        compat_hash, decode_meta, encode_meta, handshake_findings, meta_fingerprint, validate_handshake,
    };

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        errors::register(m)
    }
}
