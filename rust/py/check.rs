//! `check_scenario` for Python: a scenario's deployment validated pair by pair, returned as a dict.

use pyo3::prelude::*;

use super::convert::to_py;
use super::errors::{no_panic, Kind};
use crate::core::scenario::check::check_scenario_with;
use crate::core::scenario::{Scenario, ScenarioError};

/// Build every rank of a scenario (see `docs/scenario.md`), run the handshake checks on every rank pair,
/// plan the requests on every local rank whose pairs all pass, and return the verdict report as a dict (what
/// `hybrid-kv check SCENARIO --json` prints).
///
/// The report has `pairs` (prefill/decode/local/remote rank, `verdict`, `findings` as objects with `check`,
/// `local`, `remote` and `detail`) and a `summary` whose `compatible` is true only when every pair is.
///
/// Args:
///     scenario_json (str): the scenario.
///     coalesce (bool): peer plans coalesce runs into chunk descriptors (False: the reference plans).
///     ranks (bool): add `ranks`, every rank of both engines (prefill first) with its regions, local rows and
///         descriptors, peers, and for posting ranks their tables (`key`, `rows`, `descriptors`), each remote
///         table's descriptors (`[rank, n]` pairs) and the descriptors, bytes and transfers of the requests.
/// Raises:
///     PlanError: the scenario is malformed or an engine cannot be built (values the format forbids).
///     LayoutError: a rank's layout is invalid.
#[pyfunction]
#[pyo3(signature = (scenario_json, *, coalesce = true, ranks = false))]
pub fn check_scenario<'py>(
    py: Python<'py>,
    scenario_json: &str,
    coalesce: bool,
    ranks: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let text = scenario_json.to_owned();
    let r = no_panic(Kind::Plan, || {
        Ok(py.detach(move || -> Result<_, ScenarioError> {
            check_scenario_with(&Scenario::from_json(&text)?, coalesce, ranks)
        })?)
    })?;
    Ok(to_py(py, &r, "the check report")?)
}
