//! The private directory holding the control socket: mode 0700, socket 0600, removed on drop.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Longest socket path the kernel accepts (`sun_path` is 108 bytes including the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// `N` random bytes (kvbridge-auth, the project's one random source).
pub(crate) fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    kvbridge_auth::random_bytes(&mut out);
    out
}

/// The directory `$XDG_RUNTIME_DIR` (if set and a directory) or the system temp directory.
pub(crate) fn default_base() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute() && p.is_dir())
        .unwrap_or_else(std::env::temp_dir)
}

/// Whether process `pid` still runs: it exists and is not a zombie (a killed process stays in
/// `/proc` until its parent reaps it, but it will never clean up again).
fn runs(pid: u32) -> bool {
    match fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_none_or(|state| !matches!(state, 'Z' | 'X')),
        Err(_) => Path::new("/proc").join(pid.to_string()).exists(),
    }
}

/// Removes control directories in `base` left behind by processes of this user that died
/// without cleaning up (killed, crashed): `kvbridge-shm-<pid>-*` whose `<pid>` no longer runs.
/// Only the socket and the then-empty directory are removed; anything else is left alone.
pub(crate) fn sweep_stale(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else {
        return;
    };
    let own_uid = rustix::process::geteuid().as_raw();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("kvbridge-shm-"))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || runs(pid) {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.is_dir() || std::os::unix::fs::MetadataExt::uid(&meta) != own_uid {
            continue;
        }
        let _ = fs::remove_file(path.join("ctl.sock"));
        if fs::remove_dir(&path).is_ok() {
            tracing::debug!(dir = %path.display(), "shm: removed the control directory of a dead process");
        }
    }
}

/// A freshly created private directory with a socket path inside; both are removed on drop.
#[derive(Debug)]
pub(crate) struct PrivateDir {
    dir: PathBuf,
    socket: PathBuf,
}

impl PrivateDir {
    /// Creates `<base>/kvbridge-shm-<pid>-<random>` with mode 0700.
    pub(crate) fn create(base: &Path) -> io::Result<Self> {
        let base = if base.is_absolute() {
            base.to_path_buf()
        } else {
            std::env::current_dir()?.join(base)
        };
        for _ in 0..8 {
            let tag: [u8; 6] = random_bytes();
            let tag: String = tag.iter().map(|b| format!("{b:02x}")).collect();
            let dir = base.join(format!("kvbridge-shm-{}-{tag}", std::process::id()));
            match fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
            // The umask can only clear bits, but say the mode explicitly anyway.
            let made = Self {
                socket: dir.join("ctl.sock"),
                dir,
            };
            fs::set_permissions(&made.dir, fs::Permissions::from_mode(0o700))?;
            if made.socket.as_os_str().len() > MAX_SOCKET_PATH {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "the socket path {} is {} bytes; Unix sockets allow {MAX_SOCKET_PATH}",
                        made.socket.display(),
                        made.socket.as_os_str().len()
                    ),
                ));
            }
            return Ok(made);
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "could not find a fresh directory name after 8 tries",
        ))
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn socket(&self) -> &Path {
        &self.socket
    }

    /// Removes the socket and the directory (idempotent).
    pub(crate) fn remove(&self) {
        let _ = fs::remove_file(&self.socket);
        let _ = fs::remove_dir(&self.dir);
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        self.remove();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn directory_is_private_and_removed_on_drop() {
        let base = std::env::temp_dir();
        let d = PrivateDir::create(&base).unwrap();
        let meta = fs::metadata(d.dir()).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o700);
        assert!(d.socket().starts_with(d.dir()));
        let dir = d.dir().to_path_buf();
        drop(d);
        assert!(!dir.exists());
    }

    #[test]
    fn stale_directories_of_dead_processes_are_swept() {
        let base = std::env::temp_dir().join(format!("kvb-sweep-{}", std::process::id()));
        fs::create_dir_all(&base).unwrap();
        // pid_max is at most 2^22, so this pid cannot be running.
        let dead = base.join("kvbridge-shm-4999999-abcdef");
        fs::create_dir(&dead).unwrap();
        fs::write(dead.join("ctl.sock"), b"").unwrap();
        let live = base.join(format!("kvbridge-shm-{}-abcdef", std::process::id()));
        fs::create_dir(&live).unwrap();
        let kept = base.join("kvbridge-shm-4999998-abcdef");
        fs::create_dir(&kept).unwrap();
        fs::write(kept.join("other-file"), b"").unwrap();
        sweep_stale(&base);
        assert!(!dead.exists());
        assert!(live.exists(), "a live process's directory is kept");
        assert!(kept.exists(), "a directory holding unknown files is kept");
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn overlong_base_is_refused() {
        let base = std::env::temp_dir().join("x".repeat(120));
        fs::create_dir_all(&base).unwrap();
        let err = PrivateDir::create(&base).unwrap_err();
        fs::remove_dir_all(&base).unwrap();
        assert!(err.to_string().contains("Unix sockets allow"), "{err}");
    }
}
