//! The decode's page ids as the planners take them: a type that says where its first entry
//! starts, so a request's whole page table cannot be passed where the send range is meant.

use crate::error::{GeometryError, Result};

/// Decode **virtual** page ids of a transfer's send range: entry 0 holds the positions from
/// `decode_prefix_len` on (SGLang's `dst_page_indices`), one id per virtual page
/// (`page_size · dcp_size` tokens) of the whole send range, never sliced per chunk.
///
/// A request's page table (`ReceiveRequest::page_table`, `TokenLayout::page_table` in
/// kvbridge-coordinator) starts at position 0 instead. Passing one where the other is meant
/// would write one virtual page too early for every virtual page of cached prefix, so the
/// planners take this type, never a bare slice, and it is made only by naming where the ids
/// start: [`SendPages::after_prefix`] for ids that already start at the prefix,
/// [`SendPages::from_page_table`] for a table that starts at position 0.
///
/// A bare page table is refused at compile time:
///
/// ```compile_fail
/// use kvbridge_geometry::DcpPlanInput;
/// let page_table: Vec<u64> = vec![7, 3, 9]; // from position 0
/// let input = DcpPlanInput {
///     dst_pages: &page_table,
///     page_size: 2,
///     dcp_size: 4,
///     ..DcpPlanInput::default()
/// };
/// ```
///
/// ```
/// use kvbridge_geometry::{DcpPlanInput, SendPages};
/// let page_table = [7, 3, 9]; // virtual pages of 8 tokens from position 0
/// let input = DcpPlanInput {
///     src_pages: &[5, 2],
///     dst_pages: SendPages::from_page_table(&page_table, 8, 8)?, // skips page 7
///     page_size: 2,
///     dcp_size: 4,
///     decode_prefix_len: 8,
///     ..DcpPlanInput::default()
/// };
/// assert_eq!(input.dst_pages, SendPages::after_prefix(&[3, 9]));
/// // Position 8 (the first after the prefix) lands in virtual page 3.
/// assert_eq!(input.plan()?.to_token_plan().draft_dst[0], 3 * 8);
/// # Ok::<(), kvbridge_geometry::GeometryError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SendPages<'a>(&'a [u64]);

impl<'a> SendPages<'a> {
    /// Ids whose entry 0 holds position `decode_prefix_len` (what the decode sends in its
    /// transfer metadata, and SGLang's `dst_page_indices`).
    #[must_use]
    pub const fn after_prefix(ids: &'a [u64]) -> Self {
        Self(ids)
    }

    /// The send range of a request's whole page table, whose entry `j` holds positions
    /// `j·V .. (j+1)·V` from position 0 (`V = virtual_page_size`): the table without the
    /// `decode_prefix_len / V` entries of the cached prefix.
    ///
    /// # Errors
    /// [`GeometryError::ZeroPageSize`] when `virtual_page_size` is 0;
    /// [`GeometryError::PrefixMisaligned`] when `decode_prefix_len` is not a multiple of `V`;
    /// [`GeometryError::PageTableTooShort`] when the table does not cover the prefix.
    pub fn from_page_table(
        table: &'a [u64],
        decode_prefix_len: u64,
        virtual_page_size: u64,
    ) -> Result<Self> {
        let v = virtual_page_size;
        if v == 0 {
            return Err(GeometryError::ZeroPageSize { page_size: v });
        }
        if decode_prefix_len % v != 0 {
            return Err(GeometryError::PrefixMisaligned {
                virtual_page_size: v,
                decode_prefix_len,
            });
        }
        let prefix_pages = decode_prefix_len / v;
        match usize::try_from(prefix_pages)
            .ok()
            .and_then(|n| table.get(n..))
        {
            Some(rest) => Ok(Self(rest)),
            None => Err(GeometryError::PageTableTooShort {
                table_len: table.len() as u64,
                prefix_pages,
                virtual_page_size: v,
            }),
        }
    }

    /// The ids, entry 0 at position `decode_prefix_len`.
    #[must_use]
    pub const fn as_slice(&self) -> &'a [u64] {
        self.0
    }

    /// Virtual pages in the send range.
    #[must_use]
    pub const fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is no id.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
