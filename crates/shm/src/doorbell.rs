//! The doorbell: a single-producer single-consumer ring of small frames in shared memory, with a
//! futex wake-up, so a batch's notification reaches the other process as one ring push and (only
//! when the reader sleeps) one wake.
//!
//! Each inbound connection has one ring, allocated by the receiving transport as a sealed memfd
//! (like its regions) and handed to the connecting peer with its `Welcome` frame; the peer pushes
//! notification payloads of at most [`SLOT_PAYLOAD`] bytes into it, and longer ones, or any while
//! the ring is full, go over the control socket as before. One thread of the receiving transport
//! reads every ring (the [`Hub`]): it spins briefly (adaptively: longer while notifications keep
//! arriving during the spin) and then sleeps on one futex word, in a bell page of its own that
//! every connecting peer maps too (sent with the `Bell` frame after `Welcome`), so a thousand
//! idle connections cost no thread and no wake-up. A [`DoorbellPair`] keeps the futex word in
//! its ring.
//!
//! Layout, in little-endian 32-bit words (all accessed atomically, through
//! [`map::with_atomic_words`]):
//!
//! | word | written by | meaning |
//! |---|---|---|
//! | 0 | producer | `tail`: frames published (wrapping) |
//! | 16 | consumer | `head`: frames consumed (wrapping) |
//! | 32 | producer | `bell`: bumped before a futex wake (without a bell page) |
//! | 33 | consumer | `sleeping`: non-zero while the consumer may sleep on `bell` |
//! | 48 + 64·i | producer | slot `i`: payload length, then up to 252 payload bytes |
//!
//! The other process can write anything anywhere in the ring. The consumer trusts no word: it
//! keeps its own `head`, refuses a `tail` more than [`SLOTS`] frames ahead of it and a length
//! above [`SLOT_PAYLOAD`] (the connection is then dropped with that reason), and its waits are
//! bounded by a timeout, so a peer that scribbles on the futex word costs it wake-ups, never a
//! hang; a peer that scribbles on the shared bell page costs the hub spurious wake-ups (a scan
//! of every ring), never a lost frame. The producer refuses nothing from the consumer's side either way: a `head` that makes
//! the ring look full sends the notification over the socket.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};
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

/// Words of a bell page: the one futex word a [`Hub`] sleeps on.
const BELL_PAGE_WORDS: usize = 1;
/// Bytes of a bell page (one page, the mapping's unit).
pub(crate) const BELL_PAGE_BYTES: usize = 4096;

/// Bumps a futex word and wakes its one sleeper.
fn wake(word: &AtomicU32) {
    word.fetch_add(1, Ordering::Release);
    let _ = futex::wake(word, futex::Flags::empty(), 1);
}

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
    /// The consumer's bell page, whose word 0 is bumped and woken instead of the ring's `bell`
    /// (the transport's connections; a [`DoorbellPair`] has none).
    bell_page: Option<MemoryRegion>,
}

impl Producer {
    /// The producer of the ring at `offset` in `ring` (a fresh, zeroed ring).
    pub(crate) fn new(ring: MemoryRegion, offset: u64) -> Result<Self, String> {
        check_len(&ring, offset)?;
        Ok(Self {
            ring,
            offset,
            tail: Mutex::new(0),
            bell_page: None,
        })
    }

    /// The producer of a transport connection's ring, whose consumer sleeps on `bell_page`.
    pub(crate) fn with_bell_page(
        ring: MemoryRegion,
        offset: u64,
        bell_page: MemoryRegion,
    ) -> Result<Self, String> {
        if bell_page.len() < BELL_PAGE_WORDS * 4 {
            return Err(format!(
                "a bell page needs {} bytes, the mapping has {}",
                BELL_PAGE_WORDS * 4,
                bell_page.len()
            ));
        }
        Ok(Self {
            bell_page: Some(bell_page),
            ..Self::new(ring, offset)?
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
                match &self.bell_page {
                    None => wake(&w[BELL]),
                    // A bell page that cannot be claimed (never: only this push touches this
                    // mapping of it) leaves the frame to the hub's next timed look.
                    Some(page) => {
                        let _ = map::with_atomic_words(page, 0, BELL_PAGE_WORDS, |b| wake(&b[0]));
                    }
                }
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

    /// The next payload if one is published, without waiting. An error says how the other
    /// process broke the ring.
    pub(crate) fn try_next(&mut self) -> Result<Option<Bytes>, String> {
        let (ring, offset) = (self.ring.clone(), self.offset);
        map::with_atomic_words(&ring, offset, RING_WORDS, |w| self.take(w))
            .map_err(|e| e.to_string())?
    }

    /// Tells the producer whether this side may sleep (so it wakes the bell after a push).
    /// Returns, after setting it, whether a frame is already waiting: then do not sleep.
    fn set_sleeping(&self, sleeping: bool) -> Result<bool, String> {
        map::with_atomic_words(&self.ring, self.offset, RING_WORDS, |w| {
            w[SLEEPING].store(u32::from(sleeping), Ordering::Relaxed);
            // Pairs with the producer's fence between publishing `tail` and reading `sleeping`.
            fence(Ordering::SeqCst);
            w[TAIL].load(Ordering::Acquire) != self.head
        })
        .map_err(|e| e.to_string())
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

/// How long the hub sleeps at most before it looks again (for a closed transport, lost
/// connections and a wake-up the bell page missed).
const HUB_CHECK: Duration = Duration::from_millis(100);

/// The reading end of every ring of one transport: one thread ([`Hub::run`]) takes the frames
/// of all of them and sleeps on the single futex word of the hub's bell page, which every
/// producer wakes. Connections join with [`Hub::ring`] and [`Hub::join`] and leave when
/// `alive` says so or their ring breaks.
pub(crate) struct Hub<K> {
    /// The bell page, mapped here; its file goes to every connecting peer.
    page: MemoryRegion,
    joining: Mutex<Vec<(K, Consumer)>>,
    closed: AtomicBool,
}

/// What [`Hub::run`] does with a payload: go on, or stop (the transport is gone).
pub(crate) enum Delivered {
    Yes,
    Stop,
}

impl<K> Hub<K> {
    /// A hub with a fresh bell page.
    pub(crate) fn new() -> Result<Self, ShmError> {
        Ok(Self {
            page: map::allocate(BELL_PAGE_BYTES)?,
            joining: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        })
    }

    /// The file of the bell page, to hand to a connecting peer.
    pub(crate) fn page_fd(&self) -> Option<OwnedFd> {
        ring_fd(&self.page)
    }

    /// A fresh ring for a new connection and its consumer, marked asleep so that the peer's
    /// first push wakes the hub even before the ring joins.
    pub(crate) fn ring(&self) -> Result<(MemoryRegion, Consumer), String> {
        let ring = map::allocate(RING_BYTES).map_err(|e| e.to_string())?;
        let consumer = Consumer::new(ring.clone(), 0)?;
        consumer.set_sleeping(true)?;
        Ok((ring, consumer))
    }

    /// Adds a connection's ring to the ones the hub reads. Join before the peer learns of the
    /// ring: its first push (the ring is marked asleep) wakes the hub, which takes joining
    /// rings in before it sleeps again. Only the hub thread touches the bell page here (it
    /// holds the page's claim while it sleeps), so nothing else waits on it.
    pub(crate) fn join(&self, key: K, consumer: Consumer) {
        lock(&self.joining).push((key, consumer));
    }

    /// Stops [`run`](Self::run) within [`HUB_CHECK`].
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Reads every ring until [`close`](Self::close) or `deliver` says stop: each pass takes
    /// the frames published on every ring (at most a ring's worth each, so one busy peer cannot
    /// hold the others back), then spins briefly, then sleeps on the bell page. A ring whose
    /// peer broke it leaves with `broken(key, reason)`; one whose connection is no longer
    /// `alive` leaves quietly once the frames published before are read.
    pub(crate) fn run(
        &self,
        mut deliver: impl FnMut(&K, Bytes) -> Delivered,
        mut broken: impl FnMut(&K, String),
        alive: impl Fn(&K) -> bool,
    ) {
        let mut members: Vec<(K, Consumer)> = Vec::new();
        let mut spin = SPIN_MIN;
        // Set when a frame came; the spin that follows it ends here. None after a sleep.
        let mut spin_until: Option<Instant> = None;
        let mut slept = false;
        loop {
            if self.closed.load(Ordering::Acquire) {
                return;
            }
            members.append(&mut lock(&self.joining));
            let mut got = false;
            let mut i = 0;
            while i < members.len() {
                // A connection found lost leaves after this pass, which reads what its peer
                // published before it went (the socket path delivers what came before the end
                // of file, too).
                let mut gone = !alive(&members[i].0);
                for _ in 0..SLOTS {
                    let (key, consumer) = &mut members[i];
                    match consumer.try_next() {
                        Ok(Some(payload)) => {
                            got = true;
                            if let Delivered::Stop = deliver(key, payload) {
                                return;
                            }
                        }
                        Ok(None) => break,
                        Err(reason) => {
                            broken(key, reason);
                            gone = true;
                            break;
                        }
                    }
                }
                if gone {
                    members.swap_remove(i);
                } else {
                    i += 1;
                }
            }
            let now = Instant::now();
            if got {
                // Adapt the spin: longer while frames arrive during it, shorter once they come
                // only after a sleep.
                spin = if slept {
                    (spin / 2).max(SPIN_MIN)
                } else {
                    (spin * 2).min(SPIN_MAX)
                };
                slept = false;
                spin_until = Some(now + spin);
                continue;
            }
            if spin_until.is_some_and(|until| now < until) {
                std::hint::spin_loop();
                continue;
            }
            self.sleep(&mut members, &mut broken);
            spin_until = None;
            slept = true;
        }
    }

    /// Marks every ring asleep and waits on the bell page (up to [`HUB_CHECK`]) unless a frame
    /// or a joining ring is already waiting.
    fn sleep(&self, members: &mut Vec<(K, Consumer)>, broken: &mut impl FnMut(&K, String)) {
        let Ok(seen) = map::with_atomic_words(&self.page, 0, BELL_PAGE_WORDS, |b| {
            b[0].load(Ordering::Acquire)
        }) else {
            std::thread::sleep(HUB_CHECK);
            return;
        };
        let mut waiting = false;
        members.retain(|(key, consumer)| match consumer.set_sleeping(true) {
            Ok(pending) => {
                waiting |= pending;
                true
            }
            Err(reason) => {
                broken(key, reason);
                false
            }
        });
        if !waiting && lock(&self.joining).is_empty() && !self.closed.load(Ordering::Acquire) {
            let ts = futex::Timespec {
                tv_sec: HUB_CHECK.as_secs() as _,
                tv_nsec: HUB_CHECK.subsec_nanos() as _,
            };
            // Any outcome (woken, the word changed, timed out, interrupted) looks again.
            let _ = map::with_atomic_words(&self.page, 0, BELL_PAGE_WORDS, |b| {
                futex::wait(&b[0], futex::Flags::empty(), seen, Some(&ts))
            });
        }
        for (_, consumer) in members.iter() {
            let _ = consumer.set_sleeping(false);
        }
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

    /// What a connecting peer maps: the hub's bell page, once per connection.
    fn peer_page<K>(hub: &Hub<K>) -> MemoryRegion {
        map::map_remote(0, hub.page_fd().unwrap(), BELL_PAGE_BYTES as u64).unwrap()
    }

    fn bell_word(page: &MemoryRegion) -> u32 {
        map::with_atomic_words(page, 0, BELL_PAGE_WORDS, |b| b[0].load(Ordering::Acquire)).unwrap()
    }

    #[test]
    fn one_hub_reads_every_ring_and_drops_only_a_broken_one() {
        let hub = std::sync::Arc::new(Hub::<u32>::new().unwrap());
        let mut producers = Vec::new();
        for key in 0..3u32 {
            let (ring, consumer) = hub.ring().unwrap();
            let other = map::map_remote(0, ring_fd(&ring).unwrap(), RING_BYTES as u64).unwrap();
            let page = peer_page(&hub);
            let producer = Producer::with_bell_page(other, 0, page.clone()).unwrap();
            if key == 0 {
                // A ring starts asleep, so a push before the hub ever looked rings its bell
                // page (not the ring's own word).
                let before = bell_word(&page);
                assert!(producer.push(b"early").unwrap());
                assert_eq!(bell_word(&page), before.wrapping_add(1));
            }
            hub.join(key, consumer);
            producers.push(producer);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let broken = std::sync::Arc::new(Mutex::new(Vec::new()));
        let runner = {
            let (hub, broken) = (hub.clone(), broken.clone());
            std::thread::spawn(move || {
                hub.run(
                    |key, payload| {
                        tx.send((*key, payload)).unwrap();
                        Delivered::Yes
                    },
                    |key, reason| lock(&broken).push((*key, reason)),
                    |_| true,
                )
            })
        };
        let recv = || rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(recv(), (0, Bytes::from_static(b"early")));
        for (i, p) in producers.iter().enumerate() {
            assert!(p.push(format!("from {i}").as_bytes()).unwrap());
        }
        let mut got: Vec<(u32, Bytes)> = (0..3).map(|_| recv()).collect();
        got.sort();
        let want: Vec<(u32, Bytes)> = (0..3u32)
            .map(|i| (i, Bytes::from(format!("from {i}"))))
            .collect();
        assert_eq!(got, want);
        // Ring 1's peer scribbles on its tail: ring 1 leaves with the reason, the others go on.
        producers[1].scribble(TAIL, 1 << 20);
        assert!(producers[2].push(b"still here").unwrap());
        assert_eq!(recv(), (2, Bytes::from_static(b"still here")));
        let mut waited = 0;
        while lock(&broken).is_empty() {
            waited += 1;
            assert!(waited < 1000, "the scribbled ring was not dropped");
            std::thread::sleep(Duration::from_millis(10));
        }
        let broken = lock(&broken).clone();
        assert_eq!(broken.len(), 1, "{broken:?}");
        assert_eq!(broken[0].0, 1);
        assert!(broken[0].1.contains("unread frames"), "{}", broken[0].1);
        assert!(producers[0].push(b"last").unwrap());
        assert_eq!(recv(), (0, Bytes::from_static(b"last")));
        hub.close();
        runner.join().unwrap();
    }

    /// A peer that published a frame and then went (its connection found lost before the hub
    /// read the ring) still has the frame delivered; then its ring leaves.
    #[test]
    fn a_ring_whose_connection_is_lost_is_read_before_it_leaves() {
        let hub = std::sync::Arc::new(Hub::<u32>::new().unwrap());
        let (ring, consumer) = hub.ring().unwrap();
        let other = map::map_remote(0, ring_fd(&ring).unwrap(), RING_BYTES as u64).unwrap();
        let producer = Producer::with_bell_page(other, 0, peer_page(&hub)).unwrap();
        hub.join(7, consumer);
        assert!(producer.push(b"last words").unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let runner = {
            let hub = hub.clone();
            std::thread::spawn(move || {
                hub.run(
                    |key, payload| {
                        tx.send((*key, payload)).unwrap();
                        Delivered::Yes
                    },
                    |_, reason| panic!("broken: {reason}"),
                    |_| false, // lost from the start
                )
            })
        };
        let got = rx.recv_timeout(Duration::from_secs(5));
        hub.close();
        runner.join().unwrap();
        assert_eq!(got.ok(), Some((7, Bytes::from_static(b"last words"))));
    }
}
