//! NIXL stride descriptors (NIXL 1.5): one descriptor for `count` blocks of `len` bytes whose
//! starts are `stride` apart, so a strided op reaches NIXL as one run instead of one
//! descriptor per row.
//!
//! NIXL's C API (what nixl-sys wraps) has no stride call, so a small C++ shim
//! (`shim/stride.cc`, built by the build script) prepares the stride lists with NIXL's C++
//! API, found by its exported symbols in the loaded runtime; the prepared lists come back as
//! nixl-sys [`XferDlistHandle`]s, so the request is made, posted, polled and released through
//! nixl-sys like any other. Where the shim was not built, the runtime lacks a symbol, or the
//! agent's handle cannot be read, [`StrideAgent::new`] says why and the transport posts per-row
//! descriptors.
//!
//! The agent's handle: nixl-sys keeps its C API agent handle private and shows it only in the
//! agent's `Debug` output (`handle: 0x…`), which is where it is read from, once per transport;
//! the shim then takes the `nixlAgent*` that handle starts with (nixl-sys's
//! `nixl_capi_agent_s`). The tests check every assumption against the runtime: the symbols, the
//! list object's size, the descriptor's fields (a run one byte too long is refused, the bytes
//! of a strided write land where the runs say).
#![allow(unsafe_code)]
// Without the shim (no C++ compiler at build time) the calls into it are left out.
#![cfg_attr(kvbridge_nixl_no_shim, allow(dead_code, unused_imports))]

use std::ffi::{CString, c_char, c_void};
use std::ptr::NonNull;

use nixl_sys::{Agent, MemType, XferDlistHandle};

/// One stride run: `count` blocks of `len` bytes starting at `addr`, `stride` bytes apart
/// (`stride == len` is dense), on device `device` (0 for host memory).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) device: u64,
    pub(crate) stride: u64,
    pub(crate) count: u64,
}

impl Run {
    /// Appends `next` to `self` when the blocks continue the run (same length and device, its
    /// first block where `self`'s next one would start, the same stride or `self` a single
    /// block).
    pub(crate) fn extend(&mut self, next: &Run) -> bool {
        if next.len != self.len || next.device != self.device || next.count == 0 {
            return false;
        }
        let stride = if self.count == 1 {
            next.addr.wrapping_sub(self.addr)
        } else {
            self.stride
        };
        let continues = next.count == 1 || next.stride == stride;
        let at = self
            .count
            .checked_mul(stride)
            .and_then(|d| d.checked_add(self.addr));
        if !continues || stride < self.len || at != Some(next.addr) {
            return false;
        }
        self.stride = stride;
        self.count += next.count;
        true
    }
}

/// Shim status codes (below NIXL's own).
const NOT_RESOLVED: i32 = -1000;
const EXCEPTION: i32 = -1001;
const BAD_ARGUMENT: i32 = -1002;

#[cfg(not(kvbridge_nixl_no_shim))]
unsafe extern "C" {
    fn kvb_stride_resolve(missing: *mut c_char, cap: usize) -> i32;
    fn kvb_stride_prep(
        capi_agent: *mut c_void,
        remote: *const c_char,
        mem_type: i32,
        runs: *const u64,
        n: usize,
        out: *mut *mut c_void,
    ) -> i32;
    #[cfg_attr(not(test), allow(dead_code))]
    fn kvb_stride_describe(
        mem_type: i32,
        runs: *const u64,
        n: usize,
        text: *mut c_char,
        cap: usize,
        count: *mut i32,
        touched: *mut usize,
    ) -> isize;
    #[cfg_attr(not(test), allow(dead_code))]
    fn kvb_stride_list_max() -> usize;
}

/// Why the stride API cannot be used, as one sentence.
fn missing_symbols() -> Option<String> {
    #[cfg(kvbridge_nixl_no_shim)]
    {
        Some(
            "kvbridge-nixl was built without its stride shim (no C++ compiler at build time)"
                .to_owned(),
        )
    }
    #[cfg(not(kvbridge_nixl_no_shim))]
    {
        let mut buf = vec![0u8; 512];
        // SAFETY: `buf` is writable for its length; the shim writes a NUL-terminated string of
        // at most that many bytes. The runtime is loaded (`ffi::load`) before a transport asks.
        let ok = unsafe { kvb_stride_resolve(buf.as_mut_ptr().cast(), buf.len()) };
        if ok == 1 {
            return None;
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Some(format!(
            "the NIXL runtime lacks the stride API (symbol {} not found; NIXL 1.5 or later has it)",
            String::from_utf8_lossy(&buf[..end])
        ))
    }
}

/// NIXL's memory type number (`nixl_mem_t`) of `mem`.
fn mem_number(mem: MemType) -> i32 {
    match mem {
        MemType::Vram => 1,
        _ => 0,
    }
}

/// The C API agent handle nixl-sys shows in `agent`'s `Debug` output.
fn capi_handle(agent: &Agent) -> Option<NonNull<c_void>> {
    NonNull::new(handle_in(&format!("{agent:?}"))? as *mut c_void)
}

/// The address of the first `handle: 0x…` field of a `Debug` text.
fn handle_in(text: &str) -> Option<usize> {
    let at = text.find("handle: 0x")? + "handle: 0x".len();
    let digits: String = text[at..]
        .chars()
        .take_while(char::is_ascii_hexdigit)
        .collect();
    usize::from_str_radix(&digits, 16).ok()
}

/// What a stride prep returned, as text for logs and errors.
pub(crate) fn status_text(status: i32) -> String {
    let name = match status {
        -1 => "NIXL_ERR_NOT_POSTED",
        -2 => "NIXL_ERR_INVALID_PARAM",
        -3 => "NIXL_ERR_BACKEND",
        -4 => "NIXL_ERR_NOT_FOUND",
        -5 => "NIXL_ERR_MISMATCH",
        -6 => "NIXL_ERR_NOT_ALLOWED",
        -8 => "NIXL_ERR_UNKNOWN",
        -9 => "NIXL_ERR_NOT_SUPPORTED",
        NOT_RESOLVED => "the stride symbols are missing",
        EXCEPTION => "NIXL threw a C++ exception",
        BAD_ARGUMENT => "a null handle",
        _ => "unknown status",
    };
    format!("{name} ({status})")
}

/// The stride API of one transport's agent.
pub(crate) struct StrideAgent {
    /// nixl-sys's C API handle of the agent; valid while the agent lives (the transport owns
    /// both, and drops this first).
    capi: NonNull<c_void>,
}

// SAFETY: the handle is only passed to NIXL calls, and the agent is created with
// `ThreadSync::Strict`, so NIXL serialises its calls from any thread.
unsafe impl Send for StrideAgent {}
// SAFETY: as above; `&StrideAgent` gives no access but through NIXL's locked calls.
unsafe impl Sync for StrideAgent {}

impl StrideAgent {
    /// The stride API of `agent`, or why it cannot be used (the runtime must be loaded).
    pub(crate) fn new(agent: &Agent) -> Result<Self, String> {
        if let Some(why) = missing_symbols() {
            return Err(why);
        }
        let capi = capi_handle(agent).ok_or_else(|| {
            "nixl-sys's agent shows no `handle: 0x…` in its Debug output (a nixl-sys version \
             other than 1.5?), so the agent's C++ object cannot be reached"
                .to_owned()
        })?;
        Ok(Self { capi })
    }

    /// Prepares `runs` (of one memory type) as a NIXL descriptor list: local when `remote` is
    /// `None`, else against the loaded metadata of agent `remote`. The error is NIXL's status
    /// (a refused stride form, or a run outside every registered region) as text.
    pub(crate) fn prep(
        &self,
        agent: &Agent,
        remote: Option<&str>,
        mem: MemType,
        runs: &[Run],
    ) -> Result<Dlist, String> {
        #[cfg(kvbridge_nixl_no_shim)]
        {
            let _ = (agent, remote, mem, runs);
            Err(status_text(NOT_RESOLVED))
        }
        #[cfg(not(kvbridge_nixl_no_shim))]
        {
            let _ = agent;
            let name = remote
                .map(CString::new)
                .transpose()
                .map_err(|_| "the remote agent's name holds a NUL byte".to_owned())?;
            let mut out: *mut c_void = std::ptr::null_mut();
            // SAFETY: `capi` is nixl-sys's live agent handle (see the field); `runs` is
            // `runs.len()` `#[repr(C)]` runs of five u64 each, read during the call only;
            // `name` outlives the call; `out` is written only on success.
            let status = unsafe {
                kvb_stride_prep(
                    self.capi.as_ptr(),
                    name.as_ref().map_or(std::ptr::null(), |n| n.as_ptr()),
                    mem_number(mem),
                    runs.as_ptr().cast(),
                    runs.len(),
                    &mut out,
                )
            };
            if status != 0 || out.is_null() {
                return Err(status_text(status));
            }
            // The handle the shim made is nixl-sys's `nixl_capi_xfer_dlist_handle_s` (one
            // `nixlDlistH*`), which nixl-sys releases with `releasedDlistH` and `delete`.
            Ok(Dlist(XferDlistHandle::new(out.cast(), self.capi.cast())))
        }
    }
}

/// A prepared descriptor list, released (through nixl-sys) when dropped.
pub(crate) struct Dlist(XferDlistHandle);

// SAFETY: the handle is used only in NIXL calls (make, release) of an agent created with
// `ThreadSync::Strict`, and released once, by its owner's drop.
unsafe impl Send for Dlist {}
// SAFETY: shared references only read the handle's pointer for NIXL's locked calls.
unsafe impl Sync for Dlist {}

impl Dlist {
    pub(crate) fn handle(&self) -> &XferDlistHandle {
        &self.0
    }
}

/// What the runtime's list does with `runs`: its own description, its descriptor count and
/// how many bytes of the list object it used (for the layout tests).
#[cfg(test)]
pub(crate) fn describe(mem: MemType, runs: &[Run]) -> Result<(String, i32, usize, usize), String> {
    #[cfg(kvbridge_nixl_no_shim)]
    {
        let _ = (mem, runs);
        Err(status_text(NOT_RESOLVED))
    }
    #[cfg(not(kvbridge_nixl_no_shim))]
    {
        if let Some(why) = missing_symbols() {
            return Err(why);
        }
        let mut text = vec![0u8; 4096];
        let (mut count, mut touched) = (0i32, 0usize);
        // SAFETY: `runs` is read during the call; `text` is writable for its length and the
        // shim NUL-terminates within it; `count` and `touched` are written once.
        let n = unsafe {
            kvb_stride_describe(
                mem_number(mem),
                runs.as_ptr().cast(),
                runs.len(),
                text.as_mut_ptr().cast(),
                text.len(),
                &mut count,
                &mut touched,
            )
        };
        if n < 0 {
            return Err(status_text(n as i32));
        }
        let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
        // SAFETY: a constant of the shim.
        let max = unsafe { kvb_stride_list_max() };
        Ok((
            String::from_utf8_lossy(&text[..end]).into_owned(),
            count,
            touched,
            max,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(addr: u64, len: u64, stride: u64, count: u64) -> Run {
        Run {
            addr,
            len,
            device: 0,
            stride,
            count,
        }
    }

    #[test]
    fn runs_extend_only_where_the_blocks_continue() {
        let mut r = run(0, 8, 8, 2);
        assert!(r.extend(&run(16, 8, 8, 3)));
        assert_eq!(r, run(0, 8, 8, 5));
        // A gap, another length, another stride: no.
        assert!(!r.extend(&run(48, 8, 8, 1)));
        assert!(!r.extend(&run(40, 4, 4, 1)));
        assert!(!r.extend(&run(40, 8, 16, 2)));
        // A single block takes the stride of what follows it.
        let mut s = run(100, 8, 8, 1);
        assert!(s.extend(&run(132, 8, 32, 1)));
        assert!(s.extend(&run(164, 8, 32, 2)));
        assert_eq!(s, run(100, 8, 32, 4));
        // Blocks that would overlap never merge.
        let mut t = run(0, 8, 8, 1);
        assert!(!t.extend(&run(4, 8, 8, 1)));
    }

    #[test]
    fn the_handle_is_read_from_debug_text() {
        let text = "Agent { inner: RwLock { data: AgentInner { name: \"a\", handle: 0x5f00a8, \
                    backends: {\"UCX\": 0x77} } } }";
        assert_eq!(handle_in(text), Some(0x5f00a8));
        assert_eq!(
            handle_in("Agent { inner: RwLock { data: <locked>, .. } }"),
            None
        );
    }

    /// A raw agent with the UCX backend, after loading the runtime; `None` (and why) without one.
    fn agent() -> Option<(Agent, nixl_sys::Backend)> {
        let rt = match crate::Runtime::locate() {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("skipped: {e}");
                return None;
            }
        };
        crate::ffi::load(&rt).unwrap();
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let name = format!(
            "kvbridge-stride-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let cfg = nixl_sys::AgentConfig {
            enable_prog_thread: false,
            thread_sync: nixl_sys::ThreadSync::Strict,
            ..nixl_sys::AgentConfig::default()
        };
        let agent = Agent::new_configured(&name, &cfg).unwrap();
        let (_mems, params) = agent.get_plugin_params("UCX").unwrap();
        let backend = agent.create_backend("UCX", &params).unwrap();
        Some((agent, backend))
    }

    /// The runtime's list object fits the shim's reserved storage, holds one entry per run
    /// and reads each run's length from the second word.
    #[cfg(not(kvbridge_nixl_no_shim))]
    #[test]
    fn the_runtime_list_takes_five_word_stride_runs() {
        let Some(_agent) = agent() else { return };
        let runs = [run(0x1000, 1152, 4608, 16), run(0x9000, 64, 64, 2)];
        let (text, count, touched, max) = describe(MemType::Dram, &runs).unwrap();
        assert_eq!(count, 2, "{text}");
        assert!(text.contains("1152:1") && text.contains("64:1"), "{text}");
        assert!(
            touched > 8 && touched <= max,
            "the list used {touched} bytes, {max} allowed"
        );
    }

    /// NIXL checks every block of a run against the registration: a run ending inside the
    /// region is prepared, one block more (or the stride and count read the other way
    /// round) is refused. So the shim's runs are read as addr, len, devId, stride, count.
    #[cfg(not(kvbridge_nixl_no_shim))]
    #[test]
    fn local_prep_checks_every_block_of_a_run() {
        let Some((agent, _backend)) = agent() else {
            return;
        };
        let region = crate::ffi::allocate(1 << 20).unwrap();
        let seg = crate::ffi::Segment::of(&region);
        let _reg = agent.register_memory(&seg, None).unwrap();
        let sa = StrideAgent::new(&agent).unwrap();
        let base = seg.addr as u64;
        // 15 * 65536 + 1024 bytes: inside. Read as stride 16, count 65536: 1,049,584, outside.
        let fits = run(base, 1024, 65_536, 16);
        assert!(sa.prep(&agent, None, MemType::Dram, &[fits]).is_ok());
        let dense = run(base, 4096, 4096, 256);
        assert!(sa.prep(&agent, None, MemType::Dram, &[dense, fits]).is_ok());
        let one_more = run(base, 1024, 65_536, 17);
        let err = sa.prep(&agent, None, MemType::Dram, &[one_more]).err();
        assert!(err.is_some(), "a run past the region was prepared");
        // NIXL refuses runs whose blocks overlap (a stride below the length, zero included,
        // even for one block): the transport posts such a source as one run per row.
        for bad in [
            run(base, 64, 0, 4),
            run(base, 64, 32, 4),
            run(base, 64, 0, 1),
        ] {
            assert!(
                sa.prep(&agent, None, MemType::Dram, &[bad]).is_err(),
                "{bad:?}"
            );
        }
        // Any order, overlapping runs, odd lengths and strides are fine.
        let odd = [
            run(base + 8192, 64, 64, 2),
            run(base + 32, 64, 64, 2),
            run(base + 7, 1, 3, 30),
        ];
        assert!(sa.prep(&agent, None, MemType::Dram, &odd).is_ok());
        let past = run(base + (1 << 20), 64, 64, 1);
        assert!(sa.prep(&agent, None, MemType::Dram, &[past]).is_err());
    }

    #[test]
    fn status_texts_name_nixl_statuses() {
        assert!(status_text(-4).contains("NIXL_ERR_NOT_FOUND"));
        assert!(status_text(NOT_RESOLVED).contains("missing"));
    }
}
