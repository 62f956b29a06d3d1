//! Frame I/O over the control socket, including `SCM_RIGHTS` file-descriptor passing.
//!
//! All writes use `MSG_NOSIGNAL`, so a dead peer is an `EPIPE` error, never a `SIGPIPE` that
//! would kill a host process that did not ignore it.

use std::collections::VecDeque;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, Shutdown,
};
use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::proto::{Frame, FrameDecoder, ProtoError};

/// File descriptors received but not yet claimed by a frame, at most. A peer sending more is
/// breaking the protocol.
const MAX_PENDING_FDS: usize = 8;

/// A connected control socket shared by the tasks that write to it.
#[derive(Debug)]
pub(crate) struct Wire {
    stream: UnixStream,
    write_lock: tokio::sync::Mutex<()>,
}

/// Drops the connection if a frame write is abandoned half-way (its future dropped), so the
/// peer never parses a torn frame.
struct TornWriteGuard<'a> {
    wire: &'a Wire,
    armed: bool,
}

impl Drop for TornWriteGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.wire.shutdown();
        }
    }
}

impl Wire {
    pub(crate) fn new(stream: UnixStream) -> Self {
        Self {
            stream,
            write_lock: tokio::sync::Mutex::new(()),
        }
    }

    /// The peer's user and process id, from `SO_PEERCRED`.
    pub(crate) fn peer_cred(&self) -> io::Result<(u32, i32)> {
        let cred = rustix::net::sockopt::socket_peercred(&self.stream)?;
        Ok((cred.uid.as_raw(), cred.pid.as_raw_pid()))
    }

    /// Closes both directions; readers see end-of-file and writers `EPIPE`.
    pub(crate) fn shutdown(&self) {
        let _ = rustix::net::shutdown(&self.stream, Shutdown::Both);
    }

    /// Writes one whole frame, with `fd` attached to its first byte when given.
    pub(crate) async fn send(&self, frame: &Frame, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        let bytes = frame.encode();
        let _lock = self.write_lock.lock().await;
        let mut guard = TornWriteGuard {
            wire: self,
            armed: false,
        };
        let mut off = 0;
        let mut fd = fd;
        while off < bytes.len() {
            self.stream.writable().await?;
            let rest = &bytes[off..];
            let sent = self.stream.try_io(Interest::WRITABLE, || {
                let flags = SendFlags::NOSIGNAL | SendFlags::DONTWAIT;
                match fd {
                    Some(fd) => {
                        let fds = [fd];
                        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                        let mut control = SendAncillaryBuffer::new(&mut space);
                        control.push(SendAncillaryMessage::ScmRights(&fds));
                        rustix::net::sendmsg(
                            &self.stream,
                            &[io::IoSlice::new(rest)],
                            &mut control,
                            flags,
                        )
                    }
                    None => rustix::net::send(&self.stream, rest, flags),
                }
                .map_err(io::Error::from)
            });
            match sent {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    off += n;
                    fd = None;
                    guard.armed = off < bytes.len();
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    guard.armed = off > 0;
                    return Err(e);
                }
            }
        }
        guard.armed = false;
        Ok(())
    }
}

/// Why reading the next frame failed.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The socket failed.
    Io(io::Error),
    /// The peer broke the protocol.
    Proto(ProtoError),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Io(e) => write!(f, "control socket error: {e}"),
            ReadError::Proto(e) => write!(f, "{e}"),
        }
    }
}

/// The reading end: owned by the one task that reads a connection.
#[derive(Debug)]
pub(crate) struct WireReader {
    dec: FrameDecoder,
    fds: VecDeque<OwnedFd>,
    scratch: Box<[u8]>,
}

impl Default for WireReader {
    fn default() -> Self {
        Self {
            dec: FrameDecoder::default(),
            fds: VecDeque::new(),
            scratch: vec![0u8; 64 << 10].into_boxed_slice(),
        }
    }
}

impl WireReader {
    /// The next frame (with its file descriptor, for frames that carry one), or `None` at a clean
    /// end of file between frames.
    pub(crate) async fn next(
        &mut self,
        wire: &Wire,
    ) -> Result<Option<(Frame, Option<OwnedFd>)>, ReadError> {
        loop {
            if let Some(frame) = self.dec.next_frame().map_err(ReadError::Proto)? {
                let fd = if frame.carries_fd() {
                    Some(self.fds.pop_front().ok_or_else(|| {
                        ReadError::Proto(ProtoError(format!(
                            "a {} frame arrived without its file descriptor",
                            frame.kind_name()
                        )))
                    })?)
                } else {
                    None
                };
                return Ok(Some((frame, fd)));
            }
            wire.stream.readable().await.map_err(ReadError::Io)?;
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let scratch = &mut self.scratch;
            let got = wire.stream.try_io(Interest::READABLE, || {
                rustix::net::recvmsg(
                    &wire.stream,
                    &mut [io::IoSliceMut::new(scratch)],
                    &mut control,
                    RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
                )
                .map_err(io::Error::from)
            });
            let msg = match got {
                Ok(msg) => msg,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(ReadError::Io(e)),
            };
            for cmsg in control.drain() {
                if let RecvAncillaryMessage::ScmRights(fds) = cmsg {
                    self.fds.extend(fds);
                }
            }
            if self.fds.len() > MAX_PENDING_FDS {
                return Err(ReadError::Proto(ProtoError(format!(
                    "the peer sent {} file descriptors no frame asked for",
                    self.fds.len()
                ))));
            }
            if msg.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
                return Err(ReadError::Proto(ProtoError(
                    "the peer sent more file descriptors in one message than allowed".into(),
                )));
            }
            if msg.bytes == 0 {
                return if self.dec.buffered() == 0 {
                    Ok(None)
                } else {
                    Err(ReadError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the connection closed in the middle of a frame",
                    )))
                };
            }
            self.dec.extend(&self.scratch[..msg.bytes]);
        }
    }
}
