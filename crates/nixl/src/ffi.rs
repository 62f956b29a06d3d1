//! The unsafe edge of `kvbridge-nixl`: loading the NIXL runtime, handing NIXL the address of a
//! registered region, and allocating memory a peer may write at any time.
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
