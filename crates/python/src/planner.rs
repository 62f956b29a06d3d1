//! The planner: SGLang-compatible DCP token plans and run grouping over `kvbridge-geometry`,
//! any-to-any DCP resharding (the owner rule), plus the prefix alignment helpers.
//!
//! The Python layer (`kvbridge/sglang.py`) owns SGLang's argument handling and its numpy
//! semantics outside the planner's domain; the functions here take index arrays as the raw
//! bytes of native-endian 64-bit integers (`ndarray.tobytes()`) and return token rows as
//! `bytearray`s that numpy views without a copy (`np.frombuffer`, writable like SGLang's
//! arrays). Reading numpy memory in place would need `unsafe` (or the buffer protocol, which
//! the 3.10 stable ABI lacks); the copy is a few microseconds for a chunk's page list.

use kvbridge_geometry::{DcpPlanInput, GeometryError, ReshardInput, SendPages};
use pyo3::exceptions::{PyValueError, PyZeroDivisionError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyList};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(dcp_token_plan, m)?)?;
    m.add_function(wrap_pyfunction!(group_runs, m)?)?;
    m.add_function(wrap_pyfunction!(dcp_transfer_runs, m)?)?;
    m.add_function(wrap_pyfunction!(reshard_sources, m)?)?;
    m.add_function(wrap_pyfunction!(reshard_targets, m)?)?;
    m.add_function(wrap_pyfunction!(reshard_transfer_runs, m)?)?;
    m.add_function(wrap_pyfunction!(virtual_page_size, m)?)?;
    m.add_function(wrap_pyfunction!(align_prefix_down, m)?)?;
    m.add_function(wrap_pyfunction!(align_prefix_up, m)?)?;
    Ok(())
}

/// The part of a planner message that SGLang defines: kvbridge's messages start with SGLang's
/// text word for word and append the remedy after `; ` (docs/planning.md).
fn sglang_text(e: &GeometryError) -> String {
    let full = e.to_string();
    match full.split_once("; ") {
        Some((head, _)) => head.to_owned(),
        None => full,
    }
}

/// Planner errors of kvbridge's own helpers: `ValueError` with the whole message (remedy and
/// problem code included).
fn value_error(e: &GeometryError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The 64-bit words of `ndarray.tobytes()` (native-endian int64 or uint64), as bit patterns.
fn read_words(bytes: &[u8]) -> PyResult<Vec<u64>> {
    if bytes.len() % 8 != 0 {
        return Err(PyValueError::new_err(format!(
            "index bytes must hold whole 64-bit integers, got {} bytes; pass ndarray.tobytes() \
             of an int64 or uint64 array",
            bytes.len()
        )));
    }
    let word = |chunk: &[u8]| {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(chunk);
        u64::from_ne_bytes(raw)
    };
    Ok(bytes.chunks_exact(8).map(word).collect())
}

/// int64 words as `u64`s; `None` when one is negative (its sign bit set), so the caller takes
/// numpy's path.
fn read_u64s(bytes: &[u8]) -> PyResult<Option<Vec<u64>>> {
    let words = read_words(bytes)?;
    Ok(words.iter().all(|w| w >> 63 == 0).then_some(words))
}

/// `pairs` as two int64 arrays back to back in `bytes` (sources, then destinations).
fn write_pairs(bytes: &mut [u8], pairs: impl Iterator<Item = (u64, u64)>) {
    let (src, dst) = bytes.split_at_mut(bytes.len() / 2);
    for ((s, d), (sb, db)) in pairs.zip(src.chunks_exact_mut(8).zip(dst.chunks_exact_mut(8))) {
        sb.copy_from_slice(&s.to_ne_bytes());
        db.copy_from_slice(&d.to_ne_bytes());
    }
}

/// SGLang's `build_dcp_token_transfer_plan` on non-negative integers: one `bytearray` holding
/// the four int64 arrays back to back (target src, target dst, draft src, draft dst) and the
/// target and draft lengths. One buffer, written once: the caller's four numpy arrays are
/// views of it.
///
/// Raises what SGLang raises before any row is computed (`ZeroDivisionError` for a zero
/// virtual page, `ValueError` with SGLang's text for a misaligned prefix); returns `None` for
/// every input outside the planner's domain (too few pages, sizes above the planner's limits,
/// rows beyond int64), where the caller runs numpy's semantics to get numpy's own result or
/// exception.
#[pyfunction]
#[pyo3(signature = (src_pages, dst_pages, page_size, dcp_size, dcp_rank, src_page_offset, decode_prefix_len, num_kv_tokens))]
#[allow(clippy::too_many_arguments)]
fn dcp_token_plan<'py>(
    py: Python<'py>,
    src_pages: &[u8],
    dst_pages: &[u8],
    page_size: u64,
    dcp_size: u64,
    dcp_rank: u64,
    src_page_offset: u64,
    decode_prefix_len: u64,
    num_kv_tokens: Option<u64>,
) -> PyResult<Option<(Bound<'py, PyByteArray>, usize, usize)>> {
    if page_size == 0 || dcp_size == 0 {
        // Python's own text for `decode_prefix_len % 0`.
        return Err(PyZeroDivisionError::new_err("integer modulo by zero"));
    }
    let (Some(src), Some(dst)) = (read_u64s(src_pages)?, read_u64s(dst_pages)?) else {
        return Ok(None);
    };
    let Some(chunk_start) = src_page_offset.checked_mul(page_size) else {
        return Ok(None);
    };
    let input = DcpPlanInput {
        src_pages: &src,
        dst_pages: SendPages::after_prefix(&dst),
        page_size,
        dcp_size,
        dcp_rank: dcp_rank % dcp_size,
        chunk_start,
        decode_prefix_len,
        num_kv_tokens,
    };
    let plan = match input.plan() {
        Ok(plan) => plan,
        Err(e @ GeometryError::PrefixMisaligned { .. }) => {
            return Err(PyValueError::new_err(sglang_text(&e)));
        }
        Err(_) => return Ok(None),
    };
    // numpy computes rows in int64, where rows beyond it wrap: leave those to numpy. A row is
    // below (largest page id + 1) x its page size.
    let rows_fit = |pages: &[u64], page: u64| {
        let end = pages.iter().max().map_or(Some(0), |&m| {
            m.checked_add(1).and_then(|m| m.checked_mul(page))
        });
        end.is_some_and(|end| end <= i64::MAX as u64)
    };
    if !rows_fit(&src, page_size) || !rows_fit(&dst, page_size * dcp_size) {
        return Ok(None);
    }
    let (nt, nd) = (plan.target_len() as usize, plan.draft_len() as usize);
    let buf = PyByteArray::new_with(py, (2 * nt + 2 * nd) * 8, |buf| {
        // Nothing else can see the new bytearray yet: other threads may run meanwhile.
        py.detach(|| {
            let (target, draft) = buf.split_at_mut(2 * nt * 8);
            write_pairs(target, plan.target_pairs());
            write_pairs(draft, plan.draft_pairs());
        });
        Ok(())
    })?;
    Ok(Some((buf, nt, nd)))
}

type TwoArrays<'py> = (Bound<'py, PyByteArray>, Bound<'py, PyByteArray>);

/// Page ids for kvbridge's own planner entry points: non-negative, else a `ValueError`.
fn page_ids(bytes: &[u8], which: &str) -> PyResult<Vec<u64>> {
    read_u64s(bytes)?.ok_or_else(|| {
        PyValueError::new_err(format!(
            "{which} must be non-negative page ids; pass the ids the KV pool's allocator handed out"
        ))
    })
}

/// Runs as int64 triples `(src_row, dst_row, len)`; a `ValueError` when a row is beyond int64.
fn runs_bytes<'py>(
    py: Python<'py>,
    runs: &[kvbridge_geometry::Run],
) -> PyResult<Bound<'py, PyByteArray>> {
    let fits = |start: u64, len: u64| {
        start
            .checked_add(len)
            .is_some_and(|end| end <= i64::MAX as u64)
    };
    if let Some(run) = runs
        .iter()
        .find(|r| !fits(r.src_start, r.len) || !fits(r.dst_start, r.len))
    {
        return Err(PyValueError::new_err(format!(
            "token rows must fit in int64, got a run of {} rows from {} to {}; page ids are \
             too large for this page size",
            run.len, run.src_start, run.dst_start
        )));
    }
    PyByteArray::new_with(py, runs.len() * 24, |buf| {
        for (dst, run) in buf.chunks_exact_mut(24).zip(runs) {
            dst[..8].copy_from_slice(&run.src_start.to_ne_bytes());
            dst[8..16].copy_from_slice(&run.dst_start.to_ne_bytes());
            dst[16..].copy_from_slice(&run.len.to_ne_bytes());
        }
        Ok(())
    })
}

/// The DCP plan straight to coalesced runs, target and draft: what
/// `group_concurrent_contiguous` makes of the plan's arrays, without per-token arrays or
/// per-group lists. kvbridge's validation and messages (`dcp_rank < dcp_size`, page ids that
/// cover the chunk, ...; each `ValueError` says the fix and the problem code).
#[pyfunction]
#[pyo3(signature = (src_pages, dst_pages, page_size, dcp_size, dcp_rank, src_page_offset, decode_prefix_len, num_kv_tokens))]
#[allow(clippy::too_many_arguments)]
fn dcp_transfer_runs<'py>(
    py: Python<'py>,
    src_pages: &[u8],
    dst_pages: &[u8],
    page_size: u64,
    dcp_size: u64,
    dcp_rank: u64,
    src_page_offset: u64,
    decode_prefix_len: u64,
    num_kv_tokens: Option<u64>,
) -> PyResult<TwoArrays<'py>> {
    let src = page_ids(src_pages, "src_page_indices")?;
    let dst = page_ids(dst_pages, "dst_page_indices")?;
    let chunk_start = src_page_offset.checked_mul(page_size).ok_or_else(|| {
        value_error(&GeometryError::Overflow {
            what: "src_page_offset x page_size",
        })
    })?;
    let input = DcpPlanInput {
        src_pages: &src,
        dst_pages: SendPages::after_prefix(&dst),
        page_size,
        dcp_size,
        dcp_rank,
        chunk_start,
        decode_prefix_len,
        num_kv_tokens,
    };
    let (target, draft) = py
        .detach(|| {
            let plan = input.plan()?;
            Ok::<_, GeometryError>((
                plan.target_runs_vec(),
                plan.draft_runs().collect::<Vec<_>>(),
            ))
        })
        .map_err(|e| value_error(&e))?;
    Ok((runs_bytes(py, &target)?, runs_bytes(py, &draft)?))
}

/// Prefill DCP ranks holding rows that decode rank `decode_rank` needs (the owner rule,
/// docs/planning.md): the prefill ranks a decode rank reads from.
#[pyfunction]
fn reshard_sources(prefill_dcp: u64, decode_dcp: u64, decode_rank: u64) -> PyResult<Vec<u64>> {
    kvbridge_geometry::reshard_sources(prefill_dcp, decode_dcp, decode_rank)
        .map_err(|e| value_error(&e))
}

/// Decode DCP ranks that prefill rank `prefill_rank` writes to (the owner rule).
#[pyfunction]
fn reshard_targets(prefill_dcp: u64, decode_dcp: u64, prefill_rank: u64) -> PyResult<Vec<u64>> {
    kvbridge_geometry::reshard_targets(prefill_dcp, decode_dcp, prefill_rank)
        .map_err(|e| value_error(&e))
}

/// The rows one (prefill DCP rank, decode DCP rank) pair moves in one chunk, prefill DCP `a` →
/// decode DCP `b` for any sizes (`ReshardInput`, docs/planning.md), as coalesced int64
/// triples `(src_row, dst_row, len)`. kvbridge's validation and messages (`ValueError` with
/// the fix and the problem code).
#[pyfunction]
#[pyo3(signature = (src_pages, dst_pages, src_page_size, dst_page_size, src_dcp_size, src_dcp_rank, dst_dcp_size, dst_dcp_rank, decode_prefix_len, chunk_start, num_tokens))]
#[allow(clippy::too_many_arguments)]
fn reshard_transfer_runs<'py>(
    py: Python<'py>,
    src_pages: &[u8],
    dst_pages: &[u8],
    src_page_size: u64,
    dst_page_size: u64,
    src_dcp_size: u64,
    src_dcp_rank: u64,
    dst_dcp_size: u64,
    dst_dcp_rank: u64,
    decode_prefix_len: u64,
    chunk_start: u64,
    num_tokens: u64,
) -> PyResult<Bound<'py, PyByteArray>> {
    let src = page_ids(src_pages, "src_page_indices")?;
    let dst = page_ids(dst_pages, "dst_page_indices")?;
    let input = ReshardInput {
        src_pages: &src,
        dst_pages: SendPages::after_prefix(&dst),
        src_page_size,
        dst_page_size,
        src_dcp_size,
        src_dcp_rank,
        dst_dcp_size,
        dst_dcp_rank,
        decode_prefix_len,
        chunk_start,
        num_tokens,
    };
    let runs = py
        .detach(|| input.plan().map(|plan| plan.runs_vec()))
        .map_err(|e| value_error(&e))?;
    runs_bytes(py, &runs)
}

/// The order- and successor-preserving map of an `i64` into `u64` (sign bit flipped), so
/// signed indices group exactly as unsigned ones do.
const SIGN: u64 = 1 << 63;

type Groups<'py> = (Bound<'py, PyList>, Bound<'py, PyList>);

/// SGLang's `group_concurrent_contiguous` on two 1-D integer arrays given as 64-bit bytes
/// (`signed`: int64, else uint64): the source and destination groups as lists of lists of
/// ints. `None` when a value is the largest of its type: numpy's differences wrap around
/// there (the next value may be the smallest one and still count as consecutive), so the
/// caller takes numpy's path.
#[pyfunction]
fn group_runs<'py>(
    py: Python<'py>,
    src: &[u8],
    dst: &[u8],
    signed: bool,
) -> PyResult<Option<Groups<'py>>> {
    let decode = |bytes: &[u8]| -> PyResult<Vec<u64>> {
        let flip = if signed { SIGN } else { 0 };
        Ok(read_words(bytes)?.into_iter().map(|v| v ^ flip).collect())
    };
    let (s, d) = (decode(src)?, decode(dst)?);
    if s.contains(&u64::MAX) || d.contains(&u64::MAX) {
        return Ok(None);
    }
    let runs = py
        .detach(|| kvbridge_geometry::group_concurrent_contiguous(&s, &d))
        .map_err(|e| PyValueError::new_err(sglang_text(&e)))?;
    // Tens of thousands of fresh lists would trigger the cyclic collector every few hundred:
    // it finds nothing among them (they hold only ints), and pausing it halves the time. No
    // Python code runs until it is resumed (the GIL is held throughout).
    let _paused = GcPause::new(py)?;
    // `PyList::new` takes items, not results: build each side's groups first.
    let collect = |start: fn(&kvbridge_geometry::Run) -> u64| -> PyResult<Bound<'py, PyList>> {
        let mut out = Vec::with_capacity(runs.len());
        for run in &runs {
            let first = start(run);
            let values = (0..run.len).map(|i| first + i);
            out.push(if signed {
                PyList::new(py, values.map(|v| (v ^ SIGN) as i64))?
            } else {
                PyList::new(py, values)?
            });
        }
        PyList::new(py, out)
    };
    Ok(Some((collect(|r| r.src_start)?, collect(|r| r.dst_start)?)))
}

/// Pauses Python's cyclic garbage collector while alive, when it was enabled.
struct GcPause<'py>(Option<Bound<'py, PyModule>>);

impl<'py> GcPause<'py> {
    fn new(py: Python<'py>) -> PyResult<Self> {
        let gc = py.import("gc")?;
        if gc.call_method0("isenabled")?.is_truthy()? {
            gc.call_method0("disable")?;
            Ok(Self(Some(gc)))
        } else {
            Ok(Self(None))
        }
    }
}

impl Drop for GcPause<'_> {
    fn drop(&mut self) {
        if let Some(gc) = &self.0 {
            // Re-enabling cannot fail; were it to, the collector would stay paused, which
            // costs memory, not correctness.
            let _ = gc.call_method0("enable");
        }
    }
}

/// `page_size · dcp_size`, the decode allocator's page under DCP.
#[pyfunction]
fn virtual_page_size(physical_page_size: u64, dcp_size: u64) -> PyResult<u64> {
    kvbridge_geometry::virtual_page_size(physical_page_size, dcp_size).map_err(|e| value_error(&e))
}

/// The largest multiple of the virtual page `≤ prefix_len`: what a decode prefix cache may keep.
#[pyfunction]
fn align_prefix_down(prefix_len: u64, physical_page_size: u64, dcp_size: u64) -> PyResult<u64> {
    kvbridge_geometry::align_prefix_down(prefix_len, physical_page_size, dcp_size)
        .map_err(|e| value_error(&e))
}

/// The smallest multiple of the virtual page `≥ length`: space in whole virtual pages.
#[pyfunction]
fn align_prefix_up(length: u64, physical_page_size: u64, dcp_size: u64) -> PyResult<u64> {
    kvbridge_geometry::align_prefix_up(length, physical_page_size, dcp_size)
        .map_err(|e| value_error(&e))
}
