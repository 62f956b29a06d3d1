//! Options of a [`ShmTransport`](crate::ShmTransport).

use std::path::PathBuf;
use std::time::Duration;

/// How a [`ShmTransport`](crate::ShmTransport) is set up. Start from [`ShmOptions::default`].
///
/// ```
/// use kvbridge_shm::ShmOptions;
/// use std::time::Duration;
///
/// let options = ShmOptions::default()
///     .allow_uid(1001) // a decode server running as another user may connect too
///     .handshake_timeout(Duration::from_secs(2));
/// assert!(options.allows(1001, 1000));
/// assert!(options.allows(1000, 1000));
/// assert!(!options.allows(1002, 1000));
/// ```
#[derive(Debug, Clone)]
pub struct ShmOptions {
    pub(crate) runtime_dir: Option<PathBuf>,
    pub(crate) allow_same_uid: bool,
    pub(crate) allowed_uids: Vec<u32>,
    pub(crate) handshake_timeout: Duration,
    pub(crate) revoke_timeout: Duration,
}

impl Default for ShmOptions {
    fn default() -> Self {
        Self {
            runtime_dir: None,
            allow_same_uid: true,
            allowed_uids: Vec::new(),
            handshake_timeout: Duration::from_secs(5),
            revoke_timeout: Duration::from_secs(5),
        }
    }
}

impl ShmOptions {
    /// Directory in which the private control directory is created. Default: `$XDG_RUNTIME_DIR`
    /// when set, else the system temp directory. Its path must be short (Unix socket paths are
    /// limited to 107 bytes).
    pub fn runtime_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.runtime_dir = Some(dir.into());
        self
    }

    /// Also accepts peers running as `uid` (checked with `SO_PEERCRED` on both ends of every
    /// connection). Note that a peer running as another user also needs access to the socket
    /// directory, which is private (0700) to this user.
    pub fn allow_uid(mut self, uid: u32) -> Self {
        if !self.allowed_uids.contains(&uid) {
            self.allowed_uids.push(uid);
        }
        self
    }

    /// Whether peers running as this process's own user are accepted (default `true`). With
    /// `false`, only the uids given to [`allow_uid`](Self::allow_uid) are.
    pub fn allow_same_uid(mut self, allow: bool) -> Self {
        self.allow_same_uid = allow;
        self
    }

    /// How long connecting and the opening exchange may take (default 5 s).
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// How long `deregister` waits for a peer to confirm it stopped writing into a region it
    /// mapped (default 5 s); a peer that does not confirm in time is disconnected.
    pub fn revoke_timeout(mut self, timeout: Duration) -> Self {
        self.revoke_timeout = timeout;
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
