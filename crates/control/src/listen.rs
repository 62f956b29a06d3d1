//! The accept step of kvbridge's TCP listeners (the control channel here, the bootstrap
//! registry in `kvbridge-bootstrap`): at most `limit` connections at once, a failed `accept`
//! logged and retried after a pause, and an end when the listener's shutdown flag is set.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

/// A pause after a failed `accept` (out of file descriptors, typically), so the loop does not
/// spin while the condition lasts.
const ACCEPT_RETRY: Duration = Duration::from_millis(10);

/// Resolves once `shutdown` is `true` (or its sender is gone).
pub async fn closed(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|&c| c).await;
}

/// What [`accept_bounded`] got.
#[derive(Debug)]
pub enum Accepted {
    /// A connection within the limit; it holds its slot as long as the permit lives.
    Admitted(TcpStream, SocketAddr, OwnedSemaphorePermit),
    /// A connection over the limit: the caller tells the peer (or not) and drops it.
    OverLimit(TcpStream, SocketAddr),
}

/// The next connection of `listener`, or `None` once `shutdown` is set. `what` names the
/// listener in the log line of a failed `accept`.
pub async fn accept_bounded(
    listener: &TcpListener,
    limit: &Arc<Semaphore>,
    shutdown: &mut watch::Receiver<bool>,
    what: &str,
) -> Option<Accepted> {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = closed(shutdown) => return None,
        };
        match accepted {
            Ok((stream, peer)) => {
                return Some(match limit.clone().try_acquire_owned() {
                    Ok(permit) => Accepted::Admitted(stream, peer, permit),
                    Err(_) => Accepted::OverLimit(stream, peer),
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "{what}: accept failed");
                tokio::time::sleep(ACCEPT_RETRY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn admits_up_to_the_limit_then_reports_over_limit_and_ends_on_shutdown() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limit = Arc::new(Semaphore::new(1));
        let (tx, mut rx) = watch::channel(false);
        let _a = TcpStream::connect(addr).await.unwrap();
        let first = accept_bounded(&listener, &limit, &mut rx, "test").await;
        assert!(matches!(first, Some(Accepted::Admitted(..))), "{first:?}");
        let _b = TcpStream::connect(addr).await.unwrap();
        let second = accept_bounded(&listener, &limit, &mut rx, "test").await;
        assert!(
            matches!(second, Some(Accepted::OverLimit(..))),
            "{second:?}"
        );
        drop(first);
        let _c = TcpStream::connect(addr).await.unwrap();
        let third = accept_bounded(&listener, &limit, &mut rx, "test").await;
        assert!(matches!(third, Some(Accepted::Admitted(..))), "{third:?}");
        tx.send_replace(true);
        assert!(
            accept_bounded(&listener, &limit, &mut rx, "test")
                .await
                .is_none()
        );
    }
}
