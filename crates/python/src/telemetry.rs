//! OTLP export of kvbridge's spans from Python (the agents' rooms, the engine's writes;
//! docs/tracing.md), on the same variables as the lab: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns it on, `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` /
//! `OTEL_EXPORTER_OTLP_PROTOCOL` choose `grpc` or `http/protobuf` (`kvbridge_otlp`).
//!
//! The first `kvbridge.Engine` this process makes (every agent takes one) looks once: with no
//! endpoint variable nothing is built (no exporter, no thread, no subscriber) and the spans'
//! callsites stay disabled. With one,
//! the process gets a `tracing` subscriber with the OpenTelemetry layer (kvbridge's spans, info
//! and above) and, when `KVBRIDGE_LOG` is set, the log lines' layer (`logs.rs`), and an
//! `atexit` hook that flushes it.

use std::sync::{Mutex, OnceLock};

use kvbridge_coordinator::TraceParent;
use kvbridge_otlp::{Export, ExportOptions};
use pyo3::prelude::*;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::errors::{Kind, invalid};

/// The export, once the first engine looked (`None` inside: off).
static EXPORT: OnceLock<Mutex<Option<Export>>> = OnceLock::new();

/// Starts the export if the environment asks for it; once per process, on the first engine.
/// A failure to build it is a warning on stderr, never the agent's failure.
pub(crate) fn ensure(py: Python<'_>) {
    let mut first = false;
    EXPORT.get_or_init(|| {
        first = true;
        Mutex::new(start())
    });
    if first && exporting().is_some() {
        // Flush at interpreter exit: a process's last spans would otherwise be lost.
        let hook = py
            .import("atexit")
            .and_then(|m| m.getattr("register"))
            .and_then(|register| {
                let f = pyo3::wrap_pyfunction!(shutdown_traces, py)?;
                register.call1((f,))
            });
        if let Err(e) = hook {
            eprintln!("kvbridge: could not register the trace flush at exit: {e}");
        }
    }
}

fn start() -> Option<Export> {
    if !kvbridge_otlp::requested() {
        return None;
    }
    let options = ExportOptions {
        service_name: "kvbridge-python".to_owned(),
        process: std::env::var("KVBRIDGE_PROCESS").ok(),
        endpoint: None,
        protocol: None,
    };
    let export = match Export::start(&options) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("kvbridge: OTLP export is off: {e}");
            return None;
        }
    };
    // No code location, thread or busy/idle attributes: spans carry kvbridge's own.
    let layer = tracing_opentelemetry::layer()
        .with_tracer(export.tracer("kvbridge"))
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_filter(EnvFilter::new("kvbridge=info"));
    // KVBRIDGE_LOG's lines, if asked for, share the subscriber (logs.rs).
    let layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> =
        [Some(layer.boxed()), crate::logs::layer()]
            .into_iter()
            .flatten()
            .collect();
    if tracing_subscriber::registry()
        .with(layers)
        .try_init()
        .is_err()
    {
        eprintln!("kvbridge: OTLP export is off: this process already has a tracing subscriber");
        return None;
    }
    Some(export)
}

fn exporting() -> Option<&'static str> {
    let cell = EXPORT.get()?;
    let guard = cell.lock().unwrap_or_else(|e| e.into_inner());
    guard.as_ref().map(|e| e.protocol().as_str())
}

/// `kvbridge.traces_exporter()`: the OTLP protocol the agents' spans leave by (`"grpc"`,
/// `"http/protobuf"`), or `None` when export is off. Looks at the environment as the first
/// agent does, if none did yet.
#[pyfunction]
fn traces_exporter(py: Python<'_>) -> Option<&'static str> {
    ensure(py);
    exporting()
}

/// `kvbridge.flush_traces()`: exports every ended span now (blocks up to the exporter's
/// timeout, the interpreter released). A no-op when export is off.
#[pyfunction]
fn flush_traces(py: Python<'_>) -> PyResult<()> {
    let Some(cell) = EXPORT.get() else {
        return Ok(());
    };
    py.detach(|| {
        let guard = cell.lock().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().map_or(Ok(()), Export::flush)
    })
    .map_err(|e| Kind::Base.err(e.to_string()))
}

/// `kvbridge.shutdown_traces()`: flushes and stops the export (registered with `atexit`);
/// spans of agents still running afterwards are dropped.
#[pyfunction]
fn shutdown_traces(py: Python<'_>) -> PyResult<()> {
    let Some(cell) = EXPORT.get() else {
        return Ok(());
    };
    let export = cell.lock().unwrap_or_else(|e| e.into_inner()).take();
    match export {
        Some(e) => py
            .detach(|| e.shutdown())
            .map_err(|e| Kind::Base.err(e.to_string())),
        None => Ok(()),
    }
}

/// A `traceparent=` argument: the W3C text form, or `None`.
pub(crate) fn traceparent(value: Option<&str>) -> PyResult<Option<TraceParent>> {
    let Some(text) = value else { return Ok(None) };
    TraceParent::parse(text).map(Some).ok_or_else(|| {
        invalid(format!(
            "traceparent {text:?} is not a W3C traceparent; pass \
             '00-<32 lower-case hex trace id>-<16 hex span id>-<2 hex flags>' (non-zero ids), \
             e.g. what opentelemetry's propagate.inject writes, or None"
        ))
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(pyo3::wrap_pyfunction!(traces_exporter, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(flush_traces, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(shutdown_traces, m)?)?;
    Ok(())
}
