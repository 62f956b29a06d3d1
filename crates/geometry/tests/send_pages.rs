//! The decode's page ids say where they start; offsets count tokens.

use kvbridge_geometry::{DcpPlanInput, GeometryError, ReshardInput, SendPages};
use proptest::prelude::*;

#[test]
fn a_page_table_from_position_0_skips_the_cached_prefix() {
    let table = [7, 3, 9, 4];
    let pages = SendPages::from_page_table(&table, 16, 8).unwrap();
    assert_eq!(pages, SendPages::after_prefix(&[9, 4]));
    assert_eq!(pages.len(), 2);
    // A table that does not even cover the prefix is refused, naming both conventions.
    let e = SendPages::from_page_table(&table, 40, 8).unwrap_err();
    assert!(matches!(
        e,
        GeometryError::PageTableTooShort {
            table_len: 4,
            prefix_pages: 5,
            virtual_page_size: 8
        }
    ));
    assert!(e.to_string().contains("SendPages::after_prefix"), "{e}");
    assert!(matches!(
        SendPages::from_page_table(&table, 12, 8),
        Err(GeometryError::PrefixMisaligned { .. })
    ));
    assert!(matches!(
        SendPages::from_page_table(&table, 0, 0),
        Err(GeometryError::ZeroPageSize { .. })
    ));
}

#[test]
fn a_dcp_chunk_start_counts_tokens_and_must_be_page_aligned() {
    let base = DcpPlanInput {
        src_pages: &[5, 2],
        dst_pages: SendPages::after_prefix(&[7, 8]),
        page_size: 2,
        dcp_size: 2,
        ..DcpPlanInput::default()
    };
    let e = DcpPlanInput {
        chunk_start: 3,
        ..base
    }
    .plan()
    .unwrap_err();
    assert_eq!(
        e,
        GeometryError::ChunkStartMisaligned {
            chunk_start: 3,
            page_size: 2
        }
    );
    assert_eq!(e.code(), "KVB-E042");
    // Two tokens (one page) sent before: the chunk's draft rows start at row 2.
    let plan = DcpPlanInput {
        chunk_start: 2,
        ..base
    }
    .plan()
    .unwrap()
    .to_token_plan();
    assert_eq!(plan.draft_dst[0], 7 * 4 + 2);
}

proptest! {
    /// Both plans give the same rows for a page table from position 0 and for its send range.
    #[test]
    fn from_page_table_is_the_send_range(
        prefix_pages in 0u64..4,
        extra in 1u64..5,
        p in 1u64..5,
        d in 1u64..4,
        r_seed in 0u64..4,
    ) {
        let v = p * d;
        let table: Vec<u64> = (0..prefix_pages + extra).map(|i| 100 - i).collect();
        let l = prefix_pages * v;
        let src: Vec<u64> = (0..extra * d).collect();
        let r = r_seed % d;
        let sliced = SendPages::after_prefix(&table[prefix_pages as usize..]);
        let from_table = SendPages::from_page_table(&table, l, v).unwrap();
        prop_assert_eq!(sliced, from_table);
        let dcp = |dst_pages| DcpPlanInput {
            src_pages: &src,
            dst_pages,
            page_size: p,
            dcp_size: d,
            dcp_rank: r,
            decode_prefix_len: l,
            ..DcpPlanInput::default()
        }.plan().unwrap().to_token_plan();
        prop_assert_eq!(dcp(sliced), dcp(from_table));
        let reshard = ReshardInput {
            src_pages: &src,
            dst_pages: from_table,
            src_page_size: p,
            dst_page_size: p,
            src_dcp_size: 1,
            dst_dcp_size: d,
            dst_dcp_rank: r,
            decode_prefix_len: l,
            num_tokens: extra * v,
            ..ReshardInput::default()
        }.plan().unwrap();
        // The first row written is in the first page after the prefix, never in the prefix.
        let (_, dst) = reshard.arrays();
        if let Some(&first) = dst.first() {
            prop_assert_eq!(first / p, table[prefix_pages as usize]);
        }
    }
}
