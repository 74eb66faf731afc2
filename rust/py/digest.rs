//! Transfer digests for Python: `RegionTable.digest` (XXH3-64 of host memory over a plan's byte ranges) and
//! `MirrorPlan` (a passive rank's copy of its initiator's plan, `core::plan::mirror`).
//!
//! `digest` is the one place the binding reads memory it did not allocate: the ranges of a move array, each
//! checked to lie inside one region of the table it is called on (the memory the caller registered, host
//! memory only), hashed in move order with the GIL released. The core still never dereferences an address.

use std::hash::Hasher;
use std::sync::Arc;

use numpy::{PyArray2, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use twox_hash::XxHash3_64;

use super::arrays::u64_matrix;
use super::errors::{no_panic, Error, Kind};
use super::handshake::{check_peers, decode_payload};
use super::ids::block_ids;
use crate::core::handshake::Expected;
use crate::core::layout::MemType;
use crate::core::plan::Mirror;
use crate::core::RegionTable;

/// The move column a side's addresses are in: `(local_addr, remote_addr, len)`.
fn column(side: &str) -> Result<usize, Error> {
    match side {
        "local" => Ok(0),
        "remote" => Ok(1),
        _ => Err(Error::value_error(format!(
            "side must be 'local' or 'remote', got {side:?}"
        ))),
    }
}

/// Every range `(addr, len)` inside one region of `table` (a binary search over the regions by base), or an
/// error naming the first that is not.
fn check_inside(table: &RegionTable, ranges: impl Iterator<Item = (usize, u64, u64)>) -> Result<(), Error> {
    let mut extents: Vec<(u64, u64)> = table.regions.iter().map(|r| (r.base, r.base + r.bytes)).collect();
    extents.sort_unstable();
    for (i, addr, len) in ranges {
        let inside = extents
            .partition_point(|&(b, _)| b <= addr)
            .checked_sub(1)
            .is_some_and(|k| addr.checked_add(len).is_some_and(|end| end <= extents[k].1));
        if !inside {
            return Err(Error::value_error(format!(
                "move {i}: range {addr:#x}+{len} is not inside a region of this table"
            )));
        }
    }
    Ok(())
}

/// Bytes of one segment of the concatenated stream: segments are hashed on their own (on rayon's pool of
/// threads), so a digest costs the memory's bandwidth on every core rather than one core's hashing speed.
const SEGMENT: u64 = 1 << 18;

/// XXH3-64 of each `SEGMENT` of the concatenation of `ranges` in order, then XXH3-64 of the stream's length and
/// those digests (little-endian): how the moves are cut does not change it, their order does.
fn xxh3_ranges(ranges: &[(u64, u64)]) -> u64 {
    use rayon::prelude::*;

    let mut starts = Vec::with_capacity(ranges.len());
    let mut total = 0u64;
    for &(_, len) in ranges {
        starts.push(total);
        total += len; // every range lies inside a region (checked): the sum of their lengths cannot wrap
    }
    let segments = total.div_ceil(SEGMENT);
    let one = |seg: u64| segment_digest(ranges, &starts, seg * SEGMENT, ((seg + 1) * SEGMENT).min(total));
    let digests: Vec<u64> = if segments > 1 {
        (0..segments).into_par_iter().map(one).collect()
    } else {
        (0..segments).map(one).collect()
    };
    let mut h = XxHash3_64::new();
    h.write(&total.to_le_bytes());
    for d in &digests {
        h.write(&d.to_le_bytes());
    }
    h.finish()
}

/// XXH3-64 of the stream's bytes `[from, to)` (`starts`: each range's offset in the stream).
fn segment_digest(ranges: &[(u64, u64)], starts: &[u64], from: u64, to: u64) -> u64 {
    let mut h = XxHash3_64::new();
    let mut i = starts.partition_point(|&s| s <= from).saturating_sub(1);
    let mut at = from;
    while at < to && i < ranges.len() {
        let (addr, len) = ranges[i];
        let begin = at - starts[i];
        let end = (to - starts[i]).min(len);
        if begin < end {
            // SAFETY: every range was checked to lie inside a region of the table, which its caller registered:
            // host memory of this process that stays allocated while the table is used (the contract of
            // `RegionTable.digest`, as for a NIXL registration); `begin..end` is inside the range. The bytes are
            // only read; a concurrent writer (a fault the digest exists to catch) can only change the result.
            let bytes =
                unsafe { std::slice::from_raw_parts((addr + begin) as usize as *const u8, (end - begin) as usize) };
            h.write(bytes);
            at = starts[i] + end;
        }
        i += 1;
    }
    h.finish()
}

/// `RegionTable.digest`: see the method's documentation in `region.rs`.
pub fn digest_moves(
    py: Python<'_>,
    table: &Arc<RegionTable>,
    moves: &PyReadonlyArray2<'_, u64>,
    side: &str,
) -> PyResult<u64> {
    let col = column(side)?;
    if moves.shape()[1] != 3 {
        return Err(Error::value_error(format!(
            "moves must be an (M, 3) uint64 array (local_addr, remote_addr, len), got {} columns",
            moves.shape()[1]
        ))
        .into());
    }
    if table.mem_type != MemType::Dram {
        return Err(Error::value_error(format!(
            "digest reads host (DRAM) memory; this table's regions are {} (digest device memory with \
             hybrid_kv.verify's torch path)",
            table.mem_type.nixl_name()
        ))
        .into());
    }
    let view = moves.as_array();
    let ranges: Vec<(u64, u64)> = view.rows().into_iter().map(|m| (m[col], m[2])).collect();
    let table = Arc::clone(table);
    Ok(py.detach(move || {
        check_inside(&table, ranges.iter().enumerate().map(|(i, &(a, l))| (i, a, l)))?;
        Ok::<_, Error>(xxh3_ranges(&ranges))
    })?)
}

/// A passive rank's copy of one initiator rank's plan, restricted to this rank: the moves of a request
/// between the two, in the initiator's order, so both sides digest the same bytes.
#[pyclass(frozen, name = "MirrorPlan", module = "hybrid_kv")]
pub struct PyMirrorPlan {
    inner: Arc<Mirror>,
}

#[pymethods]
impl PyMirrorPlan {
    /// Rebuild the plan of the rank that sent `initiator_payload` against this rank.
    ///
    /// Args:
    ///     own_payload (bytes): this rank's handshake payload (the bytes it serves to peers).
    ///     initiator_payload (bytes): the initiator rank's payload (untrusted: decoded, validated against
    ///         `own_payload` as `validate_handshake` does, and bounded before anything is sized).
    ///     coalesce (bool): the initiator's `coalesce` setting (its moves are cut by it).
    /// Raises:
    ///     HandshakeError: a payload does not decode, or the two are incompatible (`findings`).
    ///     PlanError: the initiator does not exchange data with this rank, claims far more blocks than this
    ///         rank has, or cannot be planned against it.
    #[new]
    #[pyo3(signature = (own_payload, initiator_payload, *, coalesce = true))]
    fn new(py: Python<'_>, own_payload: &[u8], initiator_payload: &[u8], coalesce: bool) -> PyResult<Self> {
        let own = decode_payload(own_payload).map_err(|e| e.context("own payload"))?;
        let init = decode_payload(initiator_payload)?;
        // validated as the initiator validated us: its side is the local (posting) one, as the checks assume
        // (from this rank's side, a GQA decode wider than the KV heads was refused as a swapped P/D pair)
        check_peers(initiator_payload, std::slice::from_ref(&own), &Expected::default())
            .map_err(|e| e.context("initiator"))?;
        let mirror = no_panic(Kind::Plan, || Ok(py.detach(|| Mirror::new(&own, &init, coalesce))?))?;
        Ok(PyMirrorPlan {
            inner: Arc::new(mirror),
        })
    }

    /// This (passive) rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.inner.rank
    }

    /// The initiator's rank.
    #[getter]
    fn initiator_rank(&self) -> u32 {
        self.inner.initiator_rank
    }

    /// The moves of one request between the initiator and this rank as an `(M, 3)` uint64 array
    /// `(initiator_addr, own_addr, len)`, in the initiator's order: its `Plan.moves` of the transfers to this
    /// rank, concatenated.
    ///
    /// Args:
    ///     initiator_ids (Sequence[Sequence[int]]): the initiator's logical block ids per group.
    ///     own_ids (Sequence[Sequence[int]]): this rank's logical block ids per group.
    /// Raises:
    ///     PlanError: wrong group count, an id outside its pool, or lists that cannot be paired.
    fn moves<'py>(
        &self,
        py: Python<'py>,
        initiator_ids: &Bound<'_, PyAny>,
        own_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let (a, b) = (block_ids(initiator_ids, "initiator")?, block_ids(own_ids, "own")?);
        let mirror = Arc::clone(&self.inner);
        let moves = no_panic(Kind::Plan, || Ok(py.detach(move || mirror.moves(&a, &b))?))?;
        u64_matrix(py, moves.concat(), 3)
    }

    fn __repr__(&self) -> String {
        format!(
            "MirrorPlan(rank={}, initiator_rank={})",
            self.inner.rank, self.inner.initiator_rank
        )
    }
}
