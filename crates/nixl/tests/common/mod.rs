//! What every NIXL test file shares.

/// Whether the NIXL runtime is set up; prints why a test is skipped when it is not.
pub(crate) fn runtime_ready() -> bool {
    match kvbridge_nixl::Runtime::locate() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipped: {e}");
            false
        }
    }
}
