//! Python memory as kvbridge regions: the one module of this crate with `unsafe`.
//!
//! Every region made here is foreign memory (`MemoryRegion::from_raw_parts`): Python code
//! (numpy, torch, the caller's own buffers) may read and write the bytes at any time, so
//! kvbridge must never hold a Rust reference to them, which is exactly the foreign-memory
//! contract (`docs/transports.md`, "Foreign memory's contract"). Memory the engine allocates
//! for a transport that has no allocator of its own is foreign too, for the same reason: it is
//! handed to numpy.
#![allow(unsafe_code)]

use std::ptr::NonNull;

use kvbridge_transport::{ForeignMemory, MemoryRegion};
use pyo3::prelude::*;

use crate::errors::invalid;

/// Keeps a Python object alive for as long as a region wraps its memory. Dropped without the
/// interpreter attached, PyO3 defers the reference-count decrement until it is.
struct PyOwner(#[allow(dead_code)] Py<PyAny>);

/// Checks `ptr`/`len` the way `from_raw_parts` needs them: non-null, `len <= isize::MAX`, and
/// `ptr + len` without overflow.
fn checked(ptr: u64, len: u64) -> PyResult<(usize, usize)> {
    let too_big = || {
        invalid(format!(
            "a memory range at {ptr:#x} of {len} bytes does not fit in this process's address \
             space (ptr + length overflows, or length exceeds isize::MAX); pass the \
             allocation's real address and size in bytes"
        ))
    };
    let addr = usize::try_from(ptr).map_err(|_| too_big())?;
    let n = usize::try_from(len).map_err(|_| too_big())?;
    if n > isize::MAX as usize || addr.checked_add(n).is_none() {
        return Err(too_big());
    }
    if addr == 0 {
        return Err(invalid(
            "the pointer is 0 (NULL); pass the allocation's address, e.g. \
             array.ctypes.data or tensor.data_ptr()",
        ));
    }
    Ok((addr, n))
}

/// `len` bytes of host memory at `ptr`, owned by the caller and kept alive through `owner`.
///
/// The caller of `Engine.register` promises what `from_raw_parts` needs: the range is valid
/// for reads and writes until the region is deregistered and `owner` is released. This is the
/// same promise `ctypes` asks for; the engine checks what it can (null, overflow, overlap with
/// memory it already registered).
pub(crate) fn host(ptr: u64, len: u64, owner: Py<PyAny>) -> PyResult<MemoryRegion> {
    let (addr, n) = checked(ptr, len)?;
    let ptr = NonNull::new(std::ptr::with_exposed_provenance_mut::<u8>(addr))
        .ok_or_else(|| invalid("the pointer is 0 (NULL)"))?;
    // SAFETY: `ptr..ptr+n` is the caller's live, writable allocation kept alive by `owner`
    // (Engine.register's documented contract); `n <= isize::MAX` and the range does not wrap
    // (checked above); the engine reserved the range before calling this and refuses any
    // registration overlapping it, so no other region of this process wraps these bytes;
    // kvbridge makes no Rust reference to foreign memory, only raw copies.
    Ok(unsafe { MemoryRegion::from_raw_parts(ForeignMemory::host(ptr, n, PyOwner(owner))) })
}

/// `len` bytes of device memory at device address `addr` on device `device`.
pub(crate) fn device(device: u32, addr: u64, len: u64, owner: Py<PyAny>) -> PyResult<MemoryRegion> {
    let (addr, n) = checked(addr, len)?;
    // SAFETY: the caller promises `addr` is `n` bytes of memory on `device`, kept alive by
    // `owner`; device memory is never touched by the CPU (every accessor refuses it), only
    // handed by address to transports that declare device support.
    Ok(unsafe {
        MemoryRegion::from_raw_parts(ForeignMemory::device(device, addr, n, PyOwner(owner)))
    })
}

/// Pins the memory of a writable, C-contiguous object with the buffer protocol (a numpy array,
/// a `bytearray`, a `memoryview`): returns a holder that keeps a buffer export for as long as
/// it lives (make it the region's owner with [`host`]), the address and the length.
///
/// The holder is a `ctypes` array made with `from_buffer`: it holds the object's buffer (so a
/// `bytearray` cannot be resized and the array's memory cannot move) and refuses read-only or
/// non-contiguous buffers.
pub(crate) fn pin(obj: &Bound<'_, PyAny>) -> PyResult<(Py<PyAny>, u64, u64)> {
    let py = obj.py();
    let ctypes = py.import("ctypes")?;
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))
        .map_err(|e| {
            invalid(format!(
                "register_buffer needs an object with the buffer protocol (a numpy array, \
                 bytearray, memoryview): {e}"
            ))
        })?;
    if view.getattr("readonly")?.extract::<bool>()? {
        return Err(invalid(
            "the buffer is read-only, but peers write into registered memory; pass a \
             writable array (e.g. numpy.zeros(..), not bytes or a read-only view)",
        ));
    }
    if !view.getattr("c_contiguous")?.extract::<bool>()? {
        return Err(invalid(
            "the buffer is not C-contiguous, so its bytes are not one range; pass \
             numpy.ascontiguousarray(array) (and keep that copy) or register each contiguous \
             piece",
        ));
    }
    let nbytes: u64 = view.getattr("nbytes")?.extract()?;
    let byte_view = view.call_method1("cast", ("B",))?;
    let array_type = ctypes
        .getattr("c_char")?
        .call_method1("__mul__", (nbytes,))?;
    let holder = array_type.call_method1("from_buffer", (byte_view,))?;
    let addr: u64 = ctypes.call_method1("addressof", (&holder,))?.extract()?;
    Ok((holder.unbind(), addr, nbytes))
}

/// One page of zeroed, page-aligned memory (the engine's allocations are made of these).
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; 4096]);

/// `len` bytes of zeroed, page-aligned host memory owned by the region (for transports whose
/// `allocate` makes owned memory, which must not be handed to numpy).
pub(crate) fn alloc(len: usize) -> PyResult<MemoryRegion> {
    let pages = len.div_ceil(4096).max(1);
    let mut v: Vec<Page> = Vec::new();
    v.try_reserve_exact(pages).map_err(|_| {
        invalid(format!(
            "cannot allocate {len} bytes; reduce the size or free memory"
        ))
    })?;
    v.resize(pages, Page([0; 4096]));
    let ptr = NonNull::new(v.as_mut_ptr().cast::<u8>())
        .ok_or_else(|| invalid("the allocator returned NULL"))?;
    // SAFETY: `v` owns `pages * 4096 >= len` initialised bytes at `ptr`; moving a `Vec` does not
    // move its heap buffer, and the region keeps `v` alive until its last clone drops; nothing
    // else wraps or references these bytes.
    Ok(unsafe { MemoryRegion::from_raw_parts(ForeignMemory::host(ptr, len, v)) })
}
