//! The core's limits as module constants of `hybrid_kv._core` (`hybrid_kv.limits` re-exports them): defined
//! once, in the core, and read by the Python side that bounds inputs before they reach it.

use pyo3::prelude::*;

use crate::core::handshake::MAX_GROUPS;
use crate::core::scenario::bounds::{MAX_BLOCK_TOKENS, MAX_NUM_BLOCKS};
use crate::core::tp::MAX_TP_SIZE;

/// Adds the limits to the module `m`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MAX_TP_SIZE", MAX_TP_SIZE)?;
    m.add("MAX_NUM_BLOCKS", MAX_NUM_BLOCKS)?;
    m.add("MAX_BLOCK_TOKENS", MAX_BLOCK_TOKENS)?;
    m.add("MAX_GROUPS", MAX_GROUPS)?;
    Ok(())
}
