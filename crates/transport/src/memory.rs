//! Registered memory: the one place in this crate that touches raw memory.
//!
//! A [`MemoryRegion`] is a fixed-size byte range that transports read from and write into
//! concurrently, at disjoint offsets, like an RDMA-registered buffer. It is either owned
//! (allocated here: page-aligned, zeroed and pre-faulted) or foreign (engine or GPU memory,
//! or a shared-memory mapping, registered through the `unsafe` [`MemoryRegion::from_raw_parts`]).
//!
//! Bounds and offset arithmetic live in safe functions ([`checked_range`]); only the copies
//! themselves are `unsafe`.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, RwLock, RwLockReadGuard};

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

enum Backing {
    /// Allocated by [`MemoryRegion::allocate`]; freed with this layout.
    Owned(Layout),
    /// Memory owned by someone else; kept alive by this handle.
    Foreign(Arc<dyn Any + Send + Sync>),
    /// Zero-length region: nothing to free.
    Empty,
}

struct Inner {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    /// Ranges currently handed out by [`MemoryRegion::borrow_mut`]. Plain accessors hold the
    /// read lock for the whole copy (checking they do not touch a borrowed range), and
    /// `borrow_mut` takes the write lock to record a range, so an exclusive slice is never
    /// created over bytes a copy is still touching.
    borrows: RwLock<Vec<Range<usize>>>,
}

// SAFETY: `Inner` only holds a pointer to memory it owns (or whose owner it keeps alive) and
// hands out access through methods that copy bytes; moving it between threads is sound.
unsafe impl Send for Inner {}
// SAFETY: concurrent access goes through `ptr::copy` on ranges checked against `len`, under the
// read lock of `borrows`; exclusive slices are only created for ranges recorded in `borrows`
// under its write lock, which rejects ranges overlapping other borrows, and accessors refuse
// borrowed ranges.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Backing::Owned(layout) = self.backing {
            // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` in `allocate` and is freed once,
            // here, when the last handle drops.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// A registered memory region: fixed length, shared by cheap clones, written concurrently at
/// disjoint offsets by transports.
///
/// Concurrency contract (the same as RDMA-registered memory): the region does not order
/// concurrent accesses to *overlapping* bytes; the transfer plan guarantees writers never
/// overlap. Exclusive slices ([`borrow_mut`](Self::borrow_mut)) are tracked and overlapping
/// accesses to them are refused.
#[derive(Clone)]
pub struct MemoryRegion {
    inner: Arc<Inner>,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("ptr", &self.inner.ptr)
            .field("len", &self.inner.len)
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

impl MemoryRegion {
    /// Allocates an owned region of `len` bytes: page-aligned, zeroed, and pre-faulted (every
    /// page touched once) so the first transfer into it does not pay for page faults.
    pub fn allocate(len: usize) -> Result<Self, AllocError> {
        if len == 0 {
            return Ok(Self::from_inner(
                NonNull::<u64>::dangling().cast(),
                0,
                Backing::Empty,
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
        Ok(Self::from_inner(ptr, len, Backing::Owned(layout)))
    }

    /// Wraps foreign memory (engine memory, a GPU buffer mapped into this process, a shared
    /// mapping) as a region. `owner` is kept alive as long as any clone of the region exists;
    /// transports may downcast it (see [`owner`](Self::owner)) to recognise their own memory.
    ///
    /// # Safety
    ///
    /// For as long as `owner` is alive:
    /// - `ptr` must be valid for reads and writes of `len` bytes;
    /// - the memory must not be deallocated or unmapped (keeping it alive is `owner`'s job);
    /// - nothing outside kvbridge may create Rust references to those bytes (other processes and
    ///   devices may write them, as with any shared or DMA memory).
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        Self::from_inner(ptr, len, Backing::Foreign(owner))
    }

    fn from_inner(ptr: NonNull<u8>, len: usize, backing: Backing) -> Self {
        Self {
            inner: Arc::new(Inner {
                ptr,
                len,
                backing,
                borrows: RwLock::new(Vec::new()),
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

    /// The base address, for transports that hand it to hardware (RDMA registration, DMA).
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.ptr.as_ptr()
    }

    /// The owner passed to [`from_raw_parts`](Self::from_raw_parts), if any.
    pub fn owner(&self) -> Option<&Arc<dyn Any + Send + Sync>> {
        match &self.inner.backing {
            Backing::Foreign(owner) => Some(owner),
            _ => None,
        }
    }

    /// Whether two handles refer to the same region.
    pub fn same_region(&self, other: &MemoryRegion) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Checks `[offset, offset + len)` against this region.
    pub fn range(&self, offset: u64, len: u64) -> Result<Range<usize>, RangeError> {
        checked_range(offset, len, self.inner.len)
    }

    /// Takes the read lock of the borrow table (released when the guard drops).
    fn access(&self) -> RwLockReadGuard<'_, Vec<Range<usize>>> {
        self.inner.borrows.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Refuses `range` if it overlaps a live [`borrow_mut`](Self::borrow_mut) slice.
    fn check_unborrowed(
        &self,
        borrows: &[Range<usize>],
        range: &Range<usize>,
    ) -> Result<(), RangeError> {
        if !range.is_empty() && overlaps_any(borrows, range) {
            return Err(RangeError {
                offset: range.start as u64,
                len: range.len() as u64,
                region_len: self.inner.len as u64,
            });
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), RangeError> {
        let range = self.range(offset, dst.len() as u64)?;
        let borrows = self.access();
        self.check_unborrowed(&borrows, &range)?;
        // SAFETY: `range` is inside the region (checked above) and not borrowed exclusively
        // (checked under the read lock we still hold); `dst` is a distinct Rust slice, so the
        // two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.as_ptr().add(range.start),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), RangeError> {
        let range = self.range(offset, src.len() as u64)?;
        let borrows = self.access();
        self.check_unborrowed(&borrows, &range)?;
        // SAFETY: `range` is inside the region and not borrowed (checked above, lock held);
        // `src` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.as_ptr().add(range.start), src.len());
        }
        Ok(())
    }

    /// Fills `[offset, offset + len)` with `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<(), RangeError> {
        let range = self.range(offset, len)?;
        let borrows = self.access();
        self.check_unborrowed(&borrows, &range)?;
        // SAFETY: `range` is inside the region and not borrowed (checked above, lock held).
        unsafe { std::ptr::write_bytes(self.as_ptr().add(range.start), byte, range.len()) };
        Ok(())
    }

    /// Copies `len` bytes from `self[src_offset..]` to `dst[dst_offset..]`. Both ranges are
    /// checked before any byte moves; `dst` may be the same region (overlap is handled).
    pub fn copy_to(
        &self,
        src_offset: u64,
        dst: &MemoryRegion,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), CopyError> {
        let src_range = self.range(src_offset, len).map_err(CopyError::Source)?;
        let dst_range = dst.range(dst_offset, len).map_err(CopyError::Destination)?;
        // Hold both read locks for the copy; take them in address order (and once for the same
        // region) so two opposite copies and queued `borrow_mut` writers cannot deadlock.
        let (src_guard, dst_guard);
        let (src_borrows, dst_borrows): (&[Range<usize>], &[Range<usize>]) =
            if self.same_region(dst) {
                src_guard = self.access();
                (&src_guard, &src_guard)
            } else if Arc::as_ptr(&self.inner) < Arc::as_ptr(&dst.inner) {
                src_guard = self.access();
                dst_guard = dst.access();
                (&src_guard, &dst_guard)
            } else {
                dst_guard = dst.access();
                src_guard = self.access();
                (&src_guard, &dst_guard)
            };
        self.check_unborrowed(src_borrows, &src_range)
            .map_err(CopyError::Source)?;
        dst.check_unborrowed(dst_borrows, &dst_range)
            .map_err(CopyError::Destination)?;
        // SAFETY: both ranges are inside their regions and not borrowed (checked above, locks
        // held); `ptr::copy` permits overlap when `dst` is this same region.
        unsafe {
            std::ptr::copy(
                self.as_ptr().add(src_range.start),
                dst.as_ptr().add(dst_range.start),
                src_range.len(),
            );
        }
        Ok(())
    }

    /// Returns a copy of `[offset, offset + len)`.
    pub fn to_vec(&self, offset: u64, len: u64) -> Result<Vec<u8>, RangeError> {
        let range = self.range(offset, len)?;
        let mut out = vec![0; range.len()];
        self.read_at(offset, &mut out)?;
        Ok(out)
    }

    /// Borrows `[offset, offset + len)` exclusively as a mutable slice, e.g. to read a socket's
    /// payload straight into the region. Refused while an overlapping borrow is alive; plain
    /// accessors touching a borrowed range are refused too.
    pub fn borrow_mut(&self, offset: u64, len: u64) -> Result<RegionSliceMut, RangeError> {
        let range = self.range(offset, len)?;
        // The write lock waits for in-flight copies (they hold the read lock) to finish.
        let mut borrows = self
            .inner
            .borrows
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if !range.is_empty() && overlaps_any(&borrows, &range) {
            return Err(RangeError {
                offset,
                len,
                region_len: self.inner.len as u64,
            });
        }
        borrows.push(range.clone());
        Ok(RegionSliceMut {
            region: self.clone(),
            range,
        })
    }
}

fn overlaps_any(borrows: &[Range<usize>], range: &Range<usize>) -> bool {
    borrows
        .iter()
        .any(|b| b.start < range.end && range.start < b.end)
}

/// A failed [`MemoryRegion::copy_to`]: which side was out of range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyError {
    /// The source range does not fit (or is borrowed).
    Source(RangeError),
    /// The destination range does not fit (or is borrowed).
    Destination(RangeError),
}

impl fmt::Display for CopyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CopyError::Source(e) => write!(f, "source {e}"),
            CopyError::Destination(e) => write!(f, "destination {e}"),
        }
    }
}

impl std::error::Error for CopyError {}

/// An exclusive mutable view of part of a [`MemoryRegion`], released on drop.
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
        // SAFETY: the range is inside the region and recorded in `borrows`, so no other slice
        // of it exists and the plain accessors refuse to touch it while this view lives.
        unsafe {
            std::slice::from_raw_parts(self.region.as_ptr().add(self.range.start), self.range.len())
        }
    }
}

impl std::ops::DerefMut for RegionSliceMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` guarantees this is the only use of the view.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.region.as_ptr().add(self.range.start),
                self.range.len(),
            )
        }
    }
}

impl Drop for RegionSliceMut {
    fn drop(&mut self) {
        let mut borrows = self
            .region
            .inner
            .borrows
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(i) = borrows.iter().position(|b| *b == self.range) {
            borrows.swap_remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

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
        let r = MemoryRegion::allocate(3 * REGION_ALIGN + 5).unwrap();
        assert_eq!(r.as_ptr() as usize % REGION_ALIGN, 0);
        assert!(r.to_vec(0, r.len() as u64).unwrap().iter().all(|&b| b == 0));
        r.write_at(7, b"hello").unwrap();
        assert_eq!(r.to_vec(7, 5).unwrap(), b"hello");
        r.fill(0, 3, 9).unwrap();
        assert_eq!(r.to_vec(0, 4).unwrap(), [9, 9, 9, 0]);
        assert!(r.write_at(r.len() as u64 - 2, b"abc").is_err());
        // A refused write leaves the bytes untouched.
        assert_eq!(r.to_vec(r.len() as u64 - 2, 2).unwrap(), [0, 0]);
    }

    #[test]
    fn zero_length_region_is_usable() {
        let r = MemoryRegion::allocate(0).unwrap();
        assert!(r.is_empty());
        r.write_at(0, &[]).unwrap();
        assert!(r.write_at(0, &[1]).is_err());
    }

    #[test]
    fn copy_to_checks_both_sides_and_handles_overlap() {
        let a = MemoryRegion::allocate(16).unwrap();
        let b = MemoryRegion::allocate(8).unwrap();
        a.write_at(0, &(0..16).collect::<Vec<u8>>()).unwrap();
        a.copy_to(4, &b, 2, 6).unwrap();
        assert_eq!(b.to_vec(0, 8).unwrap(), [0, 0, 4, 5, 6, 7, 8, 9]);
        assert!(matches!(a.copy_to(12, &b, 0, 5), Err(CopyError::Source(_))));
        assert!(matches!(
            a.copy_to(0, &b, 4, 5),
            Err(CopyError::Destination(_))
        ));
        a.copy_to(0, &a, 2, 8).unwrap();
        assert_eq!(a.to_vec(0, 10).unwrap(), [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn borrows_are_exclusive_and_released_on_drop() {
        let r = MemoryRegion::allocate(64).unwrap();
        let mut s = r.borrow_mut(8, 8).unwrap();
        s.copy_from_slice(&[7; 8]);
        assert!(r.borrow_mut(12, 8).is_err());
        assert!(r.write_at(15, &[1]).is_err());
        assert!(r.read_at(0, &mut [0; 9]).is_err());
        let other = r.borrow_mut(16, 8).unwrap();
        drop(other);
        drop(s);
        assert_eq!(r.to_vec(8, 8).unwrap(), [7; 8]);
        r.write_at(12, &[1]).unwrap();
    }

    #[test]
    fn foreign_memory_keeps_its_owner_alive() {
        let buf: Arc<Mutex<Vec<u8>>> = Arc::new(Mutex::new(vec![0u8; 32]));
        let ptr = NonNull::new(buf.lock().unwrap().as_mut_ptr()).unwrap();
        // SAFETY: the Vec is never resized and `buf` (the owner) keeps it alive.
        let r = unsafe { MemoryRegion::from_raw_parts(ptr, 32, buf.clone()) };
        r.write_at(0, b"xy").unwrap();
        assert!(
            r.owner()
                .unwrap()
                .downcast_ref::<Mutex<Vec<u8>>>()
                .is_some()
        );
        drop(buf);
        assert_eq!(r.to_vec(0, 2).unwrap(), b"xy");
    }

    #[test]
    fn concurrent_disjoint_writers_and_readers() {
        // Under Miri this checks that copies into disjoint ranges from several threads are
        // race-free (the way transports write a region).
        let region = MemoryRegion::allocate(256).unwrap();
        let source = MemoryRegion::allocate(256).unwrap();
        source.fill(0, 256, 5).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (region, source) = (&region, &source);
                s.spawn(move || {
                    for _ in 0..4 {
                        region.write_at(t * 64, &[t as u8 + 1; 32]).unwrap();
                        source
                            .copy_to(t * 64 + 32, region, t * 64 + 32, 32)
                            .unwrap();
                        let mut back = [0u8; 64];
                        region.read_at(t * 64, &mut back).unwrap();
                        assert_eq!(back[..32], [t as u8 + 1; 32]);
                        assert_eq!(back[32..], [5; 32]);
                    }
                });
            }
        });
    }

    #[test]
    fn borrow_never_aliases_an_in_flight_copy() {
        // A thread copying into [0, 64) races a thread borrowing [32, 96) exclusively: each
        // attempt either gets the bytes to itself or is refused; Miri reports any overlap.
        let region = MemoryRegion::allocate(128).unwrap();
        let other = MemoryRegion::allocate(128).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..8u8 {
                    let _ = region.write_at(0, &[i; 64]);
                    let _ = other.copy_to(0, &region, 0, 64);
                    let _ = region.copy_to(64, &other, 0, 64);
                }
            });
            s.spawn(|| {
                for i in 0..8u8 {
                    if let Ok(mut slice) = region.borrow_mut(32, 64) {
                        slice.fill(i);
                        assert!(slice.iter().all(|&b| b == i));
                    }
                }
            });
            s.spawn(|| {
                for _ in 0..8 {
                    let _ = other.copy_to(0, &region, 64, 64);
                }
            });
        });
    }
}
