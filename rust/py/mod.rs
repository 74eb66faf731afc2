//! The thin PyO3 layer: argument conversion, GIL release, numpy output and exception mapping. No logic.
//!
//! Only [`errors`]' pure half (which exception class each core error is raised as) is built without the
//! `python` feature, so that a plain `cargo test` checks the mapping.

mod errors;

#[cfg(feature = "python")]
mod arrays;
#[cfg(feature = "python")]
mod check;
#[cfg(feature = "python")]
mod convert;
#[cfg(feature = "python")]
mod digest;
#[cfg(feature = "python")]
mod handshake;
#[cfg(feature = "python")]
mod id_pairs;
#[cfg(feature = "python")]
mod ids;
#[cfg(feature = "python")]
mod limits;
#[cfg(feature = "python")]
mod plan;
#[cfg(feature = "python")]
mod region;
#[cfg(feature = "python")]
mod shared_rows;
#[cfg(feature = "python")]
mod stream;

#[cfg(feature = "python")]
use pyo3::prelude::*;

/// Per-request id arrays are ~1 MB at 128K tokens; mimalloc keeps freed pages for reuse instead of handing
/// them back to the OS (glibc trims the heap top), so each request does not page-fault its output in again.
#[cfg(feature = "python")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The native module `hybrid_kv._core`.
#[cfg(feature = "python")]
#[pymodule(gil_used = false)]
mod _core {
    use super::*;

    #[pymodule_export]
    use super::region::PyRegionTable;

    #[pymodule_export]
    use super::plan::{handshake_target_ranks, plan_scenario, PyPeerPlan, PyPlan, PyRankTransfer};

    #[pymodule_export]
    use super::stream::PyStreamSchedule;

    #[pymodule_export]
    use super::check::check_scenario;

    #[pymodule_export]
    use super::digest::PyMirrorPlan;

    #[pymodule_export]
    use super::arrays::expand_rows;

    #[pymodule_export]
    use super::id_pairs::check_transfer_ids;

    #[pymodule_export]
    use super::handshake::{
        compat_hash, decode_meta, encode_meta, handshake_findings, meta_fingerprint, msgpack_prescan,
        validate_handshake,
    };

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        limits::register(m)?;
        errors::register(m)
    }
}
