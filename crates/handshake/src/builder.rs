//! [`PeerDescriptorBuilder`]: the one way to build a [`PeerDescriptor`] in Rust.

use kvbridge_geometry::PoolKind;

use crate::descriptor::{PeerDescriptor, Role, dtype_bytes};
use crate::error::{HandshakeError, Result};
use crate::version::ProtocolVersion;

/// How the builder gets `kv_item_lens`: given as registered, or derived from the model shape
/// when [`PeerDescriptorBuilder::build`] knows the parallelism.
#[derive(Debug, Clone)]
enum Entries {
    Unset,
    Given(Vec<u64>),
    /// `layers` entries of `page_size · token_bytes`.
    Mla {
        layers: usize,
        token_bytes: u64,
    },
    /// `2 · layers` entries (K then V) of `page_size · heads_per_rank · head_dim · element bytes`.
    Mha {
        layers: usize,
    },
}

/// Builds a [`PeerDescriptor`] with the JSON form's defaults for every optional field.
///
/// Start from [`PeerDescriptor::mla`], [`PeerDescriptor::mha`] or, for any other shape,
/// [`PeerDescriptor::builder`]; set the parallelism this rank runs with; call
/// [`build`](Self::build), which refuses incomplete or contradictory input
/// ([`HandshakeError::DescriptorBuild`]) with what to call to fix it.
///
/// Defaults: `kv_cache_dtype "auto"`, no `kv_layout`, attention TP, CP, PP and DCP size 1 rank 0,
/// `dcp_rank = attn_tp_rank mod dcp_size` (DCP nests inside attention TP), no KV cache
/// sharding, no draft entries, no aux buffers, [`ProtocolVersion::CURRENT`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct PeerDescriptorBuilder {
    role: Role,
    protocol_version: ProtocolVersion,
    page_size: Option<u64>,
    kv_cache_dtype: String,
    kv_layout: Option<String>,
    kv_pool: Option<PoolKind>,
    attn_tp: (u32, u32),
    attn_cp: (u32, u32),
    pp: (u32, u32),
    dcp_size: u32,
    kv_cache_sharding: bool,
    heads: Option<(u32, u32)>,
    element_bytes: Option<u64>,
    entries: Entries,
    num_draft_entries: usize,
    aux_item_lens: Vec<u64>,
}

impl PeerDescriptor {
    /// An MLA rank: `layers` KV entries of `page_size · token_bytes` bytes each, where
    /// `token_bytes` is one token's latent row in one layer (`(kv_lora_rank + qk_rope_head_dim)
    /// · element bytes`: 576 · 2 = 1152 for DeepSeek-V3 in bf16).
    ///
    /// ```
    /// use kvbridge_handshake::{PeerDescriptor, Role};
    /// // DeepSeek-V3 decode rank 1 of attention TP 4 with DCP 4: 61 layers, page size 64.
    /// let d = PeerDescriptor::mla(Role::Decode, 64, 61, 1152).attn_tp(4, 1).dcp(4).build()?;
    /// assert_eq!((d.dcp_size, d.dcp_rank), (4, 1));
    /// assert_eq!(d.kv_item_lens, vec![64 * 1152; 61]);
    /// # Ok::<(), kvbridge_handshake::HandshakeError>(())
    /// ```
    pub fn mla(
        role: Role,
        page_size: u64,
        layers: usize,
        token_bytes: u64,
    ) -> PeerDescriptorBuilder {
        let mut b = Self::builder(role).page_size(page_size);
        b.kv_pool = Some(PoolKind::Mla);
        b.entries = Entries::Mla {
            layers,
            token_bytes,
        };
        b
    }

    /// An MHA/GQA rank: `2 · layers` KV entries (K, then V, per layer) of `page_size ·
    /// heads_per_rank · head_dim · element bytes` each, with `heads_per_rank =
    /// max(1, total_kv_heads / attn_tp_size)` as SGLang shards heads. The element size comes from
    /// `kv_cache_dtype` when it names one (`"bfloat16"`, `"fp8_e4m3"`, ...); with the default
    /// `"auto"` it must be given with [`element_bytes`](PeerDescriptorBuilder::element_bytes).
    ///
    /// ```
    /// use kvbridge_handshake::{PeerDescriptor, Role};
    /// // Llama-3-8B prefill rank 0 of TP 4: 32 layers, 8 KV heads of dim 128, bf16.
    /// let d = PeerDescriptor::mha(Role::Prefill, 64, 32, 8, 128).element_bytes(2).attn_tp(4, 0).build()?;
    /// assert_eq!(d.kv_item_lens, vec![64 * 2 * 128 * 2; 64]);
    /// # Ok::<(), kvbridge_handshake::HandshakeError>(())
    /// ```
    pub fn mha(
        role: Role,
        page_size: u64,
        layers: usize,
        total_kv_heads: u32,
        head_dim: u32,
    ) -> PeerDescriptorBuilder {
        let mut b = Self::builder(role).page_size(page_size);
        b.kv_pool = Some(PoolKind::Mha);
        b.heads = Some((total_kv_heads, head_dim));
        b.entries = Entries::Mha { layers };
        b
    }

    /// A builder for any shape (hybrid MLA, entries exported from an engine as registered):
    /// `page_size`, `kv_pool` and `kv_item_lens` must be set before [`build`](PeerDescriptorBuilder::build).
    pub fn builder(role: Role) -> PeerDescriptorBuilder {
        PeerDescriptorBuilder {
            role,
            protocol_version: ProtocolVersion::CURRENT,
            page_size: None,
            kv_cache_dtype: "auto".to_owned(),
            kv_layout: None,
            kv_pool: None,
            attn_tp: (1, 0),
            attn_cp: (1, 0),
            pp: (1, 0),
            dcp_size: 1,
            kv_cache_sharding: false,
            heads: None,
            element_bytes: None,
            entries: Entries::Unset,
            num_draft_entries: 0,
            aux_item_lens: Vec::new(),
        }
    }
}

impl PeerDescriptorBuilder {
    /// Physical KV pool page size in tokens (`--page-size`).
    pub fn page_size(mut self, tokens: u64) -> Self {
        self.page_size = Some(tokens);
        self
    }

    /// Pool kind (set by [`PeerDescriptor::mla`] and [`PeerDescriptor::mha`]).
    pub fn kv_pool(mut self, kind: PoolKind) -> Self {
        self.kv_pool = Some(kind);
        self
    }

    /// The KV cache dtype string (`--kv-cache-dtype`, default `"auto"`).
    pub fn kv_cache_dtype(mut self, dtype: impl Into<String>) -> Self {
        self.kv_cache_dtype = dtype.into();
        self
    }

    /// The KV layout name (default none).
    pub fn kv_layout(mut self, layout: impl Into<String>) -> Self {
        self.kv_layout = Some(layout.into());
        self
    }

    /// Bytes per KV element, for an MHA shape whose `kv_cache_dtype` (such as `"auto"`) does not
    /// say it.
    pub fn element_bytes(mut self, bytes: u64) -> Self {
        self.element_bytes = Some(bytes);
        self
    }

    /// Total KV heads of the model and the head dimension (set by [`PeerDescriptor::mha`]).
    pub fn heads(mut self, total_kv_heads: u32, head_dim: u32) -> Self {
        self.heads = Some((total_kv_heads, head_dim));
        self
    }

    /// Bytes per page of every registered KV entry, target entries then draft entries, exactly
    /// as the engine registered them; replaces the entries [`PeerDescriptor::mla`] or
    /// [`PeerDescriptor::mha`] would derive.
    pub fn kv_item_lens(mut self, lens: Vec<u64>) -> Self {
        self.entries = Entries::Given(lens);
        self
    }

    /// How many of the last KV entries are speculative-decoding draft entries (default 0).
    pub fn num_draft_entries(mut self, n: usize) -> Self {
        self.num_draft_entries = n;
        self
    }

    /// Bytes per row of every aux (metadata) buffer (default none).
    pub fn aux_item_lens(mut self, lens: Vec<u64>) -> Self {
        self.aux_item_lens = lens;
        self
    }

    /// Attention tensor-parallel size and this rank's TP rank (default 1, 0).
    pub fn attn_tp(mut self, size: u32, rank: u32) -> Self {
        self.attn_tp = (size, rank);
        self
    }

    /// Attention context-parallel size and rank (default 1, 0; a decode must use 1).
    pub fn attn_cp(mut self, size: u32, rank: u32) -> Self {
        self.attn_cp = (size, rank);
        self
    }

    /// Pipeline-parallel size and this rank's stage (default 1, 0).
    pub fn pp(mut self, size: u32, rank: u32) -> Self {
        self.pp = (size, rank);
        self
    }

    /// Decode context-parallel size (default 1); the DCP rank follows from the attention TP
    /// rank (`attn_tp_rank mod dcp_size`).
    pub fn dcp(mut self, size: u32) -> Self {
        self.dcp_size = size;
        self
    }

    /// `--enable-kv-cache-sharding` (default false).
    pub fn kv_cache_sharding(mut self, on: bool) -> Self {
        self.kv_cache_sharding = on;
        self
    }

    /// The descriptor protocol version to advertise (default [`ProtocolVersion::CURRENT`]).
    pub fn protocol_version(mut self, version: ProtocolVersion) -> Self {
        self.protocol_version = version;
        self
    }

    /// The descriptor.
    ///
    /// # Errors
    /// [`HandshakeError::DescriptorBuild`] when a required value is missing (`page_size`,
    /// `kv_pool`, `kv_item_lens`, the head geometry of an MHA pool, the element size of an MHA
    /// shape whose dtype does not name one), a size is 0, a rank is not below its size, or
    /// `dcp_size` does not divide `attn_tp_size`. Whether two descriptors work together is
    /// [`crate::check`]'s question, not the builder's.
    pub fn build(self) -> Result<PeerDescriptor> {
        let (page_size, kv_pool) = self.check_shape()?;
        let kv_item_lens = self.item_lens(page_size)?;
        if self.num_draft_entries > kv_item_lens.len() {
            return fail(
                format!(
                    "num_draft_entries {} exceeds the {} KV entries",
                    self.num_draft_entries,
                    kv_item_lens.len()
                ),
                "count only the draft entries at the end of kv_item_lens",
            );
        }
        let (tp, tp_rank) = self.attn_tp;
        let (total_kv_heads, head_dim) = self.heads.unzip();
        Ok(PeerDescriptor {
            role: self.role,
            protocol_version: self.protocol_version,
            page_size,
            kv_cache_dtype: self.kv_cache_dtype,
            kv_layout: self.kv_layout,
            kv_pool,
            attn_tp_size: tp,
            attn_tp_rank: tp_rank,
            attn_cp_size: self.attn_cp.0,
            attn_cp_rank: self.attn_cp.1,
            pp_size: self.pp.0,
            pp_rank: self.pp.1,
            dcp_size: self.dcp_size,
            dcp_rank: tp_rank % self.dcp_size,
            kv_cache_sharding: self.kv_cache_sharding,
            total_kv_heads,
            head_dim,
            kv_item_lens,
            num_draft_entries: self.num_draft_entries,
            aux_item_lens: self.aux_item_lens,
            unknown_fields: Vec::new(),
        })
    }

    /// The page size and pool kind, once the shape and parallelism are complete and consistent.
    fn check_shape(&self) -> Result<(u64, PoolKind)> {
        let Some(page_size) = self.page_size.filter(|&p| p > 0) else {
            return fail(
                format!(
                    "page_size is {}",
                    self.page_size
                        .map_or("not set".to_owned(), |p| p.to_string())
                ),
                "call .page_size(tokens) with the engine's --page-size (at least 1)",
            );
        };
        let Some(kv_pool) = self.kv_pool else {
            return fail(
                "kv_pool is not set".to_owned(),
                "start from PeerDescriptor::mla(..) or PeerDescriptor::mha(..), or call .kv_pool(..)",
            );
        };
        for (name, (size, rank)) in [
            ("attn_tp", self.attn_tp),
            ("attn_cp", self.attn_cp),
            ("pp", self.pp),
        ] {
            if size == 0 || rank >= size {
                return fail(
                    format!(
                        "{name} size {size}, rank {rank}: the rank must be below a size of at least 1"
                    ),
                    &format!("call .{name}(size, rank) with 0 <= rank < size"),
                );
            }
        }
        let (tp, _) = self.attn_tp;
        if self.dcp_size == 0 || tp % self.dcp_size != 0 {
            return fail(
                format!(
                    "dcp_size {} does not divide attn_tp_size {tp}",
                    self.dcp_size
                ),
                "call .dcp(size) with a divisor of the attention TP size (1 without DCP)",
            );
        }
        if kv_pool == PoolKind::Mha && self.heads.is_none() {
            return fail(
                "an mha pool needs total_kv_heads and head_dim".to_owned(),
                "start from PeerDescriptor::mha(..) or call .heads(total_kv_heads, head_dim)",
            );
        }
        Ok((page_size, kv_pool))
    }

    /// `kv_item_lens` as given, or derived from the MLA or MHA shape.
    fn item_lens(&self, page_size: u64) -> Result<Vec<u64>> {
        let lens = match &self.entries {
            Entries::Unset => {
                return fail(
                    "kv_item_lens is not set".to_owned(),
                    "call .kv_item_lens(..) with the bytes per page of every registered KV entry, \
                     or start from PeerDescriptor::mla(..) or PeerDescriptor::mha(..)",
                );
            }
            Entries::Given(lens) => lens.clone(),
            &Entries::Mla {
                layers,
                token_bytes,
            } => vec![page_size.saturating_mul(token_bytes); layers],
            &Entries::Mha { layers } => {
                let (heads, head_dim) = self.heads.unwrap_or_default();
                let Some(element) = self
                    .element_bytes
                    .or_else(|| dtype_bytes(&self.kv_cache_dtype))
                else {
                    return fail(
                        format!(
                            "kv_cache_dtype {:?} does not say how many bytes a KV element takes",
                            self.kv_cache_dtype
                        ),
                        "call .element_bytes(n) (2 for a bf16 or fp16 model), or name the dtype \
                         with .kv_cache_dtype(\"bfloat16\")",
                    );
                };
                let per_rank = u64::from((heads / self.attn_tp.0).max(1));
                let item = page_size
                    .saturating_mul(per_rank)
                    .saturating_mul(u64::from(head_dim))
                    .saturating_mul(element);
                vec![item; layers.saturating_mul(2)]
            }
        };
        Ok(lens)
    }
}

/// [`HandshakeError::DescriptorBuild`]: what is wrong and the call that fixes it.
fn fail<T>(message: String, remedy: &str) -> Result<T> {
    Err(HandshakeError::DescriptorBuild {
        message,
        remedy: remedy.to_owned(),
    })
}
