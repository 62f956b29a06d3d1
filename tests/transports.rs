//! The coordinator over the real transports: the same request moved through shared memory and
//! through TCP (in one process, real sockets and mappings), every decode byte verified.
//!
//! The coordinator's own tests use `LoopbackTransport`; this file proves the agents compose
//! with every transport the workspace ships, including DCP relayout and any-to-any resharding.

use std::sync::Arc;
use std::time::Duration;

use kvbridge_coordinator::{
    AllocatedMemory, Chunk, DecodeAgent, InProcessControlHub, KvMemory, PrefillAgent,
    ReceiveRequest, StaticDirectory,
};
use kvbridge_handshake::{PeerDescriptor, Role};
use kvbridge_testkit::fill::{
    EntryView, TokenLayout, entry_views, fill_rows, verify_rows, verify_untouched,
};
use kvbridge_transport::KvTransport;

const ADDR: &str = "prefill.transports-test:8998";
const LAYERS: usize = 3;
const TOKEN_BYTES: u64 = 96;
const POOL_PAGES: u64 = 16;
/// Generous but bounded: a broken transport fails the test instead of hanging it.
const LIMIT: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug)]
enum Kind {
    Shm,
    Tcp,
}

async fn transport(kind: Kind) -> Arc<dyn KvTransport> {
    match kind {
        Kind::Shm => Arc::new(kvbridge_shm::ShmTransport::new().expect("shm transport")),
        Kind::Tcp => Arc::new(
            kvbridge_tcp::TcpTransport::new()
                .await
                .expect("tcp transport"),
        ),
    }
}

/// Views of the KV entries of memory the coordinator allocated, for the fill and verify helpers.
fn kv_views(mem: &AllocatedMemory) -> Vec<EntryView> {
    entry_views(
        &mem.kv_regions,
        mem.memory.kv.iter().map(|e| (e.offset, e.len)),
    )
}

fn mla(role: Role, page_size: u64, tp: u32, rank: u32, dcp: u32) -> PeerDescriptor {
    PeerDescriptor::mla(role, page_size, LAYERS, TOKEN_BYTES)
        .attn_tp(tp, rank)
        .dcp(dcp)
        .build()
        .expect("valid descriptor")
}

/// Moves `tokens` tokens of room 1 from every prefill rank to every decode rank in chunks of
/// `chunk_pages` prefill pages and checks each decode rank holds exactly its rows.
async fn transfer(
    kind: Kind,
    prefill: Vec<PeerDescriptor>,
    decode: Vec<PeerDescriptor>,
    tokens: u64,
    chunk_pages: u64,
) {
    let hub = InProcessControlHub::new();
    let directory = StaticDirectory::new();
    let room = 1;

    let mut prefills = Vec::new();
    for (i, desc) in prefill.into_iter().enumerate() {
        let t = transport(kind).await;
        let mem = KvMemory::allocate(&*t, &desc, POOL_PAGES, 0)
            .await
            .expect("prefill memory");
        // Pages in a scrambled order so a wrong page mapping cannot pass by accident.
        let pages: Vec<u64> = (0..POOL_PAGES).rev().collect();
        let layout = TokenLayout::for_rank(&desc, pages.clone()).expect("prefill layout");
        fill_rows(&kv_views(&mem), &layout, room, 0..tokens).expect("fill");
        let agent = PrefillAgent::builder(
            desc,
            mem.memory.clone(),
            t,
            Arc::new(hub.channel(format!("prefill-{i}")).unwrap()),
        )
        .start()
        .expect("prefill agent");
        directory.add_rank(ADDR, agent.rank_info());
        agent.create_room(room).expect("room");
        prefills.push((agent, mem, pages, layout));
    }

    let directory = Arc::new(directory);
    let mut decodes = Vec::new();
    for (i, desc) in decode.into_iter().enumerate() {
        let t = transport(kind).await;
        let mem = KvMemory::allocate(&*t, &desc, POOL_PAGES, 0)
            .await
            .expect("decode memory");
        let pages: Vec<u64> = (0..POOL_PAGES).map(|p| (p * 5 + 3) % POOL_PAGES).collect();
        let layout = TokenLayout::for_rank(&desc, pages.clone()).expect("decode layout");
        let agent = DecodeAgent::builder(
            desc,
            mem.memory.clone(),
            t,
            Arc::new(hub.channel(format!("decode-{i}")).unwrap()),
            directory.clone(),
        )
        .start()
        .expect("decode agent");
        let needed = tokens.div_ceil(layout.virtual_page()) as usize;
        agent
            .receive(
                room,
                ReceiveRequest {
                    bootstrap_addr: ADDR.into(),
                    page_table: pages[..needed].to_vec(),
                    cached_prefix_len: 0,
                    aux_index: 0,
                },
            )
            .expect("receive");
        decodes.push((agent, mem, layout));
    }

    for (agent, _, pages, layout) in &prefills {
        let start = tokio::time::timeout(LIMIT, agent.wait_ready(room))
            .await
            .expect("ready in time")
            .expect("ready");
        assert_eq!(start, 0, "the decode holds no prefix");
        let plan = kvbridge_geometry::chunk_plan(0, tokens, layout.virtual_page(), chunk_pages);
        let last = plan.len() - 1;
        for (k, (span, num_kv_tokens)) in plan.into_iter().enumerate() {
            let ids: Vec<u64> = span.map(|j| pages[j as usize]).collect();
            let chunk = if k == last {
                Chunk::last(ids, num_kv_tokens, None)
            } else {
                Chunk::new(ids, num_kv_tokens)
            };
            tokio::time::timeout(LIMIT, agent.send_chunk(room, chunk))
                .await
                .expect("send in time")
                .expect("send");
        }
    }
    for (agent, mem, layout) in &decodes {
        tokio::time::timeout(LIMIT, agent.wait(room))
            .await
            .expect("decode done in time")
            .expect("decode success");
        let verified = verify_rows(&kv_views(mem), layout, room, 0..tokens)
            .expect("every owned row holds its token");
        let owned = (0..tokens)
            .filter(|p| p % layout.dcp_size == layout.dcp_rank)
            .count() as u64;
        assert_eq!(
            verified,
            owned * TOKEN_BYTES * LAYERS as u64,
            "{kind:?}: rank {} rows",
            layout.dcp_rank
        );
        verify_untouched(&kv_views(mem), layout, 0..tokens)
            .expect("nothing written outside owned rows");
    }
    for (agent, ..) in &prefills {
        tokio::time::timeout(LIMIT, agent.wait(room))
            .await
            .expect("prefill done in time")
            .expect("prefill success");
    }
}

async fn dcp_one_to_two(kind: Kind) {
    transfer(
        kind,
        vec![mla(Role::Prefill, 16, 1, 0, 1)],
        (0..2).map(|r| mla(Role::Decode, 16, 2, r, 2)).collect(),
        100,
        3,
    )
    .await;
}

async fn dcp_two_to_four_with_page_sizes(kind: Kind) {
    // Prefill DCP 2 with 8-token pages feeding decode DCP 4 with 16-token pages.
    transfer(
        kind,
        (0..2).map(|r| mla(Role::Prefill, 8, 2, r, 2)).collect(),
        (0..4).map(|r| mla(Role::Decode, 16, 4, r, 4)).collect(),
        150,
        4,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_dcp_one_to_two() {
    dcp_one_to_two(Kind::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_dcp_one_to_two() {
    dcp_one_to_two(Kind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_dcp_two_to_four_with_different_page_sizes() {
    dcp_two_to_four_with_page_sizes(Kind::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_dcp_two_to_four_with_different_page_sizes() {
    dcp_two_to_four_with_page_sizes(Kind::Tcp).await;
}
