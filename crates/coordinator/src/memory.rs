//! A side's registered KV memory: one byte range per KV entry and per aux buffer.

use kvbridge_handshake::PeerDescriptor;
use kvbridge_transport::{KvTransport, KvTransportExt, MemoryRegion, RegionId};

use crate::error::{CoordinatorError, Result};
use crate::messages::WireRegion;

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
