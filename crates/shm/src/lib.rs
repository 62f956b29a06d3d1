//! `kvbridge-shm`: a [`KvTransport`](kvbridge_transport::KvTransport) between processes on one
//! host, through shared memory, at close to `memcpy` speed.
//!
//! # How it works
//!
//! - **Regions peers write into are shared memory.** [`ShmTransport`]'s
//!   [`allocate`](kvbridge_transport::KvTransport::allocate) creates an anonymous `memfd`
//!   (nothing in `/dev/shm` or on disk), sizes and fully allocates it, seals it against
//!   shrinking and growing (so no peer can truncate it and make the other side fault), maps it
//!   shared with page tables populated for writing, and asks for transparent huge pages. Memory
//!   that was not allocated this way (heap, engine memory) can still be registered, as a source
//!   of writes or a target of reads; a peer that tries to write into it gets a clear error.
//! - **Control runs over a Unix socket** in a private directory (mode 0700, socket 0600) under
//!   `$XDG_RUNTIME_DIR` or the temp directory, removed on [`shutdown`] and on drop. Both ends
//!   check each other's credentials (`SO_PEERCRED`: same user by default, plus an allow-list,
//!   see [`ShmOptions`]) and the connecting side must present the random token of the
//!   descriptor.
//! - **The writer maps the peer's regions once**: on first use it asks for the region, receives
//!   its file descriptor (`SCM_RIGHTS`), checks the file (a sealed, fully allocated memfd at
//!   least as long as declared) and maps it. Regions registered after `connect` are fetched the
//!   same way when a batch first names them.
//! - **A write is a direct copy** by the posting process into its mapping of the peer's region,
//!   on a dedicated copy thread (never on the async executor), in chunks of at most 1 MiB
//!   (a batch of at most 64 KiB is copied, and its notification written, by the posting task:
//!   a hand-off would cost more than the copy);
//!   between chunks it checks cancel, the deadline and the peer's liveness, so a cancelled or
//!   late batch stops promptly and no byte of it lands afterwards. Completion is local; a
//!   batch's notification is sent only after all its bytes were copied.
//! - **Strided ops are native**
//!   ([`Capabilities::strided_ops`](kvbridge_transport::Capabilities::strided_ops)): an op of
//!   many rows stays one descriptor, every row of it is bounds-checked at `post` before any byte
//!   moves, and the rows of a chunk are copied in one loop inside one claim per side.
//! - **Short notifications ring a doorbell.** Each connection has a ring of small frames in
//!   shared memory (allocated by the accepting side, handed over at connect); a notification of
//!   at most 252 bytes is one push into it plus, only when the reader sleeps, one futex wake.
//!   One thread of the receiving transport reads the rings of all its connections (a short
//!   spin, then one futex word every peer can wake) and trusts none of them: a peer that
//!   writes garbage there loses its connection. Longer notifications go over the socket.
//! - **Idle connections cost little and lock nobody out**: no thread per connection; a
//!   connection without `Hello` by the handshake timeout is closed, and when every slot
//!   ([`ShmOptions::max_inbound_connections`]) is taken, the connection idle longest (at least
//!   [`ShmOptions::evict_idle_after`]) makes room for a new peer.
//! - **Peer loss**: end of file or an error on the socket fails the peer's pending batches with
//!   [`TransportError::PeerLost`](kvbridge_transport::TransportError::PeerLost) at once (and by
//!   their deadline at the latest).
//!
//! [`shutdown`]: kvbridge_transport::KvTransport::shutdown
//!
//! # Descriptor
//!
//! [`local_descriptor`](kvbridge_transport::KvTransport::local_descriptor) is UTF-8 text,
//! `kvbridge-shm:1:<32 hex digits of token>:<absolute socket path>`, so it can travel inside a
//! JSON handshake as a string.
//!
//! # Example
//!
//! ```
//! use kvbridge_shm::ShmTransport;
//! use kvbridge_transport::{KvTransport, KvTransportExt, TransferBatch, TransferOp};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> kvbridge_transport::Result<()> {
//! let decode = ShmTransport::new()?; // usually in another process
//! let (dst_id, dst) = decode.allocate_registered(1 << 20).await?;
//!
//! let prefill = ShmTransport::new()?;
//! let (src_id, src) = prefill.allocate_registered(1 << 20).await?;
//! src.fill(0, 4096, 7).unwrap();
//! let peer = prefill.connect(&decode.local_descriptor()).await?;
//! let op = TransferOp::new(src_id, 0, dst_id, 8192, 4096);
//! prefill
//!     .transfer(peer, TransferBatch::write(vec![op]).with_notification("chunk 0".into()))
//!     .await?;
//! let note = decode.recv_notification().await?;
//! assert_eq!(&note.payload[..], b"chunk 0");
//! assert_eq!(dst.to_vec(8192, 4096).unwrap(), vec![7; 4096]);
//! # Ok(())
//! # }
//! ```
//!
//! # Trust
//!
//! A peer that maps a region can write all of it at any time, as with any shared memory: the
//! transport guarantees that *it* never writes outside a registered range, and after
//! `deregister` returns, that the peer's transport no longer writes into the region. It cannot
//! stop a hostile process of an accepted user; the credential check and the private directory
//! are what keep other users out.

pub mod baseline;
mod descriptor;
mod dir;
mod doorbell;
mod error;
mod map;
mod options;
mod proto;
mod transport;
mod wire;

pub use doorbell::DoorbellPair;
pub use error::ShmError;
pub use options::ShmOptions;
pub use transport::ShmTransport;

/// The transport's name, as returned by `KvTransport::name`.
pub const NAME: &str = "shm";
