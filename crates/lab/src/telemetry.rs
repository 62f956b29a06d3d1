//! The lab's one `tracing` subscriber (docs/tracing.md): the log lines on stderr as before,
//! plus, only when asked for, kvbridge's spans exported over OTLP (HTTP/protobuf or gRPC, as
//! `OTEL_EXPORTER_OTLP_PROTOCOL` says; `kvbridge_otlp`) when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, and written as Chrome trace-event JSON for
//! `demo --trace FILE`.
//!
//! Off costs nothing: without either, the spans' callsites are disabled by the log filter
//! (errors only by default) and no span is built. The returned [`Telemetry`] must live until
//! the process's agents are gone: dropping it flushes the exporter and writes the file.

use std::path::PathBuf;

use kvbridge_otlp::{Export, ExportOptions};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

pub mod chrome;
pub mod svg;

/// Which spans are exported and written: kvbridge's lifecycle spans (info and above).
const SPAN_FILTER: &str = "kvbridge=info";

/// What the lab's subscriber exports, beside its log lines.
#[derive(Debug, Clone, Default)]
pub struct TelemetryOptions {
    /// This process as a trace shows it (`kvbridge.process`, e.g. `prefill`, `decode 1`).
    pub process: String,
    /// The log filter when `RUST_LOG` is unset.
    pub default_log: String,
    /// Write the spans as Chrome trace-event JSON here (`demo --trace`).
    pub chrome: Option<chrome::ChromeOptions>,
    /// Export over OTLP to this endpoint even without the environment variables (the
    /// explicit option); otherwise the variables decide. The protocol is still
    /// `OTEL_EXPORTER_OTLP_PROTOCOL`'s unless `otlp_protocol` says.
    pub otlp_endpoint: Option<String>,
    /// The OTLP protocol, overriding the variables.
    pub otlp_protocol: Option<kvbridge_otlp::Protocol>,
}

/// Keeps the exporter and the trace file until the process ends; dropping it flushes both.
#[must_use = "dropping it flushes and stops the exporter"]
pub struct Telemetry {
    export: Option<Export>,
    chrome: Option<chrome::ChromeWriter>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("otlp", &self.export.as_ref().map(Export::protocol))
            .field("chrome", &self.chrome.is_some())
            .finish()
    }
}

impl Telemetry {
    /// Whether spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.export.is_some()
    }

    /// Where the Chrome trace file goes, if one is written.
    pub fn chrome_path(&self) -> Option<PathBuf> {
        self.chrome.as_ref().map(|c| c.path().to_owned())
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(e) = self.export.take() {
            if let Err(e) = e.shutdown() {
                eprintln!("kvbridge-lab: {e}");
            }
        }
        if let Some(c) = self.chrome.take() {
            if let Err(e) = c.write() {
                eprintln!("kvbridge-lab: {e}");
            }
        }
    }
}

/// Installs the process's subscriber: log lines to `writer` filtered by `RUST_LOG` (or
/// `options.default_log`), and the span exports `options` and the environment ask for. An
/// exporter that cannot be built is reported on stderr and left out (the run goes on).
pub fn init<W>(options: TelemetryOptions, writer: W) -> Telemetry
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let log_filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&options.default_log));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(false)
        .with_filter(log_filter);
    let export = if options.otlp_endpoint.is_some() || kvbridge_otlp::requested() {
        let opts = ExportOptions {
            service_name: "kvbridge-lab".to_owned(),
            process: Some(options.process.clone()),
            endpoint: options.otlp_endpoint.clone(),
            protocol: options.otlp_protocol,
        };
        match Export::start(&opts) {
            Ok(e) => Some(e),
            Err(e) => {
                eprintln!("kvbridge-lab: OTLP export is off: {e}");
                None
            }
        }
    } else {
        None
    };
    let otel = export.as_ref().map(|e| {
        // No code location, thread or busy/idle attributes: spans carry kvbridge's own.
        tracing_opentelemetry::layer()
            .with_tracer(e.tracer("kvbridge"))
            .with_location(false)
            .with_threads(false)
            .with_tracked_inactivity(false)
            .with_filter(EnvFilter::new(SPAN_FILTER))
    });
    let chrome = options.chrome.map(chrome::ChromeWriter::new);
    let chrome_layer = chrome
        .as_ref()
        .map(|c| c.layer().with_filter(EnvFilter::new(SPAN_FILTER)));
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .with(chrome_layer)
        .try_init();
    Telemetry { export, chrome }
}
