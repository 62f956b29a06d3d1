//! The demo's child processes: the prefill (every prefill rank and the bootstrap server) and
//! one decode rank. Each reports [`Event`]s on stdout and exits when its requests are done,
//! when a request failed (after cleaning up), or when the parent goes away (stdin closes).

use std::collections::BTreeSet;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvbridge_coordinator::bootstrap::{
    BootstrapClient, BootstrapConfig, BootstrapServer, ClientConfig, HttpDirectory,
    RankRegistration,
};
use kvbridge_coordinator::net_channel::{NetChannel, NetChannelConfig};
use kvbridge_coordinator::testing::{
    TokenLayout, chunk_plan, fill_aux, fill_rows, verify_aux, verify_rows,
};
use kvbridge_coordinator::{
    AllocatedMemory, Chunk, DecodeAgent, DecodeConfig, KvMemory, PrefillAgent, PrefillConfig,
    ReceiveRequest,
};
use kvbridge_handshake::PeerDescriptor;
use kvbridge_shm::ShmTransport;
use kvbridge_tcp::{TcpConfig, TcpTransport};
use kvbridge_transport::KvTransport;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::{AUX_ITEM_LENS, DemoArgs, Event, Setup, Summary, Transport, room_of};

/// Writes one event line to stdout (the parent reads it).
fn emit(ev: &Event) {
    let line = serde_json::to_string(ev).unwrap_or_default();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// What the parent tells a child on its stdin.
#[derive(Debug, Default)]
struct Commands {
    /// `start`: every decode process is up.
    start: tokio::sync::Notify,
    /// `finish`: every decode process is done; the prefill may shut its transports down.
    finish: tokio::sync::Notify,
}

/// Follows the parent through our stdin (see [`Commands`]); end of file (the parent exited or
/// was killed) exits this process, so no child outlives the demo.
fn watch_parent() -> Arc<Commands> {
    let commands = Arc::new(Commands::default());
    let c = commands.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        loop {
            line.clear();
            match std::io::BufRead::read_line(&mut std::io::stdin().lock(), &mut line) {
                Ok(0) | Err(_) => std::process::exit(3),
                Ok(_) => match line.trim() {
                    "start" => c.start.notify_one(),
                    "finish" => c.finish.notify_one(),
                    _ => {}
                },
            }
        }
    });
    commands
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
}

/// A transport, and the private directory it removes at exit (shared memory only).
async fn transport(setup: &Setup) -> Result<(Arc<dyn KvTransport>, Option<String>), String> {
    match setup.transport {
        Transport::Shm => {
            let t = ShmTransport::new().map_err(|e| format!("shared-memory transport: {e}"))?;
            let dir = t.control_dir().display().to_string();
            Ok((Arc::new(t), Some(dir)))
        }
        Transport::Tcp => {
            let keep =
                (setup.timeout / 2).clamp(Duration::from_millis(200), Duration::from_secs(10));
            let mut cfg = TcpConfig::default()
                .with_keepalive((keep / 5).max(Duration::from_millis(40)), keep);
            if let Some(s) = &setup.secret {
                cfg = cfg.with_secret(s.as_bytes().to_vec());
            }
            let t = TcpTransport::bind(cfg)
                .await
                .map_err(|e| format!("TCP transport: {e}"))?;
            Ok((Arc::new(t), None))
        }
    }
}

fn net_config(setup: &Setup) -> NetChannelConfig {
    let mut c = NetChannelConfig::default().with_queue(4096);
    if let Some(s) = &setup.secret {
        c = c.with_secret(s.as_bytes().to_vec());
    }
    c
}

fn heartbeat(setup: &Setup) -> Duration {
    (setup.timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(5))
}

fn prefill_config(setup: &Setup) -> PrefillConfig {
    let t = setup.timeout;
    PrefillConfig {
        bootstrap_timeout: t,
        waiting_timeout: t,
        batch_timeout: t,
        fence_grace: (t / 4).min(Duration::from_secs(5)),
        control_send_timeout: (t / 4).min(Duration::from_secs(30)),
        ..PrefillConfig::default()
    }
}

fn decode_config(setup: &Setup) -> DecodeConfig {
    let t = setup.timeout;
    DecodeConfig {
        bootstrap_timeout: t,
        waiting_timeout: t,
        heartbeat_interval: heartbeat(setup),
        heartbeat_max_failures: 2,
        control_send_timeout: (t / 4).min(Duration::from_secs(1)),
        fence_timeout: t,
        abort_resend_interval: heartbeat(setup),
        ..DecodeConfig::default()
    }
}

/// The page table of a request in pool slot `slot`: the slot's `n` pages in reverse order, so
/// a row that lands on the wrong page does not verify.
fn slot_table(slot: u32, n: u64) -> Vec<u64> {
    let base = u64::from(slot) * n;
    (0..n).map(|i| base + n - 1 - i).collect()
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
        let slot = self
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or(0);
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
        self.slots
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.slot);
    }
}

/// Rooms in flight on this process (aborted when a request fails).
type InFlight = Arc<Mutex<BTreeSet<u64>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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

/// Runs requests `0..requests`, at most `concurrency` at once, each in its own task holding a
/// pool slot (`start(request, slot)`), and reports each outcome to `on_done` as it ends. Once
/// `stop` is set no further request starts; the ones in flight are awaited. Returns how many
/// requests never started.
async fn drive<T, Fut>(
    requests: u32,
    concurrency: u32,
    stop: &AtomicBool,
    mut start: impl FnMut(u32, u32) -> Fut,
    mut on_done: impl FnMut(u32, Result<T, String>),
) -> u32
where
    T: Send + 'static,
    Fut: std::future::Future<Output = Result<T, String>> + Send + 'static,
{
    let slots = Slots::new(concurrency);
    let mut tasks: JoinSet<(u32, Result<T, String>)> = JoinSet::new();
    let mut done = |res: Result<(u32, Result<T, String>), tokio::task::JoinError>| match res {
        Ok((i, r)) => on_done(i, r),
        Err(e) => on_done(u32::MAX, Err(format!("a request task panicked: {e}"))),
    };
    let mut skipped = 0;
    for i in 0..requests {
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
            skipped = requests - i;
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

impl Summary {
    /// Records a failed request; the first failure sets `stop` and aborts every room in flight.
    fn fail(
        &mut self,
        request: u32,
        reason: String,
        stop: &AtomicBool,
        in_flight: &InFlight,
        abort: impl Fn(u64),
    ) {
        self.failed += 1;
        if self.first_failure.is_none() {
            self.first_failure = Some(reason.clone());
        }
        emit(&Event::Failed { request, reason });
        if !stop.swap(true, Ordering::SeqCst) {
            for room in lock(in_flight).iter() {
                abort(*room);
            }
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
    init_tracing();
    let commands = watch_parent();
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => return fail_start("prefill", 0, e),
    };
    match rt.block_on(prefill_main(args, setup, commands)) {
        Ok(code) => code,
        Err(e) => fail_start("prefill", 0, e),
    }
}

fn fail_start(role: &str, rank: u32, e: String) -> ExitCode {
    eprintln!("kvbridge demo ({role} {rank}): {e}");
    emit(&Event::Done(Summary {
        role: role.to_owned(),
        rank,
        first_failure: Some(e),
        ..Summary::default()
    }));
    ExitCode::from(1)
}

async fn prefill_main(
    args: &DemoArgs,
    setup: Setup,
    commands: Arc<Commands>,
) -> Result<ExitCode, String> {
    let boot = BootstrapServer::bind(BootstrapConfig::default().with_bind_addr(SocketAddr::new(
        Ipv4Addr::LOCALHOST.into(),
        args.bootstrap_port,
    )))
    .await
    .map_err(|e| e.to_string())?;
    let client = BootstrapClient::new(boot.bootstrap_addr());
    let conc = u64::from(setup.concurrency);
    let mut ranks = Vec::new();
    let mut dirs = Vec::new();
    for d in &setup.prefill {
        let (t, dir) = transport(&setup).await?;
        dirs.extend(dir);
        let mem = KvMemory::allocate(&*t, d, setup.prefill_pages * conc, conc)
            .await
            .map_err(|e| format!("allocating the prefill pool: {e}"))?;
        let channel = NetChannel::bind(net_config(&setup))
            .await
            .map_err(|e| e.to_string())?;
        let agent =
            PrefillAgent::builder(d.clone(), mem.memory.clone(), t.clone(), Arc::new(channel))
                .config(prefill_config(&setup))
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
    emit(&Event::Ready {
        pid: std::process::id(),
        bootstrap: Some(boot.bootstrap_addr()),
    });
    // The parent says `start` once every decode process is up, so request latencies do not
    // include the decodes' start-up.
    commands.start.notified().await;

    let ranks = Arc::new(ranks);
    let setup = Arc::new(setup);
    let in_flight: InFlight = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut summary = Summary {
        role: "prefill".to_owned(),
        ..Summary::default()
    };
    summary.skipped = drive(
        setup.requests,
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
            Ok((latency, bytes)) => {
                summary.succeeded += 1;
                emit(&Event::Sent {
                    request: i,
                    latency_us: latency.as_micros() as u64,
                    bytes,
                });
            }
            // Stop everything in flight: the decode ranks are told at once.
            Err(reason) => summary.fail(i, reason, &stop, &in_flight, |room| {
                for r in ranks.iter() {
                    r.agent.abort(room);
                }
            }),
        },
    )
    .await;

    summary.bytes = ranks
        .iter()
        .map(|r| r.agent.metrics().bytes_transferred)
        .sum();
    summary.rooms_left = settle(|| ranks.iter().map(|r| r.agent.room_count()).sum()).await;
    summary.control_dirs = dirs;
    // The decode ranks shut their transports down first (they fence this side's writes).
    let _ = tokio::time::timeout(
        setup.timeout + Duration::from_secs(10),
        commands.finish.notified(),
    )
    .await;
    for r in ranks.iter() {
        r.agent.shutdown();
        let _ = r.transport.shutdown().await;
    }
    boot.shutdown();
    let ok = summary.failed == 0 && summary.skipped == 0;
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

async fn prefill_request(
    ranks: &Arc<Vec<PRank>>,
    setup: &Arc<Setup>,
    i: u32,
    slot: u32,
    in_flight: &InFlight,
    stop: &Arc<AtomicBool>,
) -> Result<(Duration, u64), String> {
    let room = room_of(i);
    // "Compute" the prompt's KV: every rank fills the rows it holds (CPU work, off the
    // async workers).
    let layouts = {
        let (ranks, setup) = (ranks.clone(), setup.clone());
        tokio::task::spawn_blocking(move || -> Result<Vec<TokenLayout>, String> {
            let mut out = Vec::new();
            for r in ranks.iter() {
                let table = slot_table(slot, setup.prefill_pages);
                let layout = TokenLayout::for_rank(&r.desc, table)?;
                fill_rows(&r.mem.kv_views(), &layout, room, 0..setup.tokens)?;
                fill_aux(&r.mem.aux_views(), &AUX_ITEM_LENS, u64::from(slot), room)?;
                out.push(layout);
            }
            Ok(out)
        })
        .await
        .map_err(|e| format!("filling request {i}: {e}"))??
    };
    if stop.load(Ordering::SeqCst) {
        return Err("stopped before the room was created (an earlier request failed)".to_owned());
    }
    let started = Instant::now();
    for r in ranks.iter() {
        r.agent.create_room(room).map_err(|e| e.to_string())?;
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
    while let Some(res) = per_rank.join_next().await {
        let res = res.unwrap_or_else(|e| Err(format!("rank task panicked: {e}")));
        if let Err(e) = res {
            first_err.get_or_insert(e);
        }
    }
    let latency = started.elapsed();
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
            Ok((latency, bytes))
        }
    }
}

async fn send_room(
    r: &PRank,
    setup: &Setup,
    i: u32,
    k: usize,
    room: u64,
    slot: u32,
    layout: &TokenLayout,
) -> Result<(), String> {
    let agent = &r.agent;
    let prefix = agent.wait_ready(room).await.map_err(|e| e.to_string())?;
    // Chunks of whole pages of this rank's pool (virtual pages under prefill DCP), from the
    // decode's prefix on (the first chunk may start mid-page).
    let v = layout.virtual_page();
    let max_pages = (setup.chunk_tokens / v).max(1);
    let plan = chunk_plan(prefix, setup.tokens, v, max_pages);
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
        agent
            .send_chunk(room, chunk)
            .await
            .map_err(|e| e.to_string())?;
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
    agent.wait(room).await.map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------------------------
// Decode process.

pub(crate) fn run_decode(args: &DemoArgs, setup: Setup) -> ExitCode {
    init_tracing();
    let _commands = watch_parent();
    let rank = args.rank;
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => return fail_start("decode", rank, e),
    };
    match rt.block_on(decode_main(args, setup)) {
        Ok(code) => code,
        Err(e) => fail_start("decode", rank, e),
    }
}

async fn decode_main(args: &DemoArgs, setup: Setup) -> Result<ExitCode, String> {
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
    let conc = u64::from(setup.concurrency);
    let (t, dir) = transport(&setup).await?;
    let mem = KvMemory::allocate(&*t, &desc, setup.decode_pages * conc, conc)
        .await
        .map_err(|e| format!("allocating the decode pool: {e}"))?;
    let channel = NetChannel::bind(net_config(&setup))
        .await
        .map_err(|e| e.to_string())?;
    let hb = heartbeat(&setup);
    let directory = HttpDirectory::new().with_retry(hb, 15).with_client_config(
        ClientConfig::default().with_timeout(setup.timeout.min(Duration::from_secs(5))),
    );
    let agent = DecodeAgent::builder(
        desc.clone(),
        mem.memory.clone(),
        t.clone(),
        Arc::new(channel),
        Arc::new(directory),
    )
    .config(decode_config(&setup))
    .start()
    .map_err(|e| e.to_string())?;
    emit(&Event::Ready {
        pid: std::process::id(),
        bootstrap: None,
    });

    let setup = Arc::new(setup);
    let mem = Arc::new(mem);
    let desc = Arc::new(desc);
    let in_flight: InFlight = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut summary = Summary {
        role: "decode".to_owned(),
        rank,
        ..Summary::default()
    };
    summary.skipped =
        drive(
            setup.requests,
            setup.concurrency,
            &stop,
            |i, slot| {
                let (agent, setup, mem, desc, in_flight, addr) = (
                    agent.clone(),
                    setup.clone(),
                    mem.clone(),
                    desc.clone(),
                    in_flight.clone(),
                    addr.clone(),
                );
                async move {
                    decode_request(&agent, &setup, &mem, &desc, i, slot, &in_flight, addr).await
                }
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
                Err(reason) => summary.fail(i, reason, &stop, &in_flight, |room| agent.abort(room)),
            },
        )
        .await;
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

#[allow(clippy::too_many_arguments)]
async fn decode_request(
    agent: &DecodeAgent,
    setup: &Arc<Setup>,
    mem: &Arc<AllocatedMemory>,
    desc: &Arc<PeerDescriptor>,
    i: u32,
    slot: u32,
    in_flight: &InFlight,
    addr: String,
) -> Result<u64, String> {
    let room = room_of(i);
    let table = slot_table(slot, setup.decode_pages);
    let layout = TokenLayout::for_rank(desc, table.clone())?;
    if setup.prefix_tokens > 0 {
        // The cached prefix: this rank already holds these rows (from an earlier request
        // sharing the prompt's start).
        let (mem, layout, setup) = (mem.clone(), layout.clone(), setup.clone());
        tokio::task::spawn_blocking(move || {
            fill_rows(&mem.kv_views(), &layout, room, 0..setup.prefix_tokens)
        })
        .await
        .map_err(|e| e.to_string())??;
    }
    agent
        .receive(
            room,
            ReceiveRequest {
                bootstrap_addr: addr,
                page_table: table,
                cached_prefix_len: setup.prefix_tokens,
                aux_index: u64::from(slot),
            },
        )
        .map_err(|e| e.to_string())?;
    lock(in_flight).insert(room);
    // The agent's own deadlines end every room; the outer bound only guards against a bug.
    let outcome = match tokio::time::timeout(setup.timeout * 4, agent.wait(room)).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => {
            agent.abort(room);
            Err(format!(
                "room {room} did not end within {:?}",
                setup.timeout * 4
            ))
        }
    };
    let result = match outcome {
        Ok(()) => {
            let (mem, layout, setup) = (mem.clone(), layout.clone(), setup.clone());
            tokio::task::spawn_blocking(move || -> Result<u64, String> {
                let bytes = verify_rows(&mem.kv_views(), &layout, room, 0..setup.tokens)
                    .map_err(|e| format!("request {i}: verification failed: {e}"))?;
                verify_aux(
                    &mem.aux_views(),
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
            // Pages of a failed room may be reused only once no byte can land any more.
            if let Err(fence) = agent.release_when_fenced(room).await {
                tracing::warn!(room, error = %fence, "pages of a failed room stay quarantined");
            }
            Err(e)
        }
    };
    agent.clear(room);
    lock(in_flight).remove(&room);
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
    fn slot_tables_are_disjoint_and_reversed() {
        assert_eq!(slot_table(0, 3), vec![2, 1, 0]);
        assert_eq!(slot_table(2, 3), vec![8, 7, 6]);
    }
}
