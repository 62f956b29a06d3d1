//! Prefix alignment to the DCP virtual page (`V = page_size · dcp_size`).
//!
//! Under DCP the decode allocator and radix cache work in virtual pages, so a decode prefix
//! must be a multiple of `V` (otherwise [`crate::DcpPlanInput::plan`] fails with
//! `PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size …`).
//!
//! * Round **down** ([`align_prefix_down`]) when deciding how much of a cached prefix the
//!   decode may *keep*: only whole virtual pages are reusable; the tail of a partial page is
//!   sent again by prefill. This never claims tokens the decode does not have, so it is the
//!   right fix for the misalignment error.
//! * Round **up** ([`align_prefix_up`]) when sizing *space*: pages to allocate, padding a
//!   length to whole virtual pages, or pack-buffer capacity. Never use it for a prefix: it
//!   would skip tokens nobody sends.

use crate::error::{GeometryError, Result};

/// `page_size · dcp_size`, the decode allocator's page under DCP.
///
/// # Errors
/// [`GeometryError::ZeroPageSize`], [`GeometryError::ZeroDcpSize`], [`GeometryError::Overflow`].
pub fn virtual_page_size(page_size: u64, dcp_size: u64) -> Result<u64> {
    if page_size == 0 {
        return Err(GeometryError::ZeroPageSize { page_size });
    }
    if dcp_size == 0 {
        return Err(GeometryError::ZeroDcpSize { dcp_size });
    }
    page_size
        .checked_mul(dcp_size)
        .ok_or(GeometryError::Overflow {
            what: "page_size x dcp_size",
        })
}

/// Largest multiple of the virtual page that is `≤ prefix_len`: the part of a cached decode
/// prefix the decode may keep.
///
/// ```
/// use kvbridge_geometry::align_prefix_down;
/// assert_eq!(align_prefix_down(100, 16, 4).unwrap(), 64);
/// ```
///
/// # Errors
/// As [`virtual_page_size`].
pub fn align_prefix_down(prefix_len: u64, page_size: u64, dcp_size: u64) -> Result<u64> {
    let v = virtual_page_size(page_size, dcp_size)?;
    Ok(prefix_len - prefix_len % v)
}

/// Smallest multiple of the virtual page that is `≥ len`: space (pages, padding, buffers)
/// that holds `len` tokens in whole virtual pages.
///
/// ```
/// use kvbridge_geometry::align_prefix_up;
/// assert_eq!(align_prefix_up(100, 16, 4).unwrap(), 128);
/// ```
///
/// # Errors
/// As [`virtual_page_size`], and [`GeometryError::Overflow`] when the result exceeds `u64`.
pub fn align_prefix_up(len: u64, page_size: u64, dcp_size: u64) -> Result<u64> {
    let v = virtual_page_size(page_size, dcp_size)?;
    len.div_ceil(v)
        .checked_mul(v)
        .ok_or(GeometryError::Overflow {
            what: "aligned length",
        })
}
