//! `StreamSchedule` for Python: which (region, group) pairs of a rank each layer's save hook makes final.

use std::sync::Arc;

use pyo3::prelude::*;

use super::errors::Error;
use super::region::PyRegionTable;
use crate::core::stream::{Granularity, StreamSchedule};

/// When each part of a rank's KV is final during a request's last prefill forward (streaming push).
///
/// vLLM runs decoder layers in layer-number order and calls `save_kv_layer` after each attention (or MLA)
/// layer wrote its KV; SSM layers get no hook. Stage `k` holds the (region, group) pairs (one layer's pages or
/// states each) that are final once the hook in `stage_hooks[k]` fired, or at the end of the forward when it is
/// `None`. `PeerPlan.plan_staged` cuts a request's plan by these stages.
#[pyclass(frozen, name = "StreamSchedule", module = "hybrid_kv")]
pub struct PyStreamSchedule {
    pub(crate) inner: Arc<StreamSchedule>,
    granularity: Granularity,
}

#[pymethods]
impl PyStreamSchedule {
    /// The schedule of `table`.
    ///
    /// Args:
    ///     table (RegionTable): the rank's region table (its layers, regions and groups).
    ///     hooks (Sequence[str] | None): the layers vLLM calls `save_kv_layer` for; `None`: every attention and
    ///         MLA layer of the table.
    ///     granularity (str): "layer" (a layer's pages go once it ran) or "region" (a tensor goes once every
    ///         layer in it ran).
    /// Raises:
    ///     LayoutError: a hook that is not a layer of `table`.
    ///     ValueError: an unknown `granularity`.
    #[new]
    #[pyo3(signature = (table, hooks = None, *, granularity = "layer"))]
    fn new(table: PyRef<'_, PyRegionTable>, hooks: Option<Vec<String>>, granularity: &str) -> PyResult<Self> {
        let granularity = match granularity {
            "layer" => Granularity::Layer,
            "region" => Granularity::Region,
            other => {
                return Err(
                    Error::value_error(format!("granularity must be \"layer\" or \"region\", got {other:?}")).into(),
                )
            }
        };
        let s = StreamSchedule::new(&table.inner, hooks.as_deref(), granularity).map_err(Error::from)?;
        Ok(PyStreamSchedule {
            inner: Arc::new(s),
            granularity,
        })
    }

    /// Number of stages.
    #[getter]
    fn num_stages(&self) -> usize {
        self.inner.stages.len()
    }

    /// "layer" or "region".
    #[getter]
    fn granularity(&self) -> &'static str {
        match self.granularity {
            Granularity::Layer => "layer",
            Granularity::Region => "region",
        }
    }

    /// Every hook layer in forward order with the number of stages final once its hook fired.
    #[getter]
    fn hooks(&self) -> Vec<(String, usize)> {
        self.inner.hooks.clone()
    }

    /// The hook layer of each stage (`None`: the end of the forward).
    #[getter]
    fn stage_hooks(&self) -> Vec<Option<String>> {
        self.inner.stages.iter().map(|s| s.hook.clone()).collect()
    }

    /// The (region, group) pairs each stage holds (those some layer writes).
    #[getter]
    fn stage_units(&self) -> Vec<Vec<(u32, u32)>> {
        self.inner.stages.iter().map(|s| s.units.clone()).collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "StreamSchedule(granularity={}, stages={}, hooks={})",
            self.granularity(),
            self.inner.stages.len(),
            self.inner.hooks.len()
        )
    }
}
