//! Model factors read from a caller's dict or JSON, with every error naming the field: all unknown and all
//! missing keys at once (the hash is only as good as the factors, so none is dropped or guessed), then each
//! value's type.

use serde::de::DeserializeOwned;

use super::fingerprint::ModelFactors;

/// Every factor, whether it is required, and what it means (the documentation `hybrid_kv.ModelFactors` repeats).
pub const FACTORS: [(&str, bool, &str); 11] = [
    ("model", true, "model name or path, as both engines load it"),
    ("dtype", true, "model dtype (\"bfloat16\", ...)"),
    ("cache_dtype", true, "KV-cache dtype (\"auto\", \"fp8_e4m3\", ...)"),
    (
        "total_num_kv_heads",
        true,
        "KV heads of the whole model across TP (1 for MLA)",
    ),
    ("head_size", true, "attention head size (the MLA latent size for MLA)"),
    ("num_hidden_layers", true, "hidden layers of the model"),
    ("attn_backend", true, "attention backend name(s) both engines run"),
    (
        "hma",
        true,
        "whether the hybrid memory allocator pools groups' layers into shared tensors",
    ),
    (
        "speculative",
        true,
        "speculative-decoding factors as \"key=value\" strings; [] without",
    ),
    ("transfer_mode", true, "\"pull\" or \"push\""),
    (
        "connector",
        false,
        "wire version of an integration's own messages (e.g. \"hybrid-kv-vllm/2\"); \"\" without",
    ),
];

/// Why factors were refused: `at` is `factors` or `factors["key"]`; `type_error` for a value of the wrong type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FactorsError {
    /// Where.
    pub at: String,
    /// What is wrong.
    pub why: String,
    /// Whether a value (or the whole argument) has the wrong type.
    pub type_error: bool,
}

fn field<T: DeserializeOwned>(
    map: &serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Result<Option<T>, FactorsError> {
    map.get(key)
        .map(|v| {
            T::deserialize(v).map_err(|e| FactorsError {
                at: format!("factors[{key:?}]"),
                why: e.to_string(),
                type_error: e.to_string().starts_with("invalid type"),
            })
        })
        .transpose()
}

/// Parse model factors, naming every unknown and every missing key at once.
///
/// # Errors
/// A [`FactorsError`] naming where and what.
pub fn parse_factors(value: &serde_json::Value) -> Result<ModelFactors, FactorsError> {
    let whole = |why: String, type_error: bool| FactorsError {
        at: "factors".into(),
        why,
        type_error,
    };
    let map = value
        .as_object()
        .ok_or_else(|| whole(format!("expected an object of model factors, got {value}"), true))?;
    let unknown: Vec<&String> = map.keys().filter(|k| !FACTORS.iter().any(|(f, ..)| f == k)).collect();
    let missing: Vec<&str> = FACTORS
        .iter()
        .filter(|(k, required, _)| *required && !map.contains_key(*k))
        .map(|(k, ..)| *k)
        .collect();
    if !unknown.is_empty() || !missing.is_empty() {
        let mut parts = Vec::new();
        if !unknown.is_empty() {
            parts.push(format!("unknown keys {unknown:?}"));
        }
        if !missing.is_empty() {
            parts.push(format!("missing keys {missing:?}"));
        }
        let every: Vec<&str> = FACTORS.iter().map(|(k, ..)| *k).collect();
        return Err(whole(
            format!(
                "{}; the factors are {every:?} (hybrid_kv.ModelFactors)",
                parts.join(", ")
            ),
            false,
        ));
    }
    let need = |v: Option<String>| v.unwrap_or_default();
    Ok(ModelFactors {
        model: need(field(map, "model")?),
        dtype: need(field(map, "dtype")?),
        cache_dtype: need(field(map, "cache_dtype")?),
        total_num_kv_heads: field(map, "total_num_kv_heads")?.unwrap_or_default(),
        head_size: field(map, "head_size")?.unwrap_or_default(),
        num_hidden_layers: field(map, "num_hidden_layers")?.unwrap_or_default(),
        attn_backend: need(field(map, "attn_backend")?),
        hma: field(map, "hma")?.unwrap_or_default(),
        speculative: field(map, "speculative")?.unwrap_or_default(),
        transfer_mode: field(map, "transfer_mode")?.unwrap_or_default(),
        connector: need(field(map, "connector")?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unknown_and_missing_key_is_named_at_once() {
        let e = parse_factors(&serde_json::json!({"model": "m", "dtyp": "x"})).unwrap_err();
        assert_eq!(e.at, "factors");
        assert!(
            e.why
                .starts_with("unknown keys [\"dtyp\"], missing keys [\"dtype\", \"cache_dtype\","),
            "{}",
            e.why
        );
        assert!(!e.type_error);
        let mut ok = serde_json::json!({
            "model": "m", "dtype": "bfloat16", "cache_dtype": "auto", "total_num_kv_heads": 8, "head_size": 128,
            "num_hidden_layers": 2, "attn_backend": "FLASH_ATTN", "hma": false, "speculative": [],
            "transfer_mode": "pull"
        });
        assert!(parse_factors(&ok).is_ok());
        ok["head_size"] = serde_json::json!("128");
        let e = parse_factors(&ok).unwrap_err();
        assert_eq!((e.at.as_str(), e.type_error), ("factors[\"head_size\"]", true));
        assert!(parse_factors(&serde_json::json!([1])).unwrap_err().type_error);
    }
}
