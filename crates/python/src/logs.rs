//! kvbridge's own log lines (the Rust `tracing` events of its transports and agents), written
//! to the process's standard error when `KVBRIDGE_LOG` is set.
//!
//! The variable takes `tracing-subscriber`'s filter directives: `warn`, `info`,
//! `kvbridge_tcp=debug,warn`. Unset (the default), nothing is installed and the events cost
//! only the check that no subscriber listens. A host process that installed a subscriber of its
//! own keeps it.

/// The environment variable that turns the log lines on.
pub(crate) const VAR: &str = "KVBRIDGE_LOG";

/// Installs the standard-error subscriber when [`VAR`] is set; a filter it cannot read is
/// reported once on standard error and the lines stay off.
pub(crate) fn init_from_env() {
    let Ok(directives) = std::env::var(VAR) else {
        return;
    };
    match tracing_subscriber::EnvFilter::try_new(&directives) {
        Ok(filter) => {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .try_init();
        }
        Err(e) => eprintln!(
            "kvbridge: {VAR}={directives:?} is not a log filter ({e}); kvbridge's log lines stay \
             off. It takes levels and targets, e.g. {VAR}=warn or {VAR}=kvbridge_tcp=debug,warn"
        ),
    }
}
