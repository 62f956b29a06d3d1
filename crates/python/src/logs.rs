//! kvbridge's own log lines (the Rust `tracing` events of its transports and agents), written
//! to the process's standard error when `KVBRIDGE_LOG` is set.
//!
//! The variable takes `tracing-subscriber`'s filter directives: `warn`, `info`,
//! `kvbridge_tcp=debug,warn`. Unset (the default), nothing is installed and the events cost
//! only the check that no subscriber listens. A host process that installed a subscriber of its
//! own keeps it. With OTLP export asked for too (`telemetry.rs`), the first engine installs one
//! subscriber with both layers; until then no line is written.

use std::sync::OnceLock;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

/// The environment variable that turns the log lines on.
pub(crate) const VAR: &str = "KVBRIDGE_LOG";

/// The log lines' layer when [`VAR`] holds a filter it can read; a filter it cannot read is
/// reported once on standard error and the lines stay off.
pub(crate) fn layer() -> Option<Box<dyn Layer<Registry> + Send + Sync>> {
    let filter = directives()?;
    let filter = EnvFilter::try_new(filter).ok()?;
    Some(
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_filter(filter)
            .boxed(),
    )
}

/// [`VAR`]'s directives if they parse (read once; a bad value is said once).
fn directives() -> Option<&'static str> {
    static READ: OnceLock<Option<String>> = OnceLock::new();
    READ.get_or_init(|| {
        let directives = std::env::var(VAR).ok()?;
        match EnvFilter::try_new(&directives) {
            Ok(_) => Some(directives),
            Err(e) => {
                eprintln!(
                    "kvbridge: {VAR}={directives:?} is not a log filter ({e}); kvbridge's log \
                     lines stay off. It takes levels and targets, e.g. {VAR}=warn or \
                     {VAR}=kvbridge_tcp=debug,warn"
                );
                None
            }
        }
    })
    .as_deref()
}

/// At import: installs the log lines' subscriber when [`VAR`] is set, unless OTLP export is
/// asked for (then the first engine installs both together, `telemetry::ensure`).
pub(crate) fn init_from_env() {
    if kvbridge_otlp::requested() {
        return;
    }
    if let Some(layer) = layer() {
        let _ = tracing_subscriber::registry().with(layer).try_init();
    }
}
