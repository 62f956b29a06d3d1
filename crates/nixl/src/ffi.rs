//! The unsafe edge of `kvbridge-nixl`: loading the NIXL runtime, handing NIXL the address of a
//! registered region, and allocating memory a peer may write at any time (private, or shared
//! with another process on this host).
//!
//! Everything else in the crate goes through nixl-sys's safe API.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::ptr::NonNull;
use std::sync::OnceLock;

use kvbridge_transport::{ForeignMemory, MemoryRegion};
use nixl_sys::{MemType, NixlDescriptor};

use crate::NixlError;
use crate::runtime::Runtime;

/// Loads the NIXL runtime once per process; later calls return the first outcome.
///
/// Before anything of NIXL or UCX is loaded it sets, when the user has not:
/// `NIXL_PLUGIN_DIR` to the runtime's plugin folder, and `UCX_MODULES=^ib` on a host without
/// an InfiniBand device (the wheel's UCX otherwise crashes at exit in its libnl destructor).
/// Then it `dlopen`s `libnixl_capi.so` by its full path, globally: nixl-sys's loader asks for
/// `libnixl_capi.so` by name and gets this copy, whose run path finds the rest of the runtime,
/// so nothing has to be exported before the process starts.
pub(crate) fn load(rt: &Runtime) -> Result<(), NixlError> {
    static LOADED: OnceLock<Result<(), (std::path::PathBuf, String)>> = OnceLock::new();
    LOADED
        .get_or_init(|| load_once(rt))
        .clone()
        .map_err(|(path, reason)| NixlError::RuntimeLoad { path, reason })
}

fn has_infiniband() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

fn load_once(rt: &Runtime) -> Result<(), (std::path::PathBuf, String)> {
    let capi = rt.capi();
    if std::env::var_os("NIXL_PLUGIN_DIR").is_none() {
        // SAFETY: runs once (under the OnceLock), before NIXL or UCX, the only C code that reads
        // these variables, is loaded. Rust's own readers take std's environment lock. Other
        // foreign code that reads the environment on another thread at this very moment is the
        // remaining risk; the transport is created at start-up, before such threads exist.
        unsafe { std::env::set_var("NIXL_PLUGIN_DIR", &rt.plugin_dir) };
    }
    if std::env::var_os("UCX_MODULES").is_none() && !has_infiniband() {
        // SAFETY: as above.
        unsafe { std::env::set_var("UCX_MODULES", "^ib") };
    }
    let path = CString::new(capi.as_os_str().as_bytes())
        .map_err(|_| (capi.clone(), "the path contains a NUL byte".to_owned()))?;
    // SAFETY: `path` is a NUL-terminated string that outlives the call; the handle is kept for
    // the life of the process (never closed), as NIXL's symbols are used until exit.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a NUL-terminated message owned by the loader, read
        // at once on this thread.
        let reason = unsafe {
            let msg = libc::dlerror();
            if msg.is_null() {
                "dlopen failed without a message".to_owned()
            } else {
                std::ffi::CStr::from_ptr(msg).to_string_lossy().into_owned()
            }
        };
        return Err((capi, reason));
    }
    Ok(())
}

/// One region as NIXL sees it: address, length, memory type, device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Segment {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) device: Option<u32>,
}

impl Segment {
    pub(crate) fn of(region: &MemoryRegion) -> Self {
        Self {
            addr: region.as_ptr() as usize,
            len: region.len(),
            device: match region.kind() {
                kvbridge_transport::MemoryKind::Host => None,
                kvbridge_transport::MemoryKind::Device { id } => Some(id),
                _ => None,
            },
        }
    }

    pub(crate) fn mem_type(device: Option<u32>) -> MemType {
        if device.is_some() {
            MemType::Vram
        } else {
            MemType::Dram
        }
    }
}

impl nixl_sys::MemoryRegion for Segment {
    // SAFETY: the address is that of a region the transport keeps alive (in its region table)
    // for as long as NIXL has it registered; NIXL only passes it on to its backends.
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Segment {
    fn mem_type(&self) -> MemType {
        Self::mem_type(self.device)
    }

    fn device_id(&self) -> u64 {
        u64::from(self.device.unwrap_or(0))
    }
}

/// `len` bytes of zeroed, page-aligned anonymous memory, as a foreign region: a peer's NIXL
/// agent writes it without the CPU's knowledge, so it is never borrowed as a Rust slice.
pub(crate) fn allocate(len: usize) -> std::io::Result<MemoryRegion> {
    // A zero-length mapping is refused by mmap; one byte keeps the pointer valid.
    let mut map = memmap2::MmapMut::map_anon(len.max(1))?;
    let ptr = NonNull::new(map.as_mut_ptr()).expect("mmap never returns NULL");
    // SAFETY: `ptr` is the start of `map`, which is at least `len` bytes, readable and writable,
    // and moves into the region as its owner, so it stays mapped for the region's life. The
    // mapping's address does not change when the handle moves.
    Ok(unsafe { MemoryRegion::from_raw_parts(ForeignMemory::host(ptr, len, map)) })
}

/// The file behind a region of [`allocate_shared`] or [`map_shared`]: a memfd sealed so that
/// its size never changes, the region's tag. Holding it gives no access to the bytes from Rust.
struct SharedFile(std::fs::File);

/// `len` bytes of zeroed host memory that another process on this host may map too, as a
/// foreign region: a memfd (sealed against shrinking and growing) mapped shared. Hand the file
/// to the other process with [`shared_fd`] (fd passing, or `/proc/<pid>/fd/<fd>`), which maps it
/// with [`map_shared`]; both mappings are the same bytes.
///
/// # Errors
/// When the kernel refuses the memfd, its size, its seals or the mapping.
pub fn allocate_shared(len: usize) -> std::io::Result<MemoryRegion> {
    use std::os::fd::{AsRawFd, FromRawFd};
    const NAME: &[u8] = b"kvbridge-nixl-shared\0";
    // SAFETY: `NAME` is NUL-terminated and outlives the call; the flags are valid for
    // memfd_create.
    let fd = unsafe {
        libc::memfd_create(
            NAME.as_ptr().cast(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let file = std::fs::File::from(owned);
    // A zero-length mapping is refused by mmap; one byte keeps the pointer valid.
    file.set_len(len.max(1) as u64)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS on a descriptor `file` keeps open; no memory is involved.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    map_shared(file, len)
}

/// The descriptor of the memfd behind a region of [`allocate_shared`] or [`map_shared`], open
/// as long as the region lives; `None` for other regions.
#[must_use]
pub fn shared_fd(region: &MemoryRegion) -> Option<std::os::fd::RawFd> {
    use std::os::fd::AsRawFd;
    region.tag::<SharedFile>().map(|f| f.0.as_raw_fd())
}

/// Maps the first `len` bytes of a memfd another process made with [`allocate_shared`] (or any
/// memfd sealed against shrinking) as a foreign host region; its writes and this process's
/// meet in the same bytes.
///
/// # Errors
/// `InvalidInput` when the file is not sealed against shrinking (a peer could then truncate it
/// under the mapping) or is shorter than `len` (at least one byte); the kernel's error when the
/// seals cannot be read or the mapping fails.
pub fn map_shared(file: std::fs::File, len: usize) -> std::io::Result<MemoryRegion> {
    use std::io::{Error, ErrorKind};
    use std::os::fd::AsRawFd;
    // SAFETY: F_GET_SEALS on a descriptor `file` keeps open; no memory is involved.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(Error::last_os_error());
    }
    if seals & libc::F_SEAL_SHRINK == 0 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "the file is not sealed against shrinking (F_SEAL_SHRINK), so a mapping of it could \
             lose its pages; make it with kvbridge_nixl::allocate_shared",
        ));
    }
    let size = file.metadata()?.len();
    let map_len = len.max(1);
    if size < map_len as u64 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("the file has {size} bytes, fewer than the {map_len} to map"),
        ));
    }
    // SAFETY: the file is sealed against shrinking and holds at least `map_len` bytes, so every
    // page of the mapping stays backed for its life. Other processes may write the bytes at any
    // time: the mapping is only ever wrapped as foreign memory below, which kvbridge accesses by
    // raw copies and never as a Rust reference.
    let mut map = unsafe { memmap2::MmapOptions::new().len(map_len).map_mut(&file)? };
    let ptr = NonNull::new(map.as_mut_ptr()).expect("mmap never returns NULL");
    let tag = std::sync::Arc::new(SharedFile(file));
    // SAFETY: `ptr` is the start of `map`, at least `len` bytes, readable and writable and a new
    // mapping (no other region wraps these addresses); `map` moves into the region as its owner,
    // so it stays mapped for the region's life. The tag gives no access to the bytes.
    Ok(unsafe { MemoryRegion::from_raw_parts(ForeignMemory::host(ptr, len, map).with_tag(tag)) })
}

/// Sets this thread's timer slack to 1 ns (Linux's default is 50 µs, which the kernel may add
/// to every timed sleep): the polling thread's sleeps of 10 to 50 µs then last about that long
/// instead of 60 to 100 µs, so it can poll often while bytes move without spinning.
pub(crate) fn precise_sleeps() {
    // SAFETY: PR_SET_TIMERSLACK takes an integer argument and changes only the calling thread's
    // timer slack; no memory is passed.
    let _ = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_transport::ForeignMemory;

    /// What NIXL is told of a region: a device region becomes a `VRAM_SEG` descriptor with its
    /// device id and address, host memory a `DRAM_SEG` one (the VRAM path that runs without a
    /// GPU: registering device memory needs one).
    #[test]
    fn device_regions_become_vram_descriptors_with_their_device_id() {
        // SAFETY: the device address is never dereferenced: only its number is read here.
        let device =
            unsafe { MemoryRegion::from_raw_parts(ForeignMemory::device(3, 1 << 40, 8192, ())) };
        let seg = Segment::of(&device);
        assert_eq!((seg.addr, seg.len, seg.device), (1 << 40, 8192, Some(3)));
        assert!(matches!(NixlDescriptor::mem_type(&seg), MemType::Vram));
        assert_eq!(seg.device_id(), 3);
        let host = allocate(4096).unwrap();
        let seg = Segment::of(&host);
        assert_eq!(
            (seg.addr, seg.len, seg.device),
            (host.as_ptr() as usize, 4096, None)
        );
        assert!(matches!(NixlDescriptor::mem_type(&seg), MemType::Dram));
        assert_eq!(seg.device_id(), 0);
    }
}
