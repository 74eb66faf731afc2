//! Handshake errors: a bad payload, a wrong version, or a list of findings, each naming the check and
//! both sides' values.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One failed handshake check: which check, what this side has, what the peer advertised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// Check name (`engine_id`, `tp_divisibility`, `hybrid_mla_block_len`, ...).
    pub check: String,
    /// The local value, rendered.
    pub local: String,
    /// The remote value, rendered.
    pub remote: String,
    /// What the check requires (may be empty).
    pub detail: String,
}

impl Finding {
    /// A finding from anything printable.
    pub fn new(check: &str, local: impl fmt::Display, remote: impl fmt::Display, detail: impl Into<String>) -> Finding {
        Finding {
            check: check.to_string(),
            local: local.to_string(),
            remote: remote.to_string(),
            detail: detail.into(),
        }
    }

    /// A problem inside one metadata alone (no counterpart): `local` is left empty and `remote` holds the value.
    pub fn invalid(field: &str, remote: impl fmt::Display, detail: impl Into<String>) -> Finding {
        Finding::new(field, "", remote, detail)
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.local.is_empty() {
            write!(f, "{}: value {}", self.check, self.remote)?;
        } else {
            write!(f, "{}: local {}, remote {}", self.check, self.local, self.remote)?;
        }
        if !self.detail.is_empty() {
            write!(f, " ({})", self.detail)?;
        }
        Ok(())
    }
}

/// Why a peer's metadata was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The payload is larger than the decoder accepts.
    #[error("handshake payload of {size} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Payload bytes.
        size: usize,
        /// Limit.
        max: usize,
    },
    /// The bytes are not a well-formed metadata message.
    #[error("malformed handshake payload: {0}")]
    Malformed(String),
    /// The peer speaks another metadata format version.
    #[error("handshake metadata version mismatch: local {local}, remote {remote}")]
    Version {
        /// This side's version.
        local: u32,
        /// The peer's version.
        remote: u64,
    },
    /// Decoded metadata that is internally inconsistent (one line per problem, naming field and value).
    #[error("invalid handshake metadata:\n{}", lines(.0))]
    Invalid(Vec<Finding>),
    /// The peer is incompatible with this side (one line per finding).
    #[error("incompatible peer, {} handshake check(s) failed:\n{}", .0.len(), lines(.0))]
    Incompatible(Vec<Finding>),
}

impl HandshakeError {
    /// The findings behind an `Invalid` or `Incompatible` error (empty for the other kinds).
    pub fn findings(&self) -> &[Finding] {
        match self {
            HandshakeError::Invalid(f) | HandshakeError::Incompatible(f) => f,
            _ => &[],
        }
    }
}

fn lines(findings: &[Finding]) -> String {
    findings.iter().map(|f| format!("  {f}")).collect::<Vec<_>>().join("\n")
}
