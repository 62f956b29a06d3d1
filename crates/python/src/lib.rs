//! The `kvbridge` Python package's native module, `kvbridge._native`.
//!
//! Each submodule adds its classes and functions to the module in `_native` below; the pure
//! Python layer (`python/kvbridge`) re-exports them under their public names. Built by maturin
//! (`pip install ./crates/python`), tested by pytest (`crates/python/tests`); see
//! `docs/python.md`.

use pyo3::prelude::*;

mod agents;
mod checks;
mod engine;
mod errors;
mod logs;
mod memory;
mod planner;
mod telemetry;

/// The native module: one `register` call per submodule.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    logs::init_from_env();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    planner::register(m)?;
    checks::register(m)?;
    errors::register(m)?;
    engine::register(m)?;
    agents::register(m)?;
    telemetry::register(m)?;
    Ok(())
}
