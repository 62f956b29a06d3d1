//! Registered memory: the one place in kvbridge's transports that touches raw memory.
//!
//! A [`MemoryRegion`] is a fixed-size byte range that transports read from and write into
//! concurrently, like an RDMA-registered buffer. It is either owned (allocated here:
//! page-aligned, zeroed and pre-faulted) or foreign (engine memory, a shared-memory mapping, or
//! device memory such as CUDA/ROCm VRAM), registered through the `unsafe`
//! [`MemoryRegion::from_raw_parts`].
//!
//! # Safety model
//!
//! No sequence of safe calls, on any number of threads, can cause Undefined Behavior:
//!
//! - Every CPU access to a region's bytes first claims its byte range in the region's **claim
//!   table**: reads claim it shared, writes exclusively. A claim that overlaps a claim of
//!   another access, where either of them writes, waits for that access to end, at most
//!   [`CLAIM_WAIT`], and is then refused with [`MemoryError::AccessConflict`] (so nothing
//!   deadlocks on it: a thread that conflicts with its own borrow is refused after the bound).
//!   Code on an async runtime's worker thread must never wait: it uses the `try_` accessors
//!   ([`try_borrow_mut`](MemoryRegion::try_borrow_mut) and the like) and the vectored socket
//!   calls ([`recv_vectored`], [`send_vectored`]), which refuse a conflict at once, and waits
//!   for the other access to end on the runtime's own timers.
//!   Two transfers may legitimately write the same bytes (two prefill ranks sending the same
//!   aux row to one decode): they are serialised, never run at once. Copies hold their claim
//!   only for the copy; [`RegionSliceMut`] and [`with_raw_range`](MemoryRegion::with_raw_range)
//!   hold theirs until they end.
//! - Rust slices of region bytes exist only for **owned** memory, under an exclusive claim.
//!   Foreign memory may be written by other processes or devices at any time, so it is only
//!   ever copied with raw copies and never borrowed as a slice.
//! - **Device** memory is not CPU-addressable: every CPU accessor refuses it with
//!   [`MemoryError::NotHostMemory`] before touching it. Transports that declare device support
//!   hand its address to the device's own APIs.
//! - The owner of foreign memory is kept alive and never handed back; transports recognise
//!   their own memory by a typed [tag](MemoryRegion::tag) instead.
//!
//! Bounds and offset arithmetic live in safe functions ([`checked_range`]); only the copies
//! themselves are `unsafe`. Refusals are [`MemoryError`]s (the crate's one error type; transports carry them as
//! `kvbridge_transport::TransportError::Memory`), with
//! an [`Operand`] saying which region of the access was refused.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod error;

pub use error::{MemoryError, Operand, Result};

/// How long an access waits for a conflicting access to the same bytes to end before it is
/// refused. Copies hold their claims for microseconds; only a borrow held across other work
/// (or a descheduled thread on a loaded machine) makes an access wait this long.
pub const CLAIM_WAIT: Duration = Duration::from_secs(1);

/// Whether a claim that meets a conflicting access waits for it to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// At most [`CLAIM_WAIT`] (threads that may block).
    Bounded,
    /// Not at all: refused at once (async runtime workers).
    Never,
}

/// Alignment of owned regions: one 4 KiB page, so DMA engines and `O_DIRECT` are happy.
pub const REGION_ALIGN: usize = 4096;

/// A bounds violation found by [`checked_range`] or a region accessor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangeError {
    /// The offset asked for.
    pub offset: u64,
    /// The length asked for.
    pub len: u64,
    /// The region's length.
    pub region_len: u64,
}

impl fmt::Display for RangeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "range [{}, {}+{}) is outside a region of {} bytes",
            self.offset, self.offset, self.len, self.region_len
        )
    }
}

impl std::error::Error for RangeError {}

/// Checks that `[offset, offset + len)` lies inside a region of `region_len` bytes, without
/// overflow, and returns it as a `usize` range.
pub fn checked_range(offset: u64, len: u64, region_len: usize) -> Result<Range<usize>, RangeError> {
    let err = RangeError {
        offset,
        len,
        region_len: region_len as u64,
    };
    let end = offset.checked_add(len).ok_or(err)?;
    if end > region_len as u64 {
        return Err(err);
    }
    // Both fit in usize because end <= region_len, which is a usize.
    Ok(offset as usize..end as usize)
}

/// End of the last of `count` rows of `len` bytes starting at `offset`, `stride` apart
/// (`offset` itself for no rows), or `None` on `u64` overflow.
pub const fn rows_end(offset: u64, stride: u64, len: u64, count: u64) -> Option<u64> {
    if count == 0 {
        return Some(offset);
    }
    match (count - 1).checked_mul(stride) {
        Some(x) => match offset.checked_add(x) {
            Some(last) => last.checked_add(len),
            None => None,
        },
        None => None,
    }
}

/// Checks that every one of `count` rows of `len` bytes, the first at `offset` and each
/// `stride` bytes after the previous one, lies inside a region of `region_len` bytes, without
/// overflow, and returns the span from the first row's start to the last row's end. No rows
/// (or zero-length rows) still need `offset <= region_len`, as [`checked_range`] does.
pub fn checked_rows(
    region_len: usize,
    offset: u64,
    stride: u64,
    len: u64,
    count: u64,
) -> Result<Range<usize>, RangeError> {
    let Some(end) = rows_end(offset, stride, len, count) else {
        return Err(RangeError {
            offset,
            len: u64::MAX,
            region_len: region_len as u64,
        });
    };
    checked_range(offset, end - offset, region_len)
}

/// What a region's bytes are: CPU-addressable host memory, or memory of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Host memory the CPU can read and write (heap, pinned host memory, shared mappings).
    Host,
    /// Memory of an accelerator (CUDA or ROCm VRAM), not CPU-addressable. The region's address
    /// is the device address; only a transport that declares
    /// `kvbridge_transport::Capabilities::device_memory` moves it.
    Device {
        /// The device ordinal, as the device runtime numbers it (`cuda:<id>`).
        id: u32,
    },
}

impl MemoryKind {
    /// Whether the CPU can address this memory.
    pub fn is_host(&self) -> bool {
        matches!(self, MemoryKind::Host)
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host memory"),
            MemoryKind::Device { id } => write!(f, "device memory (device {id})"),
        }
    }
}

/// How an access uses the bytes it claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Only reads: may share its bytes with other reads.
    Read,
    /// Writes (and may read): has its bytes to itself.
    Write,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Read => "reading",
            Access::Write => "writing",
        })
    }
}

impl RangeError {
    /// The refusal of a CPU access to `operand` whose range this is.
    fn refused(self, operand: Operand) -> MemoryError {
        MemoryError::AccessOutOfRange {
            operand,
            offset: self.offset,
            len: self.len,
            region_len: self.region_len,
        }
    }
}

enum Backing {
    /// Allocated by [`MemoryRegion::allocate`]; freed with this layout.
    Owned(Layout),
    /// Memory owned by someone else; this keeps it alive and is never handed back (only
    /// dropped, hence never read).
    Foreign(#[allow(dead_code)] Box<dyn Send + Sync>),
    /// Zero-length region: nothing to free.
    Empty,
}

/// One access's claim on a byte range.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Claim {
    range: Range<usize>,
    access: Access,
}

impl Claim {
    /// Whether the two accesses may not run at the same time (empty ranges touch nothing).
    fn conflicts(&self, other: &Claim) -> bool {
        (self.access == Access::Write || other.access == Access::Write)
            && !self.range.is_empty()
            && !other.range.is_empty()
            && self.range.start < other.range.end
            && other.range.start < self.range.end
    }
}

/// The claims of the accesses in progress on one region. Empty ranges are never recorded.
#[derive(Debug, Default)]
struct ClaimTable {
    claims: Vec<Claim>,
    /// How many of `claims` write: a read conflicts with nothing while there are none, so the
    /// many row claims of a send are recorded without looking at the others.
    writes: usize,
    /// Accesses waiting on `released` for a conflicting claim to end: a release signals the
    /// condition variable only when there are some (a wake-up is a system call).
    waiting: usize,
}

impl ClaimTable {
    /// A held claim `want` may not run beside, if any.
    fn conflict(&self, want: &Claim) -> Option<&Claim> {
        if want.access == Access::Read && self.writes == 0 {
            return None;
        }
        self.claims.iter().find(|held| held.conflicts(want))
    }

    /// Records all of `wanted` (which may overlap each other: they belong to one access), or
    /// none, returning the index of the first refused claim and the claim it met.
    fn try_insert(&mut self, wanted: &[Claim]) -> Result<(), (usize, Claim)> {
        for (i, want) in wanted.iter().enumerate() {
            if let Some(held) = self.conflict(want) {
                return Err((i, held.clone()));
            }
        }
        for claim in wanted.iter().filter(|c| !c.range.is_empty()) {
            self.push(claim.clone());
        }
        Ok(())
    }

    /// Records the leading claims of `wanted` (one access's, not empty) that no held claim
    /// conflicts with: their number, and the claim the next one met.
    fn insert_leading(&mut self, wanted: &[Claim]) -> (usize, Option<Claim>) {
        for (i, want) in wanted.iter().enumerate() {
            if let Some(held) = self.conflict(want) {
                let held = held.clone();
                for claim in &wanted[..i] {
                    self.push(claim.clone());
                }
                return (i, Some(held));
            }
        }
        for claim in wanted {
            self.push(claim.clone());
        }
        (wanted.len(), None)
    }

    fn push(&mut self, claim: Claim) {
        self.writes += usize::from(claim.access == Access::Write);
        self.claims.push(claim);
    }

    fn remove(&mut self, claim: &Claim) {
        // From the end: the latest claims are released first most often.
        if let Some(i) = self.claims.iter().rposition(|c| c == claim) {
            let gone = self.claims.swap_remove(i);
            self.writes -= usize::from(gone.access == Access::Write);
        }
    }

    /// Removes one recorded copy of each of `gone`, in one pass over the table.
    fn remove_all(&mut self, gone: &[Claim]) {
        if gone.len() <= 4 {
            gone.iter().for_each(|c| self.remove(c));
            return;
        }
        // The claims of one vectored socket call were recorded together, in order, and
        // releasing such a block keeps the others' order: they are usually still one block,
        // which goes without hashing each claim (a send of 1,024 rows releases 1,024 claims).
        // A single claim's release moves the last claim into its place, and a block it broke
        // takes the path below.
        if let Some(start) = self.claims.iter().rposition(|c| *c == gone[0]) {
            if self.claims[start..].starts_with(gone) {
                let writes = gone.iter().filter(|c| c.access == Access::Write).count();
                self.claims.drain(start..start + gone.len());
                self.writes -= writes;
                return;
            }
        }
        let mut left: std::collections::HashMap<&Claim, usize> =
            std::collections::HashMap::with_capacity(gone.len());
        for claim in gone {
            *left.entry(claim).or_default() += 1;
        }
        let mut writes_gone = 0;
        self.claims.retain(|c| match left.get_mut(c) {
            Some(n) if *n > 0 => {
                *n -= 1;
                writes_gone += usize::from(c.access == Access::Write);
                false
            }
            _ => true,
        });
        self.writes -= writes_gone;
    }
}

struct Inner {
    /// Base address: a CPU pointer for host memory, the device address for device memory.
    ptr: *mut u8,
    len: usize,
    kind: MemoryKind,
    backing: Backing,
    tag: Option<Arc<dyn Any + Send + Sync>>,
    claims: Mutex<ClaimTable>,
    /// Signalled whenever a claim is released, for accesses waiting on a conflict.
    released: Condvar,
}

// SAFETY: `Inner` only holds a pointer to memory it owns (or whose owner it keeps alive; the
// owner is `Send + Sync`) and hands out access through claimed copies; moving it between
// threads is sound.
unsafe impl Send for Inner {}
// SAFETY: every access to the bytes from this process goes through a claim recorded in
// `claims` under its mutex, and conflicting claims (overlapping, one writing) are refused, so
// two threads never touch the same bytes at once unless both only read. Slices are only made
// of owned memory under an exclusive claim.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Backing::Owned(layout) = self.backing {
            // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` in `allocate` and is freed once,
            // here, when the last handle drops.
            unsafe { std::alloc::dealloc(self.ptr, layout) };
        }
    }
}

impl Inner {
    fn table(&self) -> MutexGuard<'_, ClaimTable> {
        // The table is consistent at every unlock (no code between lock and unlock panics
        // half-way through a change), so a poisoned lock is safe to use.
        self.claims.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `wanted` once no conflicting claim is held, waiting at most [`CLAIM_WAIT`] for
    /// conflicting accesses to end (not at all for [`Wait::Never`]); then the first refused
    /// claim and the claim it met.
    fn insert(&self, wanted: &[Claim], wait: Wait) -> std::result::Result<(), (usize, Claim)> {
        let mut table = self.table();
        // The clock is read only once a claim has to wait: an uncontended claim (nearly all of
        // them, one per row of a batch) costs no clock read.
        let mut deadline = None;
        loop {
            let refused = match table.try_insert(wanted) {
                Ok(()) => return Ok(()),
                Err(refused) => refused,
            };
            if wait == Wait::Never {
                return Err(refused);
            }
            let now = Instant::now();
            let left = deadline
                .get_or_insert(now + CLAIM_WAIT)
                .saturating_duration_since(now);
            if left.is_zero() {
                return Err(refused);
            }
            table.waiting += 1;
            table = self
                .released
                .wait_timeout(table, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            table.waiting -= 1;
        }
    }

    fn release(&self, claim: &Claim) {
        if !claim.range.is_empty() {
            self.release_all(std::slice::from_ref(claim));
        }
    }

    fn release_all(&self, claims: &[Claim]) {
        let mut table = self.table();
        table.remove_all(claims);
        let waiting = table.waiting > 0;
        drop(table);
        if waiting {
            self.released.notify_all();
        }
    }

    fn conflict(&self, operand: Operand, want: &Claim, held: &Claim) -> MemoryError {
        MemoryError::AccessConflict {
            operand,
            access: want.access,
            offset: want.range.start as u64,
            len: want.range.len() as u64,
            region_len: self.len as u64,
            held: held.access,
            held_start: held.range.start as u64,
            held_end: held.range.end as u64,
        }
    }
}

/// A claim held for the duration of one access; released on drop (also on unwind).
struct Claimed<'a> {
    inner: &'a Inner,
    claim: Claim,
}

impl Claimed<'_> {
    /// The claimed bytes' address.
    fn ptr(&self) -> *mut u8 {
        // `wrapping_add` keeps this safe; the offset is inside the region (checked when
        // claimed), so it equals the in-bounds `add`.
        self.inner.ptr.wrapping_add(self.claim.range.start)
    }

    fn len(&self) -> usize {
        self.claim.range.len()
    }
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        self.inner.release(&self.claim);
    }
}

/// A registered memory region: fixed length, shared by cheap clones, accessed concurrently by
/// transports.
///
/// Concurrent accesses at disjoint byte ranges run in parallel; overlapping ones where either
/// writes are refused with [`MemoryError::AccessConflict`] (see the [module docs](self)). The
/// transfer plan keeps writers apart, so in a correct program no access is ever refused.
#[derive(Clone)]
pub struct MemoryRegion {
    inner: Arc<Inner>,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("ptr", &self.inner.ptr)
            .field("len", &self.inner.len)
            .field("kind", &self.inner.kind)
            .field(
                "backing",
                &match self.inner.backing {
                    Backing::Owned(_) => "owned",
                    Backing::Foreign(_) => "foreign",
                    Backing::Empty => "empty",
                },
            )
            .finish()
    }
}

/// Error returned when an owned region cannot be allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocError {
    /// The size asked for.
    pub len: usize,
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "could not allocate a {}-byte region aligned to {REGION_ALIGN}; reduce the pool size or free memory",
            self.len
        )
    }
}

impl std::error::Error for AllocError {}

/// Memory owned by someone else, to wrap as a region with [`MemoryRegion::from_raw_parts`].
pub struct ForeignMemory {
    ptr: *mut u8,
    len: usize,
    kind: MemoryKind,
    owner: Box<dyn Send + Sync>,
    tag: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for ForeignMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForeignMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("tagged", &self.tag.is_some())
            .finish()
    }
}

impl ForeignMemory {
    /// `len` bytes of host memory at `ptr` (engine memory, pinned host memory, a shared
    /// mapping), kept alive by `owner`. The owner may be the allocation's handle (a `Vec`, a
    /// mapping), but not a `Box` of the bytes themselves: moving a `Box` asserts it is the only
    /// way to reach them.
    pub fn host(ptr: NonNull<u8>, len: usize, owner: impl Send + Sync + 'static) -> Self {
        Self {
            ptr: ptr.as_ptr(),
            len,
            kind: MemoryKind::Host,
            owner: Box::new(owner),
            tag: None,
        }
    }

    /// `len` bytes of memory of device `device` at device address `addr` (e.g. a
    /// `CUdeviceptr`, or a tensor's `data_ptr()`), kept alive by `owner`.
    pub fn device(device: u32, addr: usize, len: usize, owner: impl Send + Sync + 'static) -> Self {
        Self {
            // A device address is a number to the CPU: it carries no provenance.
            ptr: std::ptr::without_provenance_mut(addr),
            len,
            kind: MemoryKind::Device { id: device },
            owner: Box::new(owner),
            tag: None,
        }
    }

    /// Attaches a typed tag that transports read back with [`MemoryRegion::tag`], e.g. to
    /// recognise memory their own `allocate` made. It must not give access to the bytes.
    pub fn with_tag<T: Any + Send + Sync>(mut self, tag: Arc<T>) -> Self {
        self.tag = Some(tag);
        self
    }
}

impl MemoryRegion {
    /// Allocates an owned region of `len` bytes: page-aligned, zeroed, and pre-faulted (every
    /// page touched once) so the first transfer into it does not pay for page faults.
    pub fn allocate(len: usize) -> Result<Self, AllocError> {
        if len == 0 {
            return Ok(Self::from_inner(
                NonNull::<u64>::dangling().cast().as_ptr(),
                0,
                MemoryKind::Host,
                Backing::Empty,
                None,
            ));
        }
        let layout = Layout::from_size_align(len, REGION_ALIGN).map_err(|_| AllocError { len })?;
        // SAFETY: `layout` has a non-zero size (len > 0 checked above).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(AllocError { len })?;
        // Pre-fault: zeroed allocations of this size come from fresh mappings whose pages are
        // only materialised on first write, which would otherwise slow the first transfer ~7x.
        let mut page = 0;
        while page < len {
            // SAFETY: `page < len`, so the byte is inside the allocation just made, which nothing
            // else references yet; a volatile write keeps the touch from being optimised out.
            unsafe { ptr.as_ptr().add(page).write_volatile(0) };
            page += REGION_ALIGN;
        }
        Ok(Self::from_inner(
            ptr.as_ptr(),
            len,
            MemoryKind::Host,
            Backing::Owned(layout),
            None,
        ))
    }

    /// Wraps foreign memory (engine memory, a shared mapping, device memory) as a region. Its
    /// owner is kept alive as long as any clone of the region exists and is never handed back.
    ///
    /// kvbridge never makes Rust references to foreign bytes: it only copies host memory with
    /// raw copies ([`borrow_mut`](Self::borrow_mut) refuses foreign memory), and it never
    /// touches device memory with the CPU.
    ///
    /// # Safety
    ///
    /// For as long as the owner is alive:
    /// - host memory: `ptr` must be valid for reads and writes of `len` bytes; device memory:
    ///   `addr` must be the address of `len` bytes of memory on that device;
    /// - `len` must not exceed `isize::MAX`, and the memory must not be deallocated or unmapped
    ///   (keeping it alive is the owner's job);
    /// - no other `MemoryRegion` may wrap any of these bytes at the same addresses (share a
    ///   region by cloning it), so that every access from this process goes through one claim
    ///   table;
    /// - nothing may hold a Rust reference to these bytes. Other processes, devices and code
    ///   outside Rust may read and write them, as with any shared or DMA memory: the bytes a
    ///   copy sees are then whatever they are, which is the transfer plan's business;
    /// - the tag, if any, must not give access to the bytes: any holder of the region can
    ///   read it.
    pub unsafe fn from_raw_parts(memory: ForeignMemory) -> Self {
        let ForeignMemory {
            ptr,
            len,
            kind,
            owner,
            tag,
        } = memory;
        Self::from_inner(ptr, len, kind, Backing::Foreign(owner), tag)
    }

    fn from_inner(
        ptr: *mut u8,
        len: usize,
        kind: MemoryKind,
        backing: Backing,
        tag: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                ptr,
                len,
                kind,
                backing,
                tag,
                claims: Mutex::new(ClaimTable::default()),
                released: Condvar::new(),
            }),
        }
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// What the region's memory is.
    pub fn kind(&self) -> MemoryKind {
        self.inner.kind
    }

    /// Whether [`borrow_mut`](Self::borrow_mut) can hand out slices of this region: owned host
    /// memory only, never foreign or device memory.
    pub fn can_borrow(&self) -> bool {
        !matches!(self.inner.backing, Backing::Foreign(_))
    }

    /// The base address, for transports that hand it to hardware (RDMA registration, DMA, a
    /// device API); for device memory it is the device address. Code that dereferences it must
    /// do so inside [`with_raw_range`](Self::with_raw_range), which claims the bytes.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.ptr
    }

    /// The tag attached with [`ForeignMemory::with_tag`], if it has type `T`: how a transport
    /// recognises memory it made itself.
    pub fn tag<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        Arc::clone(self.inner.tag.as_ref()?).downcast::<T>().ok()
    }

    /// Whether two handles refer to the same region.
    pub fn same_region(&self, other: &MemoryRegion) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Checks `[offset, offset + len)` against this region.
    pub fn range(&self, offset: u64, len: u64) -> Result<Range<usize>, RangeError> {
        checked_range(offset, len, self.inner.len)
    }

    /// Refuses device memory: the CPU must not touch it.
    fn host_only(&self, operand: Operand) -> Result<()> {
        if self.inner.kind.is_host() {
            Ok(())
        } else {
            Err(MemoryError::NotHostMemory {
                operand,
                kind: self.inner.kind,
                len: self.inner.len as u64,
            })
        }
    }

    /// Checks the range and claims it for `access` (host memory only), waiting for conflicting
    /// accesses as [`CLAIM_WAIT`] says; refusals name `operand`.
    fn claim(
        &self,
        offset: u64,
        len: u64,
        access: Access,
        operand: Operand,
    ) -> Result<Claimed<'_>> {
        self.claim_waiting(offset, len, access, operand, Wait::Bounded)
    }

    fn claim_waiting(
        &self,
        offset: u64,
        len: u64,
        access: Access,
        operand: Operand,
        wait: Wait,
    ) -> Result<Claimed<'_>> {
        self.host_only(operand)?;
        let claim = Claim {
            range: self.range(offset, len).map_err(|e| e.refused(operand))?,
            access,
        };
        if !claim.range.is_empty() {
            self.inner
                .insert(std::slice::from_ref(&claim), wait)
                .map_err(|(_, held)| self.inner.conflict(operand, &claim, &held))?;
        }
        Ok(Claimed {
            inner: &self.inner,
            claim,
        })
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.read_waiting(offset, dst, Wait::Bounded)
    }

    /// [`read_at`](Self::read_at) that never waits: a conflicting access is refused at once
    /// (for code on an async runtime's worker thread, which must not block).
    pub fn try_read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.read_waiting(offset, dst, Wait::Never)
    }

    fn read_waiting(&self, offset: u64, dst: &mut [u8], wait: Wait) -> Result<()> {
        let src = self.claim_waiting(
            offset,
            dst.len() as u64,
            Access::Read,
            Operand::Region,
            wait,
        )?;
        // SAFETY: the range is inside the region, which is host memory valid for reads
        // (`allocate` / the `from_raw_parts` contract), and claimed for reading, so no write
        // from this process touches it meanwhile; `dst` is a distinct Rust slice.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr(), dst.as_mut_ptr(), src.len()) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.write_waiting(offset, src, Wait::Bounded)
    }

    /// [`write_at`](Self::write_at) that never waits: a conflicting access is refused at once
    /// (for code on an async runtime's worker thread, which must not block).
    pub fn try_write_at(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.write_waiting(offset, src, Wait::Never)
    }

    fn write_waiting(&self, offset: u64, src: &[u8], wait: Wait) -> Result<()> {
        let dst = self.claim_waiting(
            offset,
            src.len() as u64,
            Access::Write,
            Operand::Region,
            wait,
        )?;
        // SAFETY: the range is inside the host region and claimed exclusively, so nothing else
        // in this process touches it meanwhile; `src` is a distinct Rust slice.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.ptr(), dst.len()) };
        Ok(())
    }

    /// Fills `[offset, offset + len)` with `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<()> {
        let dst = self.claim(offset, len, Access::Write, Operand::Region)?;
        // SAFETY: the range is inside the host region and claimed exclusively.
        unsafe { std::ptr::write_bytes(dst.ptr(), byte, dst.len()) };
        Ok(())
    }

    /// Copies `len` bytes from `self[src_offset..]` to `dst[dst_offset..]`. Both ranges are
    /// checked and claimed before any byte moves; `dst` may be the same region (overlap is
    /// handled). A refusal names the end refused ([`Operand::Source`] or
    /// [`Operand::Destination`]).
    pub fn copy_to(
        &self,
        src_offset: u64,
        dst: &MemoryRegion,
        dst_offset: u64,
        len: u64,
    ) -> Result<()> {
        self.copy_waiting(src_offset, dst, dst_offset, len, Wait::Bounded)
    }

    /// [`copy_to`](Self::copy_to) that never waits: a conflicting access to either range is
    /// refused at once (for code on an async runtime's worker thread, which must not block).
    pub fn try_copy_to(
        &self,
        src_offset: u64,
        dst: &MemoryRegion,
        dst_offset: u64,
        len: u64,
    ) -> Result<()> {
        self.copy_waiting(src_offset, dst, dst_offset, len, Wait::Never)
    }

    fn copy_waiting(
        &self,
        src_offset: u64,
        dst: &MemoryRegion,
        dst_offset: u64,
        len: u64,
        wait: Wait,
    ) -> Result<()> {
        let (src_claim, dst_claim) = self.claim_copy(src_offset, dst, dst_offset, len, wait)?;
        // SAFETY: both ranges are inside their host regions and claimed (the source for
        // reading, the destination exclusively), so nothing else in this process writes the
        // source or touches the destination meanwhile; `ptr::copy` permits the overlap of a
        // copy within one region.
        unsafe { std::ptr::copy(src_claim.ptr(), dst_claim.ptr(), src_claim.len()) };
        Ok(())
    }

    /// Runs `f(src, dst, len)` with `self[src_offset..+len]` claimed for reading and
    /// `dst[dst_offset..+len]` for writing, where `src` and `dst` are the addresses of the two
    /// ranges' first bytes: [`with_raw_range`](Self::with_raw_range) for transport code that
    /// copies between two regions with its own instructions (streaming stores). Both ranges
    /// are checked and claimed before `f` runs, and refusals are those of
    /// [`copy_to`](Self::copy_to). Host memory only.
    ///
    /// Dereferencing the pointers is the caller's `unsafe`: while `f` runs, `len` bytes at
    /// `src` are readable and written by no one in this process, and `len` bytes at `dst` are
    /// writable and touched by nothing else in this process. When `dst` is this same region
    /// the two ranges may overlap. Do not use the pointers after `f` returns.
    pub fn with_raw_copy<R>(
        &self,
        src_offset: u64,
        dst: &MemoryRegion,
        dst_offset: u64,
        len: u64,
        f: impl FnOnce(*const u8, *mut u8, usize) -> R,
    ) -> Result<R> {
        let (src_claim, dst_claim) =
            self.claim_copy(src_offset, dst, dst_offset, len, Wait::Bounded)?;
        Ok(f(src_claim.ptr(), dst_claim.ptr(), src_claim.len()))
    }

    /// Copies `rows` (each an offset into this region and a length) one after another into
    /// `dst` from `dst_offset`, and returns the bytes copied: what a transport does to send
    /// many short rows as one piece. The source span (the first row's start to the last row's
    /// end) is checked and claimed for reading, and `dst`'s range for writing, once each, before
    /// any byte moves, so a batch of hundreds of thousands of rows pays two claims, not two
    /// per row; a refusal names the end refused ([`Operand::Source`] or
    /// [`Operand::Destination`]) and moves nothing. The bytes between rows are claimed too: a
    /// write to them meanwhile is refused (or waited for) like one to the rows. Into this same
    /// region the rows are copied one by one through [`copy_to`](Self::copy_to), and a refusal
    /// stops at the refused row. Host memory only.
    pub fn gather_to(
        &self,
        rows: &[(u64, u64)],
        dst: &MemoryRegion,
        dst_offset: u64,
    ) -> Result<u64> {
        self.gather_waiting(rows, dst, dst_offset, Wait::Bounded)
    }

    /// [`gather_to`](Self::gather_to) that never waits: a conflicting access is refused at
    /// once (for code on an async runtime's worker thread, which must not block).
    pub fn try_gather_to(
        &self,
        rows: &[(u64, u64)],
        dst: &MemoryRegion,
        dst_offset: u64,
    ) -> Result<u64> {
        self.gather_waiting(rows, dst, dst_offset, Wait::Never)
    }

    fn gather_waiting(
        &self,
        rows: &[(u64, u64)],
        dst: &MemoryRegion,
        dst_offset: u64,
        wait: Wait,
    ) -> Result<u64> {
        let span_of = |rows: &[(u64, u64)]| -> Option<(u64, u64, u64)> {
            let mut lo = u64::MAX;
            let (mut hi, mut total) = (0u64, 0u64);
            for &(offset, len) in rows {
                lo = lo.min(offset);
                hi = hi.max(offset.checked_add(len)?);
                total = total.checked_add(len)?;
            }
            Some((lo.min(hi), hi, total))
        };
        // Lengths that overflow: a range no region has, so the claim refuses it.
        let (lo, hi, total) = span_of(rows).unwrap_or((0, u64::MAX, u64::MAX));
        if self.same_region(dst) {
            let mut at = dst_offset;
            for &(offset, len) in rows {
                self.copy_waiting(offset, dst, at, len, wait)?;
                at = at.saturating_add(len);
            }
            return Ok(total);
        }
        // Claimed one after the other: no two table locks are ever held at once.
        let src = self.claim_waiting(lo, hi - lo, Access::Read, Operand::Source, wait)?;
        let out =
            dst.claim_waiting(dst_offset, total, Access::Write, Operand::Destination, wait)?;
        let (s, d) = (src.ptr(), out.ptr());
        let mut at = 0usize;
        for &(offset, len) in rows {
            let (from, len) = ((offset - lo) as usize, len as usize);
            // SAFETY: the row lies inside the claimed source span (`lo <= offset` and
            // `offset + len <= hi`), which is inside this host region and claimed for reading,
            // so nothing in this process writes it meanwhile; `at + len <= total`, inside
            // `dst`'s range claimed exclusively. The regions are different, so the two ranges
            // do not overlap (no two regions wrap the same bytes: `allocate`, and the
            // `from_raw_parts` contract).
            unsafe { std::ptr::copy_nonoverlapping(s.add(from), d.add(at), len) };
            at += len;
        }
        Ok(total)
    }

    /// Claims a copy's source (shared) and destination (exclusive).
    fn claim_copy<'a>(
        &'a self,
        src_offset: u64,
        dst: &'a MemoryRegion,
        dst_offset: u64,
        len: u64,
        wait: Wait,
    ) -> Result<(Claimed<'a>, Claimed<'a>)> {
        if self.same_region(dst) {
            return self.claim_within(src_offset, dst_offset, len, wait);
        }
        // Claimed one after the other: no two table locks are ever held at once.
        let s = self.claim_waiting(src_offset, len, Access::Read, Operand::Source, wait)?;
        let d = dst.claim_waiting(dst_offset, len, Access::Write, Operand::Destination, wait)?;
        Ok((s, d))
    }

    /// Claims a copy's source (shared) and destination (exclusive) in this same region at once,
    /// so the copy's own two claims do not refuse each other.
    fn claim_within(
        &self,
        src_offset: u64,
        dst_offset: u64,
        len: u64,
        wait: Wait,
    ) -> Result<(Claimed<'_>, Claimed<'_>)> {
        self.host_only(Operand::Source)?;
        let want = [
            Claim {
                range: self
                    .range(src_offset, len)
                    .map_err(|e| e.refused(Operand::Source))?,
                access: Access::Read,
            },
            Claim {
                range: self
                    .range(dst_offset, len)
                    .map_err(|e| e.refused(Operand::Destination))?,
                access: Access::Write,
            },
        ];
        self.inner.insert(&want, wait).map_err(|(i, held)| {
            let operand = if i == 0 {
                Operand::Source
            } else {
                Operand::Destination
            };
            self.inner.conflict(operand, &want[i], &held)
        })?;
        let [s, d] = want;
        Ok((
            Claimed {
                inner: &self.inner,
                claim: s,
            },
            Claimed {
                inner: &self.inner,
                claim: d,
            },
        ))
    }

    /// Returns a copy of `[offset, offset + len)`.
    pub fn to_vec(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        // Checked before allocating: `len` may come from a peer.
        let range = self
            .range(offset, len)
            .map_err(|e| e.refused(Operand::Region))?;
        let mut out = vec![0; range.len()];
        self.read_at(offset, &mut out)?;
        Ok(out)
    }

    /// Borrows `[offset, offset + len)` of owned memory exclusively as a mutable slice, e.g. to
    /// read a socket's payload straight into the region. Refused for foreign and device
    /// memory, and while any other access overlaps the range; other accesses to the range are
    /// refused while the slice lives.
    pub fn borrow_mut(&self, offset: u64, len: u64) -> Result<RegionSliceMut> {
        self.borrow_mut_waiting(offset, len, Wait::Bounded)
    }

    /// [`borrow_mut`](Self::borrow_mut) that never waits: a conflicting access (a borrow of
    /// the same caller included) is refused at once (for code on an async runtime's worker
    /// thread, which must not block).
    pub fn try_borrow_mut(&self, offset: u64, len: u64) -> Result<RegionSliceMut> {
        self.borrow_mut_waiting(offset, len, Wait::Never)
    }

    fn borrow_mut_waiting(&self, offset: u64, len: u64, wait: Wait) -> Result<RegionSliceMut> {
        self.host_only(Operand::Region)?;
        if !self.can_borrow() {
            return Err(MemoryError::ForeignBorrow { offset, len });
        }
        let claimed = self.claim_waiting(offset, len, Access::Write, Operand::Region, wait)?;
        let range = claimed.claim.range.clone();
        // The slice takes the claim over and releases it when it drops.
        std::mem::forget(claimed);
        Ok(RegionSliceMut {
            region: self.clone(),
            range,
        })
    }

    /// Borrows `[offset, offset + len)` of owned memory as a shared slice, e.g. to hand it to a
    /// vectored socket write. Shared borrows of the same bytes coexist (a batch may read the
    /// same source bytes twice); writes to the range are refused while the slice lives.
    /// Refused for foreign and device memory, and while a write overlaps the range.
    pub fn borrow(&self, offset: u64, len: u64) -> Result<RegionSlice> {
        self.borrow_waiting(offset, len, Wait::Bounded)
    }

    /// [`borrow`](Self::borrow) that never waits: a conflicting write is refused at once (for
    /// code on an async runtime's worker thread, which must not block).
    pub fn try_borrow(&self, offset: u64, len: u64) -> Result<RegionSlice> {
        self.borrow_waiting(offset, len, Wait::Never)
    }

    fn borrow_waiting(&self, offset: u64, len: u64, wait: Wait) -> Result<RegionSlice> {
        self.host_only(Operand::Region)?;
        if !self.can_borrow() {
            return Err(MemoryError::ForeignBorrow { offset, len });
        }
        let claimed = self.claim_waiting(offset, len, Access::Read, Operand::Region, wait)?;
        let range = claimed.claim.range.clone();
        // The slice takes the claim over and releases it when it drops.
        std::mem::forget(claimed);
        Ok(RegionSlice {
            region: self.clone(),
            range,
        })
    }

    /// Runs `f(ptr, len)` with `[offset, offset + len)` claimed for `access`, where `ptr` is
    /// the address of the range's first byte: the hook for transport code that moves bytes
    /// with its own instructions (streaming stores, a DMA it waits for) without bypassing the
    /// claim table. Host memory only.
    ///
    /// Dereferencing `ptr` is the caller's `unsafe`: while `f` runs, the `len` bytes at `ptr`
    /// are valid and no other access from this process touches them (reads by others only
    /// when `access` is [`Access::Read`], in which case `f` must not write). Do not use `ptr`
    /// after `f` returns, and do not access the same bytes through the region inside `f` (that
    /// is refused as a conflict).
    pub fn with_raw_range<R>(
        &self,
        offset: u64,
        len: u64,
        access: Access,
        f: impl FnOnce(*mut u8, usize) -> R,
    ) -> Result<R> {
        let claimed = self.claim(offset, len, access, Operand::Region)?;
        Ok(f(claimed.ptr(), claimed.len()))
    }
}

/// An exclusive mutable view of part of an owned [`MemoryRegion`], released on drop.
pub struct RegionSliceMut {
    region: MemoryRegion,
    range: Range<usize>,
}

impl fmt::Debug for RegionSliceMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionSliceMut")
            .field("range", &self.range)
            .finish()
    }
}

impl std::ops::Deref for RegionSliceMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the range is inside an owned host region (only those are borrowed) and
        // claimed exclusively by this view until it drops, so no other access from this
        // process touches the bytes and nothing outside it may (owned memory is private).
        unsafe {
            std::slice::from_raw_parts(
                self.region.inner.ptr.add(self.range.start),
                self.range.len(),
            )
        }
    }
}

impl std::ops::DerefMut for RegionSliceMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` guarantees this is the only use of the view.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.region.inner.ptr.add(self.range.start),
                self.range.len(),
            )
        }
    }
}

impl Drop for RegionSliceMut {
    fn drop(&mut self) {
        self.region.inner.release(&Claim {
            range: self.range.clone(),
            access: Access::Write,
        });
    }
}

/// A shared view of part of an owned host region ([`MemoryRegion::borrow`]); writes to its
/// bytes are refused until it drops.
pub struct RegionSlice {
    region: MemoryRegion,
    range: Range<usize>,
}

impl fmt::Debug for RegionSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionSlice")
            .field("range", &self.range)
            .finish()
    }
}

impl std::ops::Deref for RegionSlice {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the range is inside an owned host region (only those are borrowed) and
        // claimed for reading until this view drops, so no access from this process writes
        // the bytes meanwhile and nothing outside it may (owned memory is private).
        unsafe {
            std::slice::from_raw_parts(
                self.region.inner.ptr.add(self.range.start),
                self.range.len(),
            )
        }
    }
}

impl Drop for RegionSlice {
    fn drop(&mut self) {
        self.region.inner.release(&Claim {
            range: self.range.clone(),
            access: Access::Read,
        });
    }
}

/// Iovecs one [`recv_vectored`] / [`send_vectored`] call passes at most (the kernel's limit).
pub const MAX_IOVECS: usize = 1024;

/// The claims of one vectored socket call, per region in the call's order, released together
/// when dropped. Ranges that follow each other in memory are one claim (and one iovec).
struct ClaimedRanges<'a> {
    groups: Vec<(&'a Inner, Vec<Claim>)>,
}

impl ClaimedRanges<'_> {
    /// One iovec per claim, in the call's order.
    fn iovecs(&self) -> impl Iterator<Item = libc::iovec> + '_ {
        self.groups.iter().flat_map(|(inner, claims)| {
            claims.iter().map(|c| libc::iovec {
                // In bounds (checked when claimed); `wrapping_add` keeps this safe.
                iov_base: inner.ptr.wrapping_add(c.range.start).cast(),
                iov_len: c.range.len(),
            })
        })
    }

    fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}

impl Drop for ClaimedRanges<'_> {
    fn drop(&mut self) {
        for (inner, claims) in &self.groups {
            inner.release_all(claims);
        }
    }
}

/// Claims `ranges` (`(region, offset, len)`) for `access`, in order, never waiting (the
/// callers are non-blocking socket calls), stopping before the first one that overlaps an
/// earlier range of the same call where one writes or, when some are claimed already, that
/// another access holds. Refusals of the first range are errors. Empty ranges are skipped.
fn claim_ranges<'a>(
    ranges: &[(&'a MemoryRegion, u64, u64)],
    access: Access,
) -> std::io::Result<ClaimedRanges<'a>> {
    // The call's claims, checked, merged where one starts where the previous one ends.
    let mut wanted: Vec<(&'a Inner, Claim)> = Vec::with_capacity(ranges.len().min(MAX_IOVECS));
    // Per region of the call, the end of its furthest range: a write range starting at or
    // after it overlaps none of the call's earlier ones (rows in order need no search).
    let mut furthest: Vec<(*const Inner, usize)> = Vec::new();
    for &(region, offset, len) in ranges.iter().take(MAX_IOVECS) {
        let checked = region.host_only(Operand::Region).and_then(|()| {
            region
                .range(offset, len)
                .map_err(|e| e.refused(Operand::Region))
        });
        let range = match checked {
            Ok(range) => range,
            Err(_) if !wanted.is_empty() => break,
            Err(e) => return Err(std::io::Error::other(e)),
        };
        if range.is_empty() {
            continue;
        }
        let inner: &'a Inner = &region.inner;
        let key = std::ptr::from_ref(inner);
        let seen = furthest.iter_mut().find(|(r, _)| *r == key);
        let want = Claim { range, access };
        if access == Access::Write {
            let in_order = seen
                .as_ref()
                .is_none_or(|(_, end)| want.range.start >= *end);
            if !in_order
                && wanted
                    .iter()
                    .any(|(i, c)| std::ptr::eq(*i, inner) && c.conflicts(&want))
            {
                break;
            }
        }
        match seen {
            Some((_, end)) => *end = (*end).max(want.range.end),
            None => furthest.push((key, want.range.end)),
        }
        match wanted.last_mut() {
            Some((i, last)) if std::ptr::eq(*i, inner) && last.range.end == want.range.start => {
                last.range.end = want.range.end;
            }
            _ => wanted.push((inner, want)),
        }
    }
    // Recorded a region at a time (one lock each), up to the first claim another access holds.
    let mut claimed = ClaimedRanges { groups: Vec::new() };
    let mut rest = &wanted[..];
    while let Some((inner, _)) = rest.first() {
        let inner = *inner;
        let n = rest
            .iter()
            .position(|(i, _)| !std::ptr::eq(*i, inner))
            .unwrap_or(rest.len());
        let group: Vec<Claim> = rest[..n].iter().map(|(_, c)| c.clone()).collect();
        let (taken, held) = inner.table().insert_leading(&group);
        if taken == 0 {
            if let (true, Some(held)) = (claimed.is_empty(), held) {
                let err = inner.conflict(Operand::Region, &group[0], &held);
                return Err(std::io::Error::other(err));
            }
            break;
        }
        let all = taken == group.len();
        let mut group = group;
        group.truncate(taken);
        claimed.groups.push((inner, group));
        if !all {
            break;
        }
        rest = &rest[n..];
    }
    Ok(claimed)
}

/// One `readv` from `fd` straight into `ranges` of host regions, owned or foreign, without
/// making a Rust slice of their bytes (the kernel writes the raw memory). Every range is
/// checked and claimed for writing for the length of the call; at most [`MAX_IOVECS`] ranges,
/// and only the leading ones that can be claimed together are read into. It never waits for
/// another access: refusals of the first range (a conflict included) come back at once as an
/// [`std::io::Error`] wrapping the [`MemoryError`]; a non-blocking `fd` with nothing to
/// read gives [`std::io::ErrorKind::WouldBlock`].
pub fn recv_vectored(
    fd: std::os::fd::BorrowedFd<'_>,
    ranges: &[(&MemoryRegion, u64, u64)],
) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let claimed = claim_ranges(ranges, Access::Write)?;
    let iov: Vec<libc::iovec> = claimed.iovecs().collect();
    // SAFETY: each iovec covers a claimed range inside a host region (checked by `claim_ranges`),
    // valid for writes by the `allocate` / `from_raw_parts` contract, and claimed exclusively,
    // so no other access from this process touches it during the call; the kernel writes raw
    // memory, so no Rust reference to the bytes exists. `iov` outlives the call.
    let n = unsafe { libc::readv(fd.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int) };
    drop(claimed);
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// One `writev` to `fd` of `head` (a frame header, may be empty) then `ranges` of host regions,
/// owned or foreign, without making a Rust slice of their bytes. Every range is checked and
/// claimed for reading for the length of the call; at most [`MAX_IOVECS`] iovecs in all.
/// Errors as for [`recv_vectored`].
pub fn send_vectored(
    fd: std::os::fd::BorrowedFd<'_>,
    head: &[u8],
    ranges: &[(&MemoryRegion, u64, u64)],
) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let room = MAX_IOVECS - usize::from(!head.is_empty());
    let claimed = claim_ranges(&ranges[..ranges.len().min(room)], Access::Read)?;
    let mut iov = Vec::with_capacity(ranges.len().min(room) + 1);
    if !head.is_empty() {
        iov.push(libc::iovec {
            iov_base: head.as_ptr().cast_mut().cast(),
            iov_len: head.len(),
        });
    }
    iov.extend(claimed.iovecs());
    // SAFETY: `head` is a live slice the kernel only reads; each other iovec covers a claimed
    // range inside a host region, valid for reads, claimed shared so no write from this process
    // touches it during the call; the kernel reads raw memory. `iov` outlives the call.
    let n = unsafe { libc::writev(fd.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int) };
    drop(claimed);
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Foreign host memory over a zeroed heap buffer (its owner), for tests of the paths transports
/// take for memory they cannot borrow.
#[cfg(any(test, feature = "testing"))]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub fn foreign_host_region(len: usize) -> MemoryRegion {
    let mut buf = vec![0u8; len];
    let ptr = NonNull::new(buf.as_mut_ptr()).unwrap_or(NonNull::dangling());
    // SAFETY: the Vec is never resized or referenced again; moving it into the region as its
    // owner keeps the heap bytes alive and in place, and nothing else reaches them.
    unsafe { MemoryRegion::from_raw_parts(ForeignMemory::host(ptr, len, buf)) }
}

/// A device region whose address is a placeholder, for the conformance suite's check that
/// transports without device support refuse device memory at `register`.
#[cfg(any(test, feature = "testing"))]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub fn placeholder_device_region(device: u32, len: usize) -> MemoryRegion {
    // SAFETY: nothing in kvbridge dereferences device memory (every CPU accessor refuses it),
    // and the suite only registers this region with transports that do not declare device
    // memory, which refuse it; the address is never handed to a device.
    unsafe { MemoryRegion::from_raw_parts(ForeignMemory::device(device, 1 << 40, len, ())) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Foreign host memory: a heap buffer whose `Vec` is the owner.
    fn foreign(len: usize) -> MemoryRegion {
        let mut buf = vec![0u8; len];
        let ptr = NonNull::new(buf.as_mut_ptr()).unwrap();
        // SAFETY: the Vec is never resized or referenced again; moving it into the region as
        // its owner keeps the heap bytes alive and in place.
        unsafe { MemoryRegion::from_raw_parts(ForeignMemory::host(ptr, len, buf)) }
    }

    #[test]
    fn a_vectored_call_claims_its_rows_merged_in_order_and_stops_at_a_conflict() {
        let o = MemoryRegion::allocate(64).unwrap();
        let spans = |c: &ClaimedRanges<'_>| -> Vec<Range<usize>> {
            c.groups
                .iter()
                .flat_map(|(_, claims)| claims.iter().map(|c| c.range.clone()))
                .collect()
        };
        // Rows that follow each other are one claim; a gap starts another; empty ones vanish.
        let rows = [
            (&o, 0, 8),
            (&o, 8, 8),
            (&o, 20, 0),
            (&o, 24, 8),
            (&o, 32, 4),
        ];
        let c = claim_ranges(&rows, Access::Write).unwrap();
        assert_eq!(spans(&c), vec![0..16, 24..36]);
        // A write row overlapping an earlier one of the call ends the call before it; rows out
        // of order that overlap nothing are all claimed.
        let d = MemoryRegion::allocate(64).unwrap();
        let rows = [(&d, 16, 8), (&d, 0, 8), (&d, 4, 8), (&d, 40, 8)];
        assert_eq!(
            spans(&claim_ranges(&rows, Access::Write).unwrap()),
            vec![16..24, 0..8]
        );
        // Reads may overlap each other, and the bytes `c` writes refuse them.
        let rows = [(&d, 0, 8), (&d, 4, 8), (&o, 12, 8)];
        assert_eq!(
            spans(&claim_ranges(&rows, Access::Read).unwrap()),
            vec![0..8, 4..12]
        );
        let Err(e) = claim_ranges(&[(&o, 4, 4)], Access::Read) else {
            panic!("a read of bytes being written was claimed");
        };
        assert!(e.to_string().contains("claimed for writing"), "{e}");
        drop(c);
        // Released in one go: the whole region can be written again.
        assert!(o.try_borrow_mut(0, 64).is_ok());
    }

    #[test]
    fn the_claim_table_tells_reads_from_writes_and_removes_one_copy_of_each() {
        let claim = |start: usize, end: usize, access| Claim {
            range: start..end,
            access,
        };
        let mut t = ClaimTable::default();
        let reads: Vec<Claim> = (0..10)
            .map(|i| claim(i * 4, i * 4 + 8, Access::Read))
            .collect();
        assert_eq!(t.insert_leading(&reads), (10, None));
        assert_eq!(t.insert_leading(&reads[..2]), (2, None)); // the same reads, twice
        assert_eq!(t.writes, 0);
        let write = claim(9, 10, Access::Write);
        assert_eq!(t.try_insert(std::slice::from_ref(&write)).unwrap_err().0, 0);
        t.remove_all(&reads);
        // One copy of reads 0 and 1 is left: the write still meets read 1 (4..12).
        assert_eq!(t.claims.len(), 2);
        assert_eq!(
            t.try_insert(std::slice::from_ref(&write)).unwrap_err().1,
            reads[1]
        );
        t.remove_all(&reads[..2]);
        assert!(t.try_insert(std::slice::from_ref(&write)).is_ok());
        assert_eq!(t.writes, 1);
        // With a writer held, reads are checked again.
        let (n, held) =
            t.insert_leading(&[claim(20, 24, Access::Read), claim(9, 11, Access::Read)]);
        assert_eq!((n, held), (1, Some(write.clone())));
        t.remove(&write);
        assert_eq!((t.writes, t.claims.len()), (0, 1));
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn vectored_socket_io_moves_bytes_into_and_out_of_foreign_and_owned_regions() {
        use std::io::{Read, Write};
        use std::os::fd::AsFd;
        use std::os::unix::net::UnixStream;
        let (mut a, b) = UnixStream::pair().unwrap();
        let f = foreign(16);
        let o = MemoryRegion::allocate(16).unwrap();
        a.write_all(&(0u8..12).collect::<Vec<_>>()).unwrap();
        let n = recv_vectored(b.as_fd(), &[(&f, 2, 6), (&o, 10, 6)]).unwrap();
        assert_eq!(n, 12);
        assert_eq!(f.to_vec(2, 6).unwrap(), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(o.to_vec(10, 6).unwrap(), vec![6, 7, 8, 9, 10, 11]);
        let n = send_vectored(b.as_fd(), b"hd", &[(&o, 10, 6), (&f, 2, 6)]).unwrap();
        assert_eq!(n, 14);
        let mut got = [0u8; 14];
        a.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hd\x06\x07\x08\x09\x0a\x0b\x00\x01\x02\x03\x04\x05");
        // Claims are released: an exclusive borrow of the whole region succeeds.
        assert!(o.borrow_mut(0, 16).is_ok());
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn vectored_socket_io_refuses_bad_ranges_device_memory_and_held_claims() {
        use std::os::fd::AsFd;
        use std::os::unix::net::UnixStream;
        let (_a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let inner = |e: std::io::Error| *e.into_inner().unwrap().downcast::<MemoryError>().unwrap();
        let o = MemoryRegion::allocate(16).unwrap();
        let e = recv_vectored(b.as_fd(), &[(&o, 10, 7)]).unwrap_err();
        assert!(matches!(inner(e), MemoryError::AccessOutOfRange { .. }));
        let d = placeholder_device_region(0, 16);
        let e = send_vectored(b.as_fd(), b"", &[(&d, 0, 4)]).unwrap_err();
        assert!(matches!(inner(e), MemoryError::NotHostMemory { .. }));
        let held = o.borrow_mut(4, 4).unwrap();
        let e = recv_vectored(b.as_fd(), &[(&o, 0, 8)]).unwrap_err();
        assert!(matches!(inner(e), MemoryError::AccessConflict { .. }));
        drop(held);
        let e = recv_vectored(b.as_fd(), &[(&o, 0, 8)]).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    }

    #[test]
    fn shared_borrows_coexist_and_keep_writers_out() {
        let r = MemoryRegion::allocate(64).unwrap();
        r.write_at(0, &[5; 64]).unwrap();
        let a = r.borrow(0, 32).unwrap();
        let b = r.borrow(16, 32).unwrap();
        assert_eq!(&a[..], &[5; 32][..]);
        assert_eq!(b.len(), 32);
        assert!(r.to_vec(0, 64).is_ok(), "reads share with shared borrows");
        assert!(
            r.borrow_mut(40, 8).is_err(),
            "an exclusive borrow over a shared one"
        );
        assert!(
            r.write_at(60, &[1; 4]).is_ok(),
            "bytes outside every borrow"
        );
        drop((a, b));
        assert!(r.borrow_mut(0, 64).is_ok());
        assert!(foreign(8).borrow(0, 8).is_err());
    }

    #[test]
    fn checked_rows_bounds_every_row_and_overflow() {
        // 4 rows of 8 bytes every 16: the last ends at 3 * 16 + 8 = 56.
        assert_eq!(checked_rows(56, 0, 16, 8, 4), Ok(0..56));
        assert!(checked_rows(55, 0, 16, 8, 4).is_err());
        assert_eq!(checked_rows(10, 10, 5, 0, 1), Ok(10..10));
        assert_eq!(checked_rows(10, 3, 100, 7, 0), Ok(3..3));
        assert!(checked_rows(10, 11, 0, 0, 0).is_err());
        assert!(checked_rows(usize::MAX, 0, u64::MAX, 1, 2).is_err());
        assert!(checked_rows(usize::MAX, 1, 1 << 63, 0, 3).is_err());
        assert_eq!(rows_end(5, 0, 3, u64::MAX), Some(8));
    }

    #[test]
    fn checked_range_rejects_overflow_and_overrun() {
        assert_eq!(checked_range(0, 10, 10), Ok(0..10));
        assert_eq!(checked_range(10, 0, 10), Ok(10..10));
        assert!(checked_range(11, 0, 10).is_err());
        assert!(checked_range(5, 6, 10).is_err());
        assert!(checked_range(u64::MAX, 2, 10).is_err());
        assert!(checked_range(1, u64::MAX, 10).is_err());
    }

    #[test]
    fn allocate_is_aligned_zeroed_and_round_trips() {
        // Fewer pages under Miri, where checking each byte is slow.
        let pages = if cfg!(miri) { 1 } else { 3 };
        let r = MemoryRegion::allocate(pages * REGION_ALIGN + 5).unwrap();
        assert_eq!(r.as_ptr() as usize % REGION_ALIGN, 0);
        assert_eq!(r.kind(), MemoryKind::Host);
        assert!(r.to_vec(0, r.len() as u64).unwrap().iter().all(|&b| b == 0));
        r.write_at(7, b"hello").unwrap();
        assert_eq!(r.to_vec(7, 5).unwrap(), b"hello");
        r.fill(0, 3, 9).unwrap();
        assert_eq!(r.to_vec(0, 4).unwrap(), [9, 9, 9, 0]);
        assert!(matches!(
            r.write_at(r.len() as u64 - 2, b"abc"),
            Err(MemoryError::AccessOutOfRange {
                operand: Operand::Region,
                len: 3,
                ..
            })
        ));
        // A refused write leaves the bytes untouched.
        assert_eq!(r.to_vec(r.len() as u64 - 2, 2).unwrap(), [0, 0]);
        assert!(r.to_vec(0, u64::MAX).is_err());
    }

    #[test]
    fn zero_length_region_is_usable() {
        let r = MemoryRegion::allocate(0).unwrap();
        assert!(r.is_empty());
        r.write_at(0, &[]).unwrap();
        assert!(r.write_at(0, &[1]).is_err());
        assert!(r.borrow_mut(0, 0).unwrap().is_empty());
    }

    #[test]
    fn copy_to_checks_both_sides_and_handles_overlap() {
        let a = MemoryRegion::allocate(16).unwrap();
        let b = MemoryRegion::allocate(8).unwrap();
        a.write_at(0, &(0..16).collect::<Vec<u8>>()).unwrap();
        a.copy_to(4, &b, 2, 6).unwrap();
        assert_eq!(b.to_vec(0, 8).unwrap(), [0, 0, 4, 5, 6, 7, 8, 9]);
        let err = a.copy_to(12, &b, 0, 5).unwrap_err();
        assert!(
            matches!(
                err,
                MemoryError::AccessOutOfRange {
                    operand: Operand::Source,
                    offset: 12,
                    len: 5,
                    region_len: 16
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "bytes [12, 12+5) are outside the copy's source region of 16 bytes; keep offset + len \
             within the region's length"
        );
        assert!(matches!(
            a.copy_to(0, &b, 4, 5),
            Err(MemoryError::AccessOutOfRange {
                operand: Operand::Destination,
                ..
            })
        ));
        a.copy_to(0, &a, 2, 8).unwrap();
        assert_eq!(a.to_vec(0, 10).unwrap(), [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]);
        // The copy's claims were released: the whole region is free again.
        drop(a.borrow_mut(0, 16).unwrap());
        drop(b.borrow_mut(0, 8).unwrap());
    }

    #[test]
    fn borrows_are_exclusive_and_released_on_drop() {
        let r = MemoryRegion::allocate(64).unwrap();
        let mut s = r.borrow_mut(8, 8).unwrap();
        s.copy_from_slice(&[7; 8]);
        assert!(r.borrow_mut(12, 8).is_err());
        assert!(r.write_at(15, &[1]).is_err());
        assert!(r.read_at(0, &mut [0; 9]).is_err());
        assert!(r.fill(0, 64, 0).is_err());
        assert!(r.with_raw_range(8, 1, Access::Read, |_, _| ()).is_err());
        let other = r.borrow_mut(16, 8).unwrap();
        drop(other);
        drop(s);
        assert_eq!(r.to_vec(8, 8).unwrap(), [7; 8]);
        r.write_at(12, &[1]).unwrap();
    }

    #[test]
    fn conflicting_claims_are_refused_with_the_values_and_shared_reads_are_not() {
        let r = MemoryRegion::allocate(64).unwrap();
        let err = r
            .with_raw_range(16, 32, Access::Write, |_, _| r.write_at(0, &[1; 32]))
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(
                err,
                MemoryError::AccessConflict {
                    operand: Operand::Region,
                    access: Access::Write,
                    offset: 0,
                    len: 32,
                    region_len: 64,
                    held: Access::Write,
                    held_start: 16,
                    held_end: 48,
                }
            ),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("refused writing bytes [0, 0+32) of the 64-byte region")
                && text.contains("[16, 48) were still claimed for writing")
                && text.contains("drop a borrow before touching its bytes again"),
            "{text}"
        );
        // Reads share; a write next to them (not overlapping) is fine; one overlapping is not.
        r.with_raw_range(0, 32, Access::Read, |_, _| {
            assert_eq!(r.to_vec(16, 32).unwrap(), [0; 32]);
            r.copy_to(8, &r, 32, 8).unwrap();
            assert!(matches!(
                r.copy_to(40, &r, 24, 8),
                Err(MemoryError::AccessConflict {
                    operand: Operand::Destination,
                    ..
                })
            ));
            assert!(matches!(
                r.fill(31, 2, 0),
                Err(MemoryError::AccessConflict {
                    held: Access::Read,
                    ..
                })
            ));
        })
        .unwrap();
        let other = MemoryRegion::allocate(64).unwrap();
        let _busy = other.borrow_mut(0, 1).unwrap();
        assert!(matches!(
            r.copy_to(0, &other, 0, 8),
            Err(MemoryError::AccessConflict {
                operand: Operand::Destination,
                ..
            })
        ));
        // The refused copy released its source claim.
        r.fill(0, 64, 3).unwrap();
    }

    #[test]
    fn raw_copies_claim_both_ends_like_copy_to() {
        let a = MemoryRegion::allocate(32).unwrap();
        let b = MemoryRegion::allocate(32).unwrap();
        a.write_at(0, &(0..32).collect::<Vec<u8>>()).unwrap();
        let copied = a
            .with_raw_copy(4, &b, 8, 16, |s, d, n| {
                assert_eq!(n, 16);
                // Both ends are claimed while the hook runs.
                assert!(a.write_at(4, &[0]).is_err());
                assert!(b.read_at(8, &mut [0]).is_err());
                // SAFETY: the hook's contract: `n` readable bytes at `s` and `n` writable
                // bytes at `d`, in two different regions.
                unsafe { std::ptr::copy_nonoverlapping(s, d, n) };
                n
            })
            .unwrap();
        assert_eq!(copied, 16);
        assert_eq!(b.to_vec(8, 16).unwrap(), (4..20).collect::<Vec<u8>>());
        let _busy = b.borrow_mut(30, 2).unwrap();
        let r = a.with_raw_copy(0, &b, 24, 8, |_, _, _| panic!("must not run"));
        assert!(
            matches!(
                r,
                Err(MemoryError::AccessConflict {
                    operand: Operand::Destination,
                    held_start: 30,
                    held_end: 32,
                    ..
                })
            ),
            "{r:?}"
        );
        let r = a.with_raw_copy(20, &b, 0, 13, |_, _, _| panic!("must not run"));
        assert!(
            matches!(
                r,
                Err(MemoryError::AccessOutOfRange {
                    operand: Operand::Source,
                    ..
                })
            ),
            "{r:?}"
        );
        // Within one region the two claims do not refuse each other; every claim is released.
        a.with_raw_copy(0, &a, 8, 16, |_, _, n| n).unwrap();
        drop(a.borrow_mut(0, 32).unwrap());
        drop(b.borrow_mut(0, 30).unwrap());
    }

    #[test]
    fn a_panicking_raw_access_releases_its_claim() {
        let r = MemoryRegion::allocate(16).unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            r.with_raw_range(0, 16, Access::Write, |_, _| panic!("inside the hook"))
        }));
        assert!(caught.is_err());
        r.write_at(0, &[1; 16]).unwrap();
    }

    #[test]
    fn foreign_memory_is_copied_never_borrowed_and_its_owner_stays_hidden() {
        let r = foreign(32);
        assert!(!r.can_borrow());
        r.write_at(0, b"xy").unwrap();
        assert_eq!(r.to_vec(0, 2).unwrap(), b"xy");
        let err = r.borrow_mut(0, 2).unwrap_err();
        assert!(
            matches!(err, MemoryError::ForeignBorrow { offset: 0, len: 2 }),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("read_at / write_at / copy_to"),
            "{err}"
        );
        // Raw access is claimed like any other.
        let got = r
            .with_raw_range(0, 2, Access::Read, |ptr, len| {
                let mut out = [0u8; 2];
                // SAFETY: the hook's contract: `len` bytes at `ptr` are valid and claimed.
                unsafe { std::ptr::copy_nonoverlapping(ptr, out.as_mut_ptr(), len) };
                out
            })
            .unwrap();
        assert_eq!(&got, b"xy");
        assert!(r.tag::<u32>().is_none());
    }

    #[test]
    fn tags_are_typed() {
        struct Mine(u8);
        let mut buf = vec![0u8; 8];
        let ptr = NonNull::new(buf.as_mut_ptr()).unwrap();
        // SAFETY: as in `foreign`; the tag carries no access to the bytes.
        let r = unsafe {
            MemoryRegion::from_raw_parts(
                ForeignMemory::host(ptr, 8, buf).with_tag(Arc::new(Mine(7))),
            )
        };
        assert_eq!(r.tag::<Mine>().unwrap().0, 7);
        assert!(r.tag::<u8>().is_none());
        assert!(MemoryRegion::allocate(8).unwrap().tag::<Mine>().is_none());
    }

    #[test]
    fn device_memory_is_refused_by_every_cpu_accessor() {
        let d = placeholder_device_region(3, 4096);
        let host = MemoryRegion::allocate(4096).unwrap();
        assert_eq!(d.kind(), MemoryKind::Device { id: 3 });
        assert_eq!(d.len(), 4096);
        let refused = |r: Result<(), MemoryError>, want: Operand| match r {
            Err(MemoryError::NotHostMemory {
                operand,
                kind: MemoryKind::Device { id: 3 },
                len: 4096,
            }) => assert_eq!(operand, want),
            other => panic!("{other:?}"),
        };
        refused(d.read_at(0, &mut [0; 4]), Operand::Region);
        refused(d.write_at(0, &[0; 4]), Operand::Region);
        refused(d.fill(0, 4, 0), Operand::Region);
        refused(d.to_vec(0, 4).map(drop), Operand::Region);
        refused(d.borrow_mut(0, 4).map(drop), Operand::Region);
        refused(
            d.with_raw_range(0, 4, Access::Read, |_, _| ()),
            Operand::Region,
        );
        refused(d.copy_to(0, &host, 0, 4), Operand::Source);
        refused(d.copy_to(0, &d, 8, 4), Operand::Source);
        refused(host.copy_to(0, &d, 0, 4), Operand::Destination);
        refused(
            host.with_raw_copy(0, &d, 0, 4, |_, _, _| ()),
            Operand::Destination,
        );
        let text = d.read_at(0, &mut [0; 4]).unwrap_err().to_string();
        assert!(
            text.contains("the region is device memory (device 3) (4096 bytes)")
                && text.contains("capabilities declare device_memory"),
            "{text}"
        );
        // Zero-length accesses are refused too: the kind is wrong, not the range.
        refused(d.write_at(0, &[]), Operand::Region);
    }

    #[test]
    fn concurrent_overlapping_writes_from_two_clones() {
        // Two threads write overlapping bytes through clones of one region: each write runs
        // alone or is refused, so Miri sees no data race, and every byte ends as a value one
        // of the writes left there.
        let a = MemoryRegion::allocate(64).unwrap();
        let b = a.clone();
        let t = std::thread::spawn(move || b.write_at(16, &[2; 32]));
        let first = a.write_at(0, &[1; 32]);
        let second = t.join().unwrap();
        assert!(first.is_ok() || second.is_ok(), "{first:?} {second:?}");
        for r in [first, second] {
            assert!(
                matches!(r, Ok(()) | Err(MemoryError::AccessConflict { .. })),
                "{r:?}"
            );
        }
        let got = a.to_vec(0, 64).unwrap();
        assert!(got[..16].iter().all(|&x| x <= 1));
        assert!(got[16..48].iter().all(|&x| x <= 2));
        assert!(got[48..].iter().all(|&x| x == 0));
    }

    #[test]
    fn a_conflicting_write_waits_for_the_other_access_instead_of_failing() {
        // Two transfers writing the same bytes (two prefill ranks sending one aux row) are
        // serialised: the second write waits until the first access's claim is released.
        let a = MemoryRegion::allocate(64).unwrap();
        let b = a.clone();
        let held = a.borrow_mut(0, 64).unwrap();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            started_tx.send(()).unwrap();
            b.write_at(16, &[2; 32])
        });
        started_rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(if cfg!(miri) { 1 } else { 20 }));
        drop(held);
        t.join().unwrap().unwrap();
        assert_eq!(a.to_vec(16, 32).unwrap(), vec![2; 32]);
    }

    #[test]
    fn gather_to_lands_rows_back_to_back_and_refuses_bad_rows_whole() {
        let src = MemoryRegion::allocate(4096).unwrap();
        let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        src.write_at(0, &pattern).unwrap();
        let dst = MemoryRegion::allocate(512).unwrap();
        dst.fill(0, 512, 0xee).unwrap();
        // Out of order, of any length, one empty.
        let rows: [(u64, u64); 5] = [(100, 10), (0, 5), (3000, 0), (2000, 100), (4090, 6)];
        assert_eq!(src.gather_to(&rows, &dst, 7).unwrap(), 121);
        let mut want = vec![0xee; 512];
        let mut at = 7;
        for (offset, len) in rows.map(|(o, l)| (o as usize, l as usize)) {
            want[at..at + len].copy_from_slice(&pattern[offset..offset + len]);
            at += len;
        }
        assert_eq!(dst.to_vec(0, 512).unwrap(), want);
        // Refusals name the end refused and move nothing.
        let refused = |rows: &[(u64, u64)], dst_offset| {
            let before = dst.to_vec(0, 512).unwrap();
            let e = src.gather_to(rows, &dst, dst_offset).unwrap_err();
            assert_eq!(dst.to_vec(0, 512).unwrap(), before, "{rows:?} moved bytes");
            e
        };
        // The end an out-of-range refusal names.
        let out_of_range = |rows: &[(u64, u64)]| match refused(rows, 0) {
            MemoryError::AccessOutOfRange { operand, .. } => Ok(operand),
            e => Err(e.to_string()),
        };
        assert_eq!(out_of_range(&[(0, 8), (4090, 7)]), Ok(Operand::Source));
        assert_eq!(out_of_range(&[(0, 8), (u64::MAX, 2)]), Ok(Operand::Source));
        assert_eq!(
            out_of_range(&[(0, 300), (1000, 300)]),
            Ok(Operand::Destination)
        );
        let held = dst.borrow(100, 1).unwrap();
        let e = refused(&[(0, 200)], 0);
        assert!(
            matches!(
                e,
                MemoryError::AccessConflict {
                    operand: Operand::Destination,
                    ..
                }
            ),
            "{e}"
        );
        drop(held);
        // Into the same region: row by row.
        assert_eq!(src.gather_to(&[(10, 4), (0, 4)], &src, 1000).unwrap(), 8);
        let mut same = pattern[10..14].to_vec();
        same.extend_from_slice(&pattern[0..4]);
        assert_eq!(src.to_vec(1000, 8).unwrap(), same);
        // Nothing to gather.
        assert_eq!(src.gather_to(&[], &dst, 512).unwrap(), 0);
        // Device memory is refused.
        let device = placeholder_device_region(0, 64);
        let e = device.gather_to(&[(0, 8)], &dst, 0).unwrap_err();
        assert!(matches!(e, MemoryError::NotHostMemory { .. }), "{e}");
    }

    #[test]
    fn concurrent_overlapping_accesses_through_every_accessor() {
        // Each writer writes one uniform byte over the whole of [0, 64) through one accessor;
        // every read that is not refused must see uniform bytes (no torn write), and Miri
        // checks that no two accesses raced. Regions: `r` (owned), `f` (foreign), `s` (source).
        const ROUNDS: u8 = if cfg!(miri) { 3 } else { 200 };
        let r = MemoryRegion::allocate(96).unwrap();
        let f = foreign(96);
        let s = MemoryRegion::allocate(96).unwrap();
        let uniform = |v: &[u8]| v.iter().all(|&x| x == v[0]);
        let (s, uniform) = (&s, &uniform);
        std::thread::scope(|scope| {
            for target in [&r, &f] {
                scope.spawn(move || {
                    for i in 0..ROUNDS {
                        let _ = target.write_at(0, &[i; 64]);
                        let _ = target.fill(0, 64, i.wrapping_add(1));
                        let _ = s.copy_to(0, target, 0, 64);
                        let _ = s.gather_to(&[(0, 32), (32, 32)], target, 0);
                        let _ = target.copy_to(32, target, 0, 64);
                        let _ = target.gather_to(&[(0, 16), (16, 16)], target, 32);
                    }
                });
                scope.spawn(move || {
                    for i in 0..ROUNDS {
                        if let Ok(mut slice) = target.borrow_mut(16, 64) {
                            slice.fill(i);
                            assert!(slice.iter().all(|&b| b == i));
                        }
                        let _ = target.with_raw_range(0, 64, Access::Write, |ptr, len| {
                            // SAFETY: the hook's contract: `len` bytes at `ptr`, claimed
                            // exclusively while this runs.
                            unsafe { std::ptr::write_bytes(ptr, i, len) };
                            // SAFETY: as above.
                            let back = unsafe { std::slice::from_raw_parts(ptr, len) };
                            assert!(back.iter().all(|&b| b == i));
                        });
                    }
                });
                scope.spawn(move || {
                    for _ in 0..ROUNDS {
                        if let Ok(v) = target.to_vec(0, 64) {
                            assert!(uniform(&v[..16]), "{v:?}");
                        }
                        let mut buf = [0u8; 16];
                        if target.read_at(0, &mut buf).is_ok() {
                            assert!(uniform(&buf), "{buf:?}");
                        }
                        if let Ok(slice) = target.borrow(16, 16) {
                            assert!(uniform(&slice), "{:?}", &slice[..]);
                        }
                        let _ = target.copy_to(0, s, 0, 64);
                        let _ = target.gather_to(&[(0, 16), (16, 16)], s, 0);
                        let _ = target.with_raw_range(0, 16, Access::Read, |ptr, len| {
                            // SAFETY: the hook's contract: `len` readable bytes at `ptr`,
                            // written by no one while this runs.
                            let v = unsafe { std::slice::from_raw_parts(ptr, len) };
                            assert!(uniform(v), "{v:?}");
                        });
                    }
                });
            }
        });
        // Every claim was released.
        for region in [&r, s] {
            drop(region.borrow_mut(0, 96).unwrap());
        }
        f.fill(0, 96, 0).unwrap();
    }

    #[cfg(not(miri))]
    mod claims {
        use super::super::{Access, Claim, ClaimTable};
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Step {
            Claim(Vec<(usize, usize, bool)>),
            Release(usize),
            /// Released in one call, as a vectored socket call releases its claims.
            ReleaseAll(usize),
        }

        fn step() -> impl Strategy<Value = Step> {
            prop_oneof![
                proptest::collection::vec((0usize..64, 0usize..24, any::<bool>()), 1..3)
                    .prop_map(Step::Claim),
                // Many short reads at once (rows of a send), some of them the same.
                proptest::collection::vec((0usize..256, 0usize..4), 5..12).prop_map(|rows| {
                    Step::Claim(rows.into_iter().map(|(at, len)| (at, len, false)).collect())
                }),
                (0usize..16).prop_map(Step::Release),
                (0usize..16).prop_map(Step::ReleaseAll),
            ]
        }

        /// The table's claims as a sorted list, to compare with the model's.
        fn sorted<'a>(claims: impl Iterator<Item = &'a Claim>) -> Vec<(usize, usize, bool)> {
            let mut v: Vec<_> = claims
                .map(|c| (c.range.start, c.range.end, c.access == Access::Write))
                .collect();
            v.sort_unstable();
            v
        }

        proptest! {
            /// Whatever is claimed and released, the table never holds two claims that
            /// conflict unless they were taken together by one access, and it refuses a claim
            /// exactly when a held one conflicts with it.
            #[test]
            fn the_table_never_grants_conflicting_claims(steps in proptest::collection::vec(step(), 1..60)) {
                let mut table = ClaimTable::default();
                // The model: groups of claims, one per granted access.
                let mut held: Vec<Vec<Claim>> = Vec::new();
                for s in steps {
                    match s {
                        Step::Claim(parts) => {
                            let want: Vec<Claim> = parts
                                .into_iter()
                                .map(|(start, len, write)| Claim {
                                    range: start..start + len,
                                    access: if write { Access::Write } else { Access::Read },
                                })
                                .collect();
                            let blocked = want.iter().any(|w| {
                                held.iter().flatten().any(|h| h.conflicts(w))
                            });
                            let got = table.try_insert(&want);
                            prop_assert_eq!(got.is_err(), blocked);
                            if got.is_ok() {
                                held.push(want);
                            }
                        }
                        Step::Release(i) if i < held.len() => {
                            for c in held.remove(i) {
                                table.remove(&c);
                            }
                        }
                        Step::ReleaseAll(i) if i < held.len() => {
                            // As recorded: empty claims never are.
                            let gone: Vec<Claim> =
                                held.remove(i).into_iter().filter(|c| !c.range.is_empty()).collect();
                            table.remove_all(&gone);
                        }
                        Step::Release(_) | Step::ReleaseAll(_) => {}
                    }
                    let live: Vec<&Claim> = held.iter().flatten().filter(|c| !c.range.is_empty()).collect();
                    prop_assert_eq!(sorted(table.claims.iter()), sorted(live.iter().copied()));
                    let writes = live.iter().filter(|c| c.access == Access::Write).count();
                    prop_assert_eq!(table.writes, writes);
                    for (gi, g) in held.iter().enumerate() {
                        for (hi, h) in held.iter().enumerate() {
                            if gi != hi {
                                for a in g {
                                    prop_assert!(!h.iter().any(|b| a.conflicts(b)));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
