//! The setup checks both agents' `start` run before spawning anything.

use kvbridge_handshake::{PeerDescriptor, Role};

use crate::error::{CoordinatorError, Result};

/// Refuses a descriptor whose role is not `role`; `agent` names the agent being started.
pub(crate) fn check_role(descriptor: &PeerDescriptor, role: Role, agent: &str) -> Result<()> {
    if descriptor.role == role {
        return Ok(());
    }
    Err(CoordinatorError::InvalidSetup {
        message: format!(
            "a {agent} needs a descriptor with role \"{role}\", got \"{}\"",
            descriptor.role
        ),
    })
}

/// The tokio runtime `agent::start` was called in.
pub(crate) fn current_runtime(agent: &str) -> Result<tokio::runtime::Handle> {
    tokio::runtime::Handle::try_current().map_err(|_| CoordinatorError::InvalidSetup {
        message: format!("{agent}::start must be called inside a tokio runtime"),
    })
}
