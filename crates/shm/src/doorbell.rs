//! The doorbell: a single-producer single-consumer ring of small frames in shared memory, with a
//! futex wake-up, so a batch's notification reaches the other process as one ring push and (only
//! when the reader sleeps) one wake.
//!
//! Each inbound connection has one ring, allocated by the receiving transport as a sealed memfd
//! (like its regions) and handed to the connecting peer with its `Welcome` frame; the peer pushes
//! notification payloads of at most [`SLOT_PAYLOAD`] bytes into it, and longer ones, or any while
//! the ring is full, go over the control socket as before. A thread of the receiving transport
//! reads the ring: it spins briefly (adaptively: longer while notifications keep arriving during
//! the spin) and then sleeps on the futex.
//!
//! Layout, in little-endian 32-bit words (all accessed atomically, through
//! [`map::with_atomic_words`]):
//!
//! | word | written by | meaning |
//! |---|---|---|
//! | 0 | producer | `tail`: frames published (wrapping) |
//! | 16 | consumer | `head`: frames consumed (wrapping) |
//! | 32 | producer | `bell`: bumped before a futex wake |
//! | 33 | consumer | `sleeping`: non-zero while the consumer may sleep on `bell` |
//! | 48 + 64·i | producer | slot `i`: payload length, then up to 252 payload bytes |
//!
//! The other process can write anything anywhere in the ring. The consumer trusts no word: it
//! keeps its own `head`, refuses a `tail` more than [`SLOTS`] frames ahead of it and a length
//! above [`SLOT_PAYLOAD`] (the connection is then dropped with that reason), and its waits are
//! bounded by a timeout, so a peer that scribbles on the futex word costs it wake-ups, never a
//! hang. The producer refuses nothing from the consumer's side either way: a `head` that makes
//! the ring look full sends the notification over the socket.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvbridge_transport::MemoryRegion;
use kvbridge_transport::sync::lock;
use rustix::thread::futex;

use crate::ShmError;
use crate::map;

/// Frames the ring holds.
pub(crate) const SLOTS: u32 = 256;
/// Words per slot: the length word and the payload.
const SLOT_WORDS: usize = 64;
/// Longest payload a slot carries.
pub(crate) const SLOT_PAYLOAD: usize = (SLOT_WORDS - 1) * 4;
const TAIL: usize = 0;
const HEAD: usize = 16;
const BELL: usize = 32;
const SLEEPING: usize = 33;
const DATA: usize = 48;
/// Words of one ring.
const RING_WORDS: usize = DATA + SLOTS as usize * SLOT_WORDS;
/// Bytes of one ring.
pub(crate) const RING_BYTES: usize = RING_WORDS * 4;
/// Shortest and longest spin of the consumer before it sleeps. Short on purpose: on a host with
/// few cores a longer spin takes the CPU the woken task needs (measured in
/// `docs/benchmarks.md`).
const SPIN_MIN: Duration = Duration::from_micros(1);
const SPIN_MAX: Duration = Duration::from_micros(5);

/// Checks that `ring` has room for a ring at `offset`.
fn check_len(ring: &MemoryRegion, offset: u64) -> Result<(), String> {
    let end = offset.saturating_add(RING_BYTES as u64);
    if (ring.len() as u64) < end {
        return Err(format!(
            "a doorbell ring needs {RING_BYTES} bytes at offset {offset}, the mapping has {}",
            ring.len()
        ));
    }
    Ok(())
}

/// The pushing end of a ring (the connecting side of a connection).
pub(crate) struct Producer {
    ring: MemoryRegion,
    offset: u64,
    /// The next frame's number; held while pushing, which serialises the posting tasks.
    tail: Mutex<u32>,
}

impl Producer {
    /// The producer of the ring at `offset` in `ring` (a fresh, zeroed ring).
    pub(crate) fn new(ring: MemoryRegion, offset: u64) -> Result<Self, String> {
        check_len(&ring, offset)?;
        Ok(Self {
            ring,
            offset,
            tail: Mutex::new(0),
        })
    }

    /// Publishes `payload` and wakes the consumer if it sleeps. `Ok(false)` when it does not go
    /// through the ring: longer than [`SLOT_PAYLOAD`], or the ring is full.
    pub(crate) fn push(&self, payload: &[u8]) -> kvbridge_transport::Result<bool> {
        if payload.len() > SLOT_PAYLOAD {
            return Ok(false);
        }
        let mut tail = lock(&self.tail);
        map::with_atomic_words(&self.ring, self.offset, RING_WORDS, |w| {
            let head = w[HEAD].load(Ordering::Acquire);
            if tail.wrapping_sub(head) >= SLOTS {
                return false;
            }
            let slot = DATA + (*tail % SLOTS) as usize * SLOT_WORDS;
            // The slice index is in bounds: SLOT_PAYLOAD fits the slot's payload words.
            w[slot].store(payload.len() as u32, Ordering::Relaxed);
            for (word, chunk) in w[slot + 1..].iter().zip(payload.chunks(4)) {
                let mut b = [0u8; 4];
                b[..chunk.len()].copy_from_slice(chunk);
                word.store(u32::from_le_bytes(b), Ordering::Relaxed);
            }
            *tail = tail.wrapping_add(1);
            w[TAIL].store(*tail, Ordering::Release);
            // Pairs with the consumer's fence between setting `sleeping` and re-reading `tail`:
            // either it sees the new frame, or this sees it sleeping and wakes it.
            fence(Ordering::SeqCst);
            if w[SLEEPING].load(Ordering::Relaxed) != 0 {
                w[BELL].fetch_add(1, Ordering::Release);
                let _ = futex::wake(&w[BELL], futex::Flags::empty(), 1);
            }
            true
        })
    }
}

#[cfg(test)]
impl Producer {
    /// Frames pushed so far.
    pub(crate) fn pushed(&self) -> u32 {
        *lock(&self.tail)
    }

    /// Writes `value` into word `word` of the ring, as a hostile process could.
    pub(crate) fn scribble(&self, word: usize, value: u32) {
        map::with_atomic_words(&self.ring, self.offset, RING_WORDS, |w| {
            w[word].store(value, Ordering::Relaxed)
        })
        .unwrap();
    }
}

/// The reading end of a ring (the accepting side of a connection).
pub(crate) struct Consumer {
    ring: MemoryRegion,
    offset: u64,
    head: u32,
    spin: Duration,
}

impl Consumer {
    /// The consumer of the ring at `offset` in `ring` (a fresh, zeroed ring).
    pub(crate) fn new(ring: MemoryRegion, offset: u64) -> Result<Self, String> {
        check_len(&ring, offset)?;
        Ok(Self {
            ring,
            offset,
            head: 0,
            spin: SPIN_MIN,
        })
    }

    /// The next payload, waiting up to `timeout` for it (`None` if none came). An error says
    /// how the other process broke the ring.
    pub(crate) fn next(&mut self, timeout: Duration) -> Result<Option<Bytes>, String> {
        let (ring, offset) = (self.ring.clone(), self.offset);
        map::with_atomic_words(&ring, offset, RING_WORDS, |w| self.wait(w, timeout))
            .map_err(|e| e.to_string())?
    }

    fn wait(&mut self, w: &[AtomicU32], timeout: Duration) -> Result<Option<Bytes>, String> {
        let start = Instant::now();
        let deadline = start + timeout;
        let spin_until = start + self.spin;
        let mut slept = false;
        loop {
            if let Some(payload) = self.take(w)? {
                // Adapt the spin: longer while frames arrive during it, shorter once they come
                // only after a sleep.
                self.spin = if slept {
                    (self.spin / 2).max(SPIN_MIN)
                } else {
                    (self.spin * 2).min(SPIN_MAX)
                };
                return Ok(Some(payload));
            }
            let now = Instant::now();
            if !slept && now < spin_until {
                std::hint::spin_loop();
                continue;
            }
            if now >= deadline {
                return Ok(None);
            }
            let bell = w[BELL].load(Ordering::Acquire);
            w[SLEEPING].store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if w[TAIL].load(Ordering::Acquire) == self.head {
                let left = deadline - now;
                let ts = futex::Timespec {
                    tv_sec: left.as_secs() as _,
                    tv_nsec: left.subsec_nanos() as _,
                };
                // Any outcome (woken, the word changed, timed out, interrupted) re-checks the
                // ring; the deadline bounds the loop.
                let _ = futex::wait(&w[BELL], futex::Flags::empty(), bell, Some(&ts));
            }
            w[SLEEPING].store(0, Ordering::Relaxed);
            slept = true;
        }
    }

    /// Takes the next frame, if one is published.
    fn take(&mut self, w: &[AtomicU32]) -> Result<Option<Bytes>, String> {
        let tail = w[TAIL].load(Ordering::Acquire);
        let ahead = tail.wrapping_sub(self.head);
        if ahead == 0 {
            return Ok(None);
        }
        if ahead > SLOTS {
            return Err(format!(
                "its tail claims {ahead} unread frames, but the ring holds {SLOTS}"
            ));
        }
        let slot = DATA + (self.head % SLOTS) as usize * SLOT_WORDS;
        let len = w[slot].load(Ordering::Relaxed) as usize;
        if len > SLOT_PAYLOAD {
            return Err(format!(
                "frame {} claims {len} payload bytes, but a slot holds {SLOT_PAYLOAD}",
                self.head
            ));
        }
        let mut out = Vec::with_capacity(len.div_ceil(4) * 4);
        for word in &w[slot + 1..slot + 1 + len.div_ceil(4)] {
            out.extend_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        out.truncate(len);
        self.head = self.head.wrapping_add(1);
        // The slot is copied out: the producer may reuse it.
        w[HEAD].store(self.head, Ordering::Release);
        Ok(Some(Bytes::from(out)))
    }
}

/// Two doorbell rings, one each way, between two processes: the wake-up round trip the
/// transport's notifications are built on, on its own. `kvbridge-lab bench --transport shm` measures
/// it as the baseline of its `latency-4k` row.
///
/// ```
/// use kvbridge_shm::DoorbellPair;
/// use std::time::Duration;
///
/// let (a, fd) = DoorbellPair::create().unwrap();
/// // Usually in another process, which received `fd` (e.g. as its stdin).
/// let mut b = DoorbellPair::open(fd).unwrap();
/// a.ring(b"ping").unwrap();
/// let got = b.wait(Duration::from_secs(5)).unwrap();
/// assert_eq!(got.as_deref(), Some(&b"ping"[..]));
/// ```
pub struct DoorbellPair {
    out: Producer,
    incoming: Consumer,
}

impl std::fmt::Debug for DoorbellPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DoorbellPair")
            .field("rings_at", &(self.out.offset, self.incoming.offset))
            .finish()
    }
}

impl DoorbellPair {
    /// Creates the shared memory of a pair; returns this process's end and the file to hand to
    /// the other process, which opens its end with [`open`](Self::open).
    pub fn create() -> Result<(Self, OwnedFd), ShmError> {
        let ring = map::allocate(2 * RING_BYTES)?;
        let fd = map::shared_of(&ring)
            .ok_or_else(|| ShmError::Map {
                what: "allocating a doorbell pair".into(),
                source: std::io::Error::other("the allocation is not shared memory"),
            })?
            .fd()
            .try_clone_to_owned()
            .map_err(|source| ShmError::Map {
                what: "duplicating a doorbell pair's file".into(),
                source,
            })?;
        Ok((Self::ends(ring, 0, RING_BYTES as u64)?, fd))
    }

    /// The other process's end of a pair made by [`create`](Self::create). The file is checked
    /// like a peer's region (a sealed, fully allocated memfd) before it is mapped.
    pub fn open(fd: OwnedFd) -> Result<Self, ShmError> {
        let ring = map::map_remote(0, fd, 2 * RING_BYTES as u64)?;
        Self::ends(ring, RING_BYTES as u64, 0)
    }

    fn ends(ring: MemoryRegion, out: u64, incoming: u64) -> Result<Self, ShmError> {
        let bad = |reason: String| ShmError::UnsafeRemoteRegion { region: 0, reason };
        Ok(Self {
            out: Producer::new(ring.clone(), out).map_err(bad)?,
            incoming: Consumer::new(ring, incoming).map_err(bad)?,
        })
    }

    /// Sends `payload` (at most 252 bytes) to the other end, waking it if it sleeps.
    pub fn ring(&self, payload: &[u8]) -> Result<(), ShmError> {
        let refused = |reason: String| ShmError::Doorbell { reason };
        match self.out.push(payload) {
            Ok(true) => Ok(()),
            Ok(false) => Err(refused(format!(
                "{} bytes do not fit (at most {SLOT_PAYLOAD} bytes, and at most {SLOTS} unread \
                 frames)",
                payload.len()
            ))),
            Err(e) => Err(refused(e.to_string())),
        }
    }

    /// The next payload from the other end, waiting up to `timeout` (`None` if none came).
    pub fn wait(&mut self, timeout: Duration) -> Result<Option<Bytes>, ShmError> {
        self.incoming
            .next(timeout)
            .map_err(|reason| ShmError::Doorbell { reason })
    }
}

/// The file behind a ring, to hand to the peer.
pub(crate) fn ring_fd(ring: &MemoryRegion) -> Option<OwnedFd> {
    map::shared_of(ring)?.fd().as_fd().try_clone_to_owned().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The consumer's ring, and a second mapping of it (what the other process maps).
    fn mappings() -> (MemoryRegion, MemoryRegion) {
        let ring = map::allocate(RING_BYTES).unwrap();
        let other = map::map_remote(0, ring_fd(&ring).unwrap(), RING_BYTES as u64).unwrap();
        (ring, other)
    }

    fn pair() -> (Producer, Consumer) {
        let (ring, other) = mappings();
        (
            Producer::new(other, 0).unwrap(),
            Consumer::new(ring, 0).unwrap(),
        )
    }

    #[test]
    fn payloads_round_trip_in_order_and_the_ring_fills_up() {
        let (p, mut c) = pair();
        for round in 0..3u32 {
            for i in 0..SLOTS {
                let payload = vec![(i + round) as u8; (i as usize) % (SLOT_PAYLOAD + 1)];
                assert!(p.push(&payload).unwrap(), "frame {i} of round {round}");
            }
            assert!(
                !p.push(b"one too many").unwrap(),
                "a full ring takes nothing"
            );
            for i in 0..SLOTS {
                let want = vec![(i + round) as u8; (i as usize) % (SLOT_PAYLOAD + 1)];
                assert_eq!(c.next(Duration::ZERO).unwrap().unwrap(), want);
            }
            assert_eq!(c.next(Duration::from_millis(1)).unwrap(), None);
        }
        assert!(!p.push(&[0; SLOT_PAYLOAD + 1]).unwrap());
    }

    #[test]
    fn a_sleeping_consumer_is_woken_by_another_thread() {
        let (p, mut c) = pair();
        let reader = std::thread::spawn(move || c.next(Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(p.push(b"wake up").unwrap());
        let got = reader.join().unwrap().unwrap();
        assert_eq!(got.as_deref(), Some(&b"wake up"[..]));
    }

    /// Garbage written by the other process into the ring is a clear error, never a panic, an
    /// out-of-bounds read or a hang.
    #[test]
    fn a_scribbled_ring_is_an_error() {
        let (ring, peer) = mappings();
        let mut c = Consumer::new(ring, 0).unwrap();
        let set = |word: usize, value: u32| {
            map::with_atomic_words(&peer, 0, RING_WORDS, |w| {
                w[word].store(value, Ordering::Relaxed)
            })
            .unwrap()
        };
        set(TAIL, SLOTS + 1);
        let err = c.next(Duration::ZERO).unwrap_err();
        assert!(err.contains("claims 257 unread frames"), "{err}");
        set(TAIL, 1);
        set(DATA, u32::MAX);
        let err = c.next(Duration::ZERO).unwrap_err();
        assert!(err.contains("claims 4294967295 payload bytes"), "{err}");
        // A futex word that keeps changing only ends the wait at its deadline.
        set(DATA, 3);
        set(TAIL, 0);
        set(BELL, 12345);
        assert_eq!(c.next(Duration::from_millis(5)).unwrap(), None);
        // A consumer's head that makes the ring look full sends the frame elsewhere.
        let p = Producer::new(peer.clone(), 0).unwrap();
        set(HEAD, 5);
        assert!(!p.push(b"x").unwrap());
        assert!(check_len(&peer, 1).is_err());
    }

    #[test]
    fn a_pair_rings_both_ways_through_a_second_mapping() {
        let (mut a, fd) = DoorbellPair::create().unwrap();
        let mut b = DoorbellPair::open(fd).unwrap();
        a.ring(b"ping").unwrap();
        assert_eq!(
            b.wait(Duration::from_secs(5)).unwrap().as_deref(),
            Some(&b"ping"[..])
        );
        b.ring(b"pong").unwrap();
        assert_eq!(
            a.wait(Duration::from_secs(5)).unwrap().as_deref(),
            Some(&b"pong"[..])
        );
        let err = a.ring(&[0; SLOT_PAYLOAD + 1]).unwrap_err().to_string();
        assert!(err.contains("253 bytes do not fit"), "{err}");
    }
}
