//! The peer descriptor: plain UTF-8 text, so it can travel inside a JSON handshake unchanged.
//!
//! Format: `kvbridge-shm:1:<token as 32 lowercase hex digits>:<absolute socket path>`.

use std::path::{Path, PathBuf};

/// Prefix and format version of every descriptor.
pub(crate) const PREFIX: &str = "kvbridge-shm:1:";
/// Length of the random token that names one transport instance.
pub(crate) const TOKEN_LEN: usize = 16;

/// A parsed descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Descriptor {
    pub(crate) token: [u8; TOKEN_LEN],
    pub(crate) socket: PathBuf,
}

impl Descriptor {
    /// Encodes the descriptor; `None` when the socket path is not UTF-8.
    pub(crate) fn encode(&self) -> Option<String> {
        let path = self.socket.to_str()?;
        let mut out = String::with_capacity(PREFIX.len() + 2 * TOKEN_LEN + 1 + path.len());
        out.push_str(PREFIX);
        for b in self.token {
            out.push_str(&format!("{b:02x}"));
        }
        out.push(':');
        out.push_str(path);
        Some(out)
    }

    /// Parses a descriptor, saying what is wrong when it cannot.
    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, String> {
        let text = std::str::from_utf8(bytes)
            .map_err(|e| format!("it is not UTF-8 text ({e}, {} bytes)", bytes.len()))?;
        let rest = text.strip_prefix(PREFIX).ok_or_else(|| {
            format!(
                "it does not start with `{PREFIX}` (starts with {:?})",
                text.chars().take(PREFIX.len()).collect::<String>()
            )
        })?;
        let (hex, path) = rest
            .split_once(':')
            .ok_or_else(|| "it has no `:` between the token and the socket path".to_owned())?;
        if hex.len() != 2 * TOKEN_LEN || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(format!(
                "its token must be {} hex digits (got {hex:?})",
                2 * TOKEN_LEN
            ));
        }
        let mut token = [0u8; TOKEN_LEN];
        for (i, slot) in token.iter_mut().enumerate() {
            *slot = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|e| format!("bad token digit in {hex:?}: {e}"))?;
        }
        if !Path::new(path).is_absolute() || path.contains('\0') {
            return Err(format!(
                "its socket path must be absolute and free of NUL bytes (got {path:?})"
            ));
        }
        Ok(Self {
            token,
            socket: PathBuf::from(path),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_is_utf8() {
        let d = Descriptor {
            token: [0xab; TOKEN_LEN],
            socket: PathBuf::from("/run/user/1000/kvbridge-shm-1-x/ctl.sock"),
        };
        let text = d.encode().unwrap();
        assert!(text.starts_with("kvbridge-shm:1:abab"));
        assert_eq!(Descriptor::parse(text.as_bytes()).unwrap(), d);
        // A path holding ':' still round-trips: the path is everything after the token.
        let d2 = Descriptor {
            token: [1; TOKEN_LEN],
            socket: PathBuf::from("/tmp/a:b/ctl.sock"),
        };
        assert_eq!(
            Descriptor::parse(d2.encode().unwrap().as_bytes()).unwrap(),
            d2
        );
    }

    #[test]
    fn rejects_garbage_with_reasons() {
        let cases: &[(&[u8], &str)] = &[
            (b"\xff\xfe", "not UTF-8"),
            (b"tcp:127.0.0.1:80", "does not start with"),
            (b"kvbridge-shm:1:abcd", "no `:`"),
            (b"kvbridge-shm:1:zz:/tmp/x", "hex digits"),
            (
                b"kvbridge-shm:1:00000000000000000000000000000000:relative/path",
                "absolute",
            ),
        ];
        for (input, want) in cases {
            let err = Descriptor::parse(input).unwrap_err();
            assert!(err.contains(want), "{input:?}: {err}");
        }
    }
}
