//! `check_scenario` for Python: a scenario's deployment validated pair by pair, returned as JSON.

use pyo3::prelude::*;

use super::errors::{no_panic, Error, Kind};
use crate::core::scenario::ScenarioError;
use crate::core::scenario_check::check_scenario_json;

/// Build every rank of a scenario (see `docs/scenario.md`), run the handshake checks on every rank pair,
/// plan the requests on every local rank whose pairs all pass, and return the verdict report as JSON.
///
/// The report has `pairs` (prefill/decode/local/remote rank, `verdict`, `findings` as objects with `check`,
/// `local`, `remote` and `detail`) and a `summary` whose `compatible` is true only when every pair is.
///
/// Raises:
///     PlanError: the scenario is malformed or an engine cannot be built (values the format forbids).
///     LayoutError: a rank's layout is invalid.
#[pyfunction]
pub fn check_scenario(py: Python<'_>, scenario_json: &str) -> PyResult<String> {
    let text = scenario_json.to_owned();
    let out = no_panic(Kind::Plan, || {
        let r = py.detach(move || -> Result<_, ScenarioError> { check_scenario_json(&text) })?;
        serde_json::to_string(&r).map_err(|e| Error::internal(format!("the check report does not serialize: {e}")))
    })?;
    Ok(out)
}
