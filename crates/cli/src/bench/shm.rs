//! The shared-memory transport for `kvbridge bench --transport shm`.

use std::sync::Arc;

use kvbridge_shm::ShmTransport;
use kvbridge_transport::KvTransport;

use super::TransportFuture;

/// Creates a [`ShmTransport`] with default options (same-user peers, socket under
/// `$XDG_RUNTIME_DIR` or the temp directory).
pub(super) fn factory() -> TransportFuture {
    Box::pin(async {
        let t = ShmTransport::new().map_err(|e| e.to_string())?;
        super::created_control_dir(t.control_dir());
        Ok(Arc::new(t) as Arc<dyn KvTransport>)
    })
}
