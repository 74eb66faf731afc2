//! The handshake: P and D exchange [`AgentMeta`](crate::core::AgentMeta) before any transfer, and each
//! rejects an incompatible peer at once, with one error listing every mismatch and both values.
//!
//! * [`encode`] / [`decode`]: versioned msgpack; decoding treats the bytes as hostile (bounded pre-scan,
//!   version read first, internal consistency checked).
//! * [`compat_hash`] over the model factors, and [`fingerprint`] over the TP-invariant region geometry.
//! * [`validate`] / [`validate_expected`] / [`findings`]: every check, all reported at once.

mod codec;
mod error;
mod factors;
mod fingerprint;
mod pairs;
mod scan;
mod validate;
mod wellformed;

#[cfg(test)]
mod codec_tests;
#[cfg(test)]
mod validate_tests;

pub use codec::{decode, encode};
pub use error::{Finding, HandshakeError};
pub use factors::{parse_factors, FactorsError, FACTORS};
pub use fingerprint::{compat_hash, compat_hash_for, fingerprint, GeometryKey, ModelFactors, Ratio};
pub use pairs::{check_pairs, PairVerdict};
pub use scan::{prescan, prescan_within, ScanLimits, HANDSHAKE_LIMITS, MAX_DEPTH, MAX_LEN, MAX_PAYLOAD, MAX_STR};
pub use validate::{findings, validate, validate_expected, Expected, HEAD_CONTIGUOUS_LAYOUTS};
pub use wellformed::{
    check_well_formed, placement_findings, structure_findings, MAX_GROUPS, MAX_KERNEL_BLOCKS, MAX_REGIONS,
};
