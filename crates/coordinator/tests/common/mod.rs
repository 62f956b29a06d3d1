//! Shared rig for the coordinator's in-process tests: agents over `LoopbackTransport` (optionally
//! behind a `FaultInjector`), an `InProcessControlHub` and a `StaticDirectory`.

#![allow(dead_code, unreachable_pub, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use kvbridge_coordinator::{
    AllocatedMemory, Chunk, DecodeAgent, DecodeConfig, InProcessControlHub, KvMemory, PrefillAgent,
    PrefillConfig, ReceiveRequest, StaticDirectory,
};
use kvbridge_handshake::PeerDescriptor;
use kvbridge_mock::{FaultInjector, FaultScript, LoopbackTransport};
use kvbridge_testkit::fill::{
    EntryView, TokenLayout, entry_views, fill_aux, fill_rows, verify_aux, verify_rows,
    verify_untouched,
};
use kvbridge_transport::KvTransport;

/// Views of the KV entries of memory the coordinator allocated, for the fill and verify helpers.
pub fn kv_views(mem: &AllocatedMemory) -> Vec<EntryView> {
    entry_views(
        &mem.kv_regions,
        mem.memory.kv.iter().map(|e| (e.offset, e.len)),
    )
}

/// Views of the aux buffers of memory the coordinator allocated.
pub fn aux_views(mem: &AllocatedMemory) -> Vec<EntryView> {
    entry_views(
        &mem.aux_regions,
        mem.memory.aux.iter().map(|e| (e.offset, e.len)),
    )
}

pub const ADDR: &str = "prefill.test:8998";

/// A request for a room with no cached prefix, aux row 0, from the prefill at [`ADDR`].
pub fn request(page_table: Vec<u64>) -> ReceiveRequest {
    ReceiveRequest {
        bootstrap_addr: ADDR.into(),
        page_table,
        cached_prefix_len: 0,
        aux_index: 0,
    }
}
pub const AUX_LENS: [u64; 2] = [64, 128];

/// An MLA-style descriptor: `layers` entries of `page · tok` bytes, two aux buffers.
pub fn mla(
    role: &str,
    page: u64,
    layers: usize,
    tok: u64,
    tp: u32,
    rank: u32,
    dcp: u32,
) -> PeerDescriptor {
    PeerDescriptor::mla(role.parse().unwrap(), page, layers, tok)
        .attn_tp(tp, rank)
        .dcp(dcp)
        .aux_item_lens(AUX_LENS.to_vec())
        .build()
        .unwrap()
}

/// An MHA/GQA descriptor: `2·layers` entries (K then V), `heads` KV heads of `head_dim` bf16.
pub fn mha(
    role: &str,
    page: u64,
    layers: usize,
    heads: u32,
    head_dim: u32,
    tp: u32,
    rank: u32,
) -> PeerDescriptor {
    PeerDescriptor::mha(role.parse().unwrap(), page, layers, heads, head_dim)
        .element_bytes(2)
        .attn_tp(tp, rank)
        .aux_item_lens(AUX_LENS.to_vec())
        .build()
        .unwrap()
}

pub struct Rank {
    pub desc: PeerDescriptor,
    pub mem: AllocatedMemory,
    pub transport: Arc<dyn KvTransport>,
}

pub struct Rig {
    pub hub: InProcessControlHub,
    pub dir: StaticDirectory,
    pub prefills: Vec<(PrefillAgent, Rank)>,
    pub decodes: Vec<(DecodeAgent, Rank)>,
    pub prefill_pages: u64,
    pub decode_pages: u64,
}

pub struct Spec {
    pub prefill: Vec<PeerDescriptor>,
    pub decode: Vec<PeerDescriptor>,
    pub prefill_pages: u64,
    pub decode_pages: u64,
    pub aux_rows: u64,
    /// Fault script per prefill rank (missing = pass-through).
    pub faults: Vec<FaultScript>,
    pub prefill_config: PrefillConfig,
    pub decode_config: DecodeConfig,
    /// Replaces the prefill transport (default: loopback behind the fault injector).
    pub prefill_transport: Option<fn() -> Arc<dyn KvTransport>>,
}

impl Spec {
    pub fn new(prefill: Vec<PeerDescriptor>, decode: Vec<PeerDescriptor>) -> Self {
        Spec {
            prefill,
            decode,
            prefill_pages: 61,
            decode_pages: 67,
            aux_rows: 8,
            faults: Vec::new(),
            prefill_config: PrefillConfig::default(),
            decode_config: DecodeConfig::default(),
            prefill_transport: None,
        }
    }

    /// A decode the prefill refuses at registration: the decode (kvbridge envelope) accepts
    /// another page size (64 vs 16), the prefill (SGLang's envelope) does not.
    pub fn refused_page_size() -> Self {
        let mut spec = Spec::new(
            vec![mla("prefill", 16, 2, 64, 1, 0, 1)],
            vec![mla("decode", 64, 2, 64, 1, 0, 1)],
        );
        spec.prefill_config = PrefillConfig::default().with_check(
            kvbridge_handshake::CheckOptions::new(kvbridge_handshake::Compat::Sglang),
        );
        spec
    }

    /// One MLA prefill rank to one MLA decode rank (16-token pages, 2 entries of 64 bytes a
    /// token, no TP or DCP).
    pub fn mla_one_to_one() -> Self {
        Spec::new(
            vec![mla("prefill", 16, 2, 64, 1, 0, 1)],
            vec![mla("decode", 16, 2, 64, 1, 0, 1)],
        )
    }
}

pub async fn rig(spec: Spec) -> Rig {
    let hub = InProcessControlHub::new();
    let dir = StaticDirectory::new();
    let mut prefills = Vec::new();
    for (i, desc) in spec.prefill.iter().enumerate() {
        let script = spec.faults.get(i).cloned().unwrap_or_default();
        let transport: Arc<dyn KvTransport> = match spec.prefill_transport {
            Some(make) => make(),
            None => Arc::new(FaultInjector::new(LoopbackTransport::new(), script)),
        };
        let mem = KvMemory::allocate(&*transport, desc, spec.prefill_pages, spec.aux_rows)
            .await
            .unwrap();
        let channel = Arc::new(hub.channel(format!("prefill-{i}")).unwrap());
        let agent =
            PrefillAgent::builder(desc.clone(), mem.memory.clone(), transport.clone(), channel)
                .config(spec.prefill_config.clone())
                .kv_regions(mem.kv_regions.clone())
                .start()
                .unwrap();
        dir.add_rank(ADDR, agent.rank_info());
        prefills.push((
            agent,
            Rank {
                desc: desc.clone(),
                mem,
                transport,
            },
        ));
    }
    let mut decodes = Vec::new();
    for (i, desc) in spec.decode.iter().enumerate() {
        let transport: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
        let mem = KvMemory::allocate(&*transport, desc, spec.decode_pages, spec.aux_rows)
            .await
            .unwrap();
        let channel = Arc::new(hub.channel(format!("decode-{i}")).unwrap());
        let agent = DecodeAgent::builder(
            desc.clone(),
            mem.memory.clone(),
            transport.clone(),
            channel,
            Arc::new(dir.clone()),
        )
        .config(spec.decode_config.clone())
        .start()
        .unwrap();
        decodes.push((
            agent,
            Rank {
                desc: desc.clone(),
                mem,
                transport,
            },
        ));
    }
    Rig {
        hub,
        dir,
        prefills,
        decodes,
        prefill_pages: spec.prefill_pages,
        decode_pages: spec.decode_pages,
    }
}

/// A page table of `n` distinct, scrambled page ids below `pages` (so rows landing on the
/// wrong page are caught).
pub fn page_table(n: u64, pages: u64, salt: u64) -> Vec<u64> {
    assert!(n <= pages, "{n} pages needed, {pages} allocated");
    (0..n).map(|i| (i * 7 + 3 + salt * 11) % pages).collect()
}

#[derive(Debug, Clone)]
pub struct Request {
    pub room: u64,
    pub input_len: u64,
    pub cached_prefix: u64,
    /// Pages per chunk on the prefill (the last chunk takes the rest).
    pub chunk_pages: u64,
    /// Send each chunk layer by layer, this many KV entries a part (`None`: whole chunks).
    pub layers_per_part: Option<usize>,
    pub prefill_aux_row: u64,
    pub decode_aux_row: u64,
    /// Give the room its own block of pages (`(index, stride)`: pages
    /// `index · stride ..`, reversed) so rooms can run concurrently without sharing pages.
    pub block: Option<(u64, u64)>,
    /// The parent the engine gives each side's room span (`create_room_with_parent`,
    /// `receive_with_parent`); `None`: `create_room` / `receive`.
    pub prefill_parent: Option<kvbridge_coordinator::TraceParent>,
    pub decode_parent: Option<kvbridge_coordinator::TraceParent>,
}

impl Request {
    pub fn new(room: u64, input_len: u64) -> Self {
        Request {
            room,
            input_len,
            cached_prefix: 0,
            chunk_pages: u64::MAX,
            layers_per_part: None,
            prefill_aux_row: 3,
            decode_aux_row: 5,
            block: None,
            prefill_parent: None,
            decode_parent: None,
        }
    }
}

impl Request {
    fn table(&self, n: u64, pages: u64, salt: u64) -> Vec<u64> {
        match self.block {
            None => page_table(n, pages, salt),
            Some((b, stride)) => {
                assert!(
                    n <= stride && (b + 1) * stride <= pages,
                    "block {b} does not fit"
                );
                (0..n).map(|i| b * stride + (n - 1 - i)).collect()
            }
        }
    }
}

impl Rig {
    pub fn prefill_layout(&self, i: usize, req: &Request) -> TokenLayout {
        let d = &self.prefills[i].1.desc;
        let v = d.page_size * d.dcp_size as u64;
        TokenLayout::for_rank(
            d,
            req.table(req.input_len.div_ceil(v), self.prefill_pages, req.room),
        )
        .unwrap()
    }

    pub fn decode_layout(&self, i: usize, req: &Request) -> TokenLayout {
        let d = &self.decodes[i].1.desc;
        let v = d.page_size * d.dcp_size as u64;
        TokenLayout::for_rank(
            d,
            req.table(req.input_len.div_ceil(v), self.decode_pages, req.room + 1),
        )
        .unwrap()
    }

    /// Fills the prefill rows and aux, the decode's cached prefix, creates the rooms and asks
    /// every decode rank to receive.
    pub async fn start(&self, req: &Request) {
        for (i, (agent, rank)) in self.prefills.iter().enumerate() {
            let layout = self.prefill_layout(i, req);
            fill_rows(&kv_views(&rank.mem), &layout, req.room, 0..req.input_len).unwrap();
            fill_aux(
                &aux_views(&rank.mem),
                &rank.desc.aux_item_lens,
                req.prefill_aux_row,
                req.room,
            )
            .unwrap();
            match &req.prefill_parent {
                Some(tp) => agent.create_room_with_parent(req.room, tp).unwrap(),
                None => agent.create_room(req.room).unwrap(),
            }
        }
        for (i, (agent, rank)) in self.decodes.iter().enumerate() {
            let layout = self.decode_layout(i, req);
            fill_rows(
                &kv_views(&rank.mem),
                &layout,
                req.room,
                0..req.cached_prefix,
            )
            .unwrap();
            let request = ReceiveRequest {
                bootstrap_addr: ADDR.to_owned(),
                page_table: layout.page_table.clone(),
                cached_prefix_len: req.cached_prefix,
                aux_index: req.decode_aux_row,
            };
            match &req.decode_parent {
                Some(tp) => agent.receive_with_parent(req.room, request, tp).unwrap(),
                None => agent.receive(req.room, request).unwrap(),
            }
        }
    }

    /// What a prefill scheduler does for one rank: wait for the decode's metadata, then send
    /// the chunks from the advertised prefix on.
    pub async fn send_all(&self, i: usize, req: &Request) -> kvbridge_coordinator::Result<()> {
        let (agent, rank) = &self.prefills[i];
        let prefix = agent.wait_ready(req.room).await?;
        let layout = self.prefill_layout(i, req);
        let page_tokens = rank.desc.page_size * rank.desc.dcp_size as u64;
        let plan =
            kvbridge_geometry::chunk_plan(prefix, req.input_len, page_tokens, req.chunk_pages);
        let n = plan.len();
        for (k, (pages, tokens)) in plan.into_iter().enumerate() {
            let ids: Vec<u64> = pages.map(|j| layout.page_table[j as usize]).collect();
            let chunk = if k + 1 == n {
                Chunk::last(ids, tokens, Some(req.prefill_aux_row))
            } else {
                Chunk::new(ids, tokens)
            };
            let Some(per_part) = req.layers_per_part else {
                agent.send_chunk(req.room, chunk).await?;
                continue;
            };
            let entries = rank.mem.memory.kv.len();
            for start in (0..entries).step_by(per_part) {
                let part = chunk
                    .clone()
                    .for_layers(start..(start + per_part).min(entries));
                agent.send_chunk(req.room, part).await?;
            }
        }
        Ok(())
    }

    /// Runs a request end to end and returns each decode rank's outcome.
    pub async fn run(&self, req: &Request) -> Vec<kvbridge_coordinator::Result<()>> {
        self.start(req).await;
        let mut senders = Vec::new();
        for i in 0..self.prefills.len() {
            senders.push(self.send_all(i, req));
        }
        for r in join_all(senders).await {
            r.unwrap();
        }
        let mut out = Vec::new();
        for (agent, _) in &self.decodes {
            out.push(bounded(agent.wait(req.room)).await);
        }
        out
    }

    /// Checks every decode rank holds exactly what the owner rule says for `[0, input_len)`,
    /// nothing else, and the aux rows.
    pub fn verify(&self, req: &Request) -> u64 {
        self.verify_with(req, true)
    }

    /// As [`Rig::verify`], optionally skipping the "nothing else was written" check (when
    /// earlier rooms used the same memory).
    pub fn verify_with(&self, req: &Request, untouched: bool) -> u64 {
        let mut total = 0;
        let src_aux = &self.prefills[0].1.desc.aux_item_lens;
        for (i, (_, rank)) in self.decodes.iter().enumerate() {
            let layout = self.decode_layout(i, req);
            let views = kv_views(&rank.mem);
            total += verify_rows(&views, &layout, req.room, 0..req.input_len)
                .unwrap_or_else(|e| panic!("decode rank {i}: {e}"));
            if untouched {
                verify_untouched(&views, &layout, 0..req.input_len)
                    .unwrap_or_else(|e| panic!("decode rank {i}: {e}"));
            }
            verify_aux(
                &aux_views(&rank.mem),
                &rank.desc.aux_item_lens,
                src_aux,
                req.decode_aux_row,
                req.room,
            )
            .unwrap_or_else(|e| panic!("decode rank {i}: {e}"));
        }
        total
    }
}

/// Awaits `f` with a generous virtual-time bound, so a hang fails the test instead of hanging it.
pub async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(3600), f)
        .await
        .expect("no progress within an hour of virtual time: something hangs")
}

/// Runs futures concurrently on the current task and collects their outputs in order.
pub async fn join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in futs.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|o| o.unwrap()).collect()
}
