//! `kvbridge-lab demo`: real prefill and decode processes moving a real-sized KV cache, with every
//! byte checked.
//!
//! `kvbridge-lab demo` (the *parent*) starts this binary again with hidden role flags: one
//! **prefill process** (every prefill rank, each with its own transport and TCP control
//! channel, plus the embedded bootstrap server on 127.0.0.1) and one **decode process per
//! decode rank** (its transport, control channel, and an [`HttpDirectory`] pointing at the
//! prefill's bootstrap server). The children talk only through kvbridge: the bootstrap
//! registry, the control channel and the transport. They report progress to the parent as
//! JSON lines on stdout ([`Event`]); the parent draws the progress bar and the summary.
//!
//! Per request, the prefill fills every token row it holds with bytes derived from (request,
//! entry, absolute position) ([`kvbridge_testkit::fill`]), creates the room, waits for
//! the decode ranks' metadata, sends the prompt in chunks and waits for Success; each decode
//! rank receives into its own pages (optionally holding a cached prefix it filled itself),
//! waits for Success and verifies every row the owner rule says it holds. Pages are reused
//! across requests: each side's pool holds `--concurrency` requests.
//!
//! [`HttpDirectory`]: kvbridge_coordinator::bootstrap::HttpDirectory

use std::process::ExitCode;
use std::time::Duration;

use kvbridge_handshake::{PeerDescriptor, Role as PeerRole};
use serde::{Deserialize, Serialize};

mod parent;
mod worker;

/// Transports the demo can move the KV bytes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Transport {
    /// Shared memory between the processes (kvbridge-shm): a copy straight into the decode's
    /// pages.
    Shm,
    /// TCP over loopback (kvbridge-tcp).
    Tcp,
    /// NIXL's UCX backend (kvbridge-nixl; build with `--features nixl` after
    /// `cargo xtask nixl-setup`).
    Nixl,
}

/// Model families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Geometry {
    /// MLA (DeepSeek V3 style): one latent row per token per layer, replicated over TP, split
    /// over decode DCP ranks by position. Default 61 layers of 1152 bytes.
    Mla,
    /// GQA (Qwen2.5-7B style): K and V heads per layer, split over TP ranks by head. Default
    /// 28 layers, 4 KV heads of 128 bf16 values, prefill TP 2, decode TP 4.
    Gqa,
}

/// The role of a process started by the demo itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Role {
    /// Every prefill rank and the bootstrap server.
    Prefill,
    /// One decode rank.
    Decode,
}

/// Arguments of `kvbridge-lab demo`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Examples:\n  kvbridge-lab demo                                  MLA, prefill DCP 1 -> decode DCP 4, shared memory\n  kvbridge-lab demo --transport tcp                  the same over TCP\n  kvbridge-lab demo --transport nixl                 the same over NIXL (build with --features nixl)\n  kvbridge-lab demo --geometry gqa                   GQA, prefill TP 2 -> decode TP 4 (head slices)\n  kvbridge-lab demo --prefix-tokens 2048             the decode already holds the first 2048 tokens\n  kvbridge-lab demo --prefill-dcp 2 --dcp 4 --prefill-page-size 16\n                                                 any prefill DCP and page size to any decode's\n  kvbridge-lab demo --tokens 1024 --requests 4       a quick run\n\nDeadlines: a request that misses --timeout fails; after the first failure (or a process\nthat dies) the run ends within --timeout plus a grace of 10 s, killing what is still running.\n\nLogging: every process logs to stderr, each line prefixed with the process. RUST_LOG picks\nwhat (e.g. RUST_LOG=kvbridge_tcp=debug); the default is errors only; --verbose logs warnings\nand kvbridge's debug messages (why a connection closed, which deadline fired). The summary\nnames each process's first failure.\n\nExit status: 0 when every request succeeded and every byte verified, 1 otherwise, 2 for\ninvalid arguments."
)]
pub(crate) struct DemoArgs {
    /// Transport that moves the KV bytes between the processes.
    #[arg(long, value_enum, default_value = "shm")]
    transport: Transport,
    /// Model family: `mla` (DCP over positions) or `gqa` (TP over heads).
    #[arg(long, value_enum, default_value = "mla")]
    geometry: Geometry,
    /// Layers of the model (default: 61 for mla, 28 for gqa).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    layers: Option<u32>,
    /// MLA only: bytes of one token's latent row in one layer (DeepSeek V3: 576 values of
    /// 2 bytes).
    #[arg(long, default_value_t = 1152, value_parser = clap::value_parser!(u64).range(8..=1 << 20))]
    bytes_per_token_layer: u64,
    /// GQA only: KV heads of the model.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    kv_heads: u32,
    /// GQA only: head dimension (values of 2 bytes).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=4096))]
    head_dim: u32,
    /// Physical page size of the decode pool, in tokens. Under DCP a decode page table entry
    /// covers `page-size · dcp` tokens.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    page_size: u64,
    /// Physical page size of the prefill pool (default: --page-size).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=65536))]
    prefill_page_size: Option<u64>,
    /// Decode context-parallel (DCP) size: position p lives on decode rank p mod dcp (default:
    /// 4 for mla, 1 for gqa; DCP with gqa is refused at connect, as the handshake requires).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    dcp: Option<u32>,
    /// Prefill DCP size: position p lives on prefill rank p mod prefill-dcp.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    prefill_dcp: u32,
    /// Prefill attention TP size, one rank each (default: prefill-dcp for mla, 2 for gqa).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    prefill_tp: Option<u32>,
    /// Decode attention TP size, one process per rank (default: dcp for mla, 4 for gqa).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    decode_tp: Option<u32>,
    /// Prompt tokens per request (8192 with the mla defaults is about 575 MB of KV).
    #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    tokens: u64,
    /// Requests to run.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    requests: u32,
    /// Requests in flight at once; each side's pool holds this many requests and reuses their
    /// pages.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    concurrency: u32,
    /// Tokens per prefill chunk (chunked prefill); rounded down to whole prefill pages.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    chunk_tokens: u64,
    /// Tokens the decode already holds (a prefix cache hit): it fills them itself, the
    /// prefill sends only the rest (from the prefix rounded down to the decode's virtual page).
    #[arg(long, default_value_t = 0)]
    prefix_tokens: u64,
    /// Deadline in seconds for each request's handshake and transfer; the decode also declares
    /// the prefill lost after missing heartbeats for about a fifth of it (see "Deadlines").
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Shared secret of the run: the TCP transport, the control channels and the bootstrap
    /// registry all require it; default: a random one per run.
    #[arg(long)]
    secret: Option<String>,
    /// Port of the bootstrap server on --bind-addr (default: any free port).
    #[arg(long, default_value_t = 0)]
    bootstrap_port: u16,
    /// IP address every listener of the processes binds: the TCP transport, the control
    /// channels and the bootstrap server. `0.0.0.0` listens on every interface (then set
    /// --advertise-addr). The roles run on different hosts with each host's own address.
    #[arg(long, default_value = "127.0.0.1")]
    bind_addr: std::net::IpAddr,
    /// IP address the processes name to their peers (the transport's descriptor, the control
    /// endpoint, the bootstrap address); default: --bind-addr.
    #[arg(long)]
    advertise_addr: Option<std::net::IpAddr>,
    /// Gather each chunk's strided rows into registered pack buffers on the prefill and post
    /// one contiguous range per layer, chunk and decode rank (the default posts strided ops).
    #[arg(long)]
    pack: bool,
    /// Print the final summary as one JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
    /// Log warnings and kvbridge's debug messages of every process to stderr (RUST_LOG, when
    /// set, decides instead).
    #[arg(long, short)]
    verbose: bool,
    /// Write the run's spans to FILE as Chrome trace-event JSON (open it in Perfetto or
    /// chrome://tracing): one process per demo process, one track per rank. Each process
    /// writes FILE.<process>.part and the demo merges them into FILE at the end.
    #[arg(long, value_name = "FILE")]
    trace: Option<std::path::PathBuf>,

    /// Internal: the role of a process started by the demo.
    #[arg(long, hide = true, value_enum)]
    role: Option<Role>,
    /// Internal: the decode rank of this process.
    #[arg(long, hide = true, default_value_t = 0)]
    rank: u32,
    /// Internal: the prefill's bootstrap address (`host:port`), for `--role decode`.
    #[arg(long, hide = true)]
    bootstrap: Option<String>,
    /// Internal, with `--role`: run the requests the controlling process names on stdin
    /// (`run I`, one line each) instead of `0..--requests`, until `finish` or end of file; a
    /// failed request does not stop the process. A decode rank fills the pages of a failed
    /// room with a canary once no byte can land any more and checks it before reusing them
    /// and at exit (the `canary` event).
    #[arg(long, hide = true, requires = "role")]
    serve: bool,
    /// Test knob: kill a process (SIGKILL) once the prefill posted the first chunk of a
    /// request: `decode:RANK@REQUEST` or `prefill@REQUEST`.
    #[arg(long, hide = true)]
    kill: Option<String>,
    /// Test knob: like `--kill`, but stop the process (SIGSTOP) so that it hangs; only the
    /// deadlines can end the run.
    #[arg(long, hide = true, conflicts_with = "kill")]
    freeze: Option<String>,
    /// Test knob: the prefill pauses this long after every chunk but a request's last.
    #[arg(long, hide = true, default_value_t = 0)]
    chunk_delay_ms: u64,
}

/// What a child process reports to the parent, one JSON object per stdout line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub(crate) enum Event {
    /// The process is up (the prefill: its ranks registered with the bootstrap server).
    Ready {
        pid: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bootstrap: Option<String>,
    },
    /// A shared-memory control directory this process created (the parent removes it if the
    /// process dies before it could).
    ControlDir { path: String },
    /// Prefill: chunk `index` of `request` was posted by every prefill rank.
    Chunk { request: u32, index: u32 },
    /// Prefill: every prefill rank reported Success for `request`.
    Sent {
        request: u32,
        latency_us: u64,
        /// Every prefill rank's decode metadata in -> Success on every prefill rank.
        #[serde(default)]
        transfer_us: u64,
        bytes: u64,
    },
    /// Decode: `request` succeeded and every byte this rank holds verified.
    Verified { request: u32, rank: u32, bytes: u64 },
    /// A request failed on this process (first failure per request). `secondary`: the
    /// failure is a consequence of another one (an abort after an earlier failure).
    Failed {
        request: u32,
        reason: String,
        #[serde(default)]
        secondary: bool,
    },
    /// Decode (`--serve`): `request`'s room failed, now (its `failed` event follows once the
    /// pages are fenced or the fence timed out).
    RoomFailed { request: u32, reason: String },
    /// Decode (`--serve`): the canary written into the pages of failed `request` once its
    /// room was fenced (or the fence timed out), checked before the pages were reused or at
    /// exit. `changed`: why it
    /// is not intact (a byte landed after the fence).
    Canary {
        request: u32,
        rank: u32,
        bytes_checked: u64,
        /// Whether the room's fence was proven before the canary was written (otherwise the
        /// library kept the pages out of reuse, and the canary shows what would have landed).
        fenced: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        changed: Option<String>,
    },
    /// The process finished; its final state.
    Done(Summary),
}

/// A child's final report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Summary {
    /// `"prefill"` or `"decode"`.
    pub(crate) role: String,
    /// Decode rank (0 for the prefill).
    pub(crate) rank: u32,
    /// Requests that succeeded (and, on a decode, verified).
    pub(crate) succeeded: u32,
    /// Requests that failed.
    pub(crate) failed: u32,
    /// Requests never started (after a failure the process stops starting new ones).
    pub(crate) skipped: u32,
    /// KV and aux bytes the transport moved (prefill) or bytes verified (decode).
    pub(crate) bytes: u64,
    /// Rooms still held by the agents after cleanup (must be 0).
    pub(crate) rooms_left: usize,
    /// Prefill: transport descriptors posted (a strided op counts one), over all ranks.
    #[serde(default)]
    pub(crate) descriptors: u64,
    /// Prefill: rows those descriptors cover.
    #[serde(default)]
    pub(crate) rows: u64,
    /// Prefill: batches posted from a pack buffer (`--pack`).
    #[serde(default)]
    pub(crate) pack_batches: u64,
    /// Prefill: bytes gathered into pack buffers (`--pack`).
    #[serde(default)]
    pub(crate) pack_bytes: u64,
    /// The first root cause: the first failure that is not a consequence of another one (an
    /// abort), or the first failure if every one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) first_failure: Option<String>,
    /// Whether `first_failure` is only a consequence of another failure.
    #[serde(skip)]
    pub(crate) first_is_secondary: bool,
    /// The shared-memory transport's private directories (removed at exit).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) control_dirs: Vec<String>,
}

/// Everything derived from the arguments that both sides agree on.
#[derive(Debug, Clone)]
pub(crate) struct Setup {
    pub(crate) transport: Transport,
    pub(crate) geometry: Geometry,
    pub(crate) layers: u32,
    pub(crate) prefill: Vec<PeerDescriptor>,
    pub(crate) decode: Vec<PeerDescriptor>,
    /// Pages (virtual under DCP) one request takes on each prefill / decode rank.
    pub(crate) prefill_pages: u64,
    pub(crate) decode_pages: u64,
    /// Bytes of KV of one request (all tokens, all layers, full rows).
    pub(crate) kv_bytes_per_request: u64,
    pub(crate) tokens: u64,
    pub(crate) requests: u32,
    pub(crate) concurrency: u32,
    pub(crate) chunk_tokens: u64,
    pub(crate) prefix_tokens: u64,
    pub(crate) timeout: Duration,
    pub(crate) secret: Option<String>,
    pub(crate) chunk_delay: Duration,
    /// Pack buffers on the prefill (`--pack`): how many per prefill rank, and their bytes.
    pub(crate) pack: Option<(usize, u64)>,
    /// What every listener binds, and the address peers are told.
    pub(crate) bind_addr: std::net::IpAddr,
    pub(crate) advertise_addr: std::net::IpAddr,
    /// `--serve`: requests named on stdin, failures do not stop the process.
    pub(crate) serve: bool,
}

/// How long after the first failure (or a dead process) the run may take beyond `--timeout`
/// to stop: aborts, fences and cleanup. Stated in `--help`.
pub(crate) const GRACE: Duration = Duration::from_secs(10);

/// Aux buffers of every rank: one 64-byte metadata row per request.
pub(crate) const AUX_ITEM_LENS: [u64; 1] = [64];

/// The room id of request `i` (room 0 is reserved).
/// Where a worker process finds the run's secret (set by the parent when it starts it).
pub(crate) const SECRET_ENV: &str = "KVBRIDGE_DEMO_SECRET";

/// The one secret of a run: `--secret`, else the one the parent handed this worker, else (the
/// parent) 32 fresh random bytes in hex.
fn run_secret(a: &DemoArgs) -> String {
    if let Some(s) = &a.secret {
        return s.clone();
    }
    if a.role.is_some() {
        if let Ok(s) = std::env::var(SECRET_ENV) {
            return s;
        }
    }
    let mut b = [0u8; 32];
    kvbridge_auth::random_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Refuses pools that would take more than 16 GB in all (`total` bytes).
fn check_memory(total: u64, concurrency: u32, kv_bytes_per_request: u64) -> Result<(), String> {
    const LIMIT: u64 = 16 << 30;
    if total > LIMIT {
        return Err(format!(
            "the pools would take {:.1} GB ({concurrency} requests of {:.1} MB in flight on each \
             side); lower --concurrency or --tokens (limit {:.0} GB)",
            total as f64 / 1e9,
            kv_bytes_per_request as f64 / 1e6,
            LIMIT as f64 / 1e9
        ));
    }
    Ok(())
}

pub(crate) fn room_of(i: u32) -> u64 {
    u64::from(i) + 1
}

impl Setup {
    /// Layers, decode DCP and the TP sizes of both sides: the arguments, or the geometry's
    /// defaults.
    fn shape(a: &DemoArgs) -> (u32, u32, u32, u32) {
        let pdcp = a.prefill_dcp;
        match a.geometry {
            Geometry::Mla => {
                let dcp = a.dcp.unwrap_or(4);
                (
                    a.layers.unwrap_or(61),
                    dcp,
                    a.prefill_tp.unwrap_or(pdcp),
                    a.decode_tp.unwrap_or(dcp),
                )
            }
            Geometry::Gqa => {
                let dcp = a.dcp.unwrap_or(1);
                (
                    a.layers.unwrap_or(28),
                    dcp,
                    a.prefill_tp.unwrap_or(2),
                    a.decode_tp.unwrap_or(4),
                )
            }
        }
    }

    /// Refuses arguments that cannot make a run, saying which and why.
    fn check_args(
        a: &DemoArgs,
        (ptp, pdcp): (u32, u32),
        (dtp, dcp): (u32, u32),
    ) -> Result<(), String> {
        if ptp % pdcp != 0 {
            return Err(format!(
                "--prefill-tp {ptp} must be a multiple of --prefill-dcp {pdcp} (DCP ranks are nested \
                 inside attention TP)"
            ));
        }
        if dtp % dcp != 0 {
            return Err(format!(
                "--decode-tp {dtp} must be a multiple of --dcp {dcp} (DCP ranks are nested inside \
                 attention TP)"
            ));
        }
        if a.prefix_tokens >= a.tokens {
            return Err(format!(
                "--prefix-tokens {} must be below --tokens {}: the prefill must send something",
                a.prefix_tokens, a.tokens
            ));
        }
        if !(a.timeout.is_finite() && a.timeout > 0.0 && a.timeout <= 86_400.0) {
            return Err(format!(
                "--timeout must be a number of seconds in (0, 86400], got {}",
                a.timeout
            ));
        }
        if a.advertise_addr.unwrap_or(a.bind_addr).is_unspecified() {
            return Err(format!(
                "--bind-addr {} is not an address peers can connect to: pass --advertise-addr \
                 with this host's address on the network the other processes reach",
                a.bind_addr
            ));
        }
        if a.secret.as_ref().is_some_and(String::is_empty) {
            return Err("--secret must not be empty".to_owned());
        }
        Ok(())
    }

    pub(crate) fn from_args(a: &DemoArgs) -> Result<Self, String> {
        let p2 = a.page_size;
        let p1 = a.prefill_page_size.unwrap_or(p2);
        let pdcp = a.prefill_dcp;
        let (layers, dcp, ptp, dtp) = Self::shape(a);
        Self::check_args(a, (ptp, pdcp), (dtp, dcp))?;
        let desc = |role: PeerRole,
                    page: u64,
                    tp: u32,
                    rank: u32,
                    dcp: u32|
         -> Result<PeerDescriptor, String> {
            match a.geometry {
                Geometry::Mla => {
                    PeerDescriptor::mla(role, page, layers as usize, a.bytes_per_token_layer)
                }
                Geometry::Gqa => {
                    PeerDescriptor::mha(role, page, layers as usize, a.kv_heads, a.head_dim)
                        .element_bytes(2)
                }
            }
            .attn_tp(tp, rank)
            .dcp(dcp)
            .aux_item_lens(AUX_ITEM_LENS.to_vec())
            .build()
            .map_err(|e| format!("internal: {e}"))
        };
        let prefill = (0..ptp)
            .map(|r| desc(PeerRole::Prefill, p1, ptp, r, pdcp))
            .collect::<Result<Vec<_>, _>>()?;
        let decode = (0..dtp)
            .map(|r| desc(PeerRole::Decode, p2, dtp, r, dcp))
            .collect::<Result<Vec<_>, _>>()?;
        let token_bytes = match a.geometry {
            Geometry::Mla => u64::from(layers) * a.bytes_per_token_layer,
            Geometry::Gqa => {
                2 * u64::from(layers) * u64::from(a.kv_heads) * u64::from(a.head_dim) * 2
            }
        };
        let kv_bytes_per_request = token_bytes
            .checked_mul(a.tokens)
            .ok_or("the KV of one request overflows 64 bits")?;
        let prefill_pages = a.tokens.div_ceil(p1 * u64::from(pdcp));
        let decode_pages = a.tokens.div_ceil(p2 * u64::from(dcp));
        // Memory each side allocates: refuse what cannot fit rather than fail half-way.
        let per_rank = |d: &PeerDescriptor, pages: u64| -> u64 {
            d.kv_item_lens.iter().sum::<u64>() * pages * u64::from(a.concurrency)
        };
        let total: u64 = prefill
            .iter()
            .map(|d| per_rank(d, prefill_pages))
            .sum::<u64>()
            + decode
                .iter()
                .map(|d| per_rank(d, decode_pages))
                .sum::<u64>();
        // Pack buffers: one per decode rank for each request in flight, each holding a chunk's
        // share for one decode rank (`ceil(chunk / dcp)` tokens of every layer).
        let pack = a.pack.then(|| {
            let share = a.chunk_tokens.min(a.tokens).div_ceil(u64::from(dcp));
            (dtp as usize * a.concurrency as usize, share * token_bytes)
        });
        let total = total
            + pack.map_or(0, |(n, bytes)| {
                (n as u64)
                    .saturating_mul(bytes)
                    .saturating_mul(prefill.len() as u64)
            });
        check_memory(total, a.concurrency, kv_bytes_per_request)?;
        Ok(Setup {
            transport: a.transport,
            geometry: a.geometry,
            layers,
            prefill,
            decode,
            prefill_pages,
            decode_pages,
            kv_bytes_per_request,
            tokens: a.tokens,
            requests: a.requests,
            concurrency: a.concurrency,
            chunk_tokens: a.chunk_tokens,
            prefix_tokens: a.prefix_tokens,
            timeout: Duration::from_secs_f64(a.timeout),
            secret: Some(run_secret(a)),
            chunk_delay: Duration::from_millis(a.chunk_delay_ms),
            pack,
            bind_addr: a.bind_addr,
            advertise_addr: a.advertise_addr.unwrap_or(a.bind_addr),
            serve: a.serve,
        })
    }

    /// One line describing the run.
    pub(crate) fn describe(&self) -> String {
        let p = &self.prefill[0];
        let d = &self.decode[0];
        let model = match self.geometry {
            Geometry::Mla => format!(
                "MLA, {} layers x {} B/token/layer",
                self.layers,
                p.kv_item_lens[0] / p.page_size
            ),
            Geometry::Gqa => format!(
                "GQA, {} layers x {} KV heads x {} dims (bf16)",
                self.layers,
                p.total_kv_heads.unwrap_or(0),
                p.head_dim.unwrap_or(0)
            ),
        };
        format!(
            "{model}; {} tokens/request ({:.1} MB of KV); prefill TP {} DCP {} page {} -> decode TP \
             {} DCP {} page {}; {} transport",
            self.tokens,
            self.kv_bytes_per_request as f64 / 1e6,
            p.attn_tp_size,
            p.dcp_size,
            p.page_size,
            d.attn_tp_size,
            d.dcp_size,
            d.page_size,
            match self.transport {
                Transport::Shm => "shared-memory",
                Transport::Tcp => "TCP",
                Transport::Nixl => "NIXL (UCX)",
            }
        )
    }
}

pub(crate) fn run(args: DemoArgs) -> ExitCode {
    let setup = match Setup::from_args(&args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvbridge-lab demo: {e}");
            return ExitCode::from(2);
        }
    };
    match args.role {
        None => match &args.trace {
            None => parent::run(&args, setup),
            Some(file) => traced(file, || parent::run(&args, setup)),
        },
        Some(Role::Prefill) => worker::run_prefill(&args, setup),
        Some(Role::Decode) => worker::run_decode(&args, setup),
    }
}

/// The trace file part process `label` writes for `--trace FILE`: `FILE.<label>.part`.
pub(crate) fn trace_part(file: &std::path::Path, label: &str) -> std::path::PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(format!(".{}.part", label.replace(' ', "-")));
    name.into()
}

/// Runs the demo, then merges the trace file parts its processes wrote into `file`.
fn traced(file: &std::path::Path, run: impl FnOnce() -> ExitCode) -> ExitCode {
    let parts = || -> Vec<std::path::PathBuf> {
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
        let dir = file.parent().filter(|d| !d.as_os_str().is_empty());
        let dir = dir.unwrap_or(std::path::Path::new("."));
        let Some(name) = name else { return Vec::new() };
        let mut found: Vec<_> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name().is_some_and(|n| {
                    let n = n.to_string_lossy();
                    n.starts_with(&format!("{name}.")) && n.ends_with(".part")
                })
            })
            .collect();
        found.sort();
        found
    };
    // Parts of an earlier run would merge into this one.
    for p in parts() {
        let _ = std::fs::remove_file(p);
    }
    let code = run();
    match kvbridge_lab::telemetry::chrome::merge(&parts(), file) {
        Ok(_) => eprintln!("kvbridge-lab demo: spans written to {}", file.display()),
        Err(e) => {
            eprintln!("kvbridge-lab demo: {e}");
            return ExitCode::from(1);
        }
    }
    code
}
