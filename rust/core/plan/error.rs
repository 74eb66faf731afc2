//! Errors of transfer planning: each names the bad value, the limit, and where it matters both sides.

use crate::core::error::LayoutError;

/// Which side of a transfer a value belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The rank that builds and posts the transfer (decode in pull mode, prefill in push mode).
    Local,
    /// The peer rank whose memory is read (pull) or written (push).
    Remote,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// A transfer cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The two TP sizes do not divide one another (or one is zero).
    #[error("local TP {local_tp} and remote TP {remote_tp}: the larger must be a positive multiple of the smaller")]
    TpRatio {
        /// Local TP size.
        local_tp: u32,
        /// Remote TP size.
        remote_tp: u32,
    },
    /// A rank index outside its TP size.
    #[error("{side} rank {rank} is out of range for TP size {tp_size}")]
    RankOutOfRange {
        /// Which side.
        side: Side,
        /// The rank.
        rank: u32,
        /// The TP size.
        tp_size: u32,
    },
    /// A value that must agree between the two sides does not.
    #[error("{what} differs between the sides: local {local}, remote {remote}")]
    Mismatch {
        /// What was compared.
        what: String,
        /// Local value.
        local: String,
        /// Remote value.
        remote: String,
    },
    /// A combination hybrid-kv deliberately does not plan.
    #[error("not supported: {0}")]
    NotSupported(String),
    /// The handshaked remote ranks do not match the ranks this local rank must talk to.
    #[error("remote ranks {given:?} were given, but this local rank talks to remote ranks {needed:?}")]
    RemoteRanks {
        /// Ranks of the metas passed in.
        given: Vec<u32>,
        /// Ranks the TP mapping needs.
        needed: Vec<u32>,
    },
    /// A request lists block ids for the wrong number of groups.
    #[error("{side} block ids list {got} groups, but the model has {expected} KV-cache groups")]
    GroupCount {
        /// Which side.
        side: Side,
        /// Groups given.
        got: usize,
        /// Groups of the model.
        expected: usize,
    },
    /// A block id outside the pool.
    #[error("{side} block id {id} of group {group} is out of range: the pool has {limit} {unit}")]
    BlockOutOfRange {
        /// Which side.
        side: Side,
        /// Group index.
        group: usize,
        /// The id.
        id: u64,
        /// Number of blocks.
        limit: u64,
        /// What the pool counts: "logical blocks", or "state slots" for a state group whose tensors have
        /// their own slot count.
        unit: &'static str,
    },
    /// SSM state lists that cannot be paired (decode longer than prefill by two or more).
    #[error(
        "unpairable SSM state slots in group {group}: decode lists {decode_len} states, prefill lists {prefill_len}"
    )]
    UnpairableSsm {
        /// Group index.
        group: usize,
        /// Decode list length.
        decode_len: usize,
        /// Prefill list length.
        prefill_len: usize,
    },
    /// Attention block lists whose lengths differ by more than the block geometry allows.
    #[error("attention group {group}: decode lists {decode_len} units and prefill {prefill_len}; they may differ by at most {limit}")]
    UnalignedAttention {
        /// Group index.
        group: usize,
        /// Decode units (kernel blocks at the common unit).
        decode_len: u64,
        /// Prefill units.
        prefill_len: u64,
        /// Largest allowed difference.
        limit: u64,
    },
    /// A value that must divide evenly does not.
    #[error("{what} {value} is not divisible by {by}")]
    Indivisible {
        /// What was divided.
        what: String,
        /// The value.
        value: u64,
        /// The divisor.
        by: u64,
    },
    /// A descriptor table too large for 32-bit descriptor ids.
    #[error("{side} descriptor table has {len} descriptors; descriptor ids are int32, so the limit is {limit}")]
    TableTooLarge {
        /// Which side.
        side: Side,
        /// Flat descriptors.
        len: u64,
        /// Largest addressable count.
        limit: u64,
    },
    /// Address arithmetic would overflow.
    #[error("{what}: address {addr:#x} + {len} overflows the 64-bit address space")]
    AddressOverflow {
        /// What was computed.
        what: String,
        /// Base.
        addr: u64,
        /// Offset.
        len: u64,
    },
    /// A transfer index or descriptor id that does not exist.
    #[error("{0}")]
    BadTransfer(String),
    /// A stage map that does not fit the local table (its shape or a stage index), see [`super::StageMap`].
    #[error("stage map: {0}")]
    BadStages(String),
    /// A count that would size an allocation is over its limit (checked before anything is allocated).
    #[error("{what} is {value}, over the limit of {limit}")]
    OverLimit {
        /// What was counted.
        what: String,
        /// The count.
        value: u64,
        /// The largest accepted count.
        limit: u64,
    },
    /// A block id listed twice in one group of one request: its bytes would be moved (or written) twice.
    #[error("{side} block id {id} is listed twice in group {group}: a request names each block once")]
    DuplicateBlock {
        /// Which side.
        side: Side,
        /// Group index.
        group: usize,
        /// The repeated id.
        id: u64,
    },
    /// A block id listed in two groups of one request whose groups share a region (HMA pools every group's
    /// layer *i* into one tensor): the same page would be moved (or written) once per group.
    #[error("{side} block id {id} is listed in groups {} and {}, which share KV-cache tensors: a request names each block once", groups.0, groups.1)]
    SharedBlock {
        /// Which side.
        side: Side,
        /// The id listed in both groups.
        id: u64,
        /// The two groups.
        groups: (usize, usize),
    },
    /// A remote descriptor row would address bytes outside every region the remote rank advertised.
    #[error("remote rank {rank}: descriptors at {addr:#x} (+{len} bytes, stride {stride}, {count} of them) fall outside the regions it advertised")]
    OutsideAdvertised {
        /// Remote rank.
        rank: u32,
        /// First descriptor's address.
        addr: u64,
        /// Descriptor length.
        len: u64,
        /// Bytes between descriptors.
        stride: u64,
        /// Descriptors in the row.
        count: u64,
    },
    /// A remote rank's metadata is inconsistent on its own (the checks the handshake decoder runs).
    #[error("remote rank {rank} metadata is malformed: {findings}")]
    MalformedRemote {
        /// The rank the metadata claims.
        rank: u32,
        /// Every finding, `; `-separated.
        findings: String,
    },
    /// The local layout is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// Shorthand for a [`PlanError::Mismatch`].
pub(crate) fn mismatch(
    what: impl Into<String>,
    local: impl std::fmt::Debug,
    remote: impl std::fmt::Debug,
) -> PlanError {
    PlanError::Mismatch {
        what: what.into(),
        local: format!("{local:?}"),
        remote: format!("{remote:?}"),
    }
}

/// `value / by`, or an [`PlanError::Indivisible`] naming `what`.
pub(crate) fn exact_div(what: impl FnOnce() -> String, value: u64, by: u64) -> Result<u64, PlanError> {
    if by == 0 || value % by != 0 {
        return Err(PlanError::Indivisible {
            what: what(),
            value,
            by,
        });
    }
    Ok(value / by)
}
