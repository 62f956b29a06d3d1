//! OTLP span export for kvbridge's own processes (docs/tracing.md): the lab's binary and the
//! `kvbridge` Python package build their exporter here, from OpenTelemetry's standard
//! variables, so both take the same ones.
//!
//! - **Off unless asked for**: [`requested`] is true only when `OTEL_EXPORTER_OTLP_ENDPOINT`
//!   or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set (non-empty); a caller that finds it false
//!   and has no explicit endpoint builds nothing: no exporter, no thread, no runtime.
//! - **Protocol**: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else `OTEL_EXPORTER_OTLP_PROTOCOL`,
//!   `http/protobuf` (the default) or `grpc` (opentelemetry-otlp's tonic exporter).
//! - Spans leave through a batch processor on its own thread, never on the caller's runtime.
//!   gRPC's connection tasks run on a one-worker Tokio runtime the [`Export`] owns (tonic
//!   needs one); HTTP needs none.
//!
//! The library crates never depend on this one: they emit `tracing` spans and an embedding
//! engine installs what it likes.

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

/// The variables that turn OTLP export on (OpenTelemetry's standard names).
pub const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// The variables that choose the protocol, the signal's own first.
pub const PROTOCOL_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
];

/// What went wrong setting up or stopping the export.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OtlpError {
    /// A protocol variable names a protocol this build cannot speak.
    #[error(
        "{var}={value:?} is not a protocol kvbridge exports with; set it to \"grpc\" or \
         \"http/protobuf\" (or unset it: http/protobuf)"
    )]
    Protocol {
        /// The variable read.
        var: String,
        /// Its value.
        value: String,
    },
    /// opentelemetry-otlp refused to build the exporter (a malformed endpoint or header).
    #[error(
        "could not build the OTLP {protocol} exporter ({source}); check \
         OTEL_EXPORTER_OTLP_ENDPOINT (e.g. http://127.0.0.1:4318 for http/protobuf, \
         http://127.0.0.1:4317 for grpc) and OTEL_EXPORTER_OTLP_HEADERS"
    )]
    Build {
        /// The protocol asked for.
        protocol: Protocol,
        /// Why.
        source: opentelemetry_otlp::ExporterBuildError,
    },
    /// The gRPC exporter's runtime could not be started (threads exhausted).
    #[error("could not start the OTLP gRPC exporter's runtime thread: {0}")]
    Runtime(#[source] std::io::Error),
    /// Flushing or stopping the exporter failed (the collector unreachable or too slow).
    #[error("flushing the OTLP exporter failed ({0}); is the collector at the endpoint up?")]
    Flush(#[source] opentelemetry_sdk::error::OTelSdkError),
}

/// OTLP's transports as kvbridge exports with them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Protocol {
    /// OTLP/HTTP with protobuf bodies (`POST /v1/traces`), the default.
    HttpProtobuf,
    /// OTLP/gRPC (`opentelemetry.proto.collector.trace.v1.TraceService/Export`).
    Grpc,
}

impl Protocol {
    /// The name the `OTEL_EXPORTER_OTLP_*PROTOCOL` variables use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HttpProtobuf => "http/protobuf",
            Self::Grpc => "grpc",
        }
    }

    /// Reads a protocol's name as the variables spell it (case-insensitive).
    ///
    /// # Errors
    /// [`OtlpError::Protocol`] for anything but `grpc` and `http/protobuf` (`http/json` is
    /// not built in).
    pub fn parse(var: &str, value: &str) -> Result<Self, OtlpError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "http/protobuf" => Ok(Self::HttpProtobuf),
            "grpc" => Ok(Self::Grpc),
            _ => Err(OtlpError::Protocol {
                var: var.to_owned(),
                value: value.to_owned(),
            }),
        }
    }

    /// The protocol the environment asks for: the first of [`PROTOCOL_VARS`] that is set,
    /// else http/protobuf.
    ///
    /// # Errors
    /// [`OtlpError::Protocol`] when that variable names another protocol.
    pub fn from_env() -> Result<Self, OtlpError> {
        for var in PROTOCOL_VARS {
            if let Some(v) = std::env::var(var).ok().filter(|v| !v.trim().is_empty()) {
                return Self::parse(var, &v);
            }
        }
        Ok(Self::HttpProtobuf)
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether the environment asks for OTLP export (an endpoint variable is set).
pub fn requested() -> bool {
    ENDPOINT_VARS
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// What to export as.
#[derive(Debug, Clone, Default)]
pub struct ExportOptions {
    /// `service.name` when `OTEL_SERVICE_NAME` is unset.
    pub service_name: String,
    /// `kvbridge.process`, the process as a trace shows it (`prefill`, `decode 1`), if any.
    pub process: Option<String>,
    /// The endpoint, overriding the variables (for http/protobuf the full traces URL, for
    /// grpc the collector's URL).
    pub endpoint: Option<String>,
    /// The protocol, overriding the variables.
    pub protocol: Option<Protocol>,
}

/// A running export: the tracer provider behind its batch processor, and for gRPC the
/// runtime of its connection. Dropping it flushes and stops both.
pub struct Export {
    provider: Option<SdkTracerProvider>,
    runtime: Option<tokio::runtime::Runtime>,
    protocol: Protocol,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("protocol", &self.protocol)
            .finish_non_exhaustive()
    }
}

impl Export {
    /// Builds the exporter `options` and the `OTEL_*` variables describe (service name,
    /// headers, timeout, batch settings apply as opentelemetry-otlp and the SDK read them).
    ///
    /// # Errors
    /// [`OtlpError::Protocol`], [`OtlpError::Build`], [`OtlpError::Runtime`].
    pub fn start(options: &ExportOptions) -> Result<Self, OtlpError> {
        let protocol = match options.protocol {
            Some(p) => p,
            None => Protocol::from_env()?,
        };
        let endpoint = options.endpoint.as_deref();
        let build = |source| OtlpError::Build { protocol, source };
        let (exporter, runtime) = match protocol {
            Protocol::HttpProtobuf => {
                let mut b = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
                if let Some(e) = endpoint {
                    b = b.with_endpoint(e);
                }
                (b.build().map_err(build)?, None)
            }
            Protocol::Grpc => {
                // tonic's channel spawns its connection tasks on the runtime it is built in;
                // the batch thread's exports reach them through channels.
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("kvbridge-otlp-grpc")
                    .enable_all()
                    .build()
                    .map_err(OtlpError::Runtime)?;
                let exporter = {
                    let _in = runtime.enter();
                    let mut b = opentelemetry_otlp::SpanExporter::builder().with_tonic();
                    if let Some(e) = endpoint {
                        b = b.with_endpoint(e);
                    }
                    b.build().map_err(build)?
                };
                (exporter, Some(runtime))
            }
        };
        let mut resource = Resource::builder();
        if let Some(p) = &options.process {
            resource = resource.with_attribute(KeyValue::new("kvbridge.process", p.clone()));
        }
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() && !options.service_name.is_empty() {
            resource = resource.with_service_name(options.service_name.clone());
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        Ok(Self {
            provider: Some(provider),
            runtime,
            protocol,
        })
    }

    /// The protocol spans leave by.
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// A tracer of this export, for `tracing_opentelemetry::layer().with_tracer`.
    pub fn tracer(&self, name: &'static str) -> SdkTracer {
        match &self.provider {
            Some(p) => p.tracer(name),
            // Only after shutdown, which takes `self`.
            None => SdkTracerProvider::builder().build().tracer(name),
        }
    }

    /// Exports every ended span now (blocks up to the exporter's timeout).
    ///
    /// # Errors
    /// [`OtlpError::Flush`].
    pub fn flush(&self) -> Result<(), OtlpError> {
        match &self.provider {
            Some(p) => p.force_flush().map_err(OtlpError::Flush),
            None => Ok(()),
        }
    }

    /// Flushes and stops the exporter (what dropping does, with the error returned).
    ///
    /// # Errors
    /// [`OtlpError::Flush`].
    pub fn shutdown(mut self) -> Result<(), OtlpError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), OtlpError> {
        let result = match self.provider.take() {
            Some(p) => p.shutdown().map_err(OtlpError::Flush),
            None => Ok(()),
        };
        // After the last export; never blocks (safe inside another runtime too).
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
        result
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("kvbridge: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocols_read_as_the_variables_spell_them() {
        assert_eq!(Protocol::parse("V", "grpc").unwrap(), Protocol::Grpc);
        assert_eq!(Protocol::parse("V", " GRPC ").unwrap(), Protocol::Grpc);
        assert_eq!(
            Protocol::parse("V", "http/protobuf").unwrap(),
            Protocol::HttpProtobuf
        );
        let e = Protocol::parse("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json").unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("OTEL_EXPORTER_OTLP_PROTOCOL=\"http/json\"") && text.contains("grpc"),
            "{text}"
        );
    }
}
