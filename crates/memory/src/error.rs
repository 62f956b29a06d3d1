//! The one error type of `kvbridge-memory`: a CPU access to a region's bytes refused.

use crate::{Access, MemoryKind};

/// Which region a refused CPU access concerns: the region accessed, or one end of a
/// [`copy_to`](crate::MemoryRegion::copy_to) /
/// [`with_raw_copy`](crate::MemoryRegion::with_raw_copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operand {
    /// The one region a read, write, fill, borrow or raw access touches.
    Region,
    /// The region a copy reads from.
    Source,
    /// The region a copy writes into.
    Destination,
}

impl std::fmt::Display for Operand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Operand::Region => "region",
            Operand::Source => "copy's source region",
            Operand::Destination => "copy's destination region",
        })
    }
}

/// A CPU access to a [`MemoryRegion`](crate::MemoryRegion)'s bytes that was refused. Nothing
/// was read or written.
///
/// Every message says what was wrong, the values seen and how to fix it. Transports carry it
/// as `kvbridge_transport::TransportError::Memory`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// A CPU access to a region's bytes (`read_at`, `write_at`, `fill`, `to_vec`, `copy_to`,
    /// `borrow_mut`, `with_raw_range`, `with_raw_copy`) addresses bytes outside the region.
    /// Nothing was read or written.
    #[error(
        "bytes [{offset}, {offset}+{len}) are outside the {operand} of {region_len} bytes; keep \
         offset + len within the region's length"
    )]
    AccessOutOfRange {
        /// Which region.
        operand: Operand,
        /// The offset asked for.
        offset: u64,
        /// The length asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// A CPU access to a region's bytes overlaps an access in progress, and one of the two
    /// writes, and did not end within `CLAIM_WAIT`. Nothing was read or written.
    #[error(
        "refused {access} bytes [{offset}, {offset}+{len}) of the {region_len}-byte {operand}: \
         bytes [{held_start}, {held_end}) were still claimed for {held} by another access after \
         waiting 1 s for it; overlapping accesses where one writes are serialised, so one holds \
         its claim too long (drop a borrow before touching its bytes again, and do not hold one \
         across other work)"
    )]
    AccessConflict {
        /// Which region.
        operand: Operand,
        /// What the refused access wanted to do.
        access: Access,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        region_len: u64,
        /// What the access holding the overlapping claim does.
        held: Access,
        /// Start of the overlapping claim.
        held_start: u64,
        /// End of the overlapping claim.
        held_end: u64,
    },
    /// A CPU access to device memory, which the CPU cannot address. Nothing was touched.
    #[error(
        "the {operand} is {kind} ({len} bytes), which the CPU cannot read or write; move it \
         with a transport whose capabilities declare device_memory, or copy it to host memory \
         with the device's own API first"
    )]
    NotHostMemory {
        /// Which region.
        operand: Operand,
        /// The region's kind.
        kind: MemoryKind,
        /// The region's length.
        len: u64,
    },
    /// A slice of foreign memory was asked for (`borrow_mut`).
    #[error(
        "cannot borrow bytes [{offset}, {offset}+{len}) as a slice: the region wraps foreign \
         memory that other processes or devices may write, so a Rust reference to it would be \
         unsound; copy with read_at / write_at / copy_to instead"
    )]
    ForeignBorrow {
        /// The offset asked for.
        offset: u64,
        /// The length asked for.
        len: u64,
    },
}

impl MemoryError {
    /// This refusal, naming `end` as the region it concerns (as a copy names its source or
    /// destination); an error that names no region is returned as it is.
    #[must_use]
    pub fn for_operand(mut self, end: Operand) -> Self {
        if let MemoryError::AccessOutOfRange { operand, .. }
        | MemoryError::AccessConflict { operand, .. }
        | MemoryError::NotHostMemory { operand, .. } = &mut self
        {
            *operand = end;
        }
        self
    }
}

/// Result alias for accesses to registered memory.
pub type Result<T, E = MemoryError> = std::result::Result<T, E>;
