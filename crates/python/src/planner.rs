//! The planner: SGLang-compatible DCP token plans and run grouping over `kvbridge-geometry`,
//! plus the prefix alignment helpers.
//!
//! The Python layer (`kvbridge/sglang.py`) owns SGLang's argument handling and its numpy
//! semantics outside the planner's domain; the functions here take index arrays as the raw
//! bytes of native-endian 64-bit integers (`ndarray.tobytes()`) and return token rows as
//! `bytearray`s that numpy views without a copy (`np.frombuffer`, writable like SGLang's
//! arrays). Reading numpy memory in place would need `unsafe` (or the buffer protocol, which
//! the 3.10 stable ABI lacks); the copy is a few microseconds for a chunk's page list.

use std::cell::RefCell;

use kvbridge_geometry::{DcpPlanInput, DcpTokenPlan, GeometryError, SendPages};
use pyo3::exceptions::{PyValueError, PyZeroDivisionError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyList};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(dcp_token_plan, m)?)?;
    m.add_function(wrap_pyfunction!(group_runs, m)?)?;
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

/// Native-endian 64-bit integers from `ndarray.tobytes()`; `None` when a value is negative
/// (`signed`) so the caller takes numpy's path.
fn read_u64s(bytes: &[u8], signed: bool) -> PyResult<Option<Vec<u64>>> {
    if bytes.len() % 8 != 0 {
        return Err(PyValueError::new_err(format!(
            "index bytes must hold whole 64-bit integers, got {} bytes; pass ndarray.tobytes() \
             of an int64 or uint64 array",
            bytes.len()
        )));
    }
    let mut out = Vec::with_capacity(bytes.len() / 8);
    for chunk in bytes.chunks_exact(8) {
        let raw: [u8; 8] = chunk.try_into().expect("chunks_exact(8)");
        if signed {
            match u64::try_from(i64::from_ne_bytes(raw)) {
                Ok(v) => out.push(v),
                Err(_) => return Ok(None),
            }
        } else {
            out.push(u64::from_ne_bytes(raw));
        }
    }
    Ok(Some(out))
}

/// A `bytearray` holding `values` as native-endian int64 (every value came from an `i64`-range
/// plan, checked by the caller).
fn int64_bytes<'py>(py: Python<'py>, values: &[u64]) -> PyResult<Bound<'py, PyByteArray>> {
    PyByteArray::new_with(py, values.len() * 8, |buf| {
        for (dst, v) in buf.chunks_exact_mut(8).zip(values) {
            dst.copy_from_slice(&v.to_ne_bytes());
        }
        Ok(())
    })
}

thread_local! {
    /// One token plan per thread, reused: a chunk's arrays are allocated once per thread.
    static TOKEN_PLAN: RefCell<DcpTokenPlan> = RefCell::new(DcpTokenPlan::default());
}

type FourArrays<'py> = (
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
);

/// SGLang's `build_dcp_token_transfer_plan` on non-negative integers: the four arrays
/// (target src, target dst, draft src, draft dst) as int64 bytes.
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
) -> PyResult<Option<FourArrays<'py>>> {
    if page_size == 0 || dcp_size == 0 {
        // Python's own text for `decode_prefix_len % 0`.
        return Err(PyZeroDivisionError::new_err("integer modulo by zero"));
    }
    let (Some(src), Some(dst)) = (read_u64s(src_pages, true)?, read_u64s(dst_pages, true)?) else {
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
    let filled = py.detach(|| {
        let plan = input.plan()?;
        TOKEN_PLAN.with_borrow_mut(|out| {
            plan.fill_token_plan(out);
            // numpy computes in int64: rows beyond it wrap there, so leave them to numpy.
            let fits = |v: &Vec<u64>| v.iter().all(|&x| i64::try_from(x).is_ok());
            Ok::<_, GeometryError>(
                fits(&out.target_src)
                    && fits(&out.target_dst)
                    && fits(&out.draft_src)
                    && fits(&out.draft_dst),
            )
        })
    });
    match filled {
        Ok(true) => TOKEN_PLAN.with_borrow(|out| {
            Ok(Some((
                int64_bytes(py, &out.target_src)?,
                int64_bytes(py, &out.target_dst)?,
                int64_bytes(py, &out.draft_src)?,
                int64_bytes(py, &out.draft_dst)?,
            )))
        }),
        Ok(false) => Ok(None),
        Err(e @ GeometryError::PrefixMisaligned { .. }) => {
            Err(PyValueError::new_err(sglang_text(&e)))
        }
        Err(_) => Ok(None),
    }
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
        Ok(read_u64s(bytes, false)?
            .expect("unsigned reads never refuse")
            .into_iter()
            .map(|v| v ^ flip)
            .collect())
    };
    let (s, d) = (decode(src)?, decode(dst)?);
    if s.contains(&u64::MAX) || d.contains(&u64::MAX) {
        return Ok(None);
    }
    let runs = py
        .detach(|| kvbridge_geometry::group_concurrent_contiguous(&s, &d))
        .map_err(|e| PyValueError::new_err(sglang_text(&e)))?;
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
