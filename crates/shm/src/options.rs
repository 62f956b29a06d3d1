//! Options of a [`ShmTransport`](crate::ShmTransport).

use std::path::PathBuf;
use std::time::Duration;

/// How a [`ShmTransport`](crate::ShmTransport) is set up. Start from [`ShmOptions::default`]
/// and change fields with the `with_*` builders.
///
/// ```
/// use kvbridge_shm::ShmOptions;
/// use std::time::Duration;
///
/// let options = ShmOptions::default()
///     .with_allowed_uids([1001]) // a decode server running as another user may connect too
///     .with_handshake_timeout(Duration::from_secs(2));
/// assert!(options.allows(1001, 1000));
/// assert!(options.allows(1000, 1000));
/// assert!(!options.allows(1002, 1000));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ShmOptions {
    /// Directory in which the private control directory is created. Default `None`:
    /// `$XDG_RUNTIME_DIR` when set, else the system temp directory. Its path must be short
    /// (Unix socket paths are limited to 107 bytes).
    pub runtime_dir: Option<PathBuf>,
    /// Whether peers running as this process's own user are accepted (default `true`). With
    /// `false`, only the uids in [`allowed_uids`](Self::allowed_uids) are.
    pub allow_same_uid: bool,
    /// Other users whose peers are accepted (checked with `SO_PEERCRED` on both ends of every
    /// connection). A peer running as another user also needs access to the socket directory,
    /// which is private (0700) to this user. Default: none.
    pub allowed_uids: Vec<u32>,
    /// How long connecting and the opening exchange may take (default 5 s).
    pub handshake_timeout: Duration,
    /// How long `deregister` waits for a peer to confirm it stopped writing into a region it
    /// mapped (default 5 s); a peer that does not confirm in time is disconnected.
    pub revoke_timeout: Duration,
    /// Inbound control connections served at once, handshakes included (default 256). Each
    /// accepted peer costs a doorbell ring (64 KiB of shared memory) and two file descriptors;
    /// no thread (one thread reads every ring). A peer that finds every slot taken waits up to
    /// [`handshake_timeout`](Self::handshake_timeout) for one, while the longest-idle
    /// connection is evicted if it has been idle for
    /// [`evict_idle_after`](Self::evict_idle_after); otherwise it is refused with a reason that
    /// names this limit.
    pub max_inbound_connections: usize,
    /// How long an inbound connection must have sent nothing before it may be evicted to make
    /// room for a new peer when every slot is taken (default 1 s). The evicted peer is told why.
    pub evict_idle_after: Duration,
}

impl Default for ShmOptions {
    fn default() -> Self {
        Self {
            runtime_dir: None,
            allow_same_uid: true,
            allowed_uids: Vec::new(),
            handshake_timeout: Duration::from_secs(5),
            revoke_timeout: Duration::from_secs(5),
            max_inbound_connections: 256,
            evict_idle_after: Duration::from_secs(1),
        }
    }
}

impl ShmOptions {
    /// Sets [`runtime_dir`](Self::runtime_dir).
    pub fn with_runtime_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.runtime_dir = Some(dir.into());
        self
    }

    /// Sets [`allow_same_uid`](Self::allow_same_uid).
    pub fn with_allow_same_uid(mut self, allow: bool) -> Self {
        self.allow_same_uid = allow;
        self
    }

    /// Sets [`allowed_uids`](Self::allowed_uids).
    pub fn with_allowed_uids(mut self, uids: impl IntoIterator<Item = u32>) -> Self {
        self.allowed_uids = uids.into_iter().collect();
        self
    }

    /// Sets [`handshake_timeout`](Self::handshake_timeout).
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Sets [`revoke_timeout`](Self::revoke_timeout).
    pub fn with_revoke_timeout(mut self, timeout: Duration) -> Self {
        self.revoke_timeout = timeout;
        self
    }

    /// Sets [`max_inbound_connections`](Self::max_inbound_connections).
    pub fn with_max_inbound_connections(mut self, n: usize) -> Self {
        self.max_inbound_connections = n;
        self
    }

    /// Sets [`evict_idle_after`](Self::evict_idle_after).
    pub fn with_evict_idle_after(mut self, idle: Duration) -> Self {
        self.evict_idle_after = idle;
        self
    }

    /// Whether a peer running as `peer_uid` is accepted by a process running as `own_uid`.
    pub fn allows(&self, peer_uid: u32, own_uid: u32) -> bool {
        (self.allow_same_uid && peer_uid == own_uid) || self.allowed_uids.contains(&peer_uid)
    }

    pub(crate) fn describe_allowed(&self, own_uid: u32) -> String {
        let mut uids: Vec<String> = Vec::new();
        if self.allow_same_uid {
            uids.push(format!("{own_uid} (this process's user)"));
        }
        uids.extend(self.allowed_uids.iter().map(u32::to_string));
        if uids.is_empty() {
            "no uid at all".to_owned()
        } else {
            format!("uid {}", uids.join(", "))
        }
    }
}
