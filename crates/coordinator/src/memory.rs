//! A side's registered KV memory: one byte range per KV entry and per aux buffer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvbridge_handshake::PeerDescriptor;
use kvbridge_transport::sync::lock;
use kvbridge_transport::{KvTransport, KvTransportExt, MemoryRegion, RegionId, TransferOp};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{CoordinatorError, Result};
use crate::messages::WireRegion;
use kvbridge_machines::PackBuffers;

/// Where one KV entry (or aux buffer) lives: `len` bytes at `offset` in a registered region.
/// Several entries may share one region (e.g. all layers back to back).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EntryRegion {
    /// The registered region.
    pub region: RegionId,
    /// Byte offset of the entry inside the region.
    pub offset: u64,
    /// Bytes of the entry (`num_pages · item_len` for KV, `rows · aux_item_len` for aux).
    pub len: u64,
}

impl EntryRegion {
    /// A whole region as one entry.
    pub fn whole(region: RegionId, len: u64) -> Self {
        Self {
            region,
            offset: 0,
            len,
        }
    }

    pub(crate) fn to_wire(self) -> WireRegion {
        WireRegion {
            region: self.region.0,
            offset: self.offset,
            len: self.len,
        }
    }
}

/// A side's registered KV memory, in descriptor order: one [`EntryRegion`] per entry of
/// `kv_item_lens` (target then draft) and one per entry of `aux_item_lens`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvMemory {
    /// One per KV entry.
    pub kv: Vec<EntryRegion>,
    /// One per aux buffer.
    pub aux: Vec<EntryRegion>,
}

impl KvMemory {
    /// Pages every KV entry can hold (the minimum over entries), given the descriptor.
    pub fn num_pages(&self, descriptor: &PeerDescriptor) -> u64 {
        self.kv
            .iter()
            .zip(&descriptor.kv_item_lens)
            .map(|(e, &item)| e.len.checked_div(item).unwrap_or(0))
            .min()
            .unwrap_or(0)
    }

    /// Checks the memory matches the descriptor: one entry per item length, each holding at
    /// least one page / row.
    ///
    /// # Errors
    /// [`CoordinatorError::InvalidSetup`] naming the mismatch.
    pub fn validate(&self, descriptor: &PeerDescriptor) -> Result<()> {
        let bad = |message: String| Err(CoordinatorError::InvalidSetup { message });
        if self.kv.len() != descriptor.kv_item_lens.len() {
            return bad(format!(
                "the descriptor lists {} KV entries (kv_item_lens) but {} KV regions were given; \
                 pass one EntryRegion per entry, in the same order",
                descriptor.kv_item_lens.len(),
                self.kv.len()
            ));
        }
        if self.aux.len() != descriptor.aux_item_lens.len() {
            return bad(format!(
                "the descriptor lists {} aux buffers (aux_item_lens) but {} aux regions were \
                 given; pass one EntryRegion per aux buffer, in the same order",
                descriptor.aux_item_lens.len(),
                self.aux.len()
            ));
        }
        for (i, (e, &item)) in self.kv.iter().zip(&descriptor.kv_item_lens).enumerate() {
            if item == 0 || e.len < item {
                return bad(format!(
                    "KV entry {i} has {} bytes but item_len {item}: it must hold at least one page",
                    e.len
                ));
            }
        }
        for (j, (e, &item)) in self.aux.iter().zip(&descriptor.aux_item_lens).enumerate() {
            if item == 0 || e.len < item {
                return bad(format!(
                    "aux buffer {j} has {} bytes but aux_item_len {item}: it must hold at least one row",
                    e.len
                ));
            }
        }
        Ok(())
    }
}

/// Memory allocated and registered by [`KvMemory::allocate`]: the [`KvMemory`] to give an
/// agent plus the [`MemoryRegion`] handles to read and write it (one region per entry).
#[derive(Debug, Clone)]
pub struct AllocatedMemory {
    /// What the agent needs.
    pub memory: KvMemory,
    /// One region per KV entry.
    pub kv_regions: Vec<MemoryRegion>,
    /// One region per aux buffer.
    pub aux_regions: Vec<MemoryRegion>,
}

impl KvMemory {
    /// Allocates and registers one region per KV entry (`num_pages · item_len` bytes) and one
    /// per aux buffer (`aux_rows · aux_item_len` bytes) on `transport`.
    ///
    /// # Errors
    /// [`CoordinatorError::Transport`] when allocation or registration fails;
    /// [`CoordinatorError::InvalidSetup`] when a size overflows.
    pub async fn allocate(
        transport: &dyn KvTransport,
        descriptor: &PeerDescriptor,
        num_pages: u64,
        aux_rows: u64,
    ) -> Result<AllocatedMemory> {
        let mut out = AllocatedMemory {
            memory: KvMemory::default(),
            kv_regions: Vec::new(),
            aux_regions: Vec::new(),
        };
        let sizes = |lens: &[u64], count: u64| -> Result<Vec<usize>> {
            lens.iter()
                .map(|&l| {
                    l.checked_mul(count)
                        .and_then(|b| usize::try_from(b).ok())
                        .ok_or_else(|| CoordinatorError::InvalidSetup {
                            message: format!("{count} x {l} bytes does not fit in memory"),
                        })
                })
                .collect()
        };
        for (kind, bytes) in [
            (false, sizes(&descriptor.kv_item_lens, num_pages)?),
            (true, sizes(&descriptor.aux_item_lens, aux_rows)?),
        ] {
            for len in bytes {
                let (id, region) = transport.allocate_registered(len).await.map_err(|source| {
                    CoordinatorError::Transport {
                        transport: transport.name(),
                        context: format!("allocating and registering {len} bytes"),
                        source,
                    }
                })?;
                let entry = EntryRegion::whole(id, len as u64);
                if kind {
                    out.memory.aux.push(entry);
                    out.aux_regions.push(region);
                } else {
                    out.memory.kv.push(entry);
                    out.kv_regions.push(region);
                }
            }
        }
        Ok(out)
    }
}

/// The CPU handles of a prefill's KV regions, by region id: what the pack gather reads
/// through (each access claims its bytes in the region's claim table).
#[derive(Debug, Clone, Default)]
pub(crate) struct KvHandles {
    by_id: HashMap<RegionId, MemoryRegion>,
}

impl KvHandles {
    /// Pairs `memory.kv[i]` with `handles[i]`, checking that each handle is host memory large
    /// enough for its entry and that entries sharing a region id share one handle.
    pub(crate) fn new(memory: &KvMemory, handles: &[MemoryRegion]) -> Result<Self> {
        let bad = |message: String| Err(CoordinatorError::InvalidSetup { message });
        if handles.len() != memory.kv.len() {
            return bad(format!(
                "pack buffers need one KV region handle per KV entry: {} entries but {} \
                 handles; pass AllocatedMemory::kv_regions (in entry order) to \
                 PrefillAgentBuilder::kv_regions",
                memory.kv.len(),
                handles.len()
            ));
        }
        let mut by_id: HashMap<RegionId, MemoryRegion> = HashMap::new();
        for (i, (e, h)) in memory.kv.iter().zip(handles).enumerate() {
            if !h.kind().is_host() {
                return bad(format!(
                    "KV entry {i} lives in {} memory, which the CPU cannot gather from; pack \
                     buffers need host memory (turn them off for device pools)",
                    h.kind()
                ));
            }
            if e.offset
                .checked_add(e.len)
                .is_none_or(|end| end > h.len() as u64)
            {
                return bad(format!(
                    "KV entry {i} is [{}, {}+{}) of region {} but the handle given for it is \
                     {} bytes; pass the handle of the entry's own region",
                    e.offset,
                    e.offset,
                    e.len,
                    e.region,
                    h.len()
                ));
            }
            match by_id.get(&e.region) {
                Some(seen) if !seen.same_region(h) => {
                    return bad(format!(
                        "KV entries share region {} but were given different handles for it",
                        e.region
                    ));
                }
                Some(_) => {}
                None => {
                    by_id.insert(e.region, h.clone());
                }
            }
        }
        Ok(Self { by_id })
    }

    /// Runs the gather copies (each a strided op from a KV region into `pack`), row by row
    /// through the regions' guarded copies.
    pub(crate) fn gather(
        &self,
        gathers: &[TransferOp],
        pack: &MemoryRegion,
    ) -> std::result::Result<(), String> {
        for g in gathers {
            let src = self.by_id.get(&g.local_region).ok_or_else(|| {
                format!(
                    "the plan reads region {} which is not one of this prefill's KV regions",
                    g.local_region
                )
            })?;
            for row in g.rows() {
                src.copy_to(row.local_offset, pack, row.remote_offset, row.len)
                    .map_err(|e| format!("gathering rows into a pack buffer: {e}"))?;
            }
        }
        Ok(())
    }
}

/// Bytes of one pack buffer: the rows of one chunk for one decode rank,
/// `ceil(max_chunk_tokens / min_decode_dcp)` tokens of every KV entry (the geometry crate's
/// DCP pack sizing, which holds all `d` ranks' shares, divided by `d`).
pub(crate) fn pack_buffer_bytes(descriptor: &PeerDescriptor, pack: &PackBuffers) -> Result<u64> {
    let bad = |message: String| CoordinatorError::InvalidSetup { message };
    if pack.count == 0 || pack.max_chunk_tokens == 0 || pack.min_decode_dcp == 0 {
        return Err(bad(format!(
            "pack buffers need count, max_chunk_tokens and min_decode_dcp of at least 1, got \
             {pack:?}"
        )));
    }
    let all = kvbridge_geometry::dcp_pack_buffer_bytes(
        &descriptor.kv_item_lens,
        descriptor.page_size,
        pack.max_chunk_tokens,
        pack.min_decode_dcp,
    )
    .map_err(|e| bad(format!("sizing the pack buffers: {e}")))?;
    let bytes = all / pack.min_decode_dcp;
    if usize::try_from(bytes).is_err() || (bytes as u128) * (pack.count as u128) > u64::MAX as u128
    {
        return Err(bad(format!(
            "{} pack buffers of {bytes} bytes do not fit in memory; lower count or \
             max_chunk_tokens",
            pack.count
        )));
    }
    Ok(bytes)
}

/// A fixed pool of registered pack buffers, allocated on first use and reused.
///
/// A buffer is out of the pool from [`acquire`](PackPool::acquire) until its lease is
/// [released](PackLease::release), which the caller does only once the batch reading it is
/// final; a lease dropped unreleased (its batch could not be proven final) retires its buffer
/// for good, so no later gather ever writes memory a transport may still read.
pub(crate) struct PackPool {
    transport: Arc<dyn KvTransport>,
    buffer_len: u64,
    free: Mutex<Vec<(RegionId, MemoryRegion)>>,
    permits: Arc<Semaphore>,
    count: usize,
}

impl std::fmt::Debug for PackPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackPool")
            .field("buffer_len", &self.buffer_len)
            .field("count", &self.count)
            .field("available", &self.permits.available_permits())
            .finish_non_exhaustive()
    }
}

impl PackPool {
    pub(crate) fn new(transport: Arc<dyn KvTransport>, count: usize, buffer_len: u64) -> Self {
        Self {
            transport,
            buffer_len,
            free: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(count)),
            count,
        }
    }

    /// Runs `f` on the free list under its lock (the only place that takes it).
    fn with_free<R>(&self, f: impl FnOnce(&mut Vec<(RegionId, MemoryRegion)>) -> R) -> R {
        f(&mut lock(&self.free))
    }

    /// Bytes of each buffer.
    pub(crate) fn buffer_len(&self) -> u64 {
        self.buffer_len
    }

    /// Whether a buffer is free right now (a caller about to wait counts the wait).
    pub(crate) fn has_free(&self) -> bool {
        self.permits.available_permits() > 0
    }

    /// Takes a buffer, waiting while all of them are out; allocates and registers it on the
    /// transport the first time.
    pub(crate) async fn acquire(self: &Arc<Self>) -> Result<PackLease> {
        let permit = self.permits.clone().acquire_owned().await.map_err(|_| {
            CoordinatorError::InvalidSetup {
                message: "the pack buffer pool was closed".to_owned(),
            }
        })?;
        let reused = self.with_free(Vec::pop);
        let buffer = match reused {
            Some(b) => b,
            None => {
                let len = self.buffer_len as usize;
                self.transport
                    .allocate_registered(len)
                    .await
                    .map_err(|source| CoordinatorError::Transport {
                        transport: self.transport.name(),
                        context: format!("allocating and registering a pack buffer of {len} bytes"),
                        source,
                    })?
            }
        };
        Ok(PackLease {
            pool: self.clone(),
            buffer: Some(buffer),
            permit: Some(permit),
        })
    }

    /// Buffers currently in the pool or never allocated (for tests).
    #[cfg(test)]
    pub(crate) fn available(&self) -> usize {
        self.permits.available_permits()
    }
}

/// One pack buffer taken from a [`PackPool`].
pub(crate) struct PackLease {
    pool: Arc<PackPool>,
    buffer: Option<(RegionId, MemoryRegion)>,
    permit: Option<OwnedSemaphorePermit>,
}

impl std::fmt::Debug for PackLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackLease")
            .field("region", &self.buffer.as_ref().map(|b| b.0))
            .finish_non_exhaustive()
    }
}

impl PackLease {
    /// The buffer's registered id.
    pub(crate) fn id(&self) -> RegionId {
        self.buffer.as_ref().map_or(RegionId(u64::MAX), |b| b.0)
    }

    /// The buffer's CPU handle (the gather writes through it).
    pub(crate) fn region(&self) -> Option<&MemoryRegion> {
        self.buffer.as_ref().map(|b| &b.1)
    }

    /// Returns the buffer to the pool. Call only once no batch reads it any more: the batch
    /// was refused, or reached a final state.
    pub(crate) fn release(mut self) {
        if let Some(b) = self.buffer.take() {
            self.pool.with_free(|free| free.push(b));
        }
        // The permit goes back after the buffer is in the free list.
        drop(self.permit.take());
    }
}

impl Drop for PackLease {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            // Not released: its batch may still read the buffer. It stays registered (the
            // transport keeps it alive) and never returns, and the pool shrinks by one.
            permit.forget();
            tracing::warn!(
                region = %self.id(),
                "a pack buffer was retired: its batch could not be proven final"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(count: usize) -> Arc<PackPool> {
        Arc::new(PackPool::new(
            Arc::new(kvbridge_mock::LoopbackTransport::new()),
            count,
            4096,
        ))
    }

    #[tokio::test]
    async fn a_pack_buffer_is_reused_only_after_release() {
        let pool = pool(2);
        let a = pool.acquire().await.unwrap();
        let b = pool.acquire().await.unwrap();
        assert_ne!(a.id(), b.id());
        assert!(!pool.has_free());
        let (a_id, b_id) = (a.id(), b.id());
        // A third acquire waits while both are out.
        let waiting = tokio::spawn({
            let pool = pool.clone();
            async move {
                pool.acquire().await.map(|l| {
                    let id = l.id();
                    l.release();
                    id
                })
            }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        a.release();
        assert_eq!(
            waiting.await.unwrap().unwrap(),
            a_id,
            "the released buffer is reused"
        );
        b.release();
        assert_eq!(pool.available(), 2);
        let again = pool.acquire().await.unwrap();
        assert!(
            [a_id, b_id].contains(&again.id()),
            "no third buffer is allocated"
        );
        again.release();
    }

    #[tokio::test]
    async fn a_lease_dropped_unreleased_retires_its_buffer() {
        let pool = pool(2);
        let a = pool.acquire().await.unwrap();
        let kept = a.id();
        drop(a);
        assert_eq!(
            pool.available(),
            1,
            "the pool shrinks by the retired buffer"
        );
        let b = pool.acquire().await.unwrap();
        assert_ne!(b.id(), kept, "a retired buffer is never handed out again");
        b.release();
    }

    #[test]
    fn pack_buffers_are_sized_for_one_decode_ranks_share_of_a_chunk() {
        let d = PeerDescriptor::mla(kvbridge_handshake::Role::Prefill, 64, 61, 1152)
            .build()
            .unwrap();
        // 4096 tokens to DCP 4: 1024 tokens of 61 rows of 1152 bytes.
        let len = pack_buffer_bytes(&d, &PackBuffers::new(8, 4096, 4)).unwrap();
        assert_eq!(len, 1024 * 61 * 1152);
        // Rounded up: 4097 tokens to DCP 4 is at most 1025 on one rank.
        let len = pack_buffer_bytes(&d, &PackBuffers::new(8, 4097, 4)).unwrap();
        assert_eq!(len, 1025 * 61 * 1152);
        assert!(pack_buffer_bytes(&d, &PackBuffers::new(0, 4096, 4)).is_err());
        assert!(pack_buffer_bytes(&d, &PackBuffers::new(1, 4096, 0)).is_err());
        let err = pack_buffer_bytes(&d, &PackBuffers::new(usize::MAX, 1 << 40, 1)).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
    }
}
