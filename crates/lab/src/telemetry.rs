//! The lab's one `tracing` subscriber (docs/tracing.md): the log lines on stderr as before,
//! plus, only when asked for, kvbridge's spans exported over OTLP/HTTP (protobuf) when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, and written
//! as Chrome trace-event JSON for `demo --trace FILE`.
//!
//! Off costs nothing: without either, the spans' callsites are disabled by the log filter
//! (errors only by default) and no span is built. The returned [`Telemetry`] must live until
//! the process's agents are gone: dropping it flushes the exporter and writes the file.

use std::path::PathBuf;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

pub mod chrome;

/// The variables that turn OTLP export on (OpenTelemetry's standard names).
pub const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

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
    /// Export over OTLP/HTTP to this endpoint even without the environment variables (the
    /// explicit option); otherwise the variables decide.
    pub otlp_endpoint: Option<String>,
}

/// Keeps the exporter and the trace file until the process ends; dropping it flushes both.
#[must_use = "dropping it flushes and stops the exporter"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    chrome: Option<chrome::ChromeWriter>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("otlp", &self.provider.is_some())
            .field("chrome", &self.chrome.is_some())
            .finish()
    }
}

impl Telemetry {
    /// Whether spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Where the Chrome trace file goes, if one is written.
    pub fn chrome_path(&self) -> Option<PathBuf> {
        self.chrome.as_ref().map(|c| c.path().to_owned())
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("kvbridge-lab: flushing the OTLP exporter failed: {e}");
            }
        }
        if let Some(c) = self.chrome.take() {
            if let Err(e) = c.write() {
                eprintln!("kvbridge-lab: {e}");
            }
        }
    }
}

/// Whether the environment asks for OTLP export.
pub fn otlp_from_env() -> bool {
    ENDPOINT_VARS
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
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
    let provider = match (options.otlp_endpoint.as_deref(), otlp_from_env()) {
        (None, false) => None,
        (endpoint, _) => match provider(&options.process, endpoint) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("kvbridge-lab: OTLP export is off: {e}");
                None
            }
        },
    };
    let otel = provider.as_ref().map(|p| {
        // No code location, thread or busy/idle attributes: spans carry kvbridge's own.
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("kvbridge"))
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
    Telemetry { provider, chrome }
}

/// The OTLP/HTTP (protobuf) exporter behind a batch processor on its own thread, so no span
/// export ever runs on the agents' runtime. `endpoint` (the full traces URL) overrides the
/// environment; the `OTEL_*` variables (service name, headers, timeouts, batch sizes) apply.
fn provider(process: &str, endpoint: Option<&str>) -> Result<SdkTracerProvider, String> {
    use opentelemetry_otlp::WithExportConfig;
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
    if let Some(e) = endpoint {
        builder = builder.with_endpoint(e);
    }
    let exporter = builder.build().map_err(|e| {
        format!(
            "could not build the OTLP/HTTP exporter ({e}); check OTEL_EXPORTER_OTLP_ENDPOINT \
             (e.g. http://127.0.0.1:4318)"
        )
    })?;
    let mut resource =
        Resource::builder().with_attribute(KeyValue::new("kvbridge.process", process.to_owned()));
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("kvbridge-lab");
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}
