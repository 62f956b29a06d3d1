//! KV pool geometry: page size, ordered entries, target vs draft, pool kind, dtype label.

use crate::error::{GeometryError, Result};

/// The attention family of a KV pool.
///
/// Head counts and head dims live in [`PoolFormat`], not here: this enum is the small, stable
/// tag peers exchange during the handshake. With the `serde` feature it serialises as
/// `"mha"`, `"mla"` or `"hybrid_mla"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum PoolKind {
    /// Multi-head (or grouped-query) attention: K and V entries per layer, split by heads.
    Mha,
    /// Multi-head latent attention: one compressed latent entry per layer, replicated across TP.
    Mla,
    /// MLA plus other per-layer entries (item lengths may differ per entry), treated as flat.
    HybridMla,
}

/// The attention layout of a pool, with the head shape MHA/GQA needs for head slicing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolFormat {
    /// MHA/GQA: target entries are `[K_0..K_{L-1}, V_0..V_{L-1}]`, pages are `[P, heads, dim]`.
    Mha {
        /// KV heads of the whole model (before TP sharding).
        total_kv_heads: u32,
        /// Elements per head.
        head_dim: u32,
    },
    /// MHA/GQA with head-major pages (`kv_layout` `LBHNC`, vLLM's CPU layout): one entry per
    /// layer, pages are `[heads, P, dim]` where `dim` counts a token's K and V; any number of
    /// layers. Planned by head-major slicing only (docs/planning.md, "Head-major pages").
    MhaHeadMajor {
        /// KV heads of the whole model (before TP sharding).
        total_kv_heads: u32,
        /// Elements per head and token (K and V).
        head_dim: u32,
    },
    /// MLA: one latent entry per layer.
    Mla,
    /// Hybrid MLA: MLA layers plus other per-layer entries.
    HybridMla,
}

impl PoolFormat {
    /// The handshake tag of this format.
    #[must_use]
    pub fn kind(&self) -> PoolKind {
        match self {
            PoolFormat::Mha { .. } | PoolFormat::MhaHeadMajor { .. } => PoolKind::Mha,
            PoolFormat::Mla => PoolKind::Mla,
            PoolFormat::HybridMla => PoolKind::HybridMla,
        }
    }
}

/// Whether an entry holds target-model KV or speculative-decoding draft KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryRole {
    /// Target model KV (DCP-sharded on a DCP decode).
    Target,
    /// Draft model KV (same page ids; replicated to every DCP rank with page size `P · d`).
    Draft,
}

/// One registered KV region of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Entry {
    /// Bytes of one page of this entry.
    pub item_len: u64,
    /// Target or draft.
    pub role: EntryRole,
}

/// A side's KV pool as the transfer layer sees it: ordered entries, each `num_pages` pages of
/// `item_len` bytes; page `p` of entry `i` is bytes `[p · item_len_i, (p + 1) · item_len_i)`.
///
/// Built with [`PoolGeometry::builder`]; the builder validates, so a `PoolGeometry` is always
/// consistent: page size > 0, every `item_len` a positive multiple of the page size, target
/// entries before draft entries, an even number of target entries for MHA, and
/// `num_pages · item_len` fitting in `u64`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolGeometry {
    page_size: u64,
    num_pages: u64,
    entries: Vec<Entry>,
    num_draft: usize,
    format: PoolFormat,
    dtype: String,
}

/// Builder of a [`PoolGeometry`].
#[derive(Debug, Clone)]
pub struct PoolGeometryBuilder {
    page_size: u64,
    num_pages: Option<u64>,
    target: Vec<u64>,
    draft: Vec<u64>,
    format: PoolFormat,
    dtype: String,
}

impl PoolGeometryBuilder {
    /// Pages in the pool (every entry has this many pages); required, and positive.
    #[must_use]
    pub fn num_pages(mut self, num_pages: u64) -> Self {
        self.num_pages = Some(num_pages);
        self
    }

    /// Item lengths of the target entries, in registration order.
    #[must_use]
    pub fn target_entries(mut self, item_lens: &[u64]) -> Self {
        self.target = item_lens.to_vec();
        self
    }

    /// Item lengths of the draft entries (appended after the target entries).
    #[must_use]
    pub fn draft_entries(mut self, item_lens: &[u64]) -> Self {
        self.draft = item_lens.to_vec();
        self
    }

    /// Attention layout. Default [`PoolFormat::Mla`].
    #[must_use]
    pub fn format(mut self, format: PoolFormat) -> Self {
        self.format = format;
        self
    }

    /// The dtype label (only ever compared as a string, e.g. `"auto"`, `"fp8_e4m3"`).
    #[must_use]
    pub fn dtype(mut self, dtype: impl Into<String>) -> Self {
        self.dtype = dtype.into();
        self
    }

    /// Validates and builds.
    ///
    /// # Errors
    /// [`GeometryError::ZeroPageSize`], [`GeometryError::BadItemLen`],
    /// [`GeometryError::InvalidGeometry`] (no target entry, odd MHA entry count, zero heads,
    /// empty dtype, `num_pages` not set or 0), [`GeometryError::Overflow`] and [`GeometryError::TooLarge`] (a page size
    /// above [`crate::MAX_PAGE_SIZE`]).
    pub fn build(self) -> Result<PoolGeometry> {
        let page_size = self.page_size;
        if page_size == 0 {
            return Err(GeometryError::ZeroPageSize { page_size });
        }
        crate::limits::page_size("page_size", page_size)?;
        if self.target.is_empty() {
            return Err(GeometryError::InvalidGeometry {
                reason: "a pool needs at least one target entry; add the per-layer item lengths \
                         with target_entries"
                    .to_owned(),
            });
        }
        if let PoolFormat::Mha {
            total_kv_heads,
            head_dim,
        }
        | PoolFormat::MhaHeadMajor {
            total_kv_heads,
            head_dim,
        } = self.format
        {
            let kv_pairs = matches!(self.format, PoolFormat::Mha { .. });
            if kv_pairs && self.target.len() % 2 != 0 {
                return Err(GeometryError::InvalidGeometry {
                    reason: format!(
                        "an MHA pool registers K and V per layer ([K_0..K_L-1, V_0..V_L-1]), so its \
                         target entry count must be even, got {}",
                        self.target.len()
                    ),
                });
            }
            if total_kv_heads == 0 || head_dim == 0 {
                return Err(GeometryError::InvalidGeometry {
                    reason: format!(
                        "an MHA pool needs total_kv_heads > 0 and head_dim > 0, got \
                         total_kv_heads={total_kv_heads}, head_dim={head_dim}"
                    ),
                });
            }
        }
        if self.dtype.is_empty() {
            return Err(GeometryError::InvalidGeometry {
                reason:
                    "the dtype label is empty; pass the engine's kv_cache_dtype (e.g. \"auto\")"
                        .to_owned(),
            });
        }
        let num_pages = match self.num_pages {
            Some(0) => {
                return Err(GeometryError::InvalidGeometry {
                    reason: "num_pages is 0: a pool without pages cannot hold a page id; pass \
                             the pages of the KV pool (its allocator's capacity)"
                        .to_owned(),
                });
            }
            Some(n) => n,
            None => {
                return Err(GeometryError::InvalidGeometry {
                    reason: "the pool's page count is not set; call num_pages(n) with the pages \
                             of the KV pool (its allocator's capacity) before build"
                        .to_owned(),
                });
            }
        };
        let mut entries = Vec::with_capacity(self.target.len() + self.draft.len());
        let all = self
            .target
            .iter()
            .map(|&l| (l, EntryRole::Target))
            .chain(self.draft.iter().map(|&l| (l, EntryRole::Draft)));
        for (entry, (item_len, role)) in all.enumerate() {
            if item_len == 0 || item_len % page_size != 0 {
                return Err(GeometryError::BadItemLen {
                    entry,
                    item_len,
                    page_size,
                });
            }
            if item_len.checked_mul(num_pages).is_none() {
                return Err(GeometryError::Overflow {
                    what: "num_pages x item_len",
                });
            }
            entries.push(Entry { item_len, role });
        }
        Ok(PoolGeometry {
            page_size,
            num_pages,
            num_draft: self.draft.len(),
            entries,
            format: self.format,
            dtype: self.dtype,
        })
    }
}

impl PoolGeometry {
    /// Starts a builder for a pool of `page_size` tokens per page (MLA, dtype `"auto"`); the
    /// page count ([`PoolGeometryBuilder::num_pages`]) and the target entries are required.
    #[must_use]
    pub fn builder(page_size: u64) -> PoolGeometryBuilder {
        PoolGeometryBuilder {
            page_size,
            num_pages: None,
            target: Vec::new(),
            draft: Vec::new(),
            format: PoolFormat::Mla,
            dtype: "auto".to_owned(),
        }
    }

    /// Tokens per physical page.
    #[must_use]
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// Pages per entry.
    #[must_use]
    pub fn num_pages(&self) -> u64 {
        self.num_pages
    }

    /// All entries, target first, then draft.
    #[must_use]
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Number of target entries.
    #[must_use]
    pub fn num_target(&self) -> usize {
        self.entries.len() - self.num_draft
    }

    /// Number of draft entries.
    #[must_use]
    pub fn num_draft(&self) -> usize {
        self.num_draft
    }

    /// Item lengths of all entries, in order.
    #[must_use]
    pub fn item_lens(&self) -> Vec<u64> {
        self.entries.iter().map(|e| e.item_len).collect()
    }

    /// Bytes of entry `i` (`num_pages · item_len`), or `None` past the last entry.
    #[must_use]
    pub fn entry_bytes(&self, i: usize) -> Option<u64> {
        // Cannot overflow: checked by the builder.
        self.entries.get(i).map(|e| e.item_len * self.num_pages)
    }

    /// Bytes per token row of entry `i` when its pages hold `page_size` rows.
    #[must_use]
    pub fn token_bytes(&self, i: usize) -> Option<u64> {
        self.entries.get(i).map(|e| e.item_len / self.page_size)
    }

    /// Attention layout.
    #[must_use]
    pub fn format(&self) -> PoolFormat {
        self.format
    }

    /// Handshake tag of the attention layout.
    #[must_use]
    pub fn kind(&self) -> PoolKind {
        self.format.kind()
    }

    /// The dtype label.
    #[must_use]
    pub fn dtype(&self) -> &str {
        &self.dtype
    }

    /// Fails with [`GeometryError::PageOutOfRange`] if any page id is not below `num_pages`.
    ///
    /// # Errors
    /// As above.
    pub fn check_pages(&self, side: crate::Side, pages: &[u64]) -> Result<()> {
        match pages.iter().copied().find(|&p| p >= self.num_pages) {
            Some(page) => Err(GeometryError::PageOutOfRange {
                side,
                page,
                num_pages: self.num_pages,
            }),
            None => Ok(()),
        }
    }
}
