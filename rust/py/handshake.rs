//! The handshake for Python: metadata bytes in and out, digests, and validation raising `HandshakeError`.
//!
//! Metadata crosses the boundary as wire bytes (msgpack) or as JSON (`RegionTable.agent_meta_json`).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::{handshake_error, no_panic, HandshakeError, PyCoreError};
use crate::core::handshake::{self as hs, Expected, Finding, ModelFactors};
use crate::core::AgentMeta;

/// A finding as a Python tuple `(check, local, remote, detail)`.
type PyFinding = (String, String, String, String);

fn tuple(f: &Finding) -> PyFinding {
    (f.check.clone(), f.local.clone(), f.remote.clone(), f.detail.clone())
}

impl From<hs::HandshakeError> for PyCoreError {
    fn from(e: hs::HandshakeError) -> Self {
        let findings: Vec<PyFinding> = e.findings().iter().map(tuple).collect();
        let err = HandshakeError::new_err(e.to_string());
        Python::attach(|py| {
            // Best effort: the message already carries every finding.
            let _ = err.value(py).setattr("findings", findings);
        });
        PyCoreError(err)
    }
}

fn from_json(meta_json: &str) -> PyResult<AgentMeta> {
    serde_json::from_str(meta_json).map_err(|e| HandshakeError::new_err(format!("bad metadata JSON: {e}")))
}

/// Encode metadata given as JSON (as `RegionTable.agent_meta_json` returns it) into wire bytes.
///
/// Raises:
///     HandshakeError: the JSON is not metadata.
#[pyfunction]
pub fn encode_meta<'py>(py: Python<'py>, meta_json: &str) -> PyResult<Bound<'py, PyBytes>> {
    let bytes = hs::encode(&from_json(meta_json)?).map_err(PyCoreError::from)?;
    Ok(PyBytes::new(py, &bytes))
}

/// Decode a peer's wire bytes into metadata JSON; the bytes are treated as untrusted.
///
/// Raises:
///     HandshakeError: too large, malformed, another format version (both named), or inconsistent values.
#[pyfunction]
pub fn decode_meta(py: Python<'_>, data: &[u8]) -> PyResult<String> {
    let data = data.to_vec();
    let meta = no_panic(handshake_error, || {
        py.detach(move || hs::decode(&data))
            .map_err(|e| PyCoreError::from(e).into())
    })?;
    serde_json::to_string(&meta).map_err(|e| HandshakeError::new_err(e.to_string()))
}

/// Geometry fingerprint (hex SHA-256 of the TP-invariant region geometry) of wire bytes.
///
/// Raises:
///     HandshakeError: the bytes do not decode.
#[pyfunction]
pub fn meta_fingerprint(data: &[u8]) -> PyResult<String> {
    no_panic(handshake_error, || {
        Ok(hs::fingerprint(&hs::decode(data).map_err(PyCoreError::from)?))
    })
}

/// Model compatibility hash (hex SHA-256) of the model factors given as JSON.
///
/// Raises:
///     HandshakeError: the JSON is not a factors object.
#[pyfunction]
pub fn compat_hash(factors_json: &str) -> PyResult<String> {
    let factors: ModelFactors =
        serde_json::from_str(factors_json).map_err(|e| HandshakeError::new_err(format!("bad model factors: {e}")))?;
    Ok(hs::compat_hash(&factors))
}

fn findings_of(
    local: &[u8],
    remote: &[u8],
    expected_engine_id: Option<String>,
    expected_tp_size: Option<u32>,
    expected_num_blocks: Option<u64>,
) -> PyResult<Vec<Finding>> {
    no_panic(handshake_error, || {
        let local = hs::decode(local).map_err(PyCoreError::from)?;
        let remote = hs::decode(remote).map_err(PyCoreError::from)?;
        let expected = Expected {
            engine_id: expected_engine_id,
            tp_size: expected_tp_size,
            num_blocks: expected_num_blocks,
        };
        Ok(hs::findings(&local, &remote, &expected))
    })
}

/// Every failed handshake check between two metadata payloads, as `(check, local, remote, detail)` tuples
/// (empty when compatible).
///
/// Raises:
///     HandshakeError: either payload does not decode.
#[pyfunction]
#[pyo3(signature = (local, remote, *, expected_engine_id = None, expected_tp_size = None, expected_num_blocks = None))]
pub fn handshake_findings(
    local: &[u8],
    remote: &[u8],
    expected_engine_id: Option<String>,
    expected_tp_size: Option<u32>,
    expected_num_blocks: Option<u64>,
) -> PyResult<Vec<PyFinding>> {
    let f = findings_of(local, remote, expected_engine_id, expected_tp_size, expected_num_blocks)?;
    Ok(f.iter().map(tuple).collect())
}

/// Validate a peer's payload against this rank's; returns `None` when compatible.
///
/// Raises:
///     HandshakeError: a payload does not decode, or the peer is incompatible. The message has one line
///         per finding (check, local value, remote value); the exception's `findings` attribute holds them
///         as `(check, local, remote, detail)` tuples.
#[pyfunction]
#[pyo3(signature = (local, remote, *, expected_engine_id = None, expected_tp_size = None, expected_num_blocks = None))]
pub fn validate_handshake(
    local: &[u8],
    remote: &[u8],
    expected_engine_id: Option<String>,
    expected_tp_size: Option<u32>,
    expected_num_blocks: Option<u64>,
) -> PyResult<()> {
    let f = findings_of(local, remote, expected_engine_id, expected_tp_size, expected_num_blocks)?;
    if f.is_empty() {
        Ok(())
    } else {
        Err(PyCoreError::from(hs::HandshakeError::Incompatible(f)).into())
    }
}
