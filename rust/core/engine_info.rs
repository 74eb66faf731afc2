//! The engine facts a caller gives beside its region table for the handshake payload ([`EngineInfo`]): parsed
//! field by field so that every error names the field, and checked against what the table knows.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::kv_layout::{page_order_of, CONTIGUOUS_LAYOUTS, KV_LAYOUTS};
use super::meta::TransferMode;
use super::region::{GroupKind, RegionTable};

/// Identity and model facts that are not part of the region table.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineInfo {
    /// Engine id.
    pub engine_id: String,
    /// Opaque NIXL agent metadata.
    #[serde(default)]
    pub agent_metadata: Vec<u8>,
    /// The engine's KV-cache layout name (one of [`KV_LAYOUTS`]); empty: the region table's page order.
    /// Its page order must be the table's (`EngineInfo::check`).
    #[serde(default)]
    pub kv_layout: String,
    /// Attention backend name.
    pub attn_backend: String,
    /// Transfer mode.
    pub transfer_mode: TransferMode,
    /// Model compatibility hash.
    pub compat_hash: String,
    /// Whether prefix caching is enabled.
    #[serde(default)]
    pub prefix_caching: bool,
}

/// Length of a compatibility hash: hex SHA-256 (`handshake::compat_hash`).
pub const COMPAT_HASH_LEN: usize = 64;

/// Whether `h` is a well-formed compatibility hash: [`COMPAT_HASH_LEN`] lowercase hex digits.
pub fn is_compat_hash(h: &str) -> bool {
    h.len() == COMPAT_HASH_LEN && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl EngineInfo {
    /// Check the facts a caller declares against what the region table knows: `kv_layout` a known name whose page
    /// order is the table's (read off the tensors, or the layout's declaration), `compat_hash` a well-formed hash.
    ///
    /// # Errors
    /// `(field, message)` for the first bad field; the message names the value and what was expected.
    pub fn check(&self, table: &RegionTable) -> Result<(), (&'static str, String)> {
        if !self.kv_layout.is_empty() {
            let order = page_order_of(&self.kv_layout).map_err(|e| ("kv_layout", e))?;
            let attention = table.groups.contains(&GroupKind::Attention);
            match order {
                None if attention => {
                    return Err((
                        "kv_layout",
                        format!(
                            "{:?} keeps a block's heads apart, which hybrid-kv cannot address; expected one of {:?}",
                            self.kv_layout,
                            &KV_LAYOUTS[..CONTIGUOUS_LAYOUTS]
                        ),
                    ))
                }
                Some(o) if attention && o != table.page_order => {
                    return Err((
                        "kv_layout",
                        format!(
                            "{:?} means {} pages, but this rank's tensors (or its layout's kv_layout) store {} pages; \
                             the handshake must describe the bytes as they are",
                            self.kv_layout,
                            o.name(),
                            table.page_order.name()
                        ),
                    ))
                }
                _ => {}
            }
        }
        if !is_compat_hash(&self.compat_hash) {
            return Err((
                "compat_hash",
                format!(
                    "{:?} is not a compatibility hash ({COMPAT_HASH_LEN} lowercase hex digits, as hybrid_kv.compat_hash \
                     returns over the model factors)",
                    self.compat_hash
                ),
            ));
        }
        Ok(())
    }
}

/// Every field of [`EngineInfo`] and whether it is required.
const FIELDS: [(&str, bool); 7] = [
    ("engine_id", true),
    ("agent_metadata", false),
    ("kv_layout", false),
    ("attn_backend", true),
    ("transfer_mode", true),
    ("compat_hash", true),
    ("prefix_caching", false),
];

fn field<T: DeserializeOwned>(
    map: &serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Result<Option<T>, (String, String)> {
    match map.get(key) {
        None => Ok(None),
        Some(v) => T::deserialize(v)
            .map(Some)
            .map_err(|e| (format!("engine_info[{key:?}]"), e.to_string())),
    }
}

impl EngineInfo {
    /// Parse engine facts from a JSON object, field by field.
    ///
    /// # Errors
    /// `(where, why)`: `where` is `engine_info` (not an object, an unknown key, a missing one) or
    /// `engine_info["field"]` (a value of the wrong type or an unknown `transfer_mode`).
    pub fn from_value(value: &serde_json::Value) -> Result<EngineInfo, (String, String)> {
        let whole = |why: String| ("engine_info".to_string(), why);
        let map = value
            .as_object()
            .ok_or_else(|| whole(format!("expected a dict of engine facts, got {value}")))?;
        if let Some(k) = map.keys().find(|k| !FIELDS.iter().any(|(f, _)| f == k)) {
            let known: Vec<&str> = FIELDS.iter().map(|(f, _)| *f).collect();
            return Err(whole(format!("unknown key {k:?}; expected one of {known:?}")));
        }
        if let Some((k, _)) = FIELDS.iter().find(|(k, required)| *required && !map.contains_key(*k)) {
            return Err(whole(format!("missing key {k:?}")));
        }
        Ok(EngineInfo {
            engine_id: field(map, "engine_id")?.unwrap_or_default(),
            agent_metadata: field(map, "agent_metadata")?.unwrap_or_default(),
            kv_layout: field(map, "kv_layout")?.unwrap_or_default(),
            attn_backend: field(map, "attn_backend")?.unwrap_or_default(),
            transfer_mode: field(map, "transfer_mode")?.unwrap_or_default(),
            compat_hash: field(map, "compat_hash")?.unwrap_or_default(),
            prefix_caching: field(map, "prefix_caching")?.unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(extra: serde_json::Value) -> Result<EngineInfo, (String, String)> {
        let mut v = serde_json::json!({
            "engine_id": "p", "attn_backend": "FLASH_ATTN", "transfer_mode": "pull", "compat_hash": "0".repeat(64)
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        EngineInfo::from_value(&v)
    }

    #[test]
    fn every_error_names_the_field() {
        assert!(info(serde_json::json!({})).is_ok());
        let (at, why) = info(serde_json::json!({"kv_layut": "HND"})).unwrap_err();
        assert_eq!(at, "engine_info");
        assert!(why.starts_with("unknown key \"kv_layut\""), "{why}");
        let (at, why) = info(serde_json::json!({"engine_id": 1})).unwrap_err();
        assert_eq!(at, "engine_info[\"engine_id\"]");
        assert!(why.contains("invalid type"), "{why}");
        let (at, _) = info(serde_json::json!({"transfer_mode": "sideways"})).unwrap_err();
        assert_eq!(at, "engine_info[\"transfer_mode\"]");
        let mut v = serde_json::json!({"engine_id": "p"});
        v.as_object_mut().unwrap().remove("engine_id");
        let (_, why) = EngineInfo::from_value(&v).unwrap_err();
        assert_eq!(why, "missing key \"engine_id\"");
    }

    #[test]
    fn compat_hashes_are_checked_for_form() {
        assert!(is_compat_hash(&"ab".repeat(32)));
        assert!(!is_compat_hash("abc"));
        assert!(!is_compat_hash(&"AB".repeat(32)));
        assert!(!is_compat_hash(""));
    }
}
