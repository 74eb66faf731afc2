//! The pure planning core: plain integers in, plain integers out; it never dereferences an address.
#![forbid(unsafe_code)]

/// Hostile inputs for the hardening tests and fuzz benches (not in the wheel: `test-support` feature).
#[cfg(any(test, feature = "test-support"))]
pub mod adversary;
pub mod alias;
pub mod coalesce;
pub mod descs;
pub mod engine_info;
pub mod error;
pub mod handshake;
pub mod id_pairs;
pub mod kv_layout;
pub mod layout;
pub mod meta;
pub mod plan;
pub mod region;
pub mod scenario;
pub mod spec;
pub mod state_parts;
pub mod state_rows;
pub mod stream;
pub mod tp;
pub mod units;

pub use descs::{DescTable, StridedRow};
pub use error::LayoutError;
pub use layout::{LayerInput, LayerMemory, MemType, RankLayout};
pub use meta::{AgentMeta, EngineInfo, RegionMeta, TransferMode, META_VERSION};
pub use region::{GroupKind, LayerPlace, Region, RegionTable};
pub use spec::{AttentionSpec, ConvLayout, ConvSplit, LayerSpec, MambaKind, MlaSpec, SsmSpec, StatePart};
/// Small specs and layouts for tests and benches (not in the wheel: `test-support` feature).
#[cfg(any(test, feature = "test-support"))]
pub mod fixtures;
mod natural;

#[cfg(test)]
mod alias_tests;
#[cfg(test)]
mod hardening_tests;
#[cfg(test)]
mod oracle_tests;
#[cfg(test)]
mod region_tests;
#[cfg(test)]
mod state_split_tests;
#[cfg(test)]
pub(crate) mod stream_tests;
