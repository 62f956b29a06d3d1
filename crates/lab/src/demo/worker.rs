//! The demo's child processes: the prefill (every prefill rank and the bootstrap server) and
//! one decode rank. Each reports [`Event`]s on stdout and exits when its requests are done,
//! when a request failed (after cleaning up), or when the parent goes away (stdin closes) or a
//! signal (SIGTERM, SIGINT, SIGHUP) asks it to stop: then it aborts what is in flight and shuts
//! down like after a failure, within [`GRACE`], so its destructors remove what it created.

use std::collections::BTreeSet;
use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvbridge_coordinator::bootstrap::{
    BootstrapClient, BootstrapConfig, BootstrapServer, ClientConfig, HttpDirectory,
    RankRegistration,
};
use kvbridge_coordinator::net_channel::{NetChannel, NetChannelConfig};
use kvbridge_coordinator::{
    AllocatedMemory, Chunk, CoordinatorError, DecodeAgent, DecodeConfig, FailureCause, KvMemory,
    MetricsSnapshot, PackBuffers, PrefillAgent, PrefillConfig, ReceiveRequest, prometheus,
};
use kvbridge_handshake::PeerDescriptor;
use kvbridge_lab::telemetry::chrome::ChromeOptions;
use kvbridge_lab::telemetry::{Telemetry, TelemetryOptions};
use kvbridge_lab::views::{aux_views, kv_views};
use kvbridge_shm::ShmTransport;
use kvbridge_tcp::{TcpConfig, TcpTransport};
use kvbridge_testkit::fill::{TokenLayout, fill_aux, fill_rows, verify_aux, verify_rows};
use kvbridge_transport::KvTransport;
use kvbridge_transport::sync::lock;
use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tokio::task::JoinSet;

use super::{AUX_ITEM_LENS, DemoArgs, Event, GRACE, Setup, Summary, Transport, room_of};
use kvbridge_lab::process::remove_control_dir;

/// Writes one event line to stdout (the parent reads it).
fn emit(ev: &Event) {
    let line = serde_json::to_string(ev).unwrap_or_default();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Writes each log line to stderr prefixed with the process (`[decode 2] `), so the lines of
/// the processes sharing the terminal can be told apart.
struct Labelled(&'static str);

impl Write for Labelled {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut err = std::io::stderr().lock();
        err.write_all(self.0.as_bytes())?;
        err.write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Logs: `RUST_LOG` when set; otherwise errors only, or with `--verbose` warnings and
/// kvbridge's debug messages. Spans: exported over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is
/// set, written to this process's part of `--trace FILE` when given (pid 0 the prefill, 1 +
/// rank a decode rank).
fn init_tracing(label: String, verbose: bool, trace: Option<&Path>, pid: u32) -> Telemetry {
    let default = if verbose {
        // Targets match by prefix: every kvbridge crate.
        "warn,kvbridge=debug"
    } else {
        "error"
    };
    let chrome = trace.map(|file| ChromeOptions {
        path: super::trace_part(file, &label),
        pid,
        process: label.clone(),
    });
    let options = TelemetryOptions {
        process: label.clone(),
        default_log: default.to_owned(),
        chrome,
        otlp_endpoint: None,
        otlp_protocol: None,
    };
    let label: &'static str = Box::leak(format!("[{label}] ").into_boxed_str());
    kvbridge_lab::telemetry::init(options, move || Labelled(label))
}

/// What the parent tells a child on its stdin, and whether the child must stop.
#[derive(Debug)]
struct Commands {
    /// `start`: every decode process is up.
    start: Notify,
    /// `finish`: every decode process is done; the prefill may shut its transports down.
    finish: Notify,
    /// Set (with the reason) once this process must stop: the parent went away or a signal
    /// asked it to.
    stop: watch::Sender<Option<&'static str>>,
    /// `--serve`: the requests named by `run I` lines; dropped at `finish` or end of file.
    runs: Mutex<Option<mpsc::UnboundedSender<u32>>>,
}

impl Commands {
    /// Asks the process to stop (the first reason wins).
    fn stop(&self, why: &'static str) {
        // No further request is named (`--serve`).
        lock(&self.runs).take();
        self.stop
            .send_if_modified(|s| s.is_none() && s.replace(why).is_none());
    }

    /// Resolves once the process must stop, with the reason.
    async fn stopped(&self) -> &'static str {
        let mut rx = self.stop.subscribe();
        let why = rx.wait_for(Option::is_some).await.ok().and_then(|why| *why);
        match why {
            Some(why) => why,
            // The sender lives as long as `self`.
            None => std::future::pending().await,
        }
    }
}

/// Follows the parent through our stdin (see [`Commands`]); end of file (the parent exited or
/// was killed) stops this process, so no child outlives the demo.
fn watch_parent(runs: mpsc::UnboundedSender<u32>) -> Arc<Commands> {
    let commands = Arc::new(Commands {
        start: Notify::new(),
        finish: Notify::new(),
        stop: watch::Sender::new(None),
        runs: Mutex::new(Some(runs)),
    });
    let c = commands.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        loop {
            line.clear();
            match std::io::BufRead::read_line(&mut std::io::stdin().lock(), &mut line) {
                Ok(0) | Err(_) => {
                    lock(&c.runs).take();
                    c.stop("stdin closed (the parent stopped the run, or died)");
                    return;
                }
                Ok(_) => match line.trim() {
                    "start" => c.start.notify_one(),
                    "finish" => {
                        lock(&c.runs).take();
                        c.finish.notify_one();
                    }
                    other => {
                        let run = other.strip_prefix("run ").and_then(|i| i.parse().ok());
                        if let (Some(i), Some(tx)) = (run, lock(&c.runs).as_ref()) {
                            let _ = tx.send(i);
                        }
                    }
                },
            }
        }
    });
    commands
}

/// The shared-memory control directories this process created.
type Dirs = Arc<Mutex<Vec<PathBuf>>>;

/// The requests a process runs: `0..--requests`, or with `--serve` those named on stdin.
type Runs = mpsc::UnboundedReceiver<u32>;

/// Runs a child process's `main` until it returns or, once the process must stop, for at most
/// [`GRACE`] more; then drops whatever still runs (tasks, agents, transports) and removes any
/// control directory still there. Every exit path goes through here, so destructors run.
fn run_child<F, Fut>(args: &DemoArgs, role: &'static str, rank: u32, main: F) -> ExitCode
where
    F: FnOnce(Arc<Commands>, Dirs, Runs) -> Fut,
    Fut: Future<Output = Result<ExitCode, String>>,
{
    let label = match role {
        "decode" => format!("decode {rank}"),
        _ => role.to_owned(),
    };
    let pid = if role == "decode" { rank + 1 } else { 0 };
    // Dropped last, after the runtime and its agents: every span has ended by then.
    let _telemetry = init_tracing(label, args.verbose, args.trace.as_deref(), pid);
    let (tx, runs) = mpsc::unbounded_channel();
    let commands = if args.serve {
        watch_parent(tx)
    } else {
        // Every request at once; the channel closes behind the last.
        for i in 0..args.requests {
            let _ = tx.send(i);
        }
        drop(tx);
        watch_parent(mpsc::unbounded_channel().0)
    };
    let dirs = Dirs::default();
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => return report_error(role, rank, e),
    };
    let result = rt.block_on(async {
        // A signal (a Ctrl-C reaches every process of the demo) stops it like a dead parent.
        let c = commands.clone();
        tokio::spawn(async move { c.stop(kvbridge_lab::process::terminating_signal().await) });
        let main = main(commands.clone(), dirs.clone(), runs);
        tokio::pin!(main);
        tokio::select! {
            r = &mut main => r,
            why = commands.stopped() => match tokio::time::timeout(GRACE, &mut main).await {
                Ok(r) => r,
                Err(_) => Err(format!("{why}, and the process did not stop within {GRACE:?}")),
            },
        }
    });
    // Dropping the runtime drops every task, and with them the agents and transports; a fill
    // or verification still running on a blocking thread gets a bounded wait.
    rt.shutdown_timeout(Duration::from_secs(2));
    for dir in lock(&dirs).iter() {
        remove_control_dir(dir);
    }
    match result {
        Ok(code) => code,
        Err(e) => report_error(role, rank, e),
    }
}

/// Once the process must stop: no further request starts and every room in flight is aborted,
/// so the requests end and the process shuts down the way it does after a failure.
fn stop_when_told(
    commands: &Arc<Commands>,
    stop: &Arc<AtomicBool>,
    in_flight: &InFlight,
    abort: impl Fn(u64) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    let (commands, stop, in_flight) = (commands.clone(), stop.clone(), in_flight.clone());
    tokio::spawn(async move {
        let why = commands.stopped().await;
        if stop_all(&stop, &in_flight, abort) {
            tracing::warn!("{why}: aborted the rooms in flight, shutting down");
        }
    })
}

/// Sets `stop`, so no further request starts; the first caller also aborts every room in
/// flight (and returns true).
fn stop_all(stop: &AtomicBool, in_flight: &InFlight, abort: impl Fn(u64)) -> bool {
    if stop.swap(true, Ordering::SeqCst) {
        return false;
    }
    let rooms: Vec<u64> = lock(in_flight).iter().copied().collect();
    for room in rooms {
        abort(room);
    }
    true
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
}

/// A transport, and the private directory it removes at exit (shared memory only; recorded
/// in `dirs` and reported to the parent at once, so it is removed even if this process dies).
async fn transport(
    setup: &Setup,
    dirs: &Dirs,
) -> Result<(Arc<dyn KvTransport>, Option<String>), String> {
    match setup.transport {
        Transport::Shm => {
            let t = ShmTransport::new().map_err(|e| format!("shared-memory transport: {e}"))?;
            lock(dirs).push(t.control_dir().to_path_buf());
            let dir = t.control_dir().display().to_string();
            emit(&Event::ControlDir { path: dir.clone() });
            Ok((Arc::new(t), Some(dir)))
        }
        Transport::Tcp => {
            let keep =
                (setup.timeout / 2).clamp(Duration::from_millis(200), Duration::from_secs(10));
            let mut cfg = TcpConfig::default()
                .with_bind_addr(SocketAddr::new(setup.bind_addr, 0))
                .with_advertise_addr(setup.advertise_addr)
                .with_keepalive_interval((keep / 5).max(Duration::from_millis(40)))
                .with_keepalive_timeout(keep);
            if let Some(s) = &setup.secret {
                cfg = cfg.with_secret(s.as_bytes().to_vec());
            }
            let t = TcpTransport::bind(cfg)
                .await
                .map_err(|e| format!("TCP transport: {e}"))?;
            Ok((Arc::new(t), None))
        }
        Transport::Nixl => Ok((crate::nixl_transport()?, None)),
    }
}

/// The bootstrap client settings of this run (its secret).
fn client_config(setup: &Setup) -> ClientConfig {
    let c = ClientConfig::default();
    match &setup.secret {
        Some(s) => c.with_secret(s.as_bytes()),
        None => c,
    }
}

/// Prometheus text for the prefill agents of this process, one `rank` label each.
fn prefill_metrics(agents: &[PrefillAgent]) -> String {
    let snapshots: Vec<(String, MetricsSnapshot)> = agents
        .iter()
        .enumerate()
        .map(|(i, a)| (i.to_string(), a.metrics()))
        .collect();
    prometheus::render(
        snapshots
            .iter()
            .map(|(rank, m)| ([("role", "prefill"), ("rank", rank.as_str())], m)),
    )
}

fn net_config(setup: &Setup) -> NetChannelConfig {
    let mut c = NetChannelConfig::default()
        .with_queue(4096)
        .with_bind_addr(SocketAddr::new(setup.bind_addr, 0))
        .with_advertise_addr(setup.advertise_addr);
    if let Some(s) = &setup.secret {
        c = c.with_secret(s.as_bytes().to_vec());
    }
    c
}

fn heartbeat(setup: &Setup) -> Duration {
    (setup.timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(5))
}

fn prefill_config(setup: &Setup, d: &PeerDescriptor) -> PrefillConfig {
    let t = setup.timeout;
    let config = PrefillConfig::default()
        .with_bootstrap_timeout(t)
        .with_waiting_timeout(t)
        .with_batch_timeout(t)
        .with_fence_grace((t / 4).min(Duration::from_secs(5)))
        .with_control_send_timeout((t / 4).min(Duration::from_secs(30)));
    match setup.pack {
        None => config,
        Some((count, _)) => {
            // The longest chunk `prefill_request` sends: whole virtual pages, at least one.
            let v = d.page_size * u64::from(d.dcp_size.max(1));
            let chunk = (setup.chunk_tokens / v).max(1) * v;
            let dcp = setup.decode.first().map_or(1, |d| d.dcp_size.max(1));
            config.with_pack_buffers(PackBuffers::new(count, chunk, u64::from(dcp)))
        }
    }
}

fn decode_config(setup: &Setup) -> DecodeConfig {
    let t = setup.timeout;
    DecodeConfig::default()
        .with_bootstrap_timeout(t)
        .with_waiting_timeout(t)
        .with_heartbeat_interval(heartbeat(setup))
        .with_heartbeat_max_failures(2)
        .with_control_send_timeout((t / 4).min(Duration::from_secs(1)))
        // Only bounds when pages of a failed room may be reused; within the run's grace.
        .with_fence_timeout(t.min(GRACE / 2))
        .with_abort_resend_interval(heartbeat(setup))
}

/// The page table of a request in pool slot `slot`: the slot's `n` pages, in order on the
/// prefill (as an engine's allocator hands out a fresh request's pages; the planner then folds
/// a page-layer's rows across pages into one strided op) and in reverse order on the decode, so
/// a row that lands on the wrong page does not verify.
fn slot_table(slot: u32, n: u64, order: PageOrder) -> Vec<u64> {
    let base = u64::from(slot) * n;
    match order {
        PageOrder::Ascending => (0..n).map(|i| base + i).collect(),
        PageOrder::Reversed => (0..n).map(|i| base + n - 1 - i).collect(),
    }
}

/// How [`slot_table`] orders a slot's pages.
#[derive(Debug, Clone, Copy)]
enum PageOrder {
    Ascending,
    Reversed,
}

/// A bounded pool of slots: at most `concurrency` requests hold one at a time.
#[derive(Debug)]
struct Slots {
    sem: Arc<Semaphore>,
    free: Mutex<Vec<u32>>,
}

impl Slots {
    fn new(n: u32) -> Arc<Self> {
        Arc::new(Self {
            sem: Arc::new(Semaphore::new(n as usize)),
            free: Mutex::new((0..n).rev().collect()),
        })
    }

    async fn take(self: &Arc<Self>) -> SlotGuard {
        let permit = self.sem.clone().acquire_owned().await.ok();
        let slot = lock(&self.free).pop().unwrap_or(0);
        SlotGuard {
            slots: self.clone(),
            slot,
            _permit: permit,
        }
    }
}

struct SlotGuard {
    slots: Arc<Slots>,
    slot: u32,
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        lock(&self.slots.free).push(self.slot);
    }
}

/// Rooms in flight on this process (aborted when a request fails).
type InFlight = Arc<Mutex<BTreeSet<u64>>>;

/// Positions `[from, to)` that a rank of DCP size `d` and rank `r` holds.
fn owned(from: u64, to: u64, d: u64, r: u64) -> u64 {
    // Count of p < n with p % d == r.
    let count = |n: u64| n / d + u64::from(n % d > r);
    count(to).saturating_sub(count(from))
}

/// Bytes a decode rank holds for positions `[from, to)`.
pub(crate) fn decode_bytes(d: &PeerDescriptor, from: u64, to: u64) -> u64 {
    let rows = owned(from, to, u64::from(d.dcp_size), u64::from(d.dcp_rank));
    rows * d.kv_item_lens.iter().map(|l| l / d.page_size).sum::<u64>()
}

/// Runs the requests `runs` yields, at most `concurrency` at once, each in its own task holding a
/// pool slot (`start(request, slot)`), and reports each outcome to `on_done` as it ends. Once
/// `stop` is set no further request starts; the ones in flight are awaited. Returns how many
/// requests never started.
async fn drive<T, Fut>(
    mut runs: Runs,
    concurrency: u32,
    stop: &AtomicBool,
    mut start: impl FnMut(u32, u32) -> Fut,
    mut on_done: impl FnMut(u32, Result<T, Failure>),
) -> u32
where
    T: Send + 'static,
    Fut: Future<Output = Result<T, Failure>> + Send + 'static,
{
    let slots = Slots::new(concurrency);
    let mut tasks: JoinSet<(u32, Result<T, Failure>)> = JoinSet::new();
    let mut done = |res: Result<(u32, Result<T, Failure>), tokio::task::JoinError>| match res {
        Ok((i, r)) => on_done(i, r),
        Err(e) => on_done(
            u32::MAX,
            Err(format!("a request task panicked: {e}").into()),
        ),
    };
    let mut skipped = 0;
    loop {
        let next = loop {
            tokio::select! {
                i = runs.recv() => break i,
                Some(res) = tasks.join_next() => done(res),
            }
        };
        let Some(i) = next else { break };
        while let Some(res) = tasks.try_join_next() {
            done(res);
        }
        let guard = loop {
            if stop.load(Ordering::SeqCst) {
                break None;
            }
            tokio::select! {
                g = slots.take() => break Some(g),
                Some(res) = tasks.join_next() => done(res),
            }
        };
        let Some(guard) = guard.filter(|_| !stop.load(Ordering::SeqCst)) else {
            runs.close();
            skipped = 1;
            while runs.try_recv().is_ok() {
                skipped += 1;
            }
            break;
        };
        let request = start(i, guard.slot);
        tasks.spawn(async move {
            let r = request.await;
            drop(guard);
            (i, r)
        });
    }
    while let Some(res) = tasks.join_next().await {
        done(res);
    }
    skipped
}

/// Why a request failed, and whether that is only a consequence of another failure (the room
/// was aborted, by this side or the peer, after something else went wrong).
#[derive(Debug)]
struct Failure {
    text: String,
    secondary: bool,
}

impl From<String> for Failure {
    fn from(text: String) -> Self {
        Self {
            text,
            secondary: false,
        }
    }
}

impl From<CoordinatorError> for Failure {
    fn from(e: CoordinatorError) -> Self {
        let secondary = match &e {
            CoordinatorError::Transfer(t) => {
                t.is_from_another_rank
                    || matches!(
                        t.reason.cause,
                        FailureCause::Aborted
                            | FailureCause::RemoteFailure
                            | FailureCause::DuplicateRoom
                            | FailureCause::OtherRank
                            | FailureCause::Shutdown
                    )
            }
            _ => false,
        };
        Self {
            text: e.to_string(),
            secondary,
        }
    }
}

impl Summary {
    /// Adds a prefill agent's transfer counters.
    fn add_metrics(&mut self, m: &kvbridge_coordinator::MetricsSnapshot) {
        self.bytes += m.bytes_transferred;
        self.descriptors += m.descriptors_posted;
        self.rows += m.rows_posted;
        self.pack_batches += m.pack_batches;
        self.pack_bytes += m.pack_bytes;
    }

    /// Records why the process stopped early (parent gone, signal), unless a root cause is
    /// already known.
    fn stopped(&mut self, commands: &Commands) {
        let why = *commands.stop.borrow();
        if let Some(why) = why.filter(|_| self.first_failure.is_none() || self.first_is_secondary) {
            self.first_failure = Some(format!("{why}; the process stopped"));
            self.first_is_secondary = false;
        }
    }

    /// Records a failed request (the first root cause stays in `first_failure`); the first
    /// failure sets `stop` and aborts every room in flight, unless `keep_going` (`--serve`:
    /// each request stands alone, as in a server).
    fn fail(
        &mut self,
        request: u32,
        why: Failure,
        keep_going: bool,
        (stop, in_flight): (&AtomicBool, &InFlight),
        abort: impl Fn(u64),
    ) {
        self.failed += 1;
        if self.first_failure.is_none() || (self.first_is_secondary && !why.secondary) {
            self.first_failure = Some(why.text.clone());
            self.first_is_secondary = why.secondary;
        }
        emit(&Event::Failed {
            request,
            reason: why.text,
            secondary: why.secondary,
        });
        if !keep_going {
            stop_all(stop, in_flight, abort);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill process.

struct PRank {
    agent: PrefillAgent,
    desc: PeerDescriptor,
    mem: AllocatedMemory,
    transport: Arc<dyn KvTransport>,
}

pub(crate) fn run_prefill(args: &DemoArgs, setup: Setup) -> ExitCode {
    run_child(args, "prefill", 0, |commands, dirs, runs| {
        prefill_main(args, setup, commands, dirs, runs)
    })
}

/// Reports a process that could not run its requests (start-up failed, or it was stopped).
fn report_error(role: &str, rank: u32, e: String) -> ExitCode {
    // Not eprintln!: with the terminal gone it would panic instead of exiting.
    let _ = writeln!(std::io::stderr(), "kvbridge-lab demo ({role} {rank}): {e}");
    emit(&Event::Done(Summary {
        role: role.to_owned(),
        rank,
        first_failure: Some(e),
        ..Summary::default()
    }));
    ExitCode::from(1)
}

/// One prefill agent per prefill rank of the setup, each registered with the bootstrap
/// server; with the control directories their transports made.
async fn start_prefill_ranks(
    setup: &Setup,
    created: &Dirs,
    client: &BootstrapClient,
) -> Result<(Vec<PRank>, Vec<String>), String> {
    let conc = u64::from(setup.concurrency);
    let mut ranks = Vec::new();
    let mut dirs = Vec::new();
    for d in &setup.prefill {
        let (t, dir) = transport(setup, created).await?;
        dirs.extend(dir);
        let mem = KvMemory::allocate(&*t, d, setup.prefill_pages * conc, conc)
            .await
            .map_err(|e| format!("allocating the prefill pool: {e}"))?;
        let channel = NetChannel::bind(net_config(setup))
            .await
            .map_err(|e| e.to_string())?;
        let agent =
            PrefillAgent::builder(d.clone(), mem.memory.clone(), t.clone(), Arc::new(channel))
                .config(prefill_config(setup, d))
                .kv_regions(mem.kv_regions.clone())
                .start()
                .map_err(|e| e.to_string())?;
        client
            .register(&RankRegistration::from(agent.rank_info()))
            .await
            .map_err(|e| e.to_string())?;
        ranks.push(PRank {
            agent,
            desc: d.clone(),
            mem,
            transport: t,
        });
    }
    Ok((ranks, dirs))
}

/// Waits until the parent says `finish`, this process is told to stop, or `wait` passed.
async fn wait_for_finish(commands: &Commands, wait: Duration) {
    tokio::select! {
        _ = commands.finish.notified() => {}
        _ = commands.stopped() => {}
        _ = tokio::time::sleep(wait) => {}
    }
}

/// Stops every rank's agent and transport.
async fn shutdown_prefill_ranks(ranks: &[PRank]) {
    for r in ranks {
        r.agent.shutdown();
        let _ = r.transport.shutdown().await;
    }
}

/// The prefill's bootstrap server with the run's secret; its `GET /metrics` serves this
/// process's prefill agents once they are set in the returned cell.
async fn start_bootstrap(
    args: &DemoArgs,
    setup: &Setup,
) -> Result<(BootstrapServer, Arc<OnceLock<Vec<PrefillAgent>>>), String> {
    let mut config = BootstrapConfig::default()
        .with_bind_addr(SocketAddr::new(setup.bind_addr, args.bootstrap_port))
        .with_advertise_addr(setup.advertise_addr);
    if let Some(s) = &setup.secret {
        config = config.with_secret(s.as_bytes());
    }
    let scraped: Arc<OnceLock<Vec<PrefillAgent>>> = Arc::default();
    let agents = scraped.clone();
    let boot = BootstrapServer::builder(config)
        .metrics(move || prefill_metrics(agents.get().map_or(&[], Vec::as_slice)))
        .bind()
        .await
        .map_err(|e| e.to_string())?;
    Ok((boot, scraped))
}

async fn prefill_main(
    args: &DemoArgs,
    setup: Setup,
    commands: Arc<Commands>,
    created: Dirs,
    runs: Runs,
) -> Result<ExitCode, String> {
    let (boot, scraped) = start_bootstrap(args, &setup).await?;
    let client = BootstrapClient::with_config(boot.bootstrap_addr(), client_config(&setup));
    let (ranks, dirs) = start_prefill_ranks(&setup, &created, &client).await?;
    let _ = scraped.set(ranks.iter().map(|r| r.agent.clone()).collect());
    emit(&Event::Ready {
        pid: std::process::id(),
        bootstrap: Some(boot.bootstrap_addr()),
    });
    // The parent says `start` once every decode process is up, so request latencies do not
    // include the decodes' start-up (`--serve`: the requests named are the signal).
    tokio::select! {
        _ = commands.start.notified(), if !setup.serve => {}
        _ = std::future::ready(()), if setup.serve => {}
        why = commands.stopped() => {
            shutdown_prefill_ranks(&ranks).await;
            boot.shutdown();
            return Err(format!("{why} before the requests started"));
        }
    }

    let ranks = Arc::new(ranks);
    let setup = Arc::new(setup);
    let in_flight: InFlight = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let stopper = {
        let ranks = ranks.clone();
        stop_when_told(&commands, &stop, &in_flight, move |room| {
            for r in ranks.iter() {
                r.agent.abort(room);
            }
        })
    };
    let mut summary = Summary {
        role: "prefill".to_owned(),
        ..Summary::default()
    };
    summary.skipped = drive(
        runs,
        setup.concurrency,
        &stop,
        |i, slot| {
            let (ranks, setup, in_flight, stop) = (
                ranks.clone(),
                setup.clone(),
                in_flight.clone(),
                stop.clone(),
            );
            async move { prefill_request(&ranks, &setup, i, slot, &in_flight, &stop).await }
        },
        |i, r| match r {
            Ok(sent) => {
                summary.succeeded += 1;
                emit(&sent.event(i));
            }
            // Stop everything in flight: the decode ranks are told at once.
            Err(reason) => summary.fail(i, reason, setup.serve, (&stop, &in_flight), |room| {
                for r in ranks.iter() {
                    r.agent.abort(room);
                }
            }),
        },
    )
    .await;

    summary.stopped(&commands);
    for r in ranks.iter() {
        summary.add_metrics(&r.agent.metrics());
    }
    summary.rooms_left = settle(|| ranks.iter().map(|r| r.agent.room_count()).sum()).await;
    summary.control_dirs = dirs;
    // The decode ranks shut their transports down first (they fence this side's writes).
    // After a failure their rooms end by their deadlines, so do not wait for a hung one.
    let ok = summary.failed == 0 && summary.skipped == 0;
    let wait = if ok { setup.timeout + GRACE } else { GRACE / 2 };
    wait_for_finish(&commands, wait).await;
    stopper.abort();
    shutdown_prefill_ranks(&ranks).await;
    boot.shutdown();
    emit(&Event::Done(summary));
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Waits (bounded) for rooms still being fenced to go away; returns how many are left.
async fn settle(count: impl Fn() -> usize) -> usize {
    for _ in 0..200 {
        if count() == 0 {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    count()
}

/// One request the prefill sent: room created to Success on every rank (`latency`), every
/// rank's decode metadata in to that Success (`transfer`), and the bytes moved.
struct Sent {
    latency: Duration,
    transfer: Duration,
    bytes: u64,
}

impl Sent {
    /// The parent's event for request `i`.
    fn event(&self, i: u32) -> Event {
        Event::Sent {
            request: i,
            latency_us: self.latency.as_micros() as u64,
            transfer_us: self.transfer.as_micros() as u64,
            bytes: self.bytes,
        }
    }
}

async fn prefill_request(
    ranks: &Arc<Vec<PRank>>,
    setup: &Arc<Setup>,
    i: u32,
    slot: u32,
    in_flight: &InFlight,
    stop: &Arc<AtomicBool>,
) -> Result<Sent, Failure> {
    let room = room_of(i);
    // "Compute" the prompt's KV: every rank fills the rows it holds (CPU work, off the
    // async workers).
    let layouts = {
        let (ranks, setup) = (ranks.clone(), setup.clone());
        tokio::task::spawn_blocking(move || -> Result<Vec<TokenLayout>, String> {
            let mut out = Vec::new();
            for r in ranks.iter() {
                let table = slot_table(slot, setup.prefill_pages, PageOrder::Ascending);
                let layout = TokenLayout::for_rank(&r.desc, table)?;
                fill_rows(&kv_views(&r.mem), &layout, room, 0..setup.tokens)?;
                fill_aux(&aux_views(&r.mem), &AUX_ITEM_LENS, u64::from(slot), room)?;
                out.push(layout);
            }
            Ok(out)
        })
        .await
        .map_err(|e| format!("filling request {i}: {e}"))??
    };
    if stop.load(Ordering::SeqCst) {
        return Err(Failure {
            text: "stopped before the room was created (an earlier request failed)".to_owned(),
            secondary: true,
        });
    }
    let started = Instant::now();
    for r in ranks.iter() {
        r.agent.create_room(room)?;
    }
    lock(in_flight).insert(room);
    let mut per_rank = JoinSet::new();
    for (k, layout) in layouts.into_iter().enumerate() {
        let (ranks, setup) = (ranks.clone(), setup.clone());
        per_rank.spawn(async move {
            let r = &ranks[k];
            let res = send_room(r, &setup, i, k, room, slot, &layout).await;
            if res.is_err() {
                // The other ranks must not wait for this one.
                for other in ranks.iter() {
                    other.agent.abort(room);
                }
            }
            res
        });
    }
    let mut first_err = None;
    // When the last rank had its decode ranks' metadata (SGLang's `send` comes then).
    let mut ready = started;
    while let Some(res) = per_rank.join_next().await {
        let res = res.unwrap_or_else(|e| Err(format!("rank task panicked: {e}").into()));
        match res {
            Ok(at) => ready = ready.max(at),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    let latency = started.elapsed();
    let transfer = ready.elapsed();
    let prefix = ranks[0].agent.decode_prefix_len(room).unwrap_or(0);
    for r in ranks.iter() {
        r.agent.clear(room);
    }
    lock(in_flight).remove(&room);
    match first_err {
        Some(e) => Err(e),
        None => {
            // What the transport moved for this request: every decode rank's rows from the
            // advertised prefix on.
            let bytes = setup
                .decode
                .iter()
                .map(|d| decode_bytes(d, prefix, setup.tokens))
                .sum();
            Ok(Sent {
                latency,
                transfer,
                bytes,
            })
        }
    }
}

/// Sends one rank's share of the room; when its decode ranks' metadata was in.
async fn send_room(
    r: &PRank,
    setup: &Setup,
    i: u32,
    k: usize,
    room: u64,
    slot: u32,
    layout: &TokenLayout,
) -> Result<Instant, Failure> {
    let agent = &r.agent;
    let prefix = agent.wait_ready(room).await?;
    let ready = Instant::now();
    // Chunks of whole pages of this rank's pool (virtual pages under prefill DCP), from the
    // decode's prefix on (the first chunk may start mid-page).
    let v = layout.virtual_page();
    let max_pages = (setup.chunk_tokens / v).max(1);
    let plan = kvbridge_geometry::chunk_plan(prefix, setup.tokens, v, max_pages);
    let n = plan.len();
    for (c, (pages, tokens)) in plan.into_iter().enumerate() {
        let ids = pages
            .map(|j| {
                layout.page_table.get(j as usize).copied().ok_or_else(|| {
                    format!(
                        "chunk {c} names page {j} of a page table of {}",
                        layout.page_table.len()
                    )
                })
            })
            .collect::<Result<Vec<u64>, String>>()?;
        let last = c + 1 == n;
        let chunk = if last {
            Chunk::last(ids, tokens, Some(u64::from(slot)))
        } else {
            Chunk::new(ids, tokens)
        };
        agent.send_chunk(room, chunk).await?;
        if k == 0 {
            emit(&Event::Chunk {
                request: i,
                index: c as u32,
            });
        }
        if !last && !setup.chunk_delay.is_zero() {
            tokio::time::sleep(setup.chunk_delay).await;
        }
    }
    agent.wait(room).await?;
    Ok(ready)
}

// ---------------------------------------------------------------------------------------------
// Decode process.

pub(crate) fn run_decode(args: &DemoArgs, setup: Setup) -> ExitCode {
    run_child(args, "decode", args.rank, |commands, dirs, runs| {
        decode_main(args, setup, commands, dirs, runs)
    })
}

/// The decode agent of one decode rank, with its pool, transport and the control directory
/// the transport made.
async fn start_decode_agent(
    setup: &Setup,
    desc: &PeerDescriptor,
    dirs: &Dirs,
) -> Result<
    (
        DecodeAgent,
        AllocatedMemory,
        Arc<dyn KvTransport>,
        Option<String>,
    ),
    String,
> {
    let conc = u64::from(setup.concurrency);
    let (t, dir) = transport(setup, dirs).await?;
    let mem = KvMemory::allocate(&*t, desc, setup.decode_pages * conc, conc)
        .await
        .map_err(|e| format!("allocating the decode pool: {e}"))?;
    let channel = NetChannel::bind(net_config(setup))
        .await
        .map_err(|e| e.to_string())?;
    let hb = heartbeat(setup);
    let directory = HttpDirectory::new().with_retry(hb, 15).with_client_config(
        client_config(setup).with_timeout(setup.timeout.min(Duration::from_secs(5))),
    );
    let agent = DecodeAgent::builder(
        desc.clone(),
        mem.memory.clone(),
        t.clone(),
        Arc::new(channel),
        Arc::new(directory),
    )
    .config(decode_config(setup))
    .start()
    .map_err(|e| e.to_string())?;
    Ok((agent, mem, t, dir))
}

async fn decode_main(
    args: &DemoArgs,
    setup: Setup,
    commands: Arc<Commands>,
    dirs: Dirs,
    runs: Runs,
) -> Result<ExitCode, String> {
    let rank = args.rank;
    let addr = args
        .bootstrap
        .clone()
        .ok_or("internal: a decode process needs --bootstrap")?;
    let desc = setup
        .decode
        .get(rank as usize)
        .cloned()
        .ok_or_else(|| format!("internal: no decode rank {rank}"))?;
    let (agent, mem, t, dir) = start_decode_agent(&setup, &desc, &dirs).await?;
    emit(&Event::Ready {
        pid: std::process::id(),
        bootstrap: None,
    });

    let side = Arc::new(DecodeSide {
        agent: agent.clone(),
        setup: Arc::new(setup),
        mem: Arc::new(mem),
        desc,
        rank,
        addr,
        in_flight: InFlight::default(),
        canaries: Mutex::default(),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let mut summary = Summary {
        role: "decode".to_owned(),
        rank,
        ..Summary::default()
    };
    let stopper = {
        let agent = agent.clone();
        stop_when_told(&commands, &stop, &side.in_flight, move |room| {
            agent.abort(room)
        })
    };
    summary.skipped = drive(
        runs,
        side.setup.concurrency,
        &stop,
        |i, slot| {
            let side = side.clone();
            async move { decode_request(&side, i, slot).await }
        },
        |i, r| match r {
            Ok(bytes) => {
                summary.succeeded += 1;
                summary.bytes += bytes;
                emit(&Event::Verified {
                    request: i,
                    rank,
                    bytes,
                });
            }
            Err(reason) => summary.fail(
                i,
                reason,
                side.setup.serve,
                (&stop, &side.in_flight),
                |room| agent.abort(room),
            ),
        },
    )
    .await;
    // The canaries of pages never reused.
    let slots: Vec<u32> = lock(&side.canaries).keys().copied().collect();
    for slot in slots {
        check_canary(&side, slot).await;
    }
    stopper.abort();
    summary.stopped(&commands);
    summary.rooms_left = settle(|| agent.room_count()).await;
    summary.control_dirs = dir.into_iter().collect();
    agent.shutdown();
    let _ = t.shutdown().await;
    let ok = summary.failed == 0 && summary.skipped == 0;
    emit(&Event::Done(summary));
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// What every request of a decode process shares.
struct DecodeSide {
    agent: DecodeAgent,
    setup: Arc<Setup>,
    mem: Arc<AllocatedMemory>,
    desc: PeerDescriptor,
    rank: u32,
    /// The prefill's bootstrap address.
    addr: String,
    in_flight: InFlight,
    /// `--serve`: per pool slot, the canary a failed request left in its pages (request,
    /// room, layout), checked before the slot is reused and at exit.
    /// The last field: whether the fence was proven before the canary was written.
    canaries: Mutex<std::collections::BTreeMap<u32, (u32, u64, TokenLayout, bool)>>,
}

/// The room id whose rows make the canary of failed `room`: bytes no request writes.
fn canary_room(room: u64) -> u64 {
    room ^ 0xC0FF_EE00_0000_0000
}

/// Checks and reports (the `canary` event) the canary a failed request left in `slot`'s pages.
async fn check_canary(side: &DecodeSide, slot: u32) {
    let Some((request, room, layout, fenced)) = lock(&side.canaries).remove(&slot) else {
        return;
    };
    let (mem, tokens) = (side.mem.clone(), side.setup.tokens);
    let checked = tokio::task::spawn_blocking(move || {
        verify_rows(&kv_views(&mem), &layout, canary_room(room), 0..tokens)
    })
    .await;
    let (bytes_checked, changed) = match checked {
        Ok(Ok(bytes)) => (bytes, None),
        Ok(Err(e)) => (0, Some(format!("a byte landed after the fence: {e}"))),
        Err(e) => (0, Some(format!("the canary check did not finish: {e}"))),
    };
    emit(&Event::Canary {
        request,
        rank: side.rank,
        bytes_checked,
        fenced,
        changed,
    });
}

async fn decode_request(side: &DecodeSide, i: u32, slot: u32) -> Result<u64, Failure> {
    let (agent, setup, mem) = (&side.agent, &side.setup, &side.mem);
    check_canary(side, slot).await;
    let room = room_of(i);
    let table = slot_table(slot, setup.decode_pages, PageOrder::Reversed);
    let layout = TokenLayout::for_rank(&side.desc, table.clone())?;
    if setup.prefix_tokens > 0 {
        // The cached prefix: this rank already holds these rows (from an earlier request
        // sharing the prompt's start).
        let (mem, layout, setup) = (mem.clone(), layout.clone(), setup.clone());
        tokio::task::spawn_blocking(move || {
            fill_rows(&kv_views(&mem), &layout, room, 0..setup.prefix_tokens)
        })
        .await
        .map_err(|e| e.to_string())??;
    }
    agent.receive(
        room,
        ReceiveRequest {
            bootstrap_addr: side.addr.clone(),
            page_table: table,
            cached_prefix_len: setup.prefix_tokens,
            aux_index: u64::from(slot),
        },
    )?;
    lock(&side.in_flight).insert(room);
    // The agent's own deadlines end every room; the outer bound only guards against a bug.
    let outcome = match tokio::time::timeout(setup.timeout * 4, agent.wait(room)).await {
        Ok(r) => r.map_err(Failure::from),
        Err(_) => {
            agent.abort(room);
            Err(format!("room {room} did not end within {:?}", setup.timeout * 4).into())
        }
    };
    let result = match outcome {
        Ok(()) => {
            let (mem, layout, setup) = (mem.clone(), layout.clone(), setup.clone());
            tokio::task::spawn_blocking(move || -> Result<u64, Failure> {
                let bytes = verify_rows(&kv_views(&mem), &layout, room, 0..setup.tokens)
                    .map_err(|e| format!("request {i}: verification failed: {e}"))?;
                verify_aux(
                    &aux_views(&mem),
                    &AUX_ITEM_LENS,
                    &AUX_ITEM_LENS,
                    u64::from(slot),
                    room,
                )
                .map_err(|e| format!("request {i}: aux row verification failed: {e}"))?;
                Ok(bytes)
            })
            .await
            .map_err(|e| e.to_string())?
        }
        Err(e) => {
            if setup.serve {
                // When the room ended, apart from the fence that follows.
                emit(&Event::RoomFailed {
                    request: i,
                    reason: e.text.clone(),
                });
            }
            // Pages of a failed room may be reused only once no byte can land any more.
            let fenced = match agent.release_when_fenced(room).await {
                Err(fence) => {
                    tracing::warn!(room, error = %fence, "pages of a failed room stay quarantined");
                    false
                }
                Ok(_) => true,
            };
            if setup.serve {
                // From now on nothing may change these pages: a canary proves it (and, where
                // the fence could not be proven, shows whether a byte still landed).
                let (mem, canary) = (mem.clone(), layout.clone());
                let tokens = setup.tokens;
                let filled = tokio::task::spawn_blocking(move || {
                    fill_rows(&kv_views(&mem), &canary, canary_room(room), 0..tokens)
                })
                .await;
                if matches!(filled, Ok(Ok(_))) {
                    lock(&side.canaries).insert(slot, (i, room, layout, fenced));
                }
            }
            Err(e)
        }
    };
    agent.clear(room);
    lock(&side.in_flight).remove(&room);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_counts_positions_of_a_dcp_rank() {
        for d in 1..6u64 {
            for r in 0..d {
                for from in 0..20 {
                    for to in from..40 {
                        let want = (from..to).filter(|p| p % d == r).count() as u64;
                        assert_eq!(owned(from, to, d, r), want, "d={d} r={r} [{from},{to})");
                    }
                }
            }
        }
    }

    #[test]
    fn the_first_root_cause_wins_over_earlier_consequences() {
        let stop = AtomicBool::new(false);
        let in_flight = InFlight::default();
        let mut s = Summary::default();
        let secondary = |text: &str| Failure {
            text: text.to_owned(),
            secondary: true,
        };
        let both = (&stop, &in_flight);
        s.fail(0, secondary("aborted"), true, both, |_| {});
        assert_eq!(s.first_failure.as_deref(), Some("aborted"));
        assert!(!stop.load(Ordering::SeqCst), "--serve keeps going");
        s.fail(1, "peer lost".to_owned().into(), false, both, |_| {});
        s.fail(2, "later".to_owned().into(), false, both, |_| {});
        s.fail(3, secondary("aborted again"), false, both, |_| {});
        assert_eq!(s.first_failure.as_deref(), Some("peer lost"));
        assert_eq!(s.failed, 4);
        assert!(stop.load(Ordering::SeqCst));
    }

    #[test]
    fn slot_tables_are_disjoint_and_ordered() {
        assert_eq!(slot_table(0, 3, PageOrder::Reversed), vec![2, 1, 0]);
        assert_eq!(slot_table(2, 3, PageOrder::Reversed), vec![8, 7, 6]);
        assert_eq!(slot_table(2, 3, PageOrder::Ascending), vec![6, 7, 8]);
    }
}
