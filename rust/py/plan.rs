//! `PeerPlan`, `Plan` and `RankTransfer` for Python, and `plan_scenario`: conversions only, planning runs in
//! the core with the GIL released.

use std::sync::Arc;

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;

use super::arrays::{flat_descs, strided_view, u64_matrix};
use pyo3::types::{PyBytes, PyDict};

use super::convert::to_py;
use super::errors::{no_panic, Error, Kind};
use super::handshake::{check_peers, decode_payload, meta_from_py};
use super::ids::block_ids;
use super::region::PyRegionTable;
use super::stream::PyStreamSchedule;
use crate::core::handshake::Expected;
use crate::core::plan::{PeerPlan, Plan, TableKey};
use crate::core::scenario::report::report;
use crate::core::scenario::{Deployment, Scenario, ScenarioError};
use crate::core::tp::MAX_TP_SIZE;
use crate::core::{AgentMeta, TransferMode};

fn parse_mode(mode: &str) -> Result<TransferMode, Error> {
    match mode {
        "pull" => Ok(TransferMode::Pull),
        "push" => Ok(TransferMode::Push),
        _ => Err(Error::bad_mode(mode)),
    }
}

/// One remote's metadata: wire bytes through the untrusted decoder, or (tests and tools) a metadata dict as
/// `decode_meta` returns it, checked by `PeerPlan` itself.
fn remote_meta(item: &Bound<'_, PyAny>) -> PyResult<AgentMeta> {
    if let Ok(bytes) = item.cast::<PyBytes>() {
        return Ok(decode_payload(bytes.as_bytes())?);
    }
    if item.cast::<PyDict>().is_ok() {
        return meta_from_py(item).map_err(|e| Error::plan(format!("bad remote metadata: {e}")).into());
    }
    let got = item.get_type().name()?;
    Err(Error::type_error(format!(
        "remote metadata must be payload bytes or a metadata dict, got {got}"
    ))
    .into())
}

fn parse_key(key: &str) -> PyResult<TableKey> {
    Ok(key.parse::<TableKey>().map_err(Error::from)?)
}

/// Requests with fewer block ids than this are planned without releasing the GIL: their planning takes about
/// a microsecond, less than letting another thread take the GIL and handing it back would.
const DETACH_FROM_IDS: usize = 1024;

/// Everything one local rank needs to plan requests against one peer engine (mapping and tables).
#[pyclass(frozen, name = "PeerPlan", module = "hybrid_kv")]
pub struct PyPeerPlan {
    inner: Arc<PeerPlan>,
    /// The rank's table, whose cache holds the arrays of the local tables its plans share.
    local: Py<PyRegionTable>,
}

#[pymethods]
impl PyPeerPlan {
    /// Precompute the TP mapping and descriptor tables of `local` against a peer engine.
    ///
    /// Args:
    ///     local (RegionTable): this rank's region table.
    ///     payloads (Sequence[bytes]): the handshake payload of every remote rank this rank talks to, the wire
    ///         bytes each peer served, decoded here once as untrusted input (a metadata dict as `decode_meta`
    ///         returns it is accepted too, for tests and tools; the planner's own checks still run).
    ///     mode (str): "pull" (local is decode) or "push" (local is prefill).
    ///     coalesce (bool): append chunk rows to the tables of attention regions that are dense on both sides
    ///         and plan runs of consecutive blocks as one descriptor per power-of-two chunk (needs nixl >= 1.5
    ///         strided tables to stay small). False gives the reference tables and one id per unit.
    ///     own_payload (bytes | None): this rank's payload; when given, every peer is validated against it
    ///         (the checks of `validate_handshake`, on the metadata decoded for planning) before planning.
    ///     expected_engine_id, expected_tp_size, expected_num_blocks: as `validate_handshake` (need
    ///         `own_payload`).
    /// Raises:
    ///     HandshakeError: a payload does not decode (too large, malformed, another version, inconsistent), or
    ///         a peer is incompatible with `own_payload` (the message starts with `peer rank N:`, `findings`
    ///         lists every failed check).
    ///     PlanError: a bad `mode`, the two sides cannot be planned together (the message names both values),
    ///         a remote's counts are over their limits, or its tables would address bytes outside its
    ///         advertised regions.
    ///     TypeError: a payload that is neither bytes nor a dict.
    #[new]
    #[pyo3(signature = (local, payloads, mode = "pull", *, coalesce = true, own_payload = None,
                        expected_engine_id = None, expected_tp_size = None, expected_num_blocks = None))]
    #[allow(clippy::too_many_arguments)] // the Python signature: four optional keyword arguments
    fn new(
        py: Python<'_>,
        local: PyRef<'_, PyRegionTable>,
        payloads: Vec<Bound<'_, PyAny>>,
        mode: &str,
        coalesce: bool,
        own_payload: Option<&[u8]>,
        expected_engine_id: Option<String>,
        expected_tp_size: Option<u32>,
        expected_num_blocks: Option<u64>,
    ) -> PyResult<Self> {
        let mode = parse_mode(mode)?;
        if payloads.len() > MAX_TP_SIZE as usize {
            return Err(Error::plan(format!(
                "{} remote payloads given, over the limit of {MAX_TP_SIZE} (the largest TP size)",
                payloads.len()
            ))
            .into());
        }
        let metas = payloads.iter().map(remote_meta).collect::<PyResult<Vec<_>>>()?;
        let expected = Expected {
            engine_id: expected_engine_id,
            tp_size: expected_tp_size,
            num_blocks: expected_num_blocks,
        };
        match own_payload {
            Some(own) => check_peers(own, &metas, &expected)?,
            None if expected != Expected::default() => {
                return Err(Error::plan("expected_* arguments need own_payload to validate against").into())
            }
            None => {}
        }
        let table = Arc::clone(&local.inner);
        let peer = no_panic(Kind::Plan, || {
            Ok(py.detach(move || PeerPlan::with_coalescing(&table, &metas, mode, coalesce))?)
        })?;
        Ok(PyPeerPlan {
            inner: Arc::new(peer),
            local: local.into(),
        })
    }

    /// "pull" or "push".
    #[getter]
    fn mode(&self) -> &'static str {
        match self.inner.mode {
            TransferMode::Pull => "pull",
            TransferMode::Push => "push",
        }
    }

    /// Whether some attention region's runs are planned as chunk descriptors (its tables have chunk rows).
    #[getter]
    fn coalesced(&self) -> bool {
        self.inner.coalesced()
    }

    /// Signed TP ratio from the local view.
    #[getter]
    fn tp_ratio(&self) -> i64 {
        self.inner.mapping.tp_ratio
    }

    /// Remote ranks holding the attention heads this rank needs.
    #[getter]
    fn attn_ranks(&self) -> Vec<u32> {
        self.inner.mapping.attn_ranks.clone()
    }

    /// Remote ranks whose SSM shards overlap this rank's.
    #[getter]
    fn ssm_ranks(&self) -> Vec<u32> {
        self.inner.mapping.ssm_ranks.clone()
    }

    /// Handshaked remote ranks, ascending.
    #[getter]
    fn remote_ranks(&self) -> Vec<u32> {
        self.inner.remote_tables.iter().map(|(r, _)| *r).collect()
    }

    /// Keys of the local tables ("whole", "bsr:N", "split:I").
    #[getter]
    fn table_keys(&self) -> Vec<String> {
        self.inner.local_tables.iter().map(|(k, _)| k.to_string()).collect()
    }

    /// Local table `key` as an `(N, 3)` uint64 array `(addr, len, device)`.
    ///
    /// Raises:
    ///     PlanError: no such table.
    fn local_descs<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let k = parse_key(key)?;
        let t = self
            .inner
            .local_table(k)
            .ok_or_else(|| Error::plan(format!("no local table {key:?}")))?;
        flat_descs(py, t)
    }

    /// Local table `key` as strided `(rows, 5)` uint64 rows `(addr, len, device, stride, count)`.
    ///
    /// A table this rank's plans share (the coalesced base table) is one read-only array, the same object
    /// from every plan of the rank; any other table is a fresh array.
    ///
    /// Raises:
    ///     PlanError: no such table.
    fn local_rows<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let k = parse_key(key)?;
        let (_, t) = self
            .inner
            .local_tables
            .iter()
            .find(|(tk, _)| *tk == k)
            .ok_or_else(|| Error::plan(format!("no local table {key:?}")))?;
        self.local.get().shared_rows.rows(py, t)
    }

    /// Remote rank `rank`'s table as an `(N, 3)` uint64 array.
    ///
    /// Raises:
    ///     PlanError: `rank` was not handshaked.
    fn remote_descs<'py>(&self, py: Python<'py>, rank: u32) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let t = self
            .inner
            .remote_table(rank)
            .ok_or_else(|| Error::plan(format!("no remote rank {rank}")))?;
        flat_descs(py, t)
    }

    /// Remote rank `rank`'s table as strided `(rows, 5)` uint64 rows: a read-only view of the plan's own rows
    /// (not a copy), which keeps the plan alive.
    ///
    /// Raises:
    ///     PlanError: `rank` was not handshaked.
    fn remote_rows<'py>(slf: &Bound<'py, Self>, rank: u32) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let t = slf
            .get()
            .inner
            .remote_table(rank)
            .ok_or_else(|| Error::plan(format!("no remote rank {rank}")))?;
        // The plan is frozen and holds its tables behind an `Arc` it never replaces.
        strided_view(slf.as_any(), t)
    }

    /// Descriptors of local table `key` once expanded (what its strided rows stand for).
    ///
    /// Raises:
    ///     PlanError: no such table.
    fn table_descriptors(&self, key: &str) -> PyResult<u64> {
        let k = parse_key(key)?;
        Ok(self
            .inner
            .table_descriptors(k)
            .ok_or_else(|| Error::plan(format!("no local table {key:?}")))?)
    }

    /// Bytes of local descriptors `ids` of table `key` (what a transfer with these local ids moves).
    ///
    /// Args:
    ///     key (str): the local table ("whole", "bsr:N", "split:I").
    ///     ids (numpy.ndarray): int32 descriptor ids, as `RankTransfer.local_ids`.
    /// Raises:
    ///     PlanError: no such table, or an id outside it (named with the table's size).
    fn local_bytes(&self, key: &str, ids: PyReadonlyArray1<'_, i32>) -> PyResult<u64> {
        let k = parse_key(key)?;
        let ids = ids.as_array();
        let bytes = match ids.as_slice() {
            Some(s) => self.inner.ids_bytes(k, s),
            None => self.inner.ids_bytes(k, &ids.iter().copied().collect::<Vec<i32>>()),
        };
        Ok(bytes.map_err(Error::from)?)
    }

    /// The local logical block ids, one array per group (ascending, unique), whose bytes local descriptors
    /// `ids` of table `key` move: the blocks a failed transfer with these local ids leaves unknown.
    ///
    /// A region several groups share lists its blocks under each of them; a request names each block in
    /// one group only, so intersect group by group with the request's ids.
    ///
    /// Args:
    ///     key (str): the local table ("whole", "bsr:N", "split:I").
    ///     ids (numpy.ndarray): int32 descriptor ids, as `RankTransfer.local_ids`.
    /// Returns:
    ///     list[numpy.ndarray]: uint64 logical block ids per group, in group order.
    /// Raises:
    ///     PlanError: no such table, or an id outside it (named with the table's size).
    fn failed_blocks<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        ids: PyReadonlyArray1<'_, i32>,
    ) -> PyResult<Vec<Bound<'py, PyArray1<u64>>>> {
        let k = parse_key(key)?;
        let ids = ids.as_array();
        let blocks = match ids.as_slice() {
            Some(s) => self.inner.failed_blocks(k, s),
            None => self.inner.failed_blocks(k, &ids.iter().copied().collect::<Vec<i32>>()),
        };
        Ok(blocks
            .map_err(Error::from)?
            .into_iter()
            .map(|g| g.into_pyarray(py))
            .collect())
    }

    /// Byte moves of descriptor-id pairs as an `(M, 3)` uint64 array `(local_addr, remote_addr, len)`: what a
    /// transfer with these ids into local table `key` and remote rank `remote_rank`'s table moves.
    ///
    /// Raises:
    ///     PlanError: no such table, an id outside its table, lists of different lengths, or a pair whose
    ///         lengths differ.
    fn resolve<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        remote_rank: u32,
        local_ids: PyReadonlyArray1<'_, i32>,
        remote_ids: PyReadonlyArray1<'_, i32>,
    ) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let k = parse_key(key)?;
        let (l, r) = (local_ids.as_array(), remote_ids.as_array());
        let (l, r): (Vec<i32>, Vec<i32>) = (l.iter().copied().collect(), r.iter().copied().collect());
        let moves = self.inner.resolve(k, remote_rank, &l, &r).map_err(Error::from)?;
        u64_matrix(py, moves.concat(), 3)
    }

    /// Descriptors of remote rank `rank`'s table once expanded.
    ///
    /// Raises:
    ///     PlanError: `rank` was not handshaked.
    fn remote_table_descriptors(&self, rank: u32) -> PyResult<u64> {
        Ok(self
            .inner
            .remote_descriptors(rank)
            .ok_or_else(|| Error::plan(format!("no remote rank {rank}")))?)
    }

    /// Plan one request from each side's logical block ids per group.
    ///
    /// Args:
    ///     local_ids (Sequence[Sequence[int]]): this rank's logical block ids, one sequence per KV-cache group
    ///         (lists are read fastest; numpy integer arrays work too).
    ///     remote_ids (Sequence[Sequence[int]]): the peer's logical block ids, one sequence per group.
    /// Raises:
    ///     PlanError: wrong group count, an id outside its pool (negative ids too), or lists that cannot be
    ///         paired.
    fn plan(&self, py: Python<'_>, local_ids: &Bound<'_, PyAny>, remote_ids: &Bound<'_, PyAny>) -> PyResult<PyPlan> {
        let (local_ids, remote_ids) = (block_ids(local_ids, "local")?, block_ids(remote_ids, "remote")?);
        let size: usize = local_ids.iter().chain(&remote_ids).map(Vec::len).sum();
        let plan = no_panic(Kind::Plan, || {
            Ok(if size < DETACH_FROM_IDS {
                self.inner.plan(&local_ids, &remote_ids)
            } else {
                let peer = Arc::clone(&self.inner);
                py.detach(move || peer.plan(&local_ids, &remote_ids))
            }?)
        })?;
        self.to_py(py, plan)
    }

    /// Plan one request (as `plan`) cut into the stages of `schedule`: one `Plan` per stage, together exactly
    /// the whole plan (every id pair once), each with the whole plan's tables and ids, so nothing extra is
    /// prepped. A stage with nothing to move has no transfers.
    ///
    /// Args:
    ///     local_ids (Sequence[Sequence[int]]): this rank's logical block ids, one sequence per KV-cache group.
    ///     remote_ids (Sequence[Sequence[int]]): the peer's logical block ids, one sequence per group.
    ///     schedule (StreamSchedule): the stages, made from this rank's region table.
    /// Raises:
    ///     PlanError: as `plan`, or a schedule made for another region table.
    fn plan_staged(
        &self,
        py: Python<'_>,
        local_ids: &Bound<'_, PyAny>,
        remote_ids: &Bound<'_, PyAny>,
        schedule: PyRef<'_, PyStreamSchedule>,
    ) -> PyResult<Vec<PyPlan>> {
        let (local_ids, remote_ids) = (block_ids(local_ids, "local")?, block_ids(remote_ids, "remote")?);
        let size: usize = local_ids.iter().chain(&remote_ids).map(Vec::len).sum();
        let sched = Arc::clone(&schedule.inner);
        let plans = no_panic(Kind::Plan, || {
            Ok(if size < DETACH_FROM_IDS {
                self.inner.plan_staged(&local_ids, &remote_ids, &sched.map)
            } else {
                let peer = Arc::clone(&self.inner);
                py.detach(move || peer.plan_staged(&local_ids, &remote_ids, &sched.map))
            }?)
        })?;
        plans.into_iter().map(|p| self.to_py(py, p)).collect()
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "PeerPlan(mode={}, local_rank={}/{}, remote_tp={}, tp_ratio={}, tables={:?})",
            self.mode(),
            p.mapping.tp_rank,
            p.mapping.tp_size,
            p.mapping.remote_tp,
            p.mapping.tp_ratio,
            self.table_keys()
        )
    }
}

impl PyPeerPlan {
    /// A core plan as Python objects: the id vectors moved into numpy arrays.
    fn to_py(&self, py: Python<'_>, plan: Plan) -> PyResult<PyPlan> {
        let mut transfers = Vec::with_capacity(plan.transfers.len());
        for t in plan.transfers {
            let rt = PyRankTransfer {
                peer: Arc::clone(&self.inner),
                remote_rank: t.remote_rank,
                key: t.local_table,
                local_ids: t.local_ids.into_pyarray(py).unbind(),
                remote_ids: t.remote_ids.into_pyarray(py).unbind(),
            };
            transfers.push(Py::new(py, rt)?);
        }
        Ok(PyPlan {
            peer: Arc::clone(&self.inner),
            transfers,
            notify_ranks: plan.notify_ranks,
        })
    }
}

/// One NIXL transfer: int32 descriptor ids into a local table and a remote rank's table.
#[pyclass(frozen, name = "RankTransfer", module = "hybrid_kv")]
pub struct PyRankTransfer {
    peer: Arc<PeerPlan>,
    remote_rank: u32,
    key: TableKey,
    local_ids: Py<PyArray1<i32>>,
    remote_ids: Py<PyArray1<i32>>,
}

#[pymethods]
impl PyRankTransfer {
    /// Remote TP rank.
    #[getter]
    fn remote_rank(&self) -> u32 {
        self.remote_rank
    }

    /// Local table key ("whole", "bsr:N", "split:I").
    #[getter]
    fn local_table(&self) -> String {
        self.key.to_string()
    }

    /// Local descriptor ids (contiguous int32).
    #[getter]
    fn local_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.local_ids.bind(py).clone()
    }

    /// Remote descriptor ids (contiguous int32, same length).
    #[getter]
    fn remote_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.remote_ids.bind(py).clone()
    }

    /// Descriptor pairs in this transfer (the length of `local_ids`).
    #[getter]
    fn num_descriptors(&self, py: Python<'_>) -> usize {
        self.local_ids.bind(py).len().unwrap_or(0)
    }

    /// Bytes this transfer moves: the lengths of its local descriptors, summed in the core (the remote
    /// descriptors have the same lengths pair by pair).
    ///
    /// Raises:
    ///     PlanError: an id no longer indexes the local table (the id array was changed in place).
    #[getter]
    fn bytes(&self, py: Python<'_>) -> PyResult<u64> {
        let ids = self.local_ids.bind(py).readonly();
        Ok(self.peer.ids_bytes(self.key, ids.as_slice()?).map_err(Error::from)?)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "RankTransfer(remote_rank={}, local_table={}, descs={})",
            self.remote_rank,
            self.key,
            self.local_ids.bind(py).len().unwrap_or(0)
        )
    }
}

/// The transfers of one request between one local rank and one peer engine.
#[pyclass(frozen, name = "Plan", module = "hybrid_kv")]
pub struct PyPlan {
    peer: Arc<PeerPlan>,
    transfers: Vec<Py<PyRankTransfer>>,
    notify_ranks: Vec<u32>,
}

#[pymethods]
impl PyPlan {
    /// Transfers with at least one descriptor, in remote-rank order.
    #[getter]
    fn transfers(&self, py: Python<'_>) -> Vec<Py<PyRankTransfer>> {
        self.transfers.iter().map(|t| t.clone_ref(py)).collect()
    }

    /// Every handshaked remote rank (each must be notified, transferred to or not).
    #[getter]
    fn notify_ranks(&self) -> Vec<u32> {
        self.notify_ranks.clone()
    }

    fn __len__(&self) -> usize {
        self.transfers.len()
    }

    /// Byte moves of transfer `i` as an `(M, 3)` uint64 array `(local_addr, remote_addr, len)`.
    ///
    /// Raises:
    ///     PlanError: `i` is out of range or an id does not resolve.
    fn moves<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let t = self.transfers.get(i).ok_or_else(|| {
            Error::plan(format!(
                "transfer {i} is out of range for a plan of {} transfers",
                self.transfers.len()
            ))
        })?;
        let t = t.get();
        let (l, r) = (t.local_ids.bind(py).readonly(), t.remote_ids.bind(py).readonly());
        let moves = self
            .peer
            .resolve(t.key, t.remote_rank, l.as_slice()?, r.as_slice()?)
            .map_err(Error::from)?;
        u64_matrix(py, moves.concat(), 3)
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan(transfers={}, notify_ranks={:?})",
            self.transfers.len(),
            self.notify_ranks
        )
    }
}

/// Build and plan a whole scenario (see `docs/scenario.md`) and return the report as a dict (what its JSON
/// holds: `mode`, `local_side`, `tp`, `requests` with every rank's transfers, ids, bytes and moves).
///
/// Args:
///     scenario_json (str): the scenario.
///     moves (bool): resolve every descriptor pair into `[local_addr, remote_addr, len]`.
///     coalesce (bool): plan runs of consecutive blocks as chunk descriptors (see `PeerPlan`).
/// Raises:
///     PlanError: the scenario is malformed or cannot be planned.
///     LayoutError: a rank's layout is invalid.
#[pyfunction]
#[pyo3(signature = (scenario_json, *, moves = true, coalesce = true))]
pub fn plan_scenario<'py>(
    py: Python<'py>,
    scenario_json: &str,
    moves: bool,
    coalesce: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let text = scenario_json.to_owned();
    let r = no_panic(Kind::Plan, || {
        Ok(py.detach(move || -> Result<_, ScenarioError> {
            let dep = Deployment::build_with(&Scenario::from_json(&text)?, coalesce)?;
            report(&dep, moves)
        })?)
    })?;
    Ok(to_py(py, &r, "the plan report")?)
}

/// The remote ranks a local rank handshakes and exchanges data with: the one remote rank
/// covering it when the local TP is at least the remote TP, else the `remote_tp / tp_size` remote ranks its
/// shard spans. `PeerPlan` expects the metadata of exactly these ranks, in this order.
///
/// Args:
///     tp_rank (int): the local rank.
///     tp_size (int): the local TP size.
///     remote_tp (int): the peer engine's TP size.
/// Raises:
///     PlanError: the TP sizes do not divide each other, or the rank is out of range.
#[pyfunction]
pub fn handshake_target_ranks(tp_rank: i64, tp_size: i64, remote_tp: i64) -> PyResult<Vec<u32>> {
    let arg = |name: &str, v: i64| {
        u32::try_from(v).map_err(|_| Error::plan(format!("{name} must be a non-negative 32-bit integer, got {v}")))
    };
    let (rank, tp, remote) = (
        arg("tp_rank", tp_rank)?,
        arg("tp_size", tp_size)?,
        arg("remote_tp", remote_tp)?,
    );
    Ok(crate::core::tp::handshake_target_ranks(rank, tp, remote).map_err(Error::from)?)
}
