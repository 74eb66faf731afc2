//! The thin PyO3 layer: argument conversion, GIL release, numpy output and exception mapping. No logic.

mod arrays;
mod check;
mod errors;
mod handshake;
mod ids;
mod plan;
mod region;

use pyo3::prelude::*;

/// Per-request id arrays are ~1 MB at 128K tokens; mimalloc keeps freed pages for reuse instead of handing
/// them back to the OS (glibc trims the heap top), so each request does not page-fault its output in again.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The native module `hybrid_kv._core`.
#[pymodule(gil_used = false)]
mod _core {
    use super::*;

    #[pymodule_export]
    use super::region::PyRegionTable;

    #[pymodule_export]
    use super::plan::{handshake_target_ranks, plan_scenario, PyPeerPlan, PyPlan, PyRankTransfer};

    #[pymodule_export]
    use super::check::check_scenario;

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
