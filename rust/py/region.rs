//! `RegionTable` for Python: built from a JSON layout, exposing regions and descriptor tables as numpy.

use std::sync::Arc;

use numpy::{PyArray2, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::arrays::{flat_descs, u64_matrix};
use super::digest::digest_moves;
use super::errors::Error;
use super::shared_rows::SharedRows;
use crate::core::handshake as hs;
use crate::core::{AgentMeta, DescTable, EngineInfo, RankLayout, RegionTable};

/// The region table of one rank: one region per distinct base address, MLA flags OR-merged.
#[pyclass(frozen, name = "RegionTable", module = "hybrid_kv")]
pub struct PyRegionTable {
    /// The immutable core table.
    pub inner: Arc<RegionTable>,
    /// The arrays of the local tables this rank's plans share (`PeerPlan.local_rows`).
    pub shared_rows: SharedRows,
}

impl PyRegionTable {
    fn table(&self, bsr: u64, coalesce: bool) -> PyResult<DescTable> {
        let t = if coalesce {
            self.inner.coalesced_local_table(bsr)
        } else {
            self.inner.local_table(bsr)
        };
        Ok(t.map_err(Error::from)?)
    }
}

/// A malformed `engine_info` (a local argument): a `TypeError` for a value of the wrong type, else a
/// `ValueError`; both name the parameter and the key.
fn engine_info_error(at: &str, why: &str) -> Error {
    let message = format!("{at}: {why}");
    if why.starts_with("invalid type") || why.starts_with("expected a dict") {
        Error::type_error(message)
    } else {
        Error::value_error(message)
    }
}

#[pymethods]
impl PyRegionTable {
    /// Build a region table from a rank layout given as JSON (see `hybrid_kv.layout`).
    ///
    /// Raises:
    ///     LayoutError: the layout is malformed or inconsistent (the message names the value and limit).
    #[staticmethod]
    fn from_json(py: Python<'_>, layout_json: &str) -> PyResult<Self> {
        let layout = RankLayout::from_json(layout_json).map_err(Error::from)?;
        let table = py.detach(|| RegionTable::build(&layout)).map_err(Error::from)?;
        Ok(PyRegionTable {
            inner: Arc::new(table),
            shared_rows: SharedRows::default(),
        })
    }

    /// The whole table (regions, SSM region order, groups, geometry, conv split) as JSON.
    ///
    /// Raises:
    ///     HybridKvError: the table does not serialize (a bug).
    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string(&*self.inner)
            .map_err(|e| Error::internal(format!("region table does not serialize: {e}")).into())
    }

    /// Number of regions.
    #[getter]
    fn num_regions(&self) -> usize {
        self.inner.regions.len()
    }

    /// REPLICATE (MLA) flag of every region.
    #[getter]
    fn region_is_mla(&self) -> Vec<bool> {
        self.inner.regions.iter().map(|r| r.is_mla).collect()
    }

    /// Base address of every region.
    #[getter]
    fn base_addrs(&self) -> Vec<u64> {
        self.inner.regions.iter().map(|r| r.base).collect()
    }

    /// Kernel page bytes of every region.
    #[getter]
    fn block_lens(&self) -> Vec<u64> {
        self.inner.regions.iter().map(|r| r.block_len).collect()
    }

    /// NIXL memory type of the regions: "DRAM" (host) or "VRAM" (device).
    #[getter]
    fn mem_type(&self) -> &'static str {
        self.inner.mem_type.nixl_name()
    }

    /// Kernel blocks per logical block.
    #[getter]
    fn ppl(&self) -> u64 {
        self.inner.geometry.ppl
    }

    /// Kernel blocks per region.
    #[getter]
    fn num_kernel_blocks(&self) -> u64 {
        self.inner.geometry.num_kernel_blocks
    }

    /// `(conv_bytes, ssm_bytes)` of one state on this rank, or `(0, 0)` without SSM layers.
    #[getter]
    fn ssm_sizes(&self) -> (u64, u64) {
        self.inner
            .conv_split
            .as_ref()
            .map_or((0, 0), |s| (s.conv_bytes, s.ssm_bytes))
    }

    /// Flat count of attention descriptors at block-size ratio `bsr`.
    ///
    /// Raises:
    ///     LayoutError: `bsr` is 0 or does not divide a kernel page (as `local_descs`), or the count overflows.
    #[pyo3(signature = (bsr = 1))]
    fn num_fa_descs(&self, bsr: u64) -> PyResult<u64> {
        Ok(self.inner.num_fa_descs(bsr).map_err(Error::from)?)
    }

    /// Registration descriptors `(addr, bytes, device)` as an `(R, 3)` uint64 array.
    fn registration<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<u64>>> {
        u64_matrix(py, self.inner.registration().concat(), 3)
    }

    /// The local descriptor table as an `(N, 3)` uint64 array `(addr, len, device)`.
    ///
    /// `coalesce=True` appends the chunk rows of every dense attention region: the base table of every
    /// coalescing `PeerPlan` at this `bsr`, so it can be prepped before any handshake.
    ///
    /// Raises:
    ///     LayoutError: `bsr` does not divide a kernel page.
    #[pyo3(signature = (bsr = 1, *, coalesce = false))]
    fn local_descs<'py>(&self, py: Python<'py>, bsr: u64, coalesce: bool) -> PyResult<Bound<'py, PyArray2<u64>>> {
        flat_descs(py, &self.table(bsr, coalesce)?)
    }

    /// The local descriptor table as strided `(rows, 5)` uint64 rows `(addr, len, device, stride, count)`.
    ///
    /// `coalesce=True` appends the chunk rows of every dense attention region (see `local_descs`).
    ///
    /// Raises:
    ///     LayoutError: `bsr` does not divide a kernel page.
    #[pyo3(signature = (bsr = 1, *, coalesce = false))]
    fn local_rows<'py>(&self, py: Python<'py>, bsr: u64, coalesce: bool) -> PyResult<Bound<'py, PyArray2<u64>>> {
        let rows = self.table(bsr, coalesce)?.to_strided();
        u64_matrix(py, rows, 5)
    }

    /// This rank's handshake payload: its metadata as wire bytes, what peers fetch and `PeerPlan` decodes.
    ///
    /// Args:
    ///     engine_info (dict): the engine facts that are not in the table (`hybrid_kv.EngineInfo`): `engine_id`,
    ///         `compat_hash` (`hybrid_kv.compat_hash` over the model factors), `attn_backend`, `transfer_mode`
    ///         ("pull" or "push"), and optionally `agent_metadata` (a list of ints; NIXL's own metadata travels
    ///         beside the payload), `kv_layout` (the engine's layout name; its page order must be the table's,
    ///         which defaults to it) and `prefix_caching`. Unknown keys are refused.
    /// Raises:
    ///     PlanError: `transfer_mode` is not "pull" or "push".
    ///     TypeError: a field of the wrong type (named).
    ///     ValueError: an unknown or missing key, an unknown `kv_layout` or one whose page order the table's tensors
    ///         contradict, or a `compat_hash` that is not a hash (each named as `engine_info[...]`).
    fn handshake_payload<'py>(
        &self,
        py: Python<'py>,
        engine_info: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        if let Some(mode) = engine_info.get_item("transfer_mode")? {
            if let Ok(mode) = mode.extract::<String>() {
                if mode != "pull" && mode != "push" {
                    return Err(Error::bad_mode(&mode).into());
                }
            }
        }
        let value: serde_json::Value =
            pythonize::depythonize(engine_info).map_err(|e| Error::type_error(format!("engine_info: {e}")))?;
        let info = EngineInfo::from_value(&value).map_err(|(at, why)| engine_info_error(&at, &why))?;
        info.check(&self.inner)
            .map_err(|(field, why)| Error::value_error(format!("engine_info[{field:?}]: {why}")))?;
        let bytes = hs::encode(&AgentMeta::from_table(&self.inner, &info)).map_err(Error::from)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Digest of this rank's side of byte moves (XXH3-64 of each 256 KiB segment, on a pool of threads, then XXH3-64 of
    /// the length and those digests): the concatenation, in move order, of the bytes at
    /// `moves[:, 0]` (`side="local"`) or `moves[:, 1]` (`"remote"`), each `moves[:, 2]` long. How the moves are
    /// cut does not change it; their order does.
    ///
    /// It reads the memory: call it only on a table of this process's live host memory (built from tensors
    /// that outlive the call, as for a NIXL registration). Every range must lie inside one of the table's
    /// regions; device memory is digested with `hybrid_kv.verify`'s torch path instead. The GIL is released.
    ///
    /// Args:
    ///     moves (numpy.ndarray): `(M, 3)` uint64 `(local_addr, remote_addr, len)`, as `Plan.moves` and
    ///         `MirrorPlan.moves` give them.
    ///     side (str): which address column is this table's: "local" or "remote".
    /// Raises:
    ///     ValueError: a bad `side` or shape, a range outside the table's regions (named), or regions that are
    ///         not host memory.
    #[pyo3(signature = (moves, side = "local"))]
    fn digest(&self, py: Python<'_>, moves: PyReadonlyArray2<'_, u64>, side: &str) -> PyResult<u64> {
        digest_moves(py, &self.inner, &moves, side)
    }

    fn __repr__(&self) -> String {
        let t = &self.inner;
        format!(
            "RegionTable(regions={}, ssm_regions={}, ppl={}, kernel_blocks={}, tp={}/{})",
            t.regions.len(),
            t.ssm_regions.len(),
            t.geometry.ppl,
            t.geometry.num_kernel_blocks,
            t.tp_rank,
            t.tp_size
        )
    }
}
