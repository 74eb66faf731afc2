//! [`TableKey`]: which local table a transfer indexes, and its text form (`whole`, `bsr:N`, `split:I`).

use super::error::PlanError;

/// Which local table a transfer indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TableKey {
    /// The local table at the local kernel block.
    Whole,
    /// The local table with every kernel block cut into this many common units.
    Bsr(u64),
    /// The split table of the i-th remote piece.
    Split(usize),
}

impl std::fmt::Display for TableKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TableKey::Whole => f.write_str("whole"),
            TableKey::Bsr(n) => write!(f, "bsr:{n}"),
            TableKey::Split(i) => write!(f, "split:{i}"),
        }
    }
}

impl std::str::FromStr for TableKey {
    type Err = PlanError;

    /// Parse `whole`, `bsr:N` or `split:I` (the [`Display`](std::fmt::Display) form).
    fn from_str(s: &str) -> Result<TableKey, PlanError> {
        let bad = || PlanError::BadTransfer(format!("table key {s:?} is not `whole`, `bsr:N` or `split:I`"));
        match s.split_once(':') {
            None if s == "whole" => Ok(TableKey::Whole),
            Some(("bsr", n)) => n.parse().map(TableKey::Bsr).map_err(|_| bad()),
            Some(("split", i)) => i.parse().map(TableKey::Split).map_err(|_| bad()),
            _ => Err(bad()),
        }
    }
}
