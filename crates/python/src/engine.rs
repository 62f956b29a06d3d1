//! `kvbridge.Engine`: one rank's transport from Python (register memory, exchange descriptors,
//! post writes, learn when they are done), over `kvbridge_transport::KvTransport`.
//!
//! Every call that waits or copies runs on the module's tokio runtime with the interpreter
//! detached (`Python::detach`), so other Python threads run meanwhile; long waits are cut into
//! slices between which pending signals (Ctrl-C) are checked. Every class is frozen and keeps
//! its state behind `Arc`s and short locks, so one engine may be used from many threads.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvbridge_transport::sync::lock;
use kvbridge_transport::{
    BatchId, BatchState, Direction, KvTransport, MemoryKind, MemoryRegion, PeerId, RegionId,
    TransferBatch, TransferOp, TransportError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::errors::{self, Kind, invalid};
use crate::memory;

/// How long one detached wait runs before pending signals are checked.
const SIGNAL_SLICE: Duration = Duration::from_millis(100);

/// Most notifications one `notifications()` call returns.
const MAX_NOTIFICATIONS: usize = 4096;

/// The module's one tokio runtime: transports, agents and every wait run on it.
///
/// A `fork`ed child inherits the runtime's memory but none of its threads, so every call there
/// would hang: the child is refused with a typed error instead.
pub(crate) fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<(u32, std::io::Result<tokio::runtime::Runtime>)> = OnceLock::new();
    let (pid, rt) = RUNTIME.get_or_init(|| {
        let workers = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .clamp(2, 4);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("kvbridge-rt")
            .enable_all()
            .build();
        (std::process::id(), rt)
    });
    if *pid != std::process::id() {
        return Err(Kind::Unsupported.err(format!(
            "this process was forked from process {pid} after kvbridge started there, and a \
             forked child has none of its threads; create engines and agents in each process \
             (multiprocessing.get_context(\"spawn\"), or subprocess)"
        )));
    }
    rt.as_ref().map_err(|e| {
        Kind::Io.err(format!(
            "cannot start kvbridge's async runtime: {e}; check the process's thread limit"
        ))
    })
}

/// Runs `fut` to completion on the runtime with the interpreter detached, without checking
/// signals: for calls that must not be dropped half-way (a registration or a post that went
/// through but whose id would be lost), all of them short or bounded by their own deadline.
pub(crate) fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    Ok(py.detach(|| rt.block_on(fut)))
}

/// Runs `fut` until it completes (`Some`) or `limit` passes (`None`), detached, checking
/// signals every [`SIGNAL_SLICE`] so Ctrl-C interrupts a long wait. Dropping `fut` at the limit
/// must be harmless (every transport and agent wait is cancel-safe).
pub(crate) fn wait_for<F>(
    py: Python<'_>,
    limit: Option<Duration>,
    fut: F,
) -> PyResult<Option<F::Output>>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    let end = limit.map(|l| Instant::now().checked_add(l).unwrap_or_else(far_future));
    let mut fut = Box::pin(fut);
    loop {
        let slice = match end {
            None => SIGNAL_SLICE,
            Some(end) => end
                .saturating_duration_since(Instant::now())
                .min(SIGNAL_SLICE),
        };
        // The timer is made inside `block_on`: it needs the runtime's context.
        let out =
            py.detach(|| rt.block_on(async { tokio::time::timeout(slice, fut.as_mut()).await }));
        if let Ok(v) = out {
            return Ok(Some(v));
        }
        if end.is_some_and(|e| Instant::now() >= e) {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)
}

/// Seconds from Python as a duration; `None` stays `None` (no limit).
pub(crate) fn seconds(what: &str, secs: Option<f64>) -> PyResult<Option<Duration>> {
    secs.map(|s| {
        Duration::try_from_secs_f64(s).map_err(|_| {
            invalid(format!(
                "{what} must be a finite number of seconds >= 0, got {s}; pass e.g. 30.0 (or \
                 None to wait without limit where allowed)"
            ))
        })
    })
    .transpose()
}

/// A registered range, for refusing a second registration of the same bytes.
#[derive(Debug, Clone)]
struct Registered {
    /// `None` while the registration is in progress (the range is reserved meanwhile).
    id: Option<RegionId>,
    /// The region, once registered: [`Engine::alias`] registers it again.
    memory: Option<MemoryRegion>,
    /// Tells apart reservations of the same range.
    ticket: u64,
    kind: MemoryKind,
    start: u64,
    len: u64,
}

impl Registered {
    fn overlaps(&self, kind: MemoryKind, start: u64, len: u64) -> bool {
        self.kind == kind
            && len > 0
            && self.len > 0
            && start < self.start.saturating_add(self.len)
            && self.start < start.saturating_add(len)
    }
}

/// What an engine shares with its peers, transfers and agents.
pub(crate) struct EngineCore {
    pub(crate) transport: Arc<dyn KvTransport>,
    kind: &'static str,
    regions: Mutex<Vec<Registered>>,
    tickets: AtomicU64,
    closed: AtomicBool,
}

impl EngineCore {
    fn check_open(&self) -> PyResult<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Kind::Closed.err(format!(
                "this {} engine is closed; create a new kvbridge.Engine",
                self.kind
            )));
        }
        Ok(())
    }

    /// The registered length of a local region, if this engine registered it.
    pub(crate) fn region_len(&self, id: RegionId) -> Option<u64> {
        lock(&self.regions)
            .iter()
            .find(|r| r.id == Some(id))
            .map(|r| r.len)
    }

    /// Registers the region `make` builds over `len` bytes of `kind` at `start`, refusing a
    /// range that overlaps one registered (or being registered) before `make` runs: two regions
    /// over the same bytes would bypass each other's claims. The range is reserved under the
    /// lock first, so two threads cannot both pass the check.
    fn register_with(
        &self,
        py: Python<'_>,
        kind: MemoryKind,
        start: u64,
        len: u64,
        make: impl FnOnce() -> PyResult<MemoryRegion>,
    ) -> PyResult<(RegionId, MemoryRegion)> {
        self.check_open()?;
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        {
            let mut regions = lock(&self.regions);
            if let Some(r) = regions.iter().find(|r| r.overlaps(kind, start, len)) {
                let which = r.id.map_or_else(
                    || "being registered".to_owned(),
                    |id| format!("region {}", id.0),
                );
                return Err(invalid(format!(
                    "bytes [{start:#x}, +{len}) of {kind} overlap {which} ([{:#x}, +{}), \
                     registered earlier); register each allocation once and address its parts \
                     by offset, or deregister the old region first",
                    r.start, r.len
                )));
            }
            regions.push(Registered {
                id: None,
                memory: None,
                ticket,
                kind,
                start,
                len,
            });
        }
        let registered = make().and_then(|region| {
            let (transport, r) = (self.transport.clone(), region.clone());
            let id = block_on(py, async move { transport.register(r).await })?
                .map_err(errors::transport)?;
            Ok((id, region))
        });
        let mut regions = lock(&self.regions);
        match &registered {
            Ok((id, region)) => regions
                .iter_mut()
                .filter(|r| r.ticket == ticket)
                .for_each(|r| (r.id, r.memory) = (Some(*id), Some(region.clone()))),
            Err(_) => regions.retain(|r| r.ticket != ticket),
        }
        registered
    }

    /// Registers memory made just now (nothing can have registered it before).
    fn register_new(
        &self,
        py: Python<'_>,
        region: MemoryRegion,
    ) -> PyResult<(RegionId, MemoryRegion)> {
        let (kind, start, len) = (
            region.kind(),
            region.as_ptr().addr() as u64,
            region.len() as u64,
        );
        self.register_with(py, kind, start, len, || Ok(region))
    }
}

/// Memory the engine allocated for its transport (`Engine.allocate`): peers can write into
/// it. `numpy.asarray(memory)` views it as a uint8 array (through `__array_interface__`),
/// which keeps the memory alive.
#[pyclass(module = "kvbridge", frozen)]
pub(crate) struct Memory {
    region: MemoryRegion,
    id: RegionId,
}

#[pymethods]
impl Memory {
    /// The region id to use in ops and to send to peers.
    #[getter]
    pub(crate) fn region(&self) -> u64 {
        self.id.0
    }

    /// Length in bytes.
    #[getter]
    pub(crate) fn nbytes(&self) -> usize {
        self.region.len()
    }

    /// The address of the first byte.
    #[getter]
    fn ptr(&self) -> usize {
        self.region.as_ptr().addr()
    }

    fn __len__(&self) -> usize {
        self.region.len()
    }

    /// numpy's array interface: a writable uint8 vector over the memory.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.region.len(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.ptr(), false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "kvbridge.Memory(region={}, nbytes={})",
            self.id.0,
            self.region.len()
        )
    }
}

/// A connected peer of one engine.
#[pyclass(module = "kvbridge", frozen)]
pub(crate) struct Peer {
    core: Arc<EngineCore>,
    id: PeerId,
}

#[pymethods]
impl Peer {
    /// The peer's id on this engine.
    #[getter]
    fn id(&self) -> u64 {
        self.id.0
    }

    fn __repr__(&self) -> String {
        format!(
            "kvbridge.Peer(id={}, transport={:?})",
            self.id.0, self.core.kind
        )
    }
}

/// How a transfer ended, kept so `poll` and `wait` can answer after the transport forgot it.
#[derive(Debug, Clone)]
struct Final {
    state: &'static str,
    error: Option<(Kind, String)>,
}

impl Final {
    fn of(result: Result<(), TransportError>) -> Self {
        match result {
            Ok(()) => Final {
                state: "done",
                error: None,
            },
            Err(e) => Final {
                state: match e {
                    TransportError::TimedOut { .. } => "timed_out",
                    TransportError::Cancelled { .. } => "cancelled",
                    _ => "failed",
                },
                error: Some(errors::describe(&e)),
            },
        }
    }

    fn result(&self) -> PyResult<()> {
        match &self.error {
            None => Ok(()),
            Some((kind, message)) => Err(kind.err(message.clone())),
        }
    }
}

fn state_name(state: &BatchState) -> &'static str {
    match state {
        BatchState::Pending => "pending",
        BatchState::Done => "done",
        BatchState::Failed(_) => "failed",
        BatchState::Cancelled => "cancelled",
        BatchState::TimedOut => "timed_out",
        _ => "failed",
    }
}

/// One posted batch: `poll()`, `wait(timeout)`, `cancel()`. States are `"pending"`,
/// `"done"`, `"failed"`, `"cancelled"`, `"timed_out"`.
#[pyclass(module = "kvbridge", frozen)]
pub(crate) struct Transfer {
    core: Arc<EngineCore>,
    id: BatchId,
    bytes: u64,
    done: Arc<Mutex<Option<Final>>>,
    /// Serialises the transport's `wait` (it answers once; later callers read `done`).
    waiter: Arc<tokio::sync::Mutex<()>>,
    /// The batch's `kv_write` span, ended when its final state is collected.
    span: Arc<Mutex<Option<tracing::Span>>>,
}

impl Transfer {
    /// The transport's `wait`, at most once; every caller gets the final state.
    fn collect(&self) -> impl Future<Output = Final> + Send + 'static {
        let (transport, id) = (self.core.transport.clone(), self.id);
        let (done, waiter, span) = (self.done.clone(), self.waiter.clone(), self.span.clone());
        async move {
            let _turn = waiter.lock().await;
            if let Some(f) = lock(&done).clone() {
                return f;
            }
            let ended = transport.wait(id).await;
            if let Some(span) = lock(&span).take() {
                kvbridge_coordinator::set_batch_span_status(&span, ended.as_ref().map(|_| ()));
            }
            let f = Final::of(ended);
            *lock(&done) = Some(f.clone());
            f
        }
    }

    fn finished(&self) -> Option<Final> {
        lock(&self.done).clone()
    }
}

#[pymethods]
impl Transfer {
    /// The batch id on this engine.
    #[getter]
    fn id(&self) -> u64 {
        self.id.0
    }

    /// Bytes the batch moves.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.bytes
    }

    /// The state now, without waiting. A final state is also collected from the transport.
    fn poll(&self, py: Python<'_>) -> PyResult<&'static str> {
        if let Some(f) = self.finished() {
            return Ok(f.state);
        }
        match self.core.transport.batch_state(self.id) {
            Ok(BatchState::Pending) => Ok("pending"),
            Ok(state) => {
                let name = state_name(&state);
                Ok(wait_for(py, None, self.collect())?.map_or(name, |f| f.state))
            }
            // Another thread's `wait` collected it just now.
            Err(TransportError::UnknownBatch { .. }) => {
                Ok(self.finished().map_or("failed", |f| f.state))
            }
            Err(e) => Err(errors::transport(e)),
        }
    }

    /// Waits until the batch ends or `timeout` seconds pass (`None`: no limit). Returns True
    /// when every byte landed, False if still pending at the timeout; raises the typed error
    /// when it failed, was cancelled or timed out.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let limit = seconds("timeout", timeout)?;
        match wait_for(py, limit, self.collect())? {
            None => Ok(false),
            Some(f) => f.result().map(|()| true),
        }
    }

    /// Cancels the batch; returns its final state (a batch that had finished keeps its own).
    /// Once this returns, no byte of a cancelled batch lands later.
    fn cancel(&self, py: Python<'_>) -> PyResult<&'static str> {
        if let Some(f) = self.finished() {
            return Ok(f.state);
        }
        let (transport, id) = (self.core.transport.clone(), self.id);
        let cancelled = block_on(py, async move { transport.cancel(id).await })?;
        match cancelled {
            Ok(_) | Err(TransportError::UnknownBatch { .. }) => {}
            Err(e) => return Err(errors::transport(e)),
        }
        Ok(block_on(py, self.collect())?.state)
    }

    fn __repr__(&self) -> String {
        let state = self.finished().map_or("pending?", |f| f.state);
        format!(
            "kvbridge.Transfer(id={}, nbytes={}, state={state})",
            self.id.0, self.bytes
        )
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // Collect a batch nobody waited for, so the transport's table does not fill up.
        if self.finished().is_none()
            && let Ok(rt) = runtime()
        {
            rt.spawn(self.collect());
        }
    }
}

/// The transport names `Engine(transport=...)` accepts.
const TRANSPORTS: &str = "\"tcp\", \"shm\", \"loopback\" or \"nixl\"";

/// One rank's transfer engine. See `docs/python.md`.
#[pyclass(module = "kvbridge", frozen)]
pub(crate) struct Engine {
    core: Arc<EngineCore>,
}

impl Engine {
    pub(crate) fn core(&self) -> &Arc<EngineCore> {
        &self.core
    }
}

fn parse_u64(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    let v: i128 = obj.extract().map_err(|_| {
        invalid(format!(
            "{what} must be an int, got {}",
            obj.get_type()
                .name()
                .map_or_else(|_| "?".to_owned(), |n| n.to_string())
        ))
    })?;
    u64::try_from(v).map_err(|_| {
        invalid(format!(
            "{what} must be between 0 and 2**64-1, got {v}; lengths, offsets and addresses \
             cannot be negative"
        ))
    })
}

/// Reads an (N, 5) or (N, 8) uint64 numpy array of ops.
fn parse_ops(ops: &Bound<'_, PyAny>) -> PyResult<Vec<TransferOp>> {
    let py = ops.py();
    let shape_hint = "ops must be a numpy array of dtype uint64 and shape (N, 5) — (local_region, \
                      local_offset, remote_region, remote_offset, len) — or (N, 8) adding \
                      (count, local_stride, remote_stride)";
    let (Ok(dtype), Ok(shape)) = (ops.getattr("dtype"), ops.getattr("shape")) else {
        return Err(invalid(format!(
            "{shape_hint}; got a {}",
            ops.get_type()
                .name()
                .map_or_else(|_| "?".to_owned(), |n| n.to_string())
        )));
    };
    let uint64 = py.import("numpy")?.getattr("uint64")?;
    if !dtype.eq(uint64)? {
        return Err(invalid(format!(
            "{shape_hint}; got dtype {}. Build it with numpy.asarray(rows, dtype=numpy.uint64) \
             (offsets and lengths cannot be negative)",
            dtype.str()?
        )));
    }
    let shape: Vec<usize> = shape.extract()?;
    let cols = match shape.as_slice() {
        [_, c @ (5 | 8)] => *c,
        _ => return Err(invalid(format!("{shape_hint}; got shape {shape:?}"))),
    };
    let raw = ops.call_method0("tobytes")?;
    let raw = raw.cast::<PyBytes>()?.as_bytes();
    let words: Vec<u64> = raw
        .chunks_exact(8)
        .map(|b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8])))
        .collect();
    Ok(words
        .chunks_exact(cols)
        .map(|w| {
            let op = TransferOp::new(RegionId(w[0]), w[1], RegionId(w[2]), w[3], w[4]);
            if cols == 8 {
                op.with_rows(w[5], w[6], w[7])
            } else {
                op
            }
        })
        .collect())
}

/// An `advertise=` argument: the IP address peers on other hosts reach this one at.
pub(crate) fn advertise_ip(advertise: Option<&str>) -> PyResult<Option<std::net::IpAddr>> {
    advertise
        .map(|a| {
            a.parse::<std::net::IpAddr>()
                .ok()
                .filter(|ip| !ip.is_unspecified())
                .ok_or_else(|| {
                    invalid(format!(
                        "advertise must be this host's IP address on the network its peers \
                         reach (such as 10.0.0.5), got {a:?}"
                    ))
                })
        })
        .transpose()
}

/// The TCP transport's configuration from `Engine`'s keyword arguments.
fn tcp_config(
    bind: Option<&str>,
    advertise: Option<&str>,
    secret: Option<Vec<u8>>,
    keepalive_timeout: Option<f64>,
) -> PyResult<kvbridge_tcp::TcpConfig> {
    let mut config = kvbridge_tcp::TcpConfig::default();
    if let Some(addr) = bind {
        let addr = addr.parse().map_err(|e| {
            invalid(format!(
                "bind must be an ip:port such as 127.0.0.1:0, got {addr:?}: {e}"
            ))
        })?;
        config = config.with_bind_addr(addr);
    }
    if let Some(ip) = advertise_ip(advertise)? {
        config = config.with_advertise_addr(ip);
    }
    if let Some(s) = secret {
        config = config.with_secret(s);
    }
    if let Some(t) = seconds("keepalive_timeout", keepalive_timeout)? {
        // A peer pings every second: a timeout under two pings would drop
        // live peers.
        if t < Duration::from_secs(2) {
            return Err(invalid(format!(
                "keepalive_timeout must be at least 2 seconds (peers ping \
                 every second), got {t:?}; the default is 10"
            )));
        }
        config = config.with_keepalive_timeout(t);
    }
    Ok(config)
}

#[pymethods]
impl Engine {
    /// A transfer engine for one rank over `transport`: "tcp" (any hosts; `bind` is the
    /// listening `ip:port`, default 127.0.0.1:0; `advertise` the IP its descriptor names when
    /// `bind` is 0.0.0.0; `secret` enables HMAC authentication; `keepalive_timeout` the
    /// seconds a silent peer is kept before it is dropped, default 10),
    /// "shm" (processes on one host; `runtime_dir` holds its control socket), "loopback"
    /// (engines of this process, for tests) or "nixl" (a package built with the `nixl`
    /// feature; its runtime from `cargo xtask nixl-setup` or `KVBRIDGE_NIXL_LIB_DIR`).
    #[new]
    #[pyo3(signature = (transport="tcp", *, bind=None, secret=None, runtime_dir=None,
                        advertise=None, keepalive_timeout=None))]
    fn new(
        py: Python<'_>,
        transport: &str,
        bind: Option<&str>,
        secret: Option<Vec<u8>>,
        runtime_dir: Option<std::path::PathBuf>,
        advertise: Option<&str>,
        keepalive_timeout: Option<f64>,
    ) -> PyResult<Self> {
        // OTLP export, if the environment asks for it, before the first span (telemetry.rs).
        crate::telemetry::ensure(py);
        let only = |option: &str, name: &str| {
            invalid(format!(
                "{option} applies to transport=\"{name}\" only; drop it for transport=\"{transport}\""
            ))
        };
        if transport != "tcp"
            && (bind.is_some()
                || secret.is_some()
                || advertise.is_some()
                || keepalive_timeout.is_some())
        {
            return Err(only("bind/advertise/secret/keepalive_timeout", "tcp"));
        }
        if transport != "shm" && runtime_dir.is_some() {
            return Err(only("runtime_dir", "shm"));
        }
        let (kind, made): (&'static str, Result<Arc<dyn KvTransport>, TransportError>) =
            match transport {
                "tcp" => {
                    let config = tcp_config(bind, advertise, secret, keepalive_timeout)?;
                    let made = block_on(py, async move {
                        kvbridge_tcp::TcpTransport::bind(config)
                            .await
                            .map(|t| Arc::new(t) as Arc<dyn KvTransport>)
                    })?;
                    ("tcp", made)
                }
                "shm" => {
                    let mut options = kvbridge_shm::ShmOptions::default();
                    if let Some(dir) = runtime_dir {
                        options = options.with_runtime_dir(dir);
                    }
                    let _rt = runtime()?.enter();
                    let made = kvbridge_shm::ShmTransport::with_options(options)
                        .map(|t| Arc::new(t) as Arc<dyn KvTransport>);
                    ("shm", made)
                }
                "loopback" => {
                    let _rt = runtime()?.enter();
                    let t: Arc<dyn KvTransport> = Arc::new(kvbridge_mock::LoopbackTransport::new());
                    ("loopback", Ok(t))
                }
                #[cfg(feature = "nixl")]
                "nixl" => {
                    let _rt = runtime()?.enter();
                    let made = kvbridge_nixl::NixlTransport::new()
                        .map(|t| Arc::new(t) as Arc<dyn KvTransport>);
                    ("nixl", made)
                }
                #[cfg(not(feature = "nixl"))]
                "nixl" => {
                    return Err(Kind::Unsupported.err(
                        "this kvbridge was not built with NIXL, so transport=\"nixl\" is not \
                         available; run `cargo xtask nixl-setup` and build the package with the \
                         `nixl` feature (pip install ./crates/python \
                         --config-settings=build-args=\"--features nixl\"), or use \
                         transport=\"tcp\" (any hosts) or \"shm\" (one host)",
                    ));
                }
                other => {
                    return Err(invalid(format!(
                        "unknown transport {other:?}; use {TRANSPORTS}"
                    )));
                }
            };
        Ok(Engine {
            core: Arc::new(EngineCore {
                transport: made.map_err(errors::transport)?,
                kind,
                regions: Mutex::new(Vec::new()),
                tickets: AtomicU64::new(0),
                closed: AtomicBool::new(false),
            }),
        })
    }

    /// The transport's name ("tcp", "shm", "loopback", "nixl").
    #[getter]
    fn transport(&self) -> &'static str {
        self.core.kind
    }

    /// What the transport can do: reads, cross_process, device_memory, max_ops_per_batch.
    #[getter]
    fn capabilities<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.core.transport.capabilities();
        let d = PyDict::new(py);
        d.set_item("reads", c.reads)?;
        d.set_item("cross_process", c.cross_process)?;
        d.set_item("device_memory", c.device_memory)?;
        d.set_item("max_ops_per_batch", c.max_ops_per_batch)?;
        Ok(d)
    }

    /// Allocates and registers `nbytes` of zeroed host memory peers can write into (with
    /// "shm", memory peers write into must come from here). `numpy.asarray(memory)` is a
    /// uint8 view of it.
    fn allocate(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<Memory> {
        self.core.check_open()?;
        let n = parse_u64(nbytes, "nbytes")?;
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= isize::MAX as usize)
            .ok_or_else(|| invalid(format!("nbytes {n} does not fit in memory")))?;
        // shm's allocate makes shared memory and nixl's a page-aligned anonymous mapping (both
        // foreign, never borrowed, so safe to hand to numpy); the others would make owned
        // memory, which must not be, so the engine makes its own.
        let region = if matches!(self.core.kind, "shm" | "nixl") {
            self.core.transport.allocate(n).map_err(errors::transport)?
        } else {
            memory::alloc(n)?
        };
        let (id, region) = self.core.register_new(py, region)?;
        Ok(Memory { region, id })
    }

    /// Registers `length` bytes at address `ptr` that the caller owns: host memory (a numpy
    /// array's `ctypes.data`) or, with kind="cuda", memory of GPU `device` (a tensor's
    /// `data_ptr()`; refused by transports without device support). The memory must stay
    /// valid until `deregister` (or the engine is closed); `owner` is kept alive until then.
    #[pyo3(signature = (ptr, length, kind="host", device=0, owner=None))]
    fn register(
        &self,
        py: Python<'_>,
        ptr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        kind: &str,
        device: u32,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        self.core.check_open()?;
        let (ptr, len) = (parse_u64(ptr, "ptr")?, parse_u64(length, "length")?);
        let owner = owner.unwrap_or_else(|| py.None());
        let region_kind = match kind {
            "host" => MemoryKind::Host,
            "cuda" | "device" => MemoryKind::Device { id: device },
            other => {
                return Err(invalid(format!(
                    "kind must be \"host\" or \"cuda\", got {other:?}"
                )));
            }
        };
        let make = || match region_kind {
            MemoryKind::Host => memory::host(ptr, len, owner),
            _ => memory::device(device, ptr, len, owner),
        };
        Ok(self
            .core
            .register_with(py, region_kind, ptr, len, make)?
            .0
            .0)
    }

    /// Registers the memory of a writable, C-contiguous buffer (a numpy array, bytearray),
    /// which the engine keeps alive (and unresizable) until `deregister`.
    fn register_buffer(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.core.check_open()?;
        let (holder, addr, nbytes) = memory::pin(obj)?;
        let make = || {
            if nbytes == 0 {
                // An empty buffer may sit at any address; an empty region of its own is the same.
                memory::alloc(0)
            } else {
                memory::host(addr, nbytes, holder)
            }
        };
        Ok(self
            .core
            .register_with(py, MemoryKind::Host, addr, nbytes, make)?
            .0
            .0)
    }

    /// Registers the memory of `region` (a region of this engine) once more, under a new id,
    /// and returns that id: the same bytes (the same claims), reachable by peers under either
    /// id until each is deregistered. Deregistering an alias fences the peers that were given
    /// it (their writes to it are refused, before a byte moves) and leaves the other ids as
    /// they are; the bytes stay registered while any id of them does.
    fn alias(&self, py: Python<'_>, region: u64) -> PyResult<u64> {
        self.core.check_open()?;
        let of = RegionId(region);
        let found = lock(&self.core.regions)
            .iter()
            .find(|r| r.id == Some(of))
            .and_then(|r| r.memory.clone().map(|m| (m, r.kind, r.start, r.len)));
        let Some((memory, kind, start, len)) = found else {
            return Err(invalid(format!(
                "region {region} is not registered with this engine; alias a region this \
                 engine's register, register_buffer or allocate returned"
            )));
        };
        let (transport, m) = (self.core.transport.clone(), memory.clone());
        let id =
            block_on(py, async move { transport.register(m).await })?.map_err(errors::transport)?;
        let ticket = self.core.tickets.fetch_add(1, Ordering::Relaxed);
        lock(&self.core.regions).push(Registered {
            id: Some(id),
            memory: Some(memory),
            ticket,
            kind,
            start,
            len,
        });
        Ok(id.0)
    }

    /// Deregisters a region; once this returns, no peer writes into it.
    fn deregister(&self, py: Python<'_>, region: u64) -> PyResult<()> {
        self.core.check_open()?;
        let (transport, id) = (self.core.transport.clone(), RegionId(region));
        block_on(py, async move { transport.deregister(id).await })?.map_err(errors::transport)?;
        lock(&self.core.regions).retain(|r| r.id != Some(id));
        Ok(())
    }

    /// The bytes a peer passes to `connect` to reach this engine.
    fn local_descriptor<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.core.transport.local_descriptor())
    }

    /// Connects to the engine whose `local_descriptor()` this is.
    fn connect(&self, py: Python<'_>, descriptor: &[u8]) -> PyResult<Peer> {
        self.core.check_open()?;
        let (transport, d) = (self.core.transport.clone(), descriptor.to_vec());
        let id =
            block_on(py, async move { transport.connect(&d).await })?.map_err(errors::transport)?;
        Ok(Peer {
            core: self.core.clone(),
            id,
        })
    }

    /// Disconnects a peer; its pending transfers fail.
    fn disconnect(&self, py: Python<'_>, peer: &Peer) -> PyResult<()> {
        let id = self.own(peer)?;
        let transport = self.core.transport.clone();
        block_on(py, async move { transport.disconnect(id).await })?.map_err(errors::transport)
    }

    /// Checks the peer answers within `timeout` seconds; raises `PeerLostError` if not.
    #[pyo3(signature = (peer, timeout=5.0))]
    fn probe(&self, py: Python<'_>, peer: &Peer, timeout: f64) -> PyResult<()> {
        let id = self.own(peer)?;
        let t = seconds("timeout", Some(timeout))?.unwrap_or_default();
        let transport = self.core.transport.clone();
        block_on(py, async move { transport.probe(id, t).await })?.map_err(errors::transport)
    }

    /// Posts a write of `ops` to `peer` (see `parse_ops` for the layout); `notification` is
    /// delivered to the peer after every byte landed; `timeout` is the batch's deadline in
    /// seconds. Bad ops are refused here, before any byte moves. `traceparent` (W3C text)
    /// parents the write's `kv_write` span to the engine's request span, and `room` is
    /// recorded on it (docs/tracing.md).
    #[pyo3(signature = (peer, ops, notification=None, timeout=30.0, *, traceparent=None,
                        room=None))]
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        py: Python<'_>,
        peer: &Peer,
        ops: &Bound<'_, PyAny>,
        notification: Option<&[u8]>,
        timeout: f64,
        traceparent: Option<&str>,
        room: Option<u64>,
    ) -> PyResult<Transfer> {
        let batch = batch(Direction::Write, ops, notification, timeout)?;
        self.post(py, peer, batch, Trace::new(traceparent, room)?)
    }

    /// Posts a read of `ops` from `peer` (transports whose capabilities declare reads);
    /// `traceparent` and `room` as for `write`.
    #[pyo3(signature = (peer, ops, timeout=30.0, *, traceparent=None, room=None))]
    fn read(
        &self,
        py: Python<'_>,
        peer: &Peer,
        ops: &Bound<'_, PyAny>,
        timeout: f64,
        traceparent: Option<&str>,
        room: Option<u64>,
    ) -> PyResult<Transfer> {
        let batch = batch(Direction::Read, ops, None, timeout)?;
        self.post(py, peer, batch, Trace::new(traceparent, room)?)
    }

    /// Notifications received: a list of `(peer_id, payload)`, waiting up to `timeout` seconds
    /// for the first (0: only what has arrived; None: until one arrives).
    #[pyo3(signature = (timeout=0.0))]
    fn notifications<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.core.check_open()?;
        let limit = seconds("timeout", timeout)?;
        let transport = self.core.transport.clone();
        let first = {
            let t = transport.clone();
            wait_for(py, limit, async move { t.recv_notification().await })?
        };
        let mut got = Vec::new();
        if let Some(n) = first {
            got.push(n.map_err(errors::transport)?);
            // Drain what is ready without waiting (a zero timeout still polls once).
            let rest = block_on(py, async move {
                let mut rest = Vec::new();
                while rest.len() + 1 < MAX_NOTIFICATIONS {
                    match tokio::time::timeout(Duration::ZERO, transport.recv_notification()).await
                    {
                        Ok(Ok(n)) => rest.push(n),
                        _ => break,
                    }
                }
                rest
            })?;
            got.extend(rest);
        }
        let list = PyList::empty(py);
        for n in got {
            list.append(PyTuple::new(
                py,
                [
                    n.from.0.into_pyobject(py)?.into_any(),
                    PyBytes::new(py, &n.payload).into_any(),
                ],
            )?)?;
        }
        Ok(list)
    }

    /// Shuts the transport down (transfers in flight still end); later calls raise
    /// `ClosedError`. Closing twice is harmless.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if self.core.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let transport = self.core.transport.clone();
        block_on(py, async move { transport.shutdown().await })?.map_err(errors::transport)
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.core.closed.load(Ordering::Acquire)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "kvbridge.Engine(transport={:?}, closed={})",
            self.core.kind,
            self.closed()
        )
    }
}

impl Engine {
    fn own(&self, peer: &Peer) -> PyResult<PeerId> {
        if !Arc::ptr_eq(&self.core, &peer.core) {
            return Err(invalid(format!(
                "peer {} was connected by another engine; use the Peer this engine's connect() \
                 returned",
                peer.id.0
            )));
        }
        Ok(peer.id)
    }

    fn post(
        &self,
        py: Python<'_>,
        peer: &Peer,
        batch: TransferBatch,
        trace: Trace,
    ) -> PyResult<Transfer> {
        self.core.check_open()?;
        let peer = self.own(peer)?;
        let direction = batch.direction;
        let bytes = batch.total_bytes();
        let span = trace.span(&self.core, direction, peer, &batch);
        let transport = self.core.transport.clone();
        let posted = block_on(py, async move { transport.post(peer, batch).await })?;
        let id = match posted {
            Ok(id) => id,
            Err(e) => {
                kvbridge_coordinator::set_batch_span_status(&span, Err(&e));
                return Err(errors::transport(e));
            }
        };
        span.record("batch", id.0);
        Ok(Transfer {
            core: self.core.clone(),
            id,
            bytes,
            done: Arc::new(Mutex::new(None)),
            waiter: Arc::new(tokio::sync::Mutex::new(())),
            span: Arc::new(Mutex::new(Some(span))),
        })
    }
}

/// A batch from `write`'s or `read`'s arguments; bad ops are refused here.
fn batch(
    direction: Direction,
    ops: &Bound<'_, PyAny>,
    notification: Option<&[u8]>,
    timeout: f64,
) -> PyResult<TransferBatch> {
    let timeout = seconds("timeout", Some(timeout))?.unwrap_or_default();
    let mut batch = TransferBatch::new(direction, parse_ops(ops)?).with_timeout(timeout);
    if let Some(n) = notification.filter(|n| !n.is_empty()) {
        batch = batch.with_notification(Bytes::copy_from_slice(n));
    }
    Ok(batch)
}

/// What a posted batch's span says beyond the batch itself.
struct Trace {
    /// The engine's request span, the span's parent.
    parent: Option<kvbridge_coordinator::TraceParent>,
    /// The engine's room (request) the batch belongs to.
    room: Option<u64>,
}

impl Trace {
    /// From `write`'s or `read`'s `traceparent=` (refused if malformed) and `room=`.
    fn new(traceparent: Option<&str>, room: Option<u64>) -> PyResult<Self> {
        Ok(Trace {
            parent: crate::telemetry::traceparent(traceparent)?,
            room,
        })
    }

    /// The batch's `kv_write` (or `kv_read`) span, one per batch, never per op: disabled,
    /// costing nothing, when no OpenTelemetry layer is installed (docs/tracing.md).
    fn span(
        &self,
        core: &EngineCore,
        direction: Direction,
        peer: PeerId,
        batch: &TransferBatch,
    ) -> tracing::Span {
        macro_rules! batch_span {
            ($name:literal) => {
                tracing::info_span!(
                    target: "kvbridge::engine",
                    $name,
                    room = tracing::field::Empty,
                    peer = peer.0,
                    batch = tracing::field::Empty,
                    ops = batch.ops.len(),
                    rows = batch.row_count(),
                    bytes = batch.total_bytes(),
                    transport = core.transport.name(),
                    otel.status_code = tracing::field::Empty,
                    error.type = tracing::field::Empty,
                )
            };
        }
        let span = match direction {
            Direction::Write => batch_span!("kv_write"),
            _ => batch_span!("kv_read"),
        };
        if let Some(room) = self.room {
            span.record("room", room);
        }
        if let Some(parent) = &self.parent {
            kvbridge_coordinator::set_span_parent(&span, parent);
        }
        span
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_class::<Peer>()?;
    m.add_class::<Transfer>()?;
    m.add_class::<Memory>()?;
    Ok(())
}
