//! The mapping layer: the only module of `kvbridge-shm` with `unsafe` code.
//!
//! It creates sealed memfd regions, maps region files handed over by a peer, and wraps both as
//! [`MemoryRegion`]s (foreign memory, tagged with their [`SharedMapping`] so this crate
//! recognises its own). Every bounds check and claim on transfers happens in `MemoryRegion`
//! (through [`MemoryRegion::copy_to`], or [`MemoryRegion::with_raw_range`] for the streaming
//! copy); the `unsafe` blocks here only assert that a mapping stays valid for as long as the
//! region that wraps it, and copy inside claimed ranges.
//!
//! Why the checks on a peer's file matter: a writable shared mapping of a file that can shrink
//! turns a truncation by the peer into `SIGBUS` in this process. So a peer's file is mapped only
//! if it is sealed against shrinking (`F_SEAL_SHRINK`), is at least as long as the peer says, and
//! is fully allocated (so mapping it cannot make this process allocate memory for the peer).
#![allow(unsafe_code)]

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use kvbridge_transport::{
    Access, ForeignMemory, MemoryError, MemoryRegion, Operand, TransportError,
};
use memmap2::{Advice, MmapOptions, MmapRaw};
use rustix::fs::{FallocateFlags, FileType, MemfdFlags, SealFlags};

use crate::ShmError;

/// A shared, sealed memfd mapping owned by this process (the owner of a region allocated by
/// [`ShmTransport::allocate`](crate::ShmTransport)), or this process's mapping of a peer's region.
pub(crate) struct SharedMapping {
    map: MmapRaw,
    fd: OwnedFd,
}

impl std::fmt::Debug for SharedMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMapping")
            .field("len", &self.map.len())
            .finish()
    }
}

impl SharedMapping {
    /// The memfd, to hand to a peer.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn map_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ShmError {
    let what = what.into();
    move |source| ShmError::Map { what, source }
}

/// Maps `len` bytes of `fd` shared and read-write, with page tables populated for writing so
/// the first copy into it pays no page faults, and transparent huge pages requested.
fn map_populated(fd: &OwnedFd, len: usize) -> Result<MmapRaw, ShmError> {
    let map = MmapOptions::new()
        .len(len)
        .map_raw(fd)
        .map_err(map_err(format!("mmap of a {len}-byte shared region")))?;
    // Transparent huge pages for shared memory depend on
    // /sys/kernel/mm/transparent_hugepage/shmem_enabled; the advice is harmless where off.
    let _ = map.advise(Advice::HugePage);
    if map.advise(Advice::PopulateWrite).is_ok() {
        return Ok(map);
    }
    // Kernels before 5.14 lack MADV_POPULATE_WRITE: map again with MAP_POPULATE.
    drop(map);
    MmapOptions::new()
        .len(len)
        .populate()
        .map_raw(fd)
        .map_err(map_err(format!(
            "mmap (populate) of a {len}-byte shared region"
        )))
}

fn wrap(mapping: Arc<SharedMapping>) -> Result<MemoryRegion, ShmError> {
    let len = mapping.map.len();
    let ptr = NonNull::new(mapping.map.as_mut_ptr()).ok_or_else(|| ShmError::Map {
        what: "mmap".into(),
        source: std::io::Error::other("the kernel returned a null mapping"),
    })?;
    let memory = ForeignMemory::host(ptr, len, Arc::clone(&mapping)).with_tag(mapping);
    // SAFETY: `ptr` is the start of a live shared read-write mapping of exactly `len` bytes
    // (mmap lengths fit `isize`). The owner keeps the `MmapRaw` (and so the mapping) alive for
    // as long as any clone of the region exists. The file behind it is sealed against shrinking
    // and fully allocated (checked in `allocate` / `map_remote`), so no access within `len` can
    // fault with SIGBUS. Each mapping is wrapped once, here, by exactly one region. This crate
    // creates no Rust references to the bytes: all access goes through `MemoryRegion`'s claimed
    // raw copies; other processes (and other mappings of the file) writing them is the
    // shared-memory case the contract allows. The tag is a `pub(crate)` type whose only
    // accessors (`fd`) give no access to the bytes without more `unsafe`.
    Ok(unsafe { MemoryRegion::from_raw_parts(memory) })
}

/// Allocates a sealed, pre-faulted memfd region of `len` bytes. A zero-length region is an empty
/// heap region (there is nothing to share).
pub(crate) fn allocate(len: usize) -> Result<MemoryRegion, ShmError> {
    if len == 0 {
        return MemoryRegion::allocate(0).map_err(|e| ShmError::Map {
            what: "allocate".into(),
            source: std::io::Error::other(e.to_string()),
        });
    }
    let fd = rustix::fs::memfd_create(
        "kvbridge-shm",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(|e| map_err("memfd_create")(e.into()))?;
    rustix::fs::ftruncate(&fd, len as u64)
        .map_err(|e| map_err(format!("ftruncate of a memfd to {len} bytes"))(e.into()))?;
    // Allocate every page now: a full tmpfs fails here, not with SIGBUS in the middle of a copy,
    // and a peer can verify (st_blocks) that mapping this file costs it no memory of its own.
    rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64)
        .map_err(|e| map_err(format!("fallocate of {len} bytes of shared memory"))(e.into()))?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .map_err(|e| map_err("sealing a memfd against SHRINK|GROW")(e.into()))?;
    let map = map_populated(&fd, len)?;
    wrap(Arc::new(SharedMapping { map, fd }))
}

/// The shared mapping behind `region`, if `region` is exactly a mapping made by [`allocate`].
pub(crate) fn shared_of(region: &MemoryRegion) -> Option<Arc<SharedMapping>> {
    let mapping = region.tag::<SharedMapping>()?;
    (mapping.map.as_mut_ptr() == region.as_ptr() && mapping.map.len() == region.len())
        .then_some(mapping)
}

/// Checks a region file received from a peer and maps its first `len` bytes.
pub(crate) fn map_remote(region: u64, fd: OwnedFd, len: u64) -> Result<MemoryRegion, ShmError> {
    let refuse = |reason: String| ShmError::UnsafeRemoteRegion { region, reason };
    if len == 0 {
        return allocate(0);
    }
    let len_usize = usize::try_from(len)
        .ok()
        .filter(|l| *l <= isize::MAX as usize)
        .ok_or_else(|| refuse(format!("its length {len} does not fit this address space")))?;
    let stat =
        rustix::fs::fstat(&fd).map_err(|e| refuse(format!("fstat of its file failed: {e}")))?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return Err(refuse(
            "its descriptor is not a regular (memfd) file".into(),
        ));
    }
    let size = u64::try_from(stat.st_size).unwrap_or(0);
    if size < len {
        return Err(refuse(format!(
            "its file has {size} bytes but the peer declared {len}"
        )));
    }
    let allocated = u64::try_from(stat.st_blocks)
        .unwrap_or(0)
        .saturating_mul(512);
    if allocated < len {
        return Err(refuse(format!(
            "only {allocated} of its {len} bytes are allocated (a sparse file)"
        )));
    }
    let seals = rustix::fs::fcntl_get_seals(&fd)
        .map_err(|e| refuse(format!("it is not a sealable memfd ({e})")))?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(refuse(
            "its file is not sealed against shrinking (F_SEAL_SHRINK), so the peer could make \
             writes into it fault"
                .into(),
        ));
    }
    let map = map_populated(&fd, len_usize)?;
    wrap(Arc::new(SharedMapping { map, fd }))
}

/// Runs `f` with `region[offset..offset + 4 * count]` claimed exclusively and seen as `count`
/// atomic 32-bit words: how the doorbell ring (`crate::doorbell`) reads and writes memory that
/// another process writes at the same time. Refused (as a range error) when the range is out of
/// bounds or not 4-byte aligned.
pub(crate) fn with_atomic_words<R>(
    region: &MemoryRegion,
    offset: u64,
    count: usize,
    f: impl FnOnce(&[AtomicU32]) -> R,
) -> kvbridge_transport::Result<R> {
    let len = (count as u64).saturating_mul(4);
    region.with_raw_range(offset, len, Access::Write, |ptr, n| {
        if ptr.align_offset(std::mem::align_of::<AtomicU32>()) != 0 || n != count * 4 {
            return Err(TransportError::InvalidArgument {
                transport: crate::NAME,
                message: format!(
                    "a doorbell ring at offset {offset} is not 4-byte aligned; rings start at the \
                     page-aligned base of their mapping"
                ),
            });
        }
        // SAFETY: `with_raw_range` hands out `n = 4 * count` valid bytes at `ptr`, claimed
        // exclusively for as long as this closure runs, so nothing else in this process touches
        // them; `ptr` is aligned for `AtomicU32` (checked above), which has the size and
        // alignment of `u32`. Every access this process makes to the words goes through these
        // atomics (interior mutability, so the shared slice may be written through), and the
        // slice does not outlive the closure. Other processes writing the same bytes (the peer of
        // a shared mapping, whatever it writes) are the shared-memory case the region's contract
        // allows: each word this process loads is some `u32`, and every value is checked before
        // use.
        let words = unsafe { std::slice::from_raw_parts(ptr.cast::<AtomicU32>(), count) };
        Ok(f(words))
    })?
}

/// Pieces at least this long are written with non-temporal (streaming) stores on x86-64.
pub(crate) const STREAM_MIN: u64 = 64 << 10;

/// Copies `len` bytes from `src[src_offset..]` into `dst[dst_offset..]`, both ranges checked
/// and claimed first (the source for reading, the destination for writing). Long copies bypass
/// the cache with streaming stores, as `memcpy` itself does only for copies of hundreds of
/// MiB: the destination is the peer's memory, which this process will not read again, and a
/// batch is copied in pieces of at most 1 MiB, far below `memcpy`'s own threshold. Short copies
/// (and copies within one region) use [`MemoryRegion::copy_to`].
pub(crate) fn copy_out(
    src: &MemoryRegion,
    src_offset: u64,
    dst: &MemoryRegion,
    dst_offset: u64,
    len: u64,
) -> kvbridge_transport::Result<()> {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN && !src.same_region(dst) {
        return src
            .with_raw_copy(src_offset, dst, dst_offset, len, |s, d, n| {
                // SAFETY: `with_raw_copy` hands out `n` valid bytes at `s`, claimed for reading,
                // and `n` valid bytes at `d` in another region, claimed for writing, for as long
                // as this closure runs; like the region's own copies, this one creates no
                // references to the bytes.
                unsafe { stream_copy(s, d, n) }
            })
            .map_err(Into::into);
    }
    Ok(src.copy_to(src_offset, dst, dst_offset, len)?)
}

/// The rows of a strided copy (see [`copy_rows`]).
struct Rows {
    src_offset: u64,
    src_stride: u64,
    dst_offset: u64,
    dst_stride: u64,
    len: u64,
    count: u64,
}

/// [`copy_rows`] row by row through the region's own checked copy: for one row, or rows
/// within one region.
fn copy_rows_one_by_one(
    src: &MemoryRegion,
    dst: &MemoryRegion,
    rows: &Rows,
    streaming: bool,
) -> kvbridge_transport::Result<()> {
    for i in 0..rows.count {
        let at = |offset: u64, stride: u64| offset.wrapping_add(i.wrapping_mul(stride));
        let so = at(rows.src_offset, rows.src_stride);
        let doff = at(rows.dst_offset, rows.dst_stride);
        if streaming {
            copy_out(src, so, dst, doff, rows.len)?;
        } else {
            src.copy_to(so, dst, doff, rows.len)?;
        }
    }
    Ok(())
}

/// Copies `count` rows of `len` bytes, row `i` from `src[src_offset + i * src_stride..]` into
/// `dst[dst_offset + i * dst_stride..]`: one strided op, or a run of its rows. Both spans (first
/// row's start to last row's end) are checked and claimed once, before any byte moves, and the
/// rows are copied in one tight loop inside the claims: no per-row checks or claims. Rows of 64
/// bytes or more are streamed (see [`copy_out`]) when `streaming` is set: the destination is a
/// peer's memory and the caller copies a long batch ([`STREAM_MIN`] or more in all), however
/// few rows this one call copies (a DCP 4 -> 1 relayout's ops are 16 rows each). Rows
/// overlapping on
/// the destination are the caller's to refuse (the transport does, at `post`); here they only
/// make the result depend on row order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_rows(
    src: &MemoryRegion,
    src_offset: u64,
    src_stride: u64,
    dst: &MemoryRegion,
    dst_offset: u64,
    dst_stride: u64,
    len: u64,
    count: u64,
    streaming: bool,
) -> kvbridge_transport::Result<()> {
    if count <= 1 || src.same_region(dst) {
        // One row, or a copy within one region (whose two claims must be taken together).
        let rows = Rows {
            src_offset,
            src_stride,
            dst_offset,
            dst_stride,
            len,
            count,
        };
        return copy_rows_one_by_one(src, dst, &rows, streaming);
    }
    // The span from the first row's start to the last row's end; `u64::MAX` (refused by the
    // claim as out of range) when it overflows.
    let span = |offset: u64, stride: u64| {
        kvbridge_transport::memory::rows_end(offset, stride, len, count)
            .map_or(u64::MAX, |end| end - offset)
    };
    let (src_span, dst_span) = (span(src_offset, src_stride), span(dst_offset, dst_stride));
    let stream = cfg!(target_arch = "x86_64") && streaming && len >= 64;
    let copied = src.with_raw_range(src_offset, src_span, Access::Read, |s, _| {
        dst.with_raw_range(dst_offset, dst_span, Access::Write, |d, _| {
            // The spans fit in `usize` (they are inside mapped regions), so every row offset
            // below does too: row `i < count` starts at `i * stride <= span - len`.
            let (len, src_stride, dst_stride) =
                (len as usize, src_stride as usize, dst_stride as usize);
            let count = count as usize;
            let mut first = 0;
            // Rows of whole cache lines into 16-byte aligned destinations (the DCP relayout's
            // 1152-byte rows) go `ROWS_AT_ONCE` at a time, a line of each in turn (many load
            // streams in flight), unless 64-byte stores are at hand: then each row on its own,
            // without prefetch, is faster (docs/benchmarks.md).
            let wide = stream && wide_stores();
            #[cfg(target_arch = "x86_64")]
            if stream && !wide && len % 64 == 0 && d.align_offset(16) == 0 && dst_stride % 16 == 0 {
                let rows: [usize; ROWS_AT_ONCE] = std::array::from_fn(|k| k);
                while first + ROWS_AT_ONCE <= count {
                    for k in first + ROWS_AT_ONCE..(first + 2 * ROWS_AT_ONCE).min(count) {
                        prefetch(s.wrapping_add(k * src_stride), len);
                    }
                    // SAFETY: rows `first..first + ROWS_AT_ONCE` are below `count`, so each lies
                    // inside both claimed spans, as in the loop below; destination rows start
                    // 16-byte aligned (`d` and the stride are); `len` is a multiple of 64.
                    unsafe {
                        stream_row_group(
                            rows.map(|k| s.add((first + k) * src_stride).cast_const()),
                            rows.map(|k| d.add((first + k) * dst_stride)),
                            len,
                        );
                    }
                    first += ROWS_AT_ONCE;
                }
            }
            for i in first..count {
                // Hardware prefetchers start over at every row: fetch a few rows ahead.
                if !wide && i + PREFETCH_ROWS < count {
                    prefetch(s.wrapping_add((i + PREFETCH_ROWS) * src_stride), len);
                }
                // SAFETY: row `i` lies inside both claimed spans (`i * stride + len <= span`),
                // so `len` bytes at `s + i * src_stride` are readable and written by no one in
                // this process, and `len` bytes at `d + i * dst_stride` are writable and
                // touched by nothing else in this process, for as long as these closures run;
                // the two spans are in different regions (checked above), so they do not
                // overlap. No references to the bytes are made.
                unsafe {
                    let (s, d) = (s.add(i * src_stride), d.add(i * dst_stride));
                    #[cfg(target_arch = "x86_64")]
                    if stream {
                        stream_rows(s, d, len);
                        continue;
                    }
                    std::ptr::copy_nonoverlapping(s, d, len);
                }
            }
            #[cfg(target_arch = "x86_64")]
            if stream {
                sfence();
            }
        })
    });
    match copied {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(naming(e, Operand::Destination)),
        Err(e) => Err(naming(e, Operand::Source)),
    }
}

/// One member of [`copy_together`]: `count` rows of `len` bytes, row `i` from
/// `src[src_offset + i * src_stride..]` into `dst[dst_offset + i * dst_stride..]`.
pub(crate) struct GangRows<'a> {
    pub src: &'a MemoryRegion,
    pub src_offset: u64,
    pub src_stride: u64,
    pub dst: &'a MemoryRegion,
    pub dst_offset: u64,
    pub dst_stride: u64,
    pub len: u64,
    pub count: u64,
}

/// Copies the rows of several members in one pass, in the order of their source addresses:
/// the rows a DCP relayout sends to different decode ranks lie interleaved in the same source
/// pages, so one pass reads the source once, front to back (what the hardware prefetcher
/// follows), and writes each row to its member's destination. Every member's two spans are
/// checked and claimed before any byte moves, as in [`copy_rows`]; a refused claim moves no
/// byte of any member and names the member (its index) it came from. Members must not write
/// the same bytes (the transport gangs batches with different destination regions); a member
/// whose source and destination are one region is refused.
pub(crate) fn copy_together(
    members: &[GangRows<'_>],
    streaming: bool,
) -> Result<(), (usize, TransportError)> {
    if let Some(k) = members.iter().position(|m| m.src.same_region(m.dst)) {
        return Err((
            k,
            TransportError::InvalidArgument {
                transport: crate::NAME,
                message: "rows copied together must not copy within one region".into(),
            },
        ));
    }
    let total = members
        .iter()
        .fold(0u64, |t, m| t.saturating_add(m.len.saturating_mul(m.count)));
    let stream = cfg!(target_arch = "x86_64")
        && streaming
        && members.iter().all(|m| m.len >= 64)
        && total >= STREAM_MIN;
    let mut bases = Vec::with_capacity(members.len());
    with_claims(members, &mut bases, &mut |bases| {
        // Row `next[k]` of member `k` is the next to copy; the member whose next row starts
        // lowest in the source goes first (members share the source region, or their order
        // does not matter).
        let mut next = vec![0u64; members.len()];
        loop {
            let mut pick: Option<(usize, usize)> = None;
            for (k, m) in members.iter().enumerate() {
                if next[k] < m.count {
                    // Inside the claimed span (row < count), so it fits in `usize`.
                    let at = bases[k].0 as usize + (next[k] * m.src_stride) as usize;
                    if pick.is_none_or(|(_, best)| at < best) {
                        pick = Some((k, at));
                    }
                }
            }
            let Some((k, _)) = pick else { break };
            let m = &members[k];
            let (i, len) = (next[k] as usize, m.len as usize);
            // SAFETY: row `i < count` of member `k` lies inside both of its claimed spans
            // (`i * stride + len <= span`, as in `copy_rows`), so `len` bytes at the source
            // row are readable and written by no one in this process, and `len` bytes at the
            // destination row are writable and touched by nothing else in this process, while
            // the claims are held (this closure runs inside them). Source and destination are
            // different regions (checked above), and the members' destinations are claimed
            // for writing each, so no two members' rows overlap. No references are made.
            unsafe {
                let s = bases[k].0.add(i * m.src_stride as usize).cast_const();
                let d = bases[k].1.add(i * m.dst_stride as usize);
                #[cfg(target_arch = "x86_64")]
                if stream {
                    stream_rows(s, d, len);
                    next[k] += 1;
                    continue;
                }
                std::ptr::copy_nonoverlapping(s, d, len);
            }
            next[k] += 1;
        }
        #[cfg(target_arch = "x86_64")]
        if stream {
            sfence();
        }
    })
}

/// Each member's source and destination base addresses, inside its claims.
type Bases = [(*mut u8, *mut u8)];

/// Claims member `bases.len()`'s spans and the rest's after it (sources for reading,
/// destinations for writing), then runs `f` with every member's two base addresses.
fn with_claims(
    members: &[GangRows<'_>],
    bases: &mut Vec<(*mut u8, *mut u8)>,
    f: &mut dyn FnMut(&Bases),
) -> Result<(), (usize, TransportError)> {
    let k = bases.len();
    let Some(m) = members.get(k) else {
        f(bases);
        return Ok(());
    };
    // From the first row's start to the last row's end; `u64::MAX` (refused by the claim as
    // out of range) when it overflows.
    let span = |offset: u64, stride: u64| {
        kvbridge_transport::memory::rows_end(offset, stride, m.len, m.count)
            .map_or(u64::MAX, |end| end - offset)
    };
    let claimed = m.src.with_raw_range(
        m.src_offset,
        span(m.src_offset, m.src_stride),
        Access::Read,
        |s, _| {
            m.dst.with_raw_range(
                m.dst_offset,
                span(m.dst_offset, m.dst_stride),
                Access::Write,
                |d, _| {
                    bases.push((s, d));
                    let rest = with_claims(members, bases, f);
                    bases.pop();
                    rest
                },
            )
        },
    );
    match claimed {
        Ok(Ok(rest)) => rest,
        Ok(Err(e)) => Err((k, naming(e, Operand::Destination))),
        Err(e) => Err((k, naming(e, Operand::Source))),
    }
}

/// How many rows ahead a strided copy prefetches its source.
const PREFETCH_ROWS: usize = 2;

/// Asks the CPU to bring the `len` bytes at `at` into the cache: a hint, which never faults and
/// reads nothing in the sense of the memory model, so `at` need not be claimed or valid.
fn prefetch(at: *const u8, len: usize) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    for line in (0..len).step_by(64) {
        // SAFETY: `prefetcht0` (SSE, part of every x86-64 CPU) is a hint: it does not fault on
        // any address and does not access memory as far as the program can observe.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                at.wrapping_add(line).cast::<i8>(),
            );
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = (at, len);
}

/// A refusal of one region's access, naming which end of a copy it was (as `copy_to` does).
fn naming(e: MemoryError, end: Operand) -> TransportError {
    e.for_operand(end).into()
}

/// `memcpy` with non-temporal stores (SSE2, part of every x86-64 CPU), ending with `sfence` so
/// the bytes are globally visible before anything this thread does next (such as sending the
/// batch's notification).
///
/// # Safety
///
/// `src` must be valid for reads and `dst` for writes of `len` bytes.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract is `stream_rows`'.
    unsafe { stream_rows(src, dst, len) };
    sfence();
}

/// Orders every streaming store before it ahead of what this thread does next.
#[cfg(target_arch = "x86_64")]
fn sfence() {
    // Miri cannot run the fence instruction.
    #[cfg(not(miri))]
    // SAFETY: `sfence` has no memory operands and is part of every x86-64 CPU (SSE).
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

/// Rows a strided copy streams at once (measured best of 1, 4, 8 and 16 in
/// `docs/benchmarks.md`).
#[cfg(target_arch = "x86_64")]
const ROWS_AT_ONCE: usize = 4;

/// Streams `ROWS_AT_ONCE` rows of `len` bytes, one 64-byte line of each row in turn, without
/// the closing fence.
///
/// # Safety
///
/// Each `src[k]` must be valid for reads and each `dst[k]` for writes of `len` bytes; every
/// `dst[k]` must be 16-byte aligned and `len` a multiple of 64.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_row_group(
    src: [*const u8; ROWS_AT_ONCE],
    dst: [*mut u8; ROWS_AT_ONCE],
    len: usize,
) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128};
    // As in `stream_rows`: ordinary aligned stores under Miri.
    #[cfg(miri)]
    use std::arch::x86_64::_mm_store_si128 as _mm_stream_si128;
    #[cfg(not(miri))]
    use std::arch::x86_64::_mm_stream_si128;
    let mut at = 0;
    while at < len {
        for (s, d) in src.iter().zip(&dst) {
            // SAFETY: `at + 64 <= len` (`len` is a multiple of 64): 64 readable bytes at
            // `s + at` and 64 writable bytes at `d + at`, which is 16-byte aligned.
            unsafe {
                let s = s.add(at).cast::<__m128i>();
                let d = d.add(at).cast::<__m128i>();
                let a = _mm_loadu_si128(s);
                let b = _mm_loadu_si128(s.add(1));
                let c = _mm_loadu_si128(s.add(2));
                let e = _mm_loadu_si128(s.add(3));
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
        }
        at += 64;
    }
}

/// The body of [`stream_copy`], without the closing fence, so a run of rows pays one fence:
/// 64-byte stores where the CPU has them ([`wide_stores`]), else 16-byte ones.
///
/// # Safety
///
/// `src` must be valid for reads and `dst` for writes of `len` bytes.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_rows(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128};
    // Miri cannot run the streaming-store instruction; under Miri the same loop uses ordinary
    // aligned stores, so the pointer arithmetic and alignment are still checked.
    #[cfg(miri)]
    use std::arch::x86_64::_mm_store_si128 as _mm_stream_si128;
    #[cfg(not(miri))]
    use std::arch::x86_64::_mm_stream_si128;
    #[cfg(not(miri))]
    if wide_stores() {
        // Bytes until `dst` is 64-byte aligned (64-byte streaming stores need it).
        let head = dst.align_offset(64).min(len);
        let lines = (len - head) / 64;
        // SAFETY: `head + 64 * lines <= len`, so every range below is inside the caller's
        // valid ranges; `dst + head` is 64-byte aligned; `wide_stores` checked the CPU.
        unsafe {
            std::ptr::copy(src, dst, head);
            stream_lines_wide(src.add(head), dst.add(head), lines);
            let at = head + 64 * lines;
            std::ptr::copy(src.add(at), dst.add(at), len - at);
        }
        return;
    }
    // Bytes until `dst` is 16-byte aligned (streaming stores need aligned destinations).
    let head = (dst.align_offset(16)).min(len);
    // SAFETY: `head <= len`, so both ranges are inside the caller's valid ranges.
    unsafe { std::ptr::copy(src, dst, head) };
    let mut at = head;
    while at + 64 <= len {
        // SAFETY: `at + 64 <= len`: 64 readable bytes at `src + at` and 64 writable bytes at
        // `dst + at`, which is 16-byte aligned (`head` aligned it; `at` advances by 64).
        unsafe {
            let s = src.add(at).cast::<__m128i>();
            let d = dst.add(at).cast::<__m128i>();
            let a = _mm_loadu_si128(s);
            let b = _mm_loadu_si128(s.add(1));
            let c = _mm_loadu_si128(s.add(2));
            let e = _mm_loadu_si128(s.add(3));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        at += 64;
    }
    // SAFETY: the tail `[at, len)` is inside both ranges.
    unsafe {
        std::ptr::copy(src.add(at), dst.add(at), len - at);
    }
}

/// Whether this CPU (and OS) has AVX-512, for [`stream_lines_wide`]: a 64-byte streaming
/// store writes a whole line at once, and strided 1152-byte rows copy about 1.3x as fast
/// (CPU time) as with 16-byte stores (docs/benchmarks.md). Never under Miri, which cannot
/// run the instructions; `std` caches the answer, so asking costs one load. Tests turn it off
/// on their thread to cover the 16-byte path too.
#[cfg(target_arch = "x86_64")]
fn wide_stores() -> bool {
    #[cfg(test)]
    if tests::NARROW.with(std::cell::Cell::get) {
        return false;
    }
    !cfg!(miri) && std::is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn wide_stores() -> bool {
    false
}

/// Copies `lines` 64-byte lines from `src` to `dst` with AVX-512 loads and 64-byte streaming
/// stores, four lines per step, without the closing fence. Written as assembly because the
/// AVX-512 intrinsics need a newer Rust than this workspace's `rust-version`.
///
/// # Safety
///
/// The CPU must have AVX-512 ([`wide_stores`]); `src` must be valid for reads and `dst` for
/// writes of `64 * lines` bytes, and `dst` must be 64-byte aligned.
#[cfg(all(target_arch = "x86_64", not(miri)))]
unsafe fn stream_lines_wide(src: *const u8, dst: *mut u8, lines: usize) {
    // SAFETY: by the caller's contract every load is inside `src`'s valid range, every store
    // inside `dst`'s and 64-byte aligned (`dst` is, and it advances by 64), and the CPU runs
    // these instructions. Like the intrinsics above, the loads and stores create no references
    // to the bytes. The block uses no stack. It writes zmm0-3 and ends with `vzeroupper`
    // (which clears the upper bits of vector registers 0-15, so later SSE code pays no
    // penalty); xmm0-15 are declared clobbered, which covers every width of those registers,
    // so the compiler keeps nothing in them across the block.
    unsafe {
        std::arch::asm!(
            "2:",
            "cmp {n}, 4",
            "jb 3f",
            "vmovdqu64 zmm0, [{s}]",
            "vmovdqu64 zmm1, [{s} + 64]",
            "vmovdqu64 zmm2, [{s} + 128]",
            "vmovdqu64 zmm3, [{s} + 192]",
            "vmovntdq [{d}], zmm0",
            "vmovntdq [{d} + 64], zmm1",
            "vmovntdq [{d} + 128], zmm2",
            "vmovntdq [{d} + 192], zmm3",
            "add {s}, 256",
            "add {d}, 256",
            "sub {n}, 4",
            "jmp 2b",
            "3:",
            "test {n}, {n}",
            "jz 4f",
            "vmovdqu64 zmm0, [{s}]",
            "vmovntdq [{d}], zmm0",
            "add {s}, 64",
            "add {d}, 64",
            "dec {n}",
            "jmp 3b",
            "4:",
            "vzeroupper",
            s = inout(reg) src => _,
            d = inout(reg) dst => _,
            n = inout(reg) lines => _,
            out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
            out("xmm4") _, out("xmm5") _, out("xmm6") _, out("xmm7") _,
            out("xmm8") _, out("xmm9") _, out("xmm10") _, out("xmm11") _,
            out("xmm12") _, out("xmm13") _, out("xmm14") _, out("xmm15") _,
            options(nostack),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// Set: this thread's streaming copies use the 16-byte stores even where the CPU has
        /// AVX-512, so both paths are tested on such a machine.
        pub(super) static NARROW: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Runs `f` with this thread's streaming copies 16 bytes wide (`narrow`) or as wide as the
    /// CPU allows.
    fn with_narrow<R>(narrow: bool, f: impl FnOnce() -> R) -> R {
        let before = NARROW.with(|n| n.replace(narrow));
        let r = f();
        NARROW.with(|n| n.set(before));
        r
    }

    #[test]
    fn allocated_regions_are_sealed_shared_and_recognised() {
        let r = allocate(3 * 4096 + 17).unwrap();
        assert_eq!(r.len(), 3 * 4096 + 17);
        r.write_at(5, b"hello").unwrap();
        let shared = shared_of(&r).expect("an allocated region is recognised");
        let seals = rustix::fs::fcntl_get_seals(shared.fd()).unwrap();
        assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL));
        // A peer that tries to shrink (or grow) the file is refused by the kernel.
        assert!(rustix::fs::ftruncate(shared.fd(), 0).is_err());
        assert!(rustix::fs::ftruncate(shared.fd(), 1 << 20).is_err());
        // A second mapping of the same file sees the same bytes (what a peer does).
        let dup = shared.fd().try_clone_to_owned().unwrap();
        let peer = map_remote(1, dup, r.len() as u64).unwrap();
        assert_eq!(peer.to_vec(5, 5).unwrap(), b"hello");
        peer.write_at(0, b"xy").unwrap();
        assert_eq!(r.to_vec(0, 2).unwrap(), b"xy");
    }

    #[test]
    fn streamed_copies_match_at_any_alignment_and_length() {
        let len = 2 * STREAM_MIN as usize + 4096;
        let src = MemoryRegion::allocate(len).unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4096) as u8).collect();
        src.write_at(0, &bytes).unwrap();
        for (so, doff, n) in [
            (0u64, 0u64, STREAM_MIN),
            (1, 3, STREAM_MIN + 5),
            (7, 64, STREAM_MIN + 63),
            (13, 17, 2 * STREAM_MIN + 1),
            (5, 9, 100),
        ] {
            for narrow in [false, true] {
                let dst = allocate(len).unwrap();
                dst.fill(0, len as u64, 0xaa).unwrap();
                with_narrow(narrow, || copy_out(&src, so, &dst, doff, n)).unwrap();
                let got = dst.to_vec(0, len as u64).unwrap();
                let (so, doff, n) = (so as usize, doff as usize, n as usize);
                assert_eq!(
                    &got[doff..doff + n],
                    &bytes[so..so + n],
                    "({so}, {doff}, {n}, narrow {narrow})"
                );
                assert!(got[..doff].iter().all(|&b| b == 0xaa));
                assert!(got[doff + n..].iter().all(|&b| b == 0xaa));
            }
        }
        let dst = allocate(len).unwrap();
        assert!(matches!(
            copy_out(&src, 1, &dst, 0, len as u64),
            Err(TransportError::Memory(MemoryError::AccessOutOfRange {
                operand: Operand::Source,
                ..
            }))
        ));
        assert!(matches!(
            copy_out(&src, 0, &dst, 1, len as u64),
            Err(TransportError::Memory(MemoryError::AccessOutOfRange {
                operand: Operand::Destination,
                ..
            }))
        ));
    }

    /// The same copy on heap regions, so it also runs under Miri (memfd syscalls do not).
    #[test]
    fn streamed_copy_checks_bounds_and_copies_exactly_on_heap_regions() {
        let len = STREAM_MIN as usize + 200;
        let src = MemoryRegion::allocate(len).unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 256) as u8).collect();
        src.write_at(0, &bytes).unwrap();
        let dst = MemoryRegion::allocate(len).unwrap();
        copy_out(&src, 3, &dst, 5, STREAM_MIN + 1).unwrap();
        let got = dst.to_vec(0, len as u64).unwrap();
        assert_eq!(
            &got[5..5 + STREAM_MIN as usize + 1],
            &bytes[3..4 + STREAM_MIN as usize]
        );
        assert!(got[..5].iter().all(|&b| b == 0));
        assert!(got[6 + STREAM_MIN as usize..].iter().all(|&b| b == 0));
        assert!(copy_out(&src, 200, &dst, 0, STREAM_MIN + 1).is_err());
        assert!(copy_out(&src, 0, &dst, u64::MAX, STREAM_MIN).is_err());
    }

    /// The streaming copy claims its ranges like every other access: it is refused while the
    /// destination is borrowed or the source is being written, and leaves no claim behind.
    #[test]
    fn streamed_copies_respect_the_claim_table() {
        let len = STREAM_MIN as usize + 64;
        let src = MemoryRegion::allocate(len).unwrap();
        let dst = MemoryRegion::allocate(len).unwrap();
        let mut borrowed = dst.borrow_mut(len as u64 - 1, 1).unwrap();
        borrowed[0] = 7;
        let r = copy_out(&src, 0, &dst, 64, STREAM_MIN);
        assert!(
            matches!(
                r,
                Err(TransportError::Memory(MemoryError::AccessConflict {
                    operand: Operand::Destination,
                    ..
                }))
            ),
            "{r:?}"
        );
        assert_eq!(borrowed[0], 7);
        drop(borrowed);
        let r = src.with_raw_range(0, 1, Access::Write, |_, _| {
            copy_out(&src, 0, &dst, 0, STREAM_MIN)
        });
        assert!(
            matches!(
                r,
                Ok(Err(TransportError::Memory(MemoryError::AccessConflict {
                    operand: Operand::Source,
                    ..
                })))
            ),
            "{r:?}"
        );
        copy_out(&src, 0, &dst, 0, STREAM_MIN).unwrap();
        drop(dst.borrow_mut(0, len as u64).unwrap());
        drop(src.borrow_mut(0, len as u64).unwrap());
    }

    /// Row `i` of a strided copy, done one row at a time with the region's own copy.
    fn rows_by_hand(
        src: &[u8],
        dst: &mut [u8],
        geometry: (usize, usize, usize, usize, usize, usize),
    ) {
        let (so, ss, doff, ds, len, count) = geometry;
        for i in 0..count {
            dst[doff + i * ds..doff + i * ds + len]
                .copy_from_slice(&src[so + i * ss..so + i * ss + len]);
        }
    }

    proptest::proptest! {
        /// A strided copy equals its rows copied one by one, for any geometry that fits, with
        /// and without streaming stores; bytes between and around the rows stay untouched.
        #[test]
        fn strided_copies_equal_their_rows(
            so in 0usize..300,
            doff in 0usize..300,
            len in 0usize..1200,
            extra_s in 0usize..300,
            extra_d in 0usize..300,
            count in 0usize..40,
            streaming: bool,
            narrow: bool,
        ) {
            let (ss, ds) = (len + extra_s, len + extra_d);
            let src_len = so + ss * count + len + 1;
            let dst_len = doff + ds * count + len + 1;
            let src = MemoryRegion::allocate(src_len).unwrap();
            let bytes: Vec<u8> = (0..src_len).map(|i| (i * 13 + i / 251) as u8).collect();
            src.write_at(0, &bytes).unwrap();
            let dst = MemoryRegion::allocate(dst_len).unwrap();
            dst.fill(0, dst_len as u64, 0xee).unwrap();
            with_narrow(narrow, || copy_rows(
                &src, so as u64, ss as u64, &dst, doff as u64, ds as u64, len as u64,
                count as u64, streaming,
            ))
            .unwrap();
            let mut want = vec![0xee; dst_len];
            rows_by_hand(&bytes, &mut want, (so, ss, doff, ds, len, count));
            proptest::prop_assert_eq!(dst.to_vec(0, dst_len as u64).unwrap(), want);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// The same for copies long enough to stream, with rows of whole cache lines into
        /// aligned destinations (the path that streams several rows at once) and without.
        #[test]
        fn streamed_strided_copies_equal_their_rows(
            so in 0usize..200,
            doff16 in 0usize..12,
            lines in 16usize..20,
            ragged: bool,
            extra_s in 0usize..200,
            extra_d16 in 0usize..8,
            count in 64usize..120,
            narrow: bool,
        ) {
            let len = lines * 64 + usize::from(ragged) * 9;
            let (ss, ds, doff) = (len + extra_s, len + 16 * extra_d16, 16 * doff16);
            let src_len = so + ss * count + len;
            let dst_len = doff + ds * count + len;
            let src = MemoryRegion::allocate(src_len).unwrap();
            let bytes: Vec<u8> = (0..src_len).map(|i| (i * 29 + i / 241) as u8).collect();
            src.write_at(0, &bytes).unwrap();
            let dst = MemoryRegion::allocate(dst_len).unwrap();
            with_narrow(narrow, || copy_rows(
                &src, so as u64, ss as u64, &dst, doff as u64, ds as u64, len as u64,
                count as u64, true,
            ))
            .unwrap();
            let mut want = vec![0; dst_len];
            rows_by_hand(&bytes, &mut want, (so, ss, doff, ds, len, count));
            proptest::prop_assert_eq!(dst.to_vec(0, dst_len as u64).unwrap(), want);
        }
    }

    /// Streaming is used for rows of 64 bytes and more once the rows reach `STREAM_MIN`; the
    /// shape of the DCP relayout (rows of 1152 bytes, every 4th on the source) on shared memory.
    #[test]
    fn long_strided_copies_stream_into_shared_memory() {
        let (len, count) = (1152usize, 2 * STREAM_MIN as usize / 1152);
        let src = MemoryRegion::allocate(4 * len * count).unwrap();
        let bytes: Vec<u8> = (0..src.len()).map(|i| (i * 7 + i / 509) as u8).collect();
        src.write_at(0, &bytes).unwrap();
        let dst = allocate(len * count + 64).unwrap();
        copy_rows(
            &src,
            3 * len as u64,
            4 * len as u64,
            &dst,
            64,
            len as u64,
            len as u64,
            count as u64,
            true,
        )
        .unwrap();
        let mut want = vec![0u8; dst.len()];
        rows_by_hand(&bytes, &mut want, (3 * len, 4 * len, 64, len, len, count));
        assert_eq!(dst.to_vec(0, dst.len() as u64).unwrap(), want);
    }

    /// Bounds of the whole op are checked before any byte moves: a last row past the end (or
    /// a span past `u64`) refuses the copy with nothing written, naming the end refused.
    #[test]
    fn a_strided_copy_past_either_end_moves_nothing() {
        let src = MemoryRegion::allocate(4096).unwrap();
        src.fill(0, 4096, 1).unwrap();
        let dst = MemoryRegion::allocate(4096).unwrap();
        let r = copy_rows(&src, 0, 1024, &dst, 0, 100, 100, 5, true);
        assert!(
            matches!(
                r,
                Err(TransportError::Memory(MemoryError::AccessOutOfRange {
                    operand: Operand::Source,
                    ..
                }))
            ),
            "{r:?}"
        );
        let r = copy_rows(&src, 0, 100, &dst, 0, 1024, 100, 5, false);
        assert!(
            matches!(
                r,
                Err(TransportError::Memory(MemoryError::AccessOutOfRange {
                    operand: Operand::Destination,
                    ..
                }))
            ),
            "{r:?}"
        );
        let r = copy_rows(&src, 0, 100, &dst, 0, u64::MAX / 2, 100, 3, true);
        assert!(r.is_err(), "{r:?}");
        assert_eq!(dst.to_vec(0, 4096).unwrap(), vec![0; 4096]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Rows copied together (a DCP relayout's: member `k` takes every `members`-th row of
        /// one source from row `k` on, into a destination of its own) equal each member's rows
        /// copied on its own, with and without streaming stores, members of different lengths
        /// and row counts included; bytes between and around the rows stay untouched.
        #[test]
        #[cfg_attr(miri, ignore = "thousands of rows: too slow under Miri; the small relayout covers the same code")]
        fn together_rows_equal_each_members_rows_copied_alone(
            members in 1usize..6,
            len in 1usize..1300,
            counts in proptest::collection::vec(1usize..40, 6),
            doffs in proptest::collection::vec(0usize..200, 6),
            gap in 0usize..100,
            streaming: bool,
            narrow: bool,
        ) {
            let stride = members * len;
            let rows = counts.iter().take(members).max().copied().unwrap_or(0);
            let src_len = stride * rows + gap;
            let bytes: Vec<u8> = (0..src_len).map(|i| (i * 31 + i / 253) as u8).collect();
            let src = MemoryRegion::allocate(src_len).unwrap();
            src.write_at(0, &bytes).unwrap();
            let dst_lens: Vec<usize> = (0..members).map(|k| doffs[k] + (len + gap) * counts[k] + 1).collect();
            let dsts: Vec<MemoryRegion> = dst_lens.iter().map(|&n| {
                let d = MemoryRegion::allocate(n).unwrap();
                d.fill(0, n as u64, 0xee).unwrap();
                d
            }).collect();
            let gang: Vec<GangRows<'_>> = (0..members).map(|k| GangRows {
                src: &src,
                src_offset: (k * len) as u64,
                src_stride: stride as u64,
                dst: &dsts[k],
                dst_offset: doffs[k] as u64,
                dst_stride: (len + gap) as u64,
                len: len as u64,
                count: counts[k] as u64,
            }).collect();
            with_narrow(narrow, || copy_together(&gang, streaming)).unwrap();
            for k in 0..members {
                let mut want = vec![0xee; dst_lens[k]];
                rows_by_hand(&bytes, &mut want, (k * len, stride, doffs[k], len + gap, len, counts[k]));
                proptest::prop_assert_eq!(dsts[k].to_vec(0, dst_lens[k] as u64).unwrap(), want);
            }
        }
    }

    /// A DCP 1 -> 4 relayout in small: four members take every fourth row of one source (rows
    /// of whole cache lines, streamed; and short rows, copied plainly), each into its own
    /// destination; every row lands where its member puts it. Small enough for Miri
    /// (`cargo xtask miri`).
    #[test]
    fn together_a_small_relayout_lands_every_row() {
        for (len, rows, streaming) in [(1152usize, 16usize, true), (40, 5, false)] {
            let src = MemoryRegion::allocate(4 * len * rows).unwrap();
            let bytes: Vec<u8> = (0..src.len()).map(|i| (i * 7 + i / 61) as u8).collect();
            src.write_at(0, &bytes).unwrap();
            let dsts: Vec<MemoryRegion> = (0..4)
                .map(|_| MemoryRegion::allocate(len * rows + 16).unwrap())
                .collect();
            let gang: Vec<GangRows<'_>> = (0..4)
                .map(|k| GangRows {
                    src: &src,
                    src_offset: (k * len) as u64,
                    src_stride: (4 * len) as u64,
                    dst: &dsts[k],
                    dst_offset: 16,
                    dst_stride: len as u64,
                    len: len as u64,
                    count: rows as u64,
                })
                .collect();
            // 72 KiB in all: streamed (`STREAM_MIN`); the short rows are copied plainly.
            copy_together(&gang, streaming).unwrap();
            for (k, dst) in dsts.iter().enumerate() {
                let mut want = vec![0; len * rows + 16];
                rows_by_hand(&bytes, &mut want, (k * len, 4 * len, 16, len, len, rows));
                assert_eq!(
                    dst.to_vec(0, want.len() as u64).unwrap(),
                    want,
                    "member {k}"
                );
            }
        }
    }

    /// Every member's spans are checked and claimed before any byte moves: one member past its
    /// destination's end (or its source's) refuses the whole gang, names that member and
    /// leaves every destination untouched; so does a member copying within one region.
    #[test]
    fn together_nothing_moves_when_one_member_is_refused() {
        let src = MemoryRegion::allocate(8192).unwrap();
        src.fill(0, 8192, 1).unwrap();
        let dsts: Vec<MemoryRegion> = (0..3)
            .map(|_| MemoryRegion::allocate(4096).unwrap())
            .collect();
        let member = |k: usize, src_stride: u64, dst_stride: u64| GangRows {
            src: &src,
            src_offset: 100 * k as u64,
            src_stride,
            dst: &dsts[k],
            dst_offset: 0,
            dst_stride,
            len: 100,
            count: 5,
        };
        let cases = [
            (
                vec![
                    member(0, 300, 100),
                    member(1, 300, 1024),
                    member(2, 300, 100),
                ],
                1,
                Operand::Destination,
            ),
            (
                vec![
                    member(0, 300, 100),
                    member(1, 300, 100),
                    member(2, 4096, 100),
                ],
                2,
                Operand::Source,
            ),
        ];
        for (gang, bad, end) in cases {
            match copy_together(&gang, true) {
                Err((k, TransportError::Memory(MemoryError::AccessOutOfRange { operand, .. }))) => {
                    assert_eq!((k, operand), (bad, end));
                }
                other => panic!("member {bad} should have been refused: {other:?}"),
            }
        }
        let within = [
            member(0, 300, 100),
            GangRows {
                dst: &src,
                ..member(1, 300, 100)
            },
        ];
        assert!(matches!(
            copy_together(&within, false),
            Err((1, TransportError::InvalidArgument { .. }))
        ));
        for d in &dsts {
            assert_eq!(d.to_vec(0, 4096).unwrap(), vec![0; 4096]);
        }
    }

    #[test]
    fn heap_regions_are_not_shared() {
        let heap = MemoryRegion::allocate(4096).unwrap();
        assert!(shared_of(&heap).is_none());
        assert!(allocate(0).unwrap().is_empty());
    }

    #[test]
    fn unsealed_short_or_sparse_files_are_refused() {
        let unsealed = rustix::fs::memfd_create("t", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&unsealed, 4096).unwrap();
        rustix::fs::fallocate(&unsealed, FallocateFlags::empty(), 0, 4096).unwrap();
        let err = map_remote(3, unsealed, 4096).unwrap_err().to_string();
        assert!(err.contains("not sealed against shrinking"), "{err}");

        let r = allocate(4096).unwrap();
        let fd = shared_of(&r).unwrap().fd().try_clone_to_owned().unwrap();
        let err = map_remote(4, fd, 8192).unwrap_err().to_string();
        assert!(
            err.contains("has 4096 bytes but the peer declared 8192"),
            "{err}"
        );

        let sparse =
            rustix::fs::memfd_create("t", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&sparse, 1 << 30).unwrap();
        rustix::fs::fcntl_add_seals(&sparse, SealFlags::SHRINK).unwrap();
        let err = map_remote(5, sparse, 1 << 30).unwrap_err().to_string();
        assert!(err.contains("sparse"), "{err}");

        let file = std::fs::File::open("/proc/self/status").unwrap();
        let err = map_remote(6, file.into(), 10).unwrap_err().to_string();
        assert!(err.contains("region 6 cannot be mapped"), "{err}");
    }
}
