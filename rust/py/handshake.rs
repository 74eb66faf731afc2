//! The handshake for Python: metadata bytes in and out, digests, and validation raising `HandshakeError`.
//!
//! Metadata crosses the boundary as wire bytes (msgpack), made by `RegionTable.handshake_payload` and decoded
//! once by `PeerPlan`; as a dict only for inspection and tests (`decode_meta`, `encode_meta`), through
//! pythonize, never as a JSON string.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use super::convert::to_py;
use super::errors::{finding_tuple, no_panic, Error, Kind, PyFinding};
use crate::core::handshake::{self as hs, Expected, Finding};
use crate::core::AgentMeta;

/// Metadata from a dict as `decode_meta` returns it (the JSON data model: lists for tuples, a list of ints
/// for the opaque NIXL bytes); the error names the missing or mistyped field.
pub fn meta_from_py(obj: &Bound<'_, PyAny>) -> Result<AgentMeta, String> {
    let value: serde_json::Value = pythonize::depythonize(obj).map_err(|e| e.to_string())?;
    serde_json::from_value(value).map_err(|e| e.to_string())
}

/// Decode a peer's wire bytes, untrusted: every failure (a panic too) is a `HandshakeError`.
pub fn decode_payload(data: &[u8]) -> Result<AgentMeta, Error> {
    no_panic(Kind::Handshake, || Ok(hs::decode(data)?))
}

/// Check every remote's metadata against this rank's payload, in order; the first incompatible one is
/// refused as `peer rank N: ...` with its findings.
pub fn check_peers(own_payload: &[u8], remotes: &[AgentMeta], expected: &Expected) -> Result<(), Error> {
    let own = decode_payload(own_payload).map_err(|e| e.context("own payload"))?;
    no_panic(Kind::Handshake, || {
        for remote in remotes {
            let found = hs::findings(&own, remote, expected);
            if !found.is_empty() {
                let err = Error::from(hs::HandshakeError::Incompatible(found));
                return Err(err.context(format_args!("peer rank {}", remote.tp_rank)));
            }
        }
        Ok(())
    })
}

/// Encode metadata given as a dict (as `decode_meta` returns it) into wire bytes, unchecked: tests and tools
/// use it to build the payloads a hostile peer could send.
///
/// Raises:
///     HandshakeError: the dict is not metadata (a missing or mistyped field, named).
#[pyfunction]
pub fn encode_meta<'py>(py: Python<'py>, meta: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let meta = meta_from_py(meta).map_err(|e| Error::handshake(format!("bad metadata: {e}")))?;
    let bytes = hs::encode(&meta).map_err(Error::from)?;
    Ok(PyBytes::new(py, &bytes))
}

/// Decode a peer's wire bytes into a metadata dict, for inspection; the bytes are treated as untrusted.
///
/// Raises:
///     HandshakeError: too large, malformed, another format version (both named), or inconsistent values.
#[pyfunction]
pub fn decode_meta<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let data = data.to_vec();
    let meta = py.detach(move || decode_payload(&data))?;
    Ok(to_py(py, &meta, "metadata")?)
}

/// Geometry fingerprint (hex SHA-256 of the TP-invariant region geometry) of wire bytes.
///
/// Raises:
///     HandshakeError: the bytes do not decode.
#[pyfunction]
pub fn meta_fingerprint(data: &[u8]) -> PyResult<String> {
    Ok(no_panic(Kind::Handshake, || {
        Ok(hs::fingerprint(&decode_payload(data)?))
    })?)
}

/// Model compatibility hash (hex SHA-256) of the model factors, given as a dict or as JSON text.
///
/// Args:
///     factors (dict | str): the model facts both engines must share (`hybrid_kv.ModelFactors`, every field
///         documented there): `model`, `dtype`, `cache_dtype`, `total_num_kv_heads`, `head_size`,
///         `num_hidden_layers`, `attn_backend`, `hma`, `speculative`, `transfer_mode` and optionally `connector`.
/// Raises:
///     ValueError: unknown or missing keys (every one named at once), or text that is not JSON.
///     TypeError: not an object, or a value of the wrong type (named as `factors["key"]`).
#[pyfunction]
pub fn compat_hash(factors: &Bound<'_, PyAny>) -> PyResult<String> {
    let value: serde_json::Value = match factors.cast::<PyString>() {
        Ok(text) => {
            serde_json::from_str(text.to_str()?).map_err(|e| Error::value_error(format!("factors: not JSON: {e}")))?
        }
        Err(_) => pythonize::depythonize(factors).map_err(|e| Error::type_error(format!("factors: {e}")))?,
    };
    let factors = hs::parse_factors(&value).map_err(|e| {
        let message = format!("{}: {}", e.at, e.why);
        if e.type_error {
            Error::type_error(message)
        } else {
            Error::value_error(message)
        }
    })?;
    Ok(hs::compat_hash(&factors))
}

fn findings_of(local: &[u8], remote: &[u8], expected: Expected) -> Result<Vec<Finding>, Error> {
    let (local, remote) = (decode_payload(local)?, decode_payload(remote)?);
    no_panic(Kind::Handshake, || Ok(hs::findings(&local, &remote, &expected)))
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
    let expected = Expected {
        engine_id: expected_engine_id,
        tp_size: expected_tp_size,
        num_blocks: expected_num_blocks,
    };
    Ok(findings_of(local, remote, expected)?
        .iter()
        .map(finding_tuple)
        .collect())
}

/// Validate a peer's payload against this rank's; returns `None` when compatible.
///
/// `PeerPlan(..., own_payload=...)` runs the same checks on the payloads it plans from, decoding each once.
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
    let expected = Expected {
        engine_id: expected_engine_id,
        tp_size: expected_tp_size,
        num_blocks: expected_num_blocks,
    };
    let found = findings_of(local, remote, expected)?;
    if found.is_empty() {
        Ok(())
    } else {
        Err(Error::from(hs::HandshakeError::Incompatible(found)).into())
    }
}

/// Check that untrusted `data` holds exactly one msgpack value within the given bounds, before any decoder
/// allocates or recurses (it walks the bytes once, iteratively, allocating nothing beyond `max_depth`).
///
/// Args:
///     data (bytes): the untrusted bytes.
///     max_bytes (int): largest input accepted.
///     max_len (int): most elements of one array (or entries of one map).
///     max_str (int): longest string (binary values are bounded by the input only).
///     max_depth (int): deepest container nesting.
/// Raises:
///     HandshakeError: over a bound, truncated, trailing bytes, or an unknown or extension marker (the message
///         names the byte offset and the bound).
#[pyfunction]
#[pyo3(signature = (data, *, max_bytes, max_len, max_str, max_depth))]
pub fn msgpack_prescan(data: &[u8], max_bytes: usize, max_len: u64, max_str: u64, max_depth: usize) -> PyResult<()> {
    let limits = hs::ScanLimits {
        max_bytes,
        max_len,
        max_str,
        max_depth,
    };
    Ok(no_panic(Kind::Handshake, || Ok(hs::prescan_within(data, &limits)?))?)
}
