//! Wire encoding of [`AgentMeta`]: a msgpack map with named fields, versioned by its `version` field.
//!
//! Decoding treats the bytes as hostile: size and shape are bounded by [`prescan`] before `rmp-serde`
//! sees them, the version is read on its own first (so a peer on another format gets "version local X,
//! remote Y" rather than a field error), and the decoded metadata must be safe to compute with
//! ([`structure_findings`]). Where its regions lie (overlaps, states larger than pages) is judged by the
//! validation, which lists it beside every other finding, and by `PeerPlan`, which refuses it.

use serde::Deserialize;

use super::error::HandshakeError;
use super::scan::prescan;
use super::wellformed::structure_findings;
use crate::core::meta::{AgentMeta, META_VERSION};

/// Encode metadata for the wire (msgpack map with named fields).
///
/// # Errors
/// [`HandshakeError::Malformed`] if serialization fails (it does not for well-typed metadata).
pub fn encode(meta: &AgentMeta) -> Result<Vec<u8>, HandshakeError> {
    rmp_serde::to_vec_named(meta).map_err(|e| HandshakeError::Malformed(format!("cannot encode metadata: {e}")))
}

/// The first thing read from a payload: only the version, every other field ignored.
#[derive(Deserialize)]
struct VersionProbe {
    version: Option<u64>,
}

/// The version probe of a payload that did not decode: a missing, unreadable or other version is the error.
fn check_version(bytes: &[u8]) -> Result<(), HandshakeError> {
    let probe: VersionProbe = rmp_serde::from_slice(bytes)
        .map_err(|e| HandshakeError::Malformed(format!("cannot read the version field: {e}")))?;
    match probe.version {
        None => Err(HandshakeError::Malformed("the version field is missing".into())),
        Some(v) if v != u64::from(META_VERSION) => Err(HandshakeError::Version {
            local: META_VERSION,
            remote: v,
        }),
        Some(_) => Ok(()),
    }
}

/// Decode and check a peer's metadata. Never panics; allocation is bounded by the payload size, which is
/// itself capped.
///
/// # Errors
/// [`HandshakeError::TooLarge`], [`HandshakeError::Malformed`] (bad msgpack, missing or mistyped field),
/// [`HandshakeError::Version`] (naming both versions) or [`HandshakeError::Invalid`] (inconsistent values).
pub fn decode(bytes: &[u8]) -> Result<AgentMeta, HandshakeError> {
    prescan(bytes)?;
    if !matches!(bytes[0], 0x80..=0x8f | 0xde | 0xdf) {
        return Err(HandshakeError::Malformed(format!(
            "expected a msgpack map at the top level, found marker {:#04x}",
            bytes[0]
        )));
    }
    // One pass for the common case, a payload of this version; only a payload that does not decode as this
    // version's metadata is probed for its version, so that another version's payload is named as such (the
    // errors are those of probing first: the probe reads a subset of what a full decode reads).
    let meta: AgentMeta = match rmp_serde::from_slice::<AgentMeta>(bytes) {
        Ok(meta) if meta.version == META_VERSION => meta,
        Ok(meta) => {
            return Err(HandshakeError::Version {
                local: META_VERSION,
                remote: u64::from(meta.version),
            })
        }
        Err(e) => {
            check_version(bytes)?;
            return Err(HandshakeError::Malformed(format!("cannot decode metadata: {e}")));
        }
    };
    let problems = structure_findings(&meta);
    if problems.is_empty() {
        Ok(meta)
    } else {
        Err(HandshakeError::Invalid(problems))
    }
}
