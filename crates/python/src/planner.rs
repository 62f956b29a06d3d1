//! The planner: SGLang-compatible DCP token plans and run grouping over `kvbridge-geometry`.

use pyo3::prelude::*;

pub(crate) fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
