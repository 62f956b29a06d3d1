//! Connection plumbing shared by both directions: timed reads, frame I/O and the handshake.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;

use crate::TcpConfig;
use crate::auth::{self, HelloFields};
use crate::error::TcpError;
use crate::wire::{self, FLAG_SECRET, Frame, HEADER_LEN, PREFACE_LEN, Preface, VERSION};

/// Control frames queued per connection, in both directions.
pub(crate) const CTRL_QUEUE: usize = 1024;
/// Time a writer gets to send a closing `Error` frame before the connection is dropped.
pub(crate) const CLOSE_GRACE: Duration = Duration::from_millis(200);

/// A connection's write half, shared by its writer task and callers that write a frame at once.
pub(crate) type SharedWriter = Arc<tokio::sync::Mutex<OwnedWriteHalf>>;

/// Writes `frame` from the calling task, saving the hop to the connection's writer task, when
/// `idle_queue` (nothing is queued before it) and the writer holds no frame: frames already
/// queued keep their order, and a frame is never interleaved with another. The part a full
/// socket does not take is finished by a task holding the writer (within `limit`). Gives the
/// frame back when it must be queued instead.
pub(crate) fn write_now(
    w: &SharedWriter,
    idle_queue: bool,
    frame: Vec<u8>,
    limit: Duration,
) -> Result<(), Vec<u8>> {
    if !idle_queue {
        return Err(frame);
    }
    let Ok(mut g) = w.clone().try_lock_owned() else {
        return Err(frame);
    };
    let done = match g.try_write(&frame) {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
        // The writer task meets the same error on its next write and reports it.
        Err(_) => return Err(frame),
    };
    if done < frame.len() {
        tokio::spawn(async move {
            let _ = tokio::time::timeout(limit, g.write_all(&frame[done..])).await;
        });
    }
    Ok(())
}

/// Why a connection ended.
#[derive(Debug)]
pub(crate) enum LinkError {
    Io(std::io::Error),
    Eof,
    Silent(Duration),
    /// The handshake did not finish within `TcpConfig::connect_timeout`.
    HandshakeDeadline(Duration),
    Protocol(TcpError),
}

impl std::fmt::Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkError::Io(e) => write!(f, "connection error: {e}"),
            LinkError::Eof => f.write_str("the peer closed the connection"),
            LinkError::Silent(d) => write!(
                f,
                "nothing heard from the peer for {d:?} (keep-alive timeout); it is dead or stalled"
            ),
            LinkError::HandshakeDeadline(d) => write!(
                f,
                "the handshake did not finish within {d:?} (TcpConfig::connect_timeout)"
            ),
            LinkError::Protocol(e) => write!(f, "{e}"),
        }
    }
}

impl From<TcpError> for LinkError {
    fn from(e: TcpError) -> Self {
        LinkError::Protocol(e)
    }
}

fn io_err(e: std::io::Error) -> LinkError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        LinkError::Eof
    } else {
        LinkError::Io(e)
    }
}

/// A reader's keep-alive limit: a read that waits `idle` for bytes fails with
/// [`LinkError::Silent`]. One timer serves all the reads of a connection: it is moved only when
/// a wait would outlast it by more than half the limit (and when it fires early), so a read
/// that waits for the next frame, as each small batch's does, neither arms nor disarms a timer.
pub(crate) struct Silence {
    idle: Duration,
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl Silence {
    pub(crate) fn new(idle: Duration) -> Self {
        Self {
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
        }
    }

    /// Runs `fut`, failing if it is still pending `idle` from now.
    async fn limit<F: std::future::Future>(&mut self, fut: F) -> Result<F::Output, LinkError> {
        let limit = Instant::now() + self.idle;
        if self.timer.deadline() + self.idle / 2 < limit {
            self.timer.as_mut().reset(limit);
        }
        let mut fut = std::pin::pin!(fut);
        std::future::poll_fn(|cx| {
            if let std::task::Poll::Ready(v) = fut.as_mut().poll(cx) {
                return std::task::Poll::Ready(Ok(v));
            }
            while self.timer.as_mut().poll(cx).is_ready() {
                if Instant::now() >= limit {
                    return std::task::Poll::Ready(Err(LinkError::Silent(self.idle)));
                }
                self.timer.as_mut().reset(limit);
            }
            std::task::Poll::Pending
        })
        .await
    }
}

/// Reads exactly `buf.len()` bytes, failing if the peer is silent for `silence`'s limit.
///
/// Bytes already at hand (in a read-ahead, or in the socket) are taken without looking at the
/// clock: a clock read is a good part of a small batch's time on some VMs, and a small batch's
/// frames arrive in one read.
pub(crate) async fn read_exact_timed<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut [u8],
    silence: &mut Silence,
) -> Result<(), LinkError> {
    let mut read = std::pin::pin!(r.read_exact(buf));
    let first = std::future::poll_fn(|cx| match read.as_mut().poll(cx) {
        std::task::Poll::Ready(r) => std::task::Poll::Ready(Some(r)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await;
    let done = match first {
        Some(r) => r,
        // The same read goes on (what it has read so far is kept), now under the limit.
        None => silence.limit(read).await?,
    };
    done.map(|_| ()).map_err(io_err)
}

/// Waits until `r` is readable, failing if the peer is silent for `silence`'s limit.
pub(crate) async fn readable_timed(
    r: &tokio::net::tcp::OwnedReadHalf,
    silence: &mut Silence,
) -> Result<(), LinkError> {
    silence.limit(r.readable()).await?.map_err(LinkError::Io)
}

/// Reads one frame (a `Data` frame's payload stays on the stream). `buf` is reused; it never
/// grows beyond `max_body`.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max_body: u32,
    silence: &mut Silence,
) -> Result<Frame, LinkError> {
    read_frame_checked(r, buf, max_body, silence, |_, _| Ok(())).await
}

/// [`read_frame`], with `check` run on the header's type and body length before any of the
/// body is read (a budget refusing the frame refuses it before anything is allocated for it).
pub(crate) async fn read_frame_checked<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max_body: u32,
    silence: &mut Silence,
    check: impl FnOnce(wire::FrameType, u32) -> Result<(), TcpError>,
) -> Result<Frame, LinkError> {
    let mut h = [0u8; HEADER_LEN];
    read_exact_timed(r, &mut h, silence).await?;
    let (ty, len) = wire::decode_header(&h, max_body)?;
    check(ty, len)?;
    buf.clear();
    buf.resize(len as usize, 0);
    read_exact_timed(r, buf, silence).await?;
    Ok(wire::decode_body(ty, buf)?)
}

/// The `Error` frame telling the peer why this side closes the connection.
pub(crate) fn error_frame(e: &TcpError) -> Vec<u8> {
    Frame::Error {
        code: e.code(),
        message: e.to_string(),
    }
    .encode()
}

/// Best-effort: tells the peer why the connection closes.
pub(crate) async fn send_error<W: AsyncWrite + Unpin>(w: &mut W, e: &TcpError) {
    let frame = error_frame(e);
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        w.write_all(&frame).await?;
        w.flush().await
    })
    .await;
}

fn my_preface(config: &TcpConfig) -> [u8; PREFACE_LEN] {
    Preface {
        version: VERSION,
        flags: if config.secret.is_some() {
            FLAG_SECRET
        } else {
            0
        },
        nonce: auth::nonce(),
    }
    .encode()
}

async fn read_preface<R: AsyncRead + Unpin>(
    r: &mut R,
    idle: Duration,
) -> Result<([u8; PREFACE_LEN], Preface), LinkError> {
    let mut raw = [0u8; PREFACE_LEN];
    read_exact_timed(r, &mut raw, &mut Silence::new(idle)).await?;
    let p = Preface::decode(&raw)?;
    Ok((raw, p))
}

/// Who lacks the secret, as `(side, other)` of [`TcpError::SecretMissing`]: when only this side
/// has one, and when only the peer has one.
struct SecretNames {
    only_here: (&'static str, &'static str),
    only_there: (&'static str, &'static str),
}

/// Writes this side's preface, reads the peer's and refuses a secret configured on one side
/// only. Returns both raw prefaces (the secret's proofs cover them).
async fn exchange_prefaces<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    config: &TcpConfig,
    names: SecretNames,
) -> Result<([u8; PREFACE_LEN], [u8; PREFACE_LEN]), LinkError> {
    let mine = my_preface(config);
    s.write_all(&mine).await.map_err(io_err)?;
    let (theirs_raw, theirs) = read_preface(s, config.connect_timeout).await?;
    let they_have_secret = theirs.flags & FLAG_SECRET != 0;
    let missing = match (&config.secret, they_have_secret) {
        (Some(_), false) => Some(names.only_here),
        (None, true) => Some(names.only_there),
        _ => None,
    };
    if let Some((side, other)) = missing {
        return Err(TcpError::SecretMissing { side, other }.into());
    }
    Ok((mine, theirs_raw))
}

/// The connecting side's handshake: prefaces, proof of the secret, `Welcome`. Returns when the
/// `Welcome` was read (no earlier than the listener sent it: the epoch of `Begin` deadlines).
pub(crate) async fn client_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    config: &TcpConfig,
    hello: HelloFields,
) -> Result<Instant, LinkError> {
    let idle = config.connect_timeout;
    let names = SecretNames {
        only_here: ("this transport", "listener"),
        // Let the listener say so in its own words if it does; otherwise say it here.
        only_there: ("the listener", "connecting transport"),
    };
    let (mine, theirs_raw) = exchange_prefaces(s, config, names).await?;
    let mac = config
        .secret
        .as_ref()
        .map(|k| auth::client_proof(k, &mine, &theirs_raw, hello));
    let frame = Frame::Hello {
        session: hello.session,
        conn_index: hello.conn_index,
        conn_count: hello.conn_count,
        keepalive_ms: hello.keepalive_ms,
        mac,
    };
    s.write_all(&frame.encode()).await.map_err(io_err)?;
    let mut buf = Vec::new();
    let frame = read_frame(s, &mut buf, 4096, &mut Silence::new(idle)).await?;
    let welcomed = Instant::now();
    match frame {
        Frame::Welcome { mac } => match (&config.secret, mac) {
            (None, None) => Ok(welcomed),
            (Some(k), Some(tag)) if auth::verify_server(k, &mine, &theirs_raw, &tag) => {
                Ok(welcomed)
            }
            (Some(_), _) => Err(TcpError::SecretMismatch { who: "listener" }.into()),
            (None, Some(_)) => Err(TcpError::UnexpectedFrame {
                got: "Welcome with a proof",
                state: "connecting without a secret",
            }
            .into()),
        },
        Frame::Error { code, message } => Err(TcpError::Rejected { code, message }.into()),
        other => Err(TcpError::UnexpectedFrame {
            got: other.frame_type().name(),
            state: "waiting for Welcome",
        }
        .into()),
    }
}

/// The listener's handshake; returns the client's `Hello` and when the `Welcome` was sent (no
/// later than the client read it: the epoch of `Begin` deadlines). On a protocol failure, or with
/// `refuse` once the client is authenticated, the peer is told why before the caller closes
/// the connection.
pub(crate) async fn server_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    config: &TcpConfig,
    refuse: Option<TcpError>,
) -> Result<(HelloFields, Instant), LinkError> {
    let r = server_handshake_inner(s, config, refuse).await;
    if let Err(LinkError::Protocol(e)) = &r {
        send_error(s, e).await;
    }
    r
}

async fn server_handshake_inner<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    config: &TcpConfig,
    refuse: Option<TcpError>,
) -> Result<(HelloFields, Instant), LinkError> {
    let idle = config.connect_timeout;
    let names = SecretNames {
        only_here: ("this listener", "connecting peer"),
        only_there: ("the connecting peer", "listener"),
    };
    let (mine, theirs_raw) = exchange_prefaces(s, config, names).await?;
    let mut buf = Vec::new();
    let frame = read_frame(s, &mut buf, 4096, &mut Silence::new(idle)).await?;
    let Frame::Hello {
        session,
        conn_index,
        conn_count,
        keepalive_ms,
        mac,
    } = frame
    else {
        return Err(TcpError::UnexpectedFrame {
            got: frame.frame_type().name(),
            state: "waiting for Hello",
        }
        .into());
    };
    let hello = HelloFields {
        session,
        conn_index,
        conn_count,
        keepalive_ms,
    };
    let proof = match (&config.secret, mac) {
        (None, None) => None,
        (Some(k), Some(tag)) => {
            if !auth::verify_client(k, &theirs_raw, &mine, hello, &tag) {
                return Err(TcpError::SecretMismatch { who: "peer" }.into());
            }
            Some(auth::server_proof(k, &theirs_raw, &mine))
        }
        (Some(_), None) => return Err(TcpError::SecretMismatch { who: "peer" }.into()),
        (None, Some(_)) => {
            return Err(TcpError::UnexpectedFrame {
                got: "Hello with a proof",
                state: "accepting without a secret",
            }
            .into());
        }
    };
    if let Some(e) = refuse {
        return Err(e.into());
    }
    let welcomed = Instant::now();
    s.write_all(&Frame::Welcome { mac: proof }.encode())
        .await
        .map_err(io_err)?;
    Ok((hello, welcomed))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limit counts from the start of each wait, whether the shared timer is moved for it
    /// or only re-armed when it fires early.
    #[tokio::test(start_paused = true)]
    async fn silence_fails_a_wait_exactly_idle_after_it_began() {
        let idle = Duration::from_secs(10);
        let mut silence = Silence::new(idle);
        // A first wait arms the timer at 10 s and is answered at once.
        assert_eq!(silence.limit(async { 7 }).await.unwrap(), 7);
        for start_after in [Duration::from_secs(4), Duration::from_secs(7)] {
            tokio::time::advance(start_after).await;
            let began = Instant::now();
            let r = silence.limit(std::future::pending::<()>()).await;
            assert!(matches!(r, Err(LinkError::Silent(d)) if d == idle), "{r:?}");
            assert_eq!(Instant::now() - began, idle, "after {start_after:?}");
        }
    }

    /// A wait that ends before the limit returns what it read, however long it took.
    #[tokio::test(start_paused = true)]
    async fn silence_lets_a_wait_shorter_than_the_limit_finish() {
        let mut silence = Silence::new(Duration::from_secs(10));
        for _ in 0..3 {
            let r = silence
                .limit(async {
                    tokio::time::sleep(Duration::from_secs(9)).await;
                    "frame"
                })
                .await;
            assert_eq!(r.unwrap(), "frame");
        }
    }
}
