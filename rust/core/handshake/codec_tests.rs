//! Codec tests: round trips, and hostile bytes (random, truncated, wrong versions, absurd lengths).

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::core::fixtures::{hybrid_mla_f2, kimi_linear_like};
use crate::core::meta::{AgentMeta, EngineInfo, TransferMode, META_VERSION};
use crate::core::region::RegionTable;

fn sample() -> AgentMeta {
    let info = EngineInfo {
        engine_id: "prefill-0".into(),
        agent_metadata: (0..=255).collect(),
        kv_layout: "HND".into(),
        attn_backend: "FLASHMLA".into(),
        transfer_mode: TransferMode::Push,
        compat_hash: compat_hash(&ModelFactors::default()),
        prefix_caching: true,
    };
    AgentMeta::from_table(
        &RegionTable::build(&hybrid_mla_f2([0x1000, 0x10000], 4)).unwrap(),
        &info,
    )
}

/// Encode a msgpack map from `(key, raw value bytes)` pairs.
fn map(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut out = vec![0x80 | entries.len() as u8];
    for (k, v) in entries {
        out.push(0xa0 | k.len() as u8);
        out.extend(k.as_bytes());
        out.extend(v);
    }
    out
}

#[test]
fn round_trip_of_fixtures() {
    let m = sample();
    let bytes = encode(&m).unwrap();
    assert_eq!(decode(&bytes).unwrap(), m);
    let kimi = RegionTable::build(&kimi_linear_like(27, 32, 64)).unwrap();
    let k = AgentMeta::from_table(
        &kimi,
        &EngineInfo {
            engine_id: "d".into(),
            ..EngineInfo::default()
        },
    );
    assert_eq!(decode(&encode(&k).unwrap()).unwrap(), k);
}

#[test]
fn wrong_version_names_both() {
    let mut m = sample();
    m.version = 7;
    let err = decode(&encode(&m).unwrap()).unwrap_err();
    assert_eq!(
        err,
        HandshakeError::Version {
            local: META_VERSION,
            remote: 7
        }
    );
    assert_eq!(
        err.to_string(),
        "handshake metadata version mismatch: local 1, remote 7"
    );
    // A version-only map from a future format: rejected on the version, not on missing fields.
    let future = map(&[("version", vec![0xcd, 0x01, 0x00]), ("shiny", vec![0xc3])]);
    assert_eq!(
        decode(&future),
        Err(HandshakeError::Version {
            local: META_VERSION,
            remote: 256
        })
    );
}

#[test]
fn missing_version_wrong_shape_and_missing_fields() {
    let e = decode(&map(&[("engine_id", vec![0xa1, b'x'])]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("version field is missing"), "{e}");
    let e = decode(&[0x91, 0x01]).unwrap_err().to_string();
    assert!(e.contains("expected a msgpack map"), "{e}");
    let e = decode(&map(&[("version", vec![0x01])])).unwrap_err().to_string();
    assert!(
        e.contains("cannot decode metadata") && e.contains("missing field"),
        "{e}"
    );
    let e = decode(&map(&[("version", vec![0xa1, b'1'])])).unwrap_err().to_string();
    assert!(e.contains("cannot read the version field"), "{e}");
}

#[test]
fn inconsistent_values_are_invalid() {
    let mut m = sample();
    m.tp_rank = 3;
    m.ssm_regions = vec![0, 9];
    m.regions[1].base = u64::MAX - 10;
    let err = decode(&encode(&m).unwrap()).unwrap_err();
    let checks: Vec<&str> = err.findings().iter().map(|f| f.check.as_str()).collect();
    assert_eq!(checks, ["tp_rank", "regions[1]", "ssm_regions"]);
    assert!(err.to_string().contains("tp_rank: value 3/1"), "{err}");
}

#[test]
fn absurd_lengths_are_rejected_before_allocating() {
    let huge: &[&[u8]] = &[
        &[0xdf, 0xff, 0xff, 0xff, 0xff],                   // map of 4G entries
        &[0x81, 0xa1, b'a', 0xdd, 0xff, 0xff, 0xff, 0xff], // array of 4G elements
        &[0x81, 0xa1, b'a', 0xc6, 0xff, 0xff, 0xff, 0xff], // 4 GiB binary
        &[0x81, 0xa1, b'a', 0xdb, 0x7f, 0xff, 0xff, 0xff], // 2 GiB string
        &[0x81, 0xa7, b'v', b'e', b'r', b's', b'i', b'o', b'n', 0xdc, 0x10, 0x00],
    ];
    for b in huge {
        let start = Instant::now();
        let err = decode(b).unwrap_err();
        assert!(matches!(err, HandshakeError::Malformed(_)), "{err}");
        assert!(start.elapsed() < Duration::from_millis(100));
    }
    // The regions list claims more entries than there are bytes.
    let mut m = sample();
    m.regions.truncate(1);
    m.ssm_regions = vec![0];
    let mut bytes = encode(&m).unwrap();
    let pos = bytes.windows(8).position(|w| w == b"regions\x91").unwrap() + 7;
    bytes.splice(pos..=pos, [0xdd, 0x00, 0x01, 0x00, 0x00]);
    assert!(decode(&bytes).unwrap_err().to_string().contains("bytes remain"));
    let big = vec![0x90u8; MAX_PAYLOAD + 1];
    assert!(matches!(decode(&big), Err(HandshakeError::TooLarge { .. })));
    // A maximal payload of nesting and scalars is rejected quickly.
    let start = Instant::now();
    let mut flat = vec![0xdd, 0x00, 0x00, 0xff, 0xff];
    flat.resize(MAX_PAYLOAD, 0xc0);
    assert!(decode(&flat).is_err());
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = encode(&sample()).unwrap();
    for n in 0..bytes.len() {
        assert!(decode(&bytes[..n]).is_err(), "prefix of {n} bytes decoded");
    }
    let mut long = bytes.clone();
    long.push(0xc0);
    assert!(decode(&long).unwrap_err().to_string().contains("trailing"));
}

fn arb_meta() -> impl Strategy<Value = AgentMeta> {
    (
        ".{0,40}",
        proptest::collection::vec(any::<u8>(), 0..600),
        (1u32..64).prop_flat_map(|tp| (Just(tp), 0..tp)),
        any::<[u64; 2]>(),
        1u64..50,
        (
            prop::sample::select(crate::core::kv_layout::KV_LAYOUTS.to_vec()),
            ".{0,12}",
            any::<bool>(),
            any::<bool>(),
            any::<u32>(),
        ),
    )
        .prop_map(
            |(engine, blob, (tp, rank), bases, n, (layout, backend, push, pc, dev))| {
                let bases = bases.map(|b| b >> 2);
                let (lo, hi) = (
                    bases[0].min(bases[1]),
                    bases[0].max(bases[1]).max(bases[0].min(bases[1]) + (1 << 20)),
                );
                let mut l = hybrid_mla_f2([lo, hi], n);
                (l.tp_size, l.tp_rank) = (tp, rank);
                let info = EngineInfo {
                    engine_id: engine,
                    agent_metadata: blob,
                    kv_layout: layout.to_string(),
                    attn_backend: backend,
                    transfer_mode: if push { TransferMode::Push } else { TransferMode::Pull },
                    compat_hash: "h".into(),
                    prefix_caching: pc,
                };
                let mut m = AgentMeta::from_table(&RegionTable::build(&l).unwrap(), &info);
                m.device_id = dev;
                m
            },
        )
}

proptest! {
    #[test]
    fn round_trip(m in arb_meta()) {
        let bytes = encode(&m).unwrap();
        prop_assert_eq!(decode(&bytes).unwrap(), m);
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        prop_assert!(decode(&bytes).is_err());
    }

    #[test]
    fn mutated_encodings_never_panic(m in arb_meta(), edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut bytes = encode(&m).unwrap();
        for (at, v) in edits {
            let i = at % bytes.len();
            bytes[i] = v;
        }
        if let Ok(back) = decode(&bytes) {
            // Whatever decodes is safe to compute with (where its regions lie is the validation's to judge) and
            // survives another round trip.
            prop_assert!(structure_findings(&back).is_empty());
            prop_assert_eq!(decode(&encode(&back).unwrap()).unwrap(), back);
        }
    }

    #[test]
    fn random_maps_with_a_version_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..256), v in any::<u64>()) {
        let mut bytes = vec![0x82, 0xa7];
        bytes.extend(b"version");
        bytes.push(0xcf);
        bytes.extend(v.to_be_bytes());
        bytes.extend(tail);
        prop_assert!(decode(&bytes).is_err());
    }
}
