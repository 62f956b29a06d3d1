//! The bytes `local_descriptor` hands out: the NIXL agent's metadata plus kvbridge's region
//! table, in an envelope that is checked whole before NIXL sees any of it.
//!
//! Layout (little-endian):
//!
//! ```text
//! "KVBNIXL1"                      magic and version (8 bytes)
//! u32 name_len, name              the agent's name (UTF-8, 1..=MAX_NAME bytes)
//! u32 count, count × region       region table (at most MAX_REGIONS entries of 29 bytes:
//!                                 u64 id, u64 addr, u64 len, u8 kind, u32 device)
//! u32 md_len, md                  NIXL's agent metadata (at most MAX_METADATA bytes)
//! [u8; 32]                        SHA-256 of everything before it
//! ```
//!
//! Every length is checked against the bytes that are actually there before anything is
//! allocated, and the digest must match, so a truncated, corrupted or oversized descriptor is
//! refused with a message and never reaches NIXL's own parser.

use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"KVBNIXL1";
/// Longest agent name accepted.
pub const MAX_NAME: usize = 256;
/// Most regions a descriptor may list.
pub const MAX_REGIONS: usize = 1 << 16;
/// Largest NIXL metadata blob accepted (64 MiB).
pub const MAX_METADATA: usize = 64 << 20;
const REGION_BYTES: usize = 8 + 8 + 8 + 1 + 4;
const DIGEST_BYTES: usize = 32;

/// One registered region of the peer, as its descriptor lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// The peer's region id.
    pub id: u64,
    /// Its address in the peer (a CPU address, or a device address for device memory).
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// `None` for host memory, `Some(device)` for device memory.
    pub device: Option<u32>,
}

/// A decoded descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    /// The peer agent's name.
    pub name: String,
    /// Its registered regions when the descriptor was made.
    pub regions: Vec<RemoteRegion>,
    /// NIXL's metadata of the agent (for `loadRemoteMD`).
    pub metadata: Vec<u8>,
}

impl Descriptor {
    /// The envelope's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            64 + self.name.len() + self.regions.len() * REGION_BYTES + self.metadata.len(),
        );
        out.extend_from_slice(MAGIC);
        put_blob(&mut out, self.name.as_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            out.extend_from_slice(&r.id.to_le_bytes());
            out.extend_from_slice(&r.addr.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
            out.push(u8::from(r.device.is_some()));
            out.extend_from_slice(&r.device.unwrap_or(0).to_le_bytes());
        }
        put_blob(&mut out, &self.metadata);
        let digest = Sha256::digest(&out);
        out.extend_from_slice(&digest);
        out
    }

    /// Parses and checks an envelope; the error says what was wrong.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() < MAGIC.len() + DIGEST_BYTES || &bytes[..MAGIC.len()] != MAGIC {
            return Err(format!(
                "{} bytes that do not start with the kvbridge-nixl magic {:?}",
                bytes.len(),
                std::str::from_utf8(MAGIC).unwrap_or_default()
            ));
        }
        let (body, digest) = bytes.split_at(bytes.len() - DIGEST_BYTES);
        if Sha256::digest(body).as_slice() != digest {
            return Err(format!(
                "the checksum of the {}-byte descriptor does not match (truncated or altered in \
                 transit)",
                bytes.len()
            ));
        }
        let mut r = Reader {
            rest: &body[MAGIC.len()..],
        };
        let name = r.blob("agent name", MAX_NAME)?;
        let name = String::from_utf8(name.to_vec())
            .map_err(|_| "the agent name is not UTF-8".to_owned())?;
        if name.is_empty() {
            return Err("the agent name is empty".to_owned());
        }
        let count = r.u32("region count")? as usize;
        if count > MAX_REGIONS {
            return Err(format!(
                "the region table lists {count} regions, more than the {MAX_REGIONS} allowed"
            ));
        }
        // Checked against the bytes present before anything is allocated.
        if r.rest.len() < count * REGION_BYTES {
            return Err(format!(
                "the region table lists {count} regions but only {} bytes follow",
                r.rest.len()
            ));
        }
        let mut regions = Vec::with_capacity(count);
        for _ in 0..count {
            let id = r.u64("region id")?;
            let addr = r.u64("region address")?;
            let len = r.u64("region length")?;
            let kind = r.u8("region kind")?;
            let device = r.u32("device id")?;
            let device = match kind {
                0 => None,
                1 => Some(device),
                other => return Err(format!("region {id} has unknown memory kind {other}")),
            };
            if addr.checked_add(len).is_none() {
                return Err(format!(
                    "region {id} at {addr:#x} of {len} bytes runs past the end of the address space"
                ));
            }
            regions.push(RemoteRegion {
                id,
                addr,
                len,
                device,
            });
        }
        let metadata = r.blob("NIXL metadata", MAX_METADATA)?.to_vec();
        if metadata.is_empty() {
            return Err("the NIXL metadata is empty".to_owned());
        }
        if !r.rest.is_empty() {
            return Err(format!(
                "{} unexpected bytes after the NIXL metadata",
                r.rest.len()
            ));
        }
        Ok(Self {
            name,
            regions,
            metadata,
        })
    }
}

fn put_blob(out: &mut Vec<u8>, blob: &[u8]) {
    out.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    out.extend_from_slice(blob);
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if self.rest.len() < n {
            return Err(format!(
                "the descriptor ends inside the {what}: {n} bytes needed, {} left",
                self.rest.len()
            ));
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn blob(&mut self, what: &str, max: usize) -> Result<&'a [u8], String> {
        let len = self.u32(what)? as usize;
        if len > max {
            return Err(format!(
                "the {what} is {len} bytes, more than the {max} allowed"
            ));
        }
        self.take(len, what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Descriptor {
        Descriptor {
            name: "kvbridge-1-2".to_owned(),
            regions: vec![
                RemoteRegion {
                    id: 1,
                    addr: 0x7000_0000,
                    len: 4096,
                    device: None,
                },
                RemoteRegion {
                    id: 2,
                    addr: 0x1_0000_0000,
                    len: 1 << 20,
                    device: Some(3),
                },
            ],
            metadata: vec![7; 300],
        }
    }

    #[test]
    fn round_trips() {
        let d = sample();
        assert_eq!(Descriptor::decode(&d.encode()).unwrap(), d);
    }

    #[test]
    fn every_truncation_is_refused() {
        let bytes = sample().encode();
        for cut in 0..bytes.len() {
            let err = Descriptor::decode(&bytes[..cut]).unwrap_err();
            assert!(!err.is_empty());
        }
    }

    #[test]
    fn huge_counts_are_refused_before_allocating() {
        // A region count of u32::MAX with a valid checksum: refused by the count check.
        let mut body = MAGIC.to_vec();
        put_blob(&mut body, b"x");
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        let digest = Sha256::digest(&body);
        body.extend_from_slice(&digest);
        let err = Descriptor::decode(&body).unwrap_err();
        assert!(err.contains("4294967295 regions"), "{err}");
        // A count within the limit but more than the bytes present.
        let mut body = MAGIC.to_vec();
        put_blob(&mut body, b"x");
        body.extend_from_slice(&1000u32.to_le_bytes());
        let digest = Sha256::digest(&body);
        body.extend_from_slice(&digest);
        let err = Descriptor::decode(&body).unwrap_err();
        assert!(err.contains("lists 1000 regions but only 0 bytes"), "{err}");
    }

    #[test]
    fn other_transports_descriptors_are_refused() {
        let err = Descriptor::decode(b"kvbridge-shm:1:abcd:/run/x").unwrap_err();
        assert!(err.contains("magic"), "{err}");
    }

    proptest! {
        #[test]
        fn altered_bytes_are_refused(flip in 0usize..400, bit in 0u8..8) {
            let mut bytes = sample().encode();
            let i = flip % bytes.len();
            bytes[i] ^= 1 << bit;
            prop_assert!(Descriptor::decode(&bytes).is_err());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Descriptor::decode(&bytes);
        }
    }
}
