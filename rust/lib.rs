//! hybrid-kv: KV-cache transfer planning for disaggregated (prefill/decode) serving of hybrid models.
//!
//! The crate has two halves. [`core`] is pure Rust (no Python, no `unsafe`): region tables, NIXL
//! descriptor tables, TP mapping, per-request plans and the handshake. `py` (behind the `python`
//! feature) is the thin PyO3 layer that turns those into numpy arrays and Python exceptions.
#![deny(missing_docs)]

pub mod core;

// Without `python`, only the binding's pure error mapping is built, for `cargo test`.
#[cfg(any(test, feature = "python"))]
mod py;
