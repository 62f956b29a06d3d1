//! The transport's connection to an accepted decode rank: made when it registers, and made
//! again (once per loss) when it was lost before a room sends to it.

use std::sync::Arc;

use kvbridge_transport::{KvTransport, PeerId};

use super::{AcceptedPeer, Conn, PrefillInner, problem};
use crate::messages::{Registration, TransferInfo, WireProblem};
use crate::state::{FailureCause, FailureReason};
use kvbridge_machines::prefill::AcceptedDecode;

impl PrefillInner {
    /// Connects the transport to a registering decode rank, bounded by the control send
    /// timeout.
    pub(super) async fn connect(
        &self,
        reg: &Registration,
    ) -> std::result::Result<PeerId, WireProblem> {
        let name = self.transport.name();
        let timeout = self.config.control_send_timeout;
        let message = match tokio::time::timeout(
            timeout,
            self.transport.connect(&reg.transport.descriptor),
        )
        .await
        {
            Ok(Ok(p)) => return Ok(p),
            Ok(Err(e)) => format!("connecting the {name} transport to the decode failed: {e}"),
            Err(_) => format!(
                "connecting the {name} transport to the decode did not finish within {timeout:?}"
            ),
        };
        Err(problem(
            "KVB-CONNECT",
            message,
            "check the decode's transport is reachable from the prefill",
        ))
    }

    /// Connects the transport to `old`'s decode rank again (its connection was lost), puts the
    /// new connection in its place, then handles `info`; a decode rank that cannot be reached
    /// fails the room, naming it.
    pub(super) async fn reconnect_then(self: Arc<Self>, info: TransferInfo, old: Conn) {
        match self.reconnect(&old).await {
            Ok(_) => self.on_transfer_info(info),
            Err(why) => {
                let endpoint = &old.endpoint;
                let reason = FailureReason::with_peer(
                    FailureCause::TransferError,
                    endpoint,
                    format!("room {}: {why}", info.room),
                );
                self.reply_failed(&info, &reason);
            }
        }
    }

    /// Connects the transport to `old`'s decode rank again (its connection was lost) and puts
    /// the new connection in its place (unless a concurrent reconnect or a new registration
    /// replaced it first: then that one). The connection to use now, or why there is none.
    pub(super) async fn reconnect(&self, old: &Conn) -> std::result::Result<Conn, String> {
        let name = self.transport.name();
        let endpoint = &old.endpoint;
        // Another room may have connected again already.
        let replaced = self.with_core(|c| {
            c.machine
                .replacement(endpoint, old.peer, old.session)
                .map(|a| a.conn.clone())
        });
        if let Some(current) = replaced {
            return Ok(current);
        }
        let timeout = self.config.control_send_timeout;
        let connected =
            tokio::time::timeout(timeout, self.transport.connect(&old.descriptor)).await;
        let peer = match connected {
            Ok(Ok(p)) => p,
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("it did not finish within {timeout:?}"),
                };
                return Err(format!(
                    "the {name} connection to decode {endpoint} was lost, and connecting again \
                     failed: {why}"
                ));
            }
        };
        let fresh = Arc::new(AcceptedPeer {
            endpoint: endpoint.clone(),
            session: old.session,
            peer,
            plan: old.plan.clone(),
            descriptor: old.descriptor.clone(),
        });
        let decode = AcceptedDecode {
            session: old.session,
            peer,
            conn: fresh.clone(),
        };
        let replaced = self.with_core(|c| c.machine.replace_lost(endpoint, old.peer, decode));
        match replaced {
            Ok(()) => {
                tracing::info!(decode = %endpoint, "connected the transport to the decode again after it was lost");
                let _ = self.transport.disconnect(old.peer).await;
                Ok(fresh)
            }
            Err(other) => {
                let _ = self.transport.disconnect(peer).await;
                other.map(|a| a.conn).ok_or_else(|| {
                    format!(
                        "decode {endpoint} registered again while its lost connection was replaced"
                    )
                })
            }
        }
    }
}
