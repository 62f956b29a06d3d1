//! The demo's parent process: starts the prefill and decode processes, follows their events,
//! draws the progress bar, and prints the summary.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvbridge_lab::process::{OnDrop, Output, Worker, this_binary};
use serde::Serialize;
use tokio::sync::mpsc;

use super::worker::decode_bytes;
use super::{DemoArgs, Event, GRACE, Setup, Summary, Transport};
use crate::progress::Progress;

/// Which process to kill or freeze, and when (test knobs `--kill`, `--freeze`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KillSpec {
    /// `None`: the prefill; `Some(r)`: decode rank `r`.
    decode: Option<u32>,
    /// Killed once the prefill posted the first chunk of this request.
    request: u32,
    /// SIGSTOP instead of SIGKILL.
    freeze: bool,
}

fn parse_kill(s: &str, decode_ranks: u32, requests: u32) -> Result<KillSpec, String> {
    let bad = || {
        format!("--kill and --freeze take `decode:RANK@REQUEST` or `prefill@REQUEST`, got {s:?}")
    };
    let (who, req) = s.split_once('@').ok_or_else(bad)?;
    let request: u32 = req.parse().map_err(|_| bad())?;
    let decode = match who {
        "prefill" => None,
        _ => {
            let r: u32 = who
                .strip_prefix("decode:")
                .and_then(|r| r.parse().ok())
                .ok_or_else(bad)?;
            if r >= decode_ranks {
                return Err(format!(
                    "--kill names decode rank {r}, but there are {decode_ranks}"
                ));
            }
            Some(r)
        }
    };
    if request >= requests {
        return Err(format!(
            "--kill names request {request}, but only {requests} run"
        ));
    }
    Ok(KillSpec {
        decode,
        request,
        freeze: false,
    })
}

/// Stops a process (SIGSTOP) without killing it: it keeps its sockets and answers nothing.
fn freeze(pid: u32) -> Result<(), String> {
    let status = std::process::Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .map_err(|e| format!("cannot run kill -STOP {pid}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -STOP {pid} failed with {status}"))
    }
}

struct Proc {
    role: &'static str,
    rank: u32,
    /// The process (its stdin kept open: closing it tells the child its parent is gone).
    worker: Worker,
    eof: bool,
    exit_code: Option<i32>,
    /// How it ended, when not with an exit code (e.g. "killed by signal 9").
    exit_signal: Option<i32>,
    summary: Option<Summary>,
    /// Its first root cause so far (from its `Failed` events), and whether that is only a
    /// consequence of another failure.
    failure: Option<(String, bool)>,
}

impl Proc {
    /// How the summary names it: "prefill", "decode rank 2".
    fn name(&self) -> String {
        match self.role {
            "decode" => format!("decode rank {}", self.rank),
            role => role.to_owned(),
        }
    }
}

fn spawn(
    label: String,
    role: &'static str,
    rank: u32,
    extra: &[String],
    idx: usize,
    tx: &mpsc::Sender<Output>,
    secret: Option<&str>,
) -> Result<Proc, String> {
    let forwarded: Vec<String> = std::env::args().skip(1).collect();
    let mut command = this_binary(None)?;
    // The run's one secret reaches the workers in their environment, not on a command line.
    if let Some(s) = secret {
        command.env(super::SECRET_ENV, s);
    }
    command.args(&forwarded).args(extra);
    let worker = Worker::start(label, command, idx, tx, OnDrop::Kill)?;
    Ok(Proc {
        role,
        rank,
        worker,
        eof: false,
        exit_code: None,
        exit_signal: None,
        summary: None,
        failure: None,
    })
}

#[derive(Debug, Clone, Default)]
struct Request {
    latency: Option<Duration>,
    transfer: Option<Duration>,
    bytes: u64,
    verified: u32,
    failed: bool,
}

/// The demo's progress line: requests done, bytes and rate since the decodes were ready.
fn draw(progress: &Progress, done: u32, total: u32, bytes: u64, since: Instant) {
    let secs = since.elapsed().as_secs_f64().max(1e-9);
    progress.bar(
        u64::from(done),
        u64::from(total),
        &format!(
            "requests  {:.2} GB  {:.2} GB/s ",
            bytes as f64 / 1e9,
            bytes as f64 / 1e9 / secs
        ),
    );
}

#[derive(Debug, Serialize)]
struct Latency {
    p50: f64,
    p99: f64,
}

#[derive(Debug, Serialize)]
struct PerRequest {
    descriptors: u64,
    rows: u64,
    pack_batches: u64,
    pack_bytes: u64,
}

#[derive(Debug, Serialize)]
struct ProcReport {
    role: &'static str,
    rank: u32,
    pid: Option<u32>,
    exit_code: Option<i32>,
    summary: Option<Summary>,
}

/// The final report (`--json` prints it as is).
#[derive(Debug, Serialize)]
struct Report {
    ok: bool,
    setup: String,
    transport: Transport,
    bootstrap: Option<String>,
    requests: u32,
    concurrency: u32,
    succeeded: u32,
    failed: u32,
    seconds: f64,
    bytes_moved: u64,
    gbps: f64,
    latency_ms: Option<Latency>,
    /// Per request: every decode rank's metadata in -> Success on every prefill rank (what
    /// SGLang's prefill times from `send`).
    transfer_ms: Option<Latency>,
    verified_bytes: u64,
    expected_verified_bytes: u64,
    /// Per request that succeeded, over every prefill rank: transport descriptors posted (a
    /// strided op counts one), the rows they cover, and on the pack path (`--pack`) the
    /// batches posted from pack buffers and the bytes gathered into them.
    descriptors_per_request: Option<PerRequest>,
    killed: Vec<String>,
    /// Processes stopped with `--freeze`.
    frozen: Vec<String>,
    timed_out: bool,
    failures: Vec<String>,
    processes: Vec<ProcReport>,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub(crate) fn run(args: &DemoArgs, setup: Setup) -> ExitCode {
    let knob = args.kill.as_deref().map(|s| (s, false));
    let knob = knob.or(args.freeze.as_deref().map(|s| (s, true)));
    let kill = match knob {
        None => None,
        Some((s, freeze)) => match parse_kill(s, setup.decode.len() as u32, setup.requests) {
            Ok(k) => Some(KillSpec { freeze, ..k }),
            Err(e) => {
                eprintln!("kvbridge-lab demo: {e}");
                return ExitCode::from(2);
            }
        },
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvbridge-lab demo: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let report = rt.block_on(orchestrate(args, &setup, kill));
    print_report(args, &setup, &report);
    if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The state of a demo run while its processes report.
struct Run<'a> {
    setup: &'a Setup,
    n_decode: usize,
    kill: Option<KillSpec>,
    tx: mpsc::Sender<Output>,
    procs: Vec<Proc>,
    failures: Vec<String>,
    bootstrap: Option<String>,
    requests: Vec<Request>,
    killed: Vec<String>,
    frozen: Vec<String>,
    timed_out: bool,
    started_at: Option<Instant>,
    ready_decodes: usize,
    done_requests: u32,
    done_bytes: u64,
    finish_sent: bool,
    /// The first failure or dead process: from then on the run ends within the timeout (the
    /// survivors' deadlines) plus the grace, or what still runs is killed.
    trouble: Option<Instant>,
    progress: Progress,
    bar_start: Instant,
}

impl<'a> Run<'a> {
    fn new(
        args: &DemoArgs,
        setup: &'a Setup,
        kill: Option<KillSpec>,
        tx: mpsc::Sender<Output>,
    ) -> Self {
        Run {
            setup,
            n_decode: setup.decode.len(),
            kill,
            tx,
            procs: Vec::new(),
            failures: Vec::new(),
            bootstrap: None,
            requests: vec![Request::default(); setup.requests as usize],
            killed: Vec::new(),
            frozen: Vec::new(),
            timed_out: false,
            started_at: None,
            ready_decodes: 0,
            done_requests: 0,
            done_bytes: 0,
            finish_sent: false,
            trouble: None,
            progress: Progress::on_stderr(!args.json),
            bar_start: Instant::now(),
        }
    }

    /// Counts a request sent and verified by every decode rank (`Some(its bytes)`), on the
    /// progress line too.
    fn request_done(&mut self, bytes: Option<u64>) {
        let Some(bytes) = bytes else { return };
        self.done_requests += 1;
        self.done_bytes += bytes;
        draw(
            &self.progress,
            self.done_requests,
            self.setup.requests,
            self.done_bytes,
            self.bar_start,
        );
    }

    /// One event of process `idx`.
    async fn on_event(&mut self, idx: usize, ev: Event) {
        match ev {
            Event::Ready {
                bootstrap: Some(addr),
                ..
            } if idx == 0 => {
                self.bootstrap = Some(addr.clone());
                spawn_decodes(
                    self.n_decode,
                    &addr,
                    &mut self.procs,
                    &self.tx,
                    &mut self.failures,
                    self.setup.secret.as_deref(),
                );
            }
            Event::Ready { .. } => {
                self.ready_decodes += 1;
                if self.ready_decodes == self.n_decode {
                    self.started_at = Some(Instant::now());
                    self.bar_start = Instant::now();
                    if let Err(e) = self.procs[0].worker.send("start").await {
                        self.failures
                            .push(format!("cannot tell the prefill to start: {e}"));
                    }
                }
            }
            Event::Chunk { request, index } => {
                if let Some(k) = self.kill.filter(|k| k.request == request && index == 0) {
                    apply_kill(
                        k,
                        &mut self.procs,
                        &mut self.killed,
                        &mut self.frozen,
                        &mut self.failures,
                    );
                }
            }
            Event::Sent {
                request,
                latency_us,
                transfer_us,
                bytes,
            } => {
                let n_decode = self.n_decode;
                let done = self.requests.get_mut(request as usize).and_then(|r| {
                    r.latency = Some(Duration::from_micros(latency_us));
                    r.transfer = Some(Duration::from_micros(transfer_us));
                    r.bytes = bytes;
                    (r.verified as usize == n_decode).then_some(bytes)
                });
                self.request_done(done);
            }
            Event::Verified { request, .. } => {
                let n_decode = self.n_decode;
                let done = self.requests.get_mut(request as usize).and_then(|r| {
                    r.verified += 1;
                    (r.verified as usize == n_decode && r.latency.is_some()).then_some(r.bytes)
                });
                self.request_done(done);
            }
            Event::ControlDir { path } => self.procs[idx]
                .worker
                .control_dirs
                .push(PathBuf::from(path)),
            // Only `--serve` workers check canaries; the demo never starts them so.
            Event::Canary { .. } | Event::RoomFailed { .. } => {}
            Event::Failed {
                request,
                reason,
                secondary,
            } => {
                self.trouble.get_or_insert_with(Instant::now);
                if let Some(r) = self.requests.get_mut(request as usize) {
                    r.failed = true;
                }
                let p = &mut self.procs[idx];
                if p.failure.as_ref().is_none_or(|f| f.1 && !secondary) {
                    p.failure = Some((reason, secondary));
                }
            }
            Event::Done(s) => {
                if s.first_failure.is_some() {
                    self.trouble.get_or_insert_with(Instant::now);
                }
                self.procs[idx].summary = Some(s);
            }
        }
    }
}

/// When the whole run must have ended: generous bounds for start-up (allocating pools), then
/// every request's own deadline.
fn run_deadline(setup: &Setup) -> Instant {
    let startup = Duration::from_secs(60);
    let waves = f64::from(setup.requests) / f64::from(setup.concurrency);
    Instant::now()
        + startup
        + setup.timeout.mul_f64(4.0 + waves.min(1e6))
        + Duration::from_secs_f64(waves.min(1e6) * 0.5)
}

async fn orchestrate(args: &DemoArgs, setup: &Setup, kill: Option<KillSpec>) -> Report {
    let (tx, mut rx) = mpsc::channel::<Output>(1024);
    let mut run = Run::new(args, setup, kill, tx);
    let begun = Instant::now();
    if !args.json {
        println!("kvbridge-lab demo: {}", setup.describe());
    }
    match spawn(
        "prefill".to_owned(),
        "prefill",
        0,
        &["--role".into(), "prefill".into()],
        0,
        &run.tx,
        setup.secret.as_deref(),
    ) {
        Ok(p) => run.procs.push(p),
        Err(e) => run.failures.push(e),
    }
    let deadline = run_deadline(setup);
    // After a signal: the grace, for the children to stop.
    let mut stop_by: Option<Instant> = None;
    // The parent's SIGINT or SIGTERM stops the run cleanly (the children are told).
    let signal = kvbridge_lab::process::terminating_signal();
    tokio::pin!(signal);

    while !run.procs.is_empty() && run.procs.iter().any(|p| !p.eof) {
        let end = [
            Some(deadline),
            run.trouble.map(|t| t + setup.timeout + GRACE),
            stop_by,
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(deadline);
        let msg = tokio::select! {
            m = rx.recv() => m,
            why = &mut signal, if stop_by.is_none() => {
                // Closing their stdin stops the children, which clean up and report.
                for p in &mut run.procs {
                    p.worker.close_stdin();
                }
                run.failures.push(format!("{why}: every process was told to stop"));
                stop_by.get_or_insert_with(|| Instant::now() + GRACE);
                continue;
            }
            _ = tokio::time::sleep_until(end.into()) => {
                run.timed_out = true;
                for p in &mut run.procs {
                    p.worker.kill();
                }
                let after_signal = stop_by == Some(end);
                let why = timeout_failure(setup, run.trouble, after_signal, end < deadline, (begun, deadline));
                run.failures.push(why);
                break;
            }
        };
        let Some(msg) = msg else { break };
        let (idx, line) = match msg {
            Output::Eof(idx) => {
                run.procs[idx].eof = true;
                if run.procs[idx].summary.is_none() {
                    run.trouble.get_or_insert_with(Instant::now);
                }
                maybe_finish(&mut run.procs, &mut run.finish_sent).await;
                // A prefill that dies before it is ready leaves nothing to wait for.
                if idx == 0 && run.bootstrap.is_none() {
                    run.failures
                        .push("the prefill process exited before it was ready".to_owned());
                }
                continue;
            }
            Output::Line(idx, line) => (idx, line),
        };
        let Ok(ev) = serde_json::from_str::<Event>(&line) else {
            eprintln!("[{}] {line}", run.procs[idx].worker.label());
            continue;
        };
        run.on_event(idx, ev).await;
        maybe_finish(&mut run.procs, &mut run.finish_sent).await;
    }
    run.progress.clear();
    let elapsed = run.started_at.map_or(Duration::ZERO, |t| t.elapsed());
    reap(&mut run.procs).await;

    let outcome = Outcome {
        bootstrap: run.bootstrap,
        killed: run.killed,
        frozen: run.frozen,
        timed_out: run.timed_out,
        failures: run.failures,
    };
    report(setup, run.procs, &run.requests, outcome, elapsed)
}

/// How the run ended, besides the processes' own reports.
struct Outcome {
    bootstrap: Option<String>,
    killed: Vec<String>,
    frozen: Vec<String>,
    timed_out: bool,
    failures: Vec<String>,
}

/// The prefill's transfer counters per succeeded request.
fn per_request(procs: &[Proc], succeeded: u32) -> Option<PerRequest> {
    procs
        .first()
        .and_then(|p| p.summary.as_ref())
        .filter(|_| succeeded > 0)
        .map(|s| {
            let n = u64::from(succeeded);
            PerRequest {
                descriptors: s.descriptors / n,
                rows: s.rows / n,
                pack_batches: s.pack_batches / n,
                pack_bytes: s.pack_bytes / n,
            }
        })
}

/// The run's report from what the processes and their events said.
fn report(
    setup: &Setup,
    procs: Vec<Proc>,
    requests: &[Request],
    outcome: Outcome,
    elapsed: Duration,
) -> Report {
    let n_decode = setup.decode.len();
    let Outcome {
        bootstrap,
        killed,
        frozen,
        timed_out,
        mut failures,
    } = outcome;
    let ms = |pick: fn(&Request) -> Option<Duration>| {
        let mut v: Vec<f64> = requests
            .iter()
            .filter(|r| !r.failed && r.verified as usize == n_decode)
            .filter_map(|r| pick(r).map(|l| l.as_secs_f64() * 1e3))
            .collect();
        v.sort_by(f64::total_cmp);
        (!v.is_empty()).then(|| Latency {
            p50: percentile(&v, 50.0),
            p99: percentile(&v, 99.0),
        })
    };
    let succeeded = requests
        .iter()
        .filter(|r| !r.failed && r.latency.is_some() && r.verified as usize == n_decode)
        .count() as u32;
    let failed = requests.iter().filter(|r| r.failed).count() as u32;
    let bytes_moved = procs
        .first()
        .and_then(|p| p.summary.as_ref())
        .map_or(0, |s| s.bytes);
    let verified_bytes: u64 = procs
        .iter()
        .filter(|p| p.role == "decode")
        .filter_map(|p| p.summary.as_ref().map(|s| s.bytes))
        .sum();
    let expected_verified_bytes = u64::from(setup.requests)
        * setup
            .decode
            .iter()
            .map(|d| decode_bytes(d, 0, setup.tokens))
            .sum::<u64>();
    root_causes(&procs, &killed, &mut failures);
    let all_exited_ok = procs.len() == n_decode + 1 && procs.iter().all(|p| p.exit_code == Some(0));
    let ok = !timed_out
        && killed.is_empty()
        && frozen.is_empty()
        && failures.is_empty()
        && all_exited_ok
        && succeeded == setup.requests
        && verified_bytes == expected_verified_bytes;
    let secs = elapsed.as_secs_f64();
    let descriptors_per_request = per_request(&procs, succeeded);
    Report {
        ok,
        setup: setup.describe(),
        transport: setup.transport,
        bootstrap,
        requests: setup.requests,
        concurrency: setup.concurrency,
        succeeded,
        failed,
        seconds: secs,
        bytes_moved,
        gbps: if secs > 0.0 {
            bytes_moved as f64 / 1e9 / secs
        } else {
            0.0
        },
        latency_ms: ms(|r| r.latency),
        transfer_ms: ms(|r| r.transfer),
        verified_bytes,
        expected_verified_bytes,
        descriptors_per_request,
        killed,
        frozen,
        timed_out,
        failures,
        processes: procs
            .into_iter()
            .map(|p| ProcReport {
                role: p.role,
                rank: p.rank,
                pid: p.worker.pid(),
                exit_code: p.exit_code,
                summary: p.summary,
            })
            .collect(),
    }
}

/// The `--kill` test knob: kills (or freezes) its target once, if it still runs.
fn apply_kill(
    k: KillSpec,
    procs: &mut [Proc],
    killed: &mut Vec<String>,
    frozen: &mut Vec<String>,
    failures: &mut Vec<String>,
) {
    let target = match k.decode {
        None => Some(0),
        Some(r) => procs.iter().position(|p| p.role == "decode" && p.rank == r),
    };
    if let Some(t) = target.filter(|&t| procs[t].exit_code.is_none() && !procs[t].eof) {
        if killed.is_empty() && frozen.is_empty() {
            if k.freeze {
                match procs[t]
                    .worker
                    .pid()
                    .ok_or("no pid".to_owned())
                    .and_then(freeze)
                {
                    Ok(()) => frozen.push(procs[t].worker.label().to_owned()),
                    Err(e) => failures.push(e),
                }
            } else {
                procs[t].worker.kill();
                killed.push(procs[t].worker.label().to_owned());
            }
        }
    }
}

/// Why the run was cut short: the grace after a signal passed, the run outlived its
/// timeout after the first failure (`early`: before the overall deadline), or the deadline.
fn timeout_failure(
    setup: &Setup,
    trouble: Option<Instant>,
    after_signal: bool,
    early: bool,
    (begun, deadline): (Instant, Instant),
) -> String {
    match trouble {
        _ if after_signal => format!(
            "the processes did not stop within the grace of {} s; every process \
             still running was killed",
            GRACE.as_secs()
        ),
        Some(t) if early => format!(
            "the run did not end within --timeout {:.1} s plus the grace of {} s \
             after the first failure ({:.1} s after the start); every process still \
             running was killed",
            setup.timeout.as_secs_f64(),
            GRACE.as_secs(),
            (t - begun).as_secs_f64()
        ),
        _ => format!(
            "the run did not finish within {:.0} s; every process was killed",
            (deadline - begun).as_secs_f64()
        ),
    }
}

/// Starts one process per decode rank, pointed at the prefill's bootstrap server `addr`.
fn spawn_decodes(
    n_decode: usize,
    addr: &str,
    procs: &mut Vec<Proc>,
    tx: &mpsc::Sender<Output>,
    failures: &mut Vec<String>,
    secret: Option<&str>,
) {
    for r in 0..n_decode as u32 {
        let extra = [
            "--role".to_owned(),
            "decode".to_owned(),
            "--rank".to_owned(),
            r.to_string(),
            "--bootstrap".to_owned(),
            addr.to_owned(),
        ];
        let i = procs.len();
        match spawn(format!("decode {r}"), "decode", r, &extra, i, tx, secret) {
            Ok(p) => procs.push(p),
            Err(e) => failures.push(e),
        }
    }
}

/// Waits (bounded) for every child to exit, killing what does not, and removes the control
/// directories of those that died before they could.
async fn reap(procs: &mut [Proc]) {
    for p in procs.iter_mut() {
        // One that died before it could clean up (killed, crashed) has its control directories
        // removed here.
        let ended = p
            .worker
            .reap(Duration::from_secs(10), p.summary.is_some())
            .await;
        p.exit_code = ended.code;
        p.exit_signal = ended.signal;
    }
}

/// Each process's first root cause, into `failures`: a process that died comes first (it is
/// usually what the others' failures follow from).
fn root_causes(procs: &[Proc], killed: &[String], failures: &mut Vec<String>) {
    for p in procs {
        if p.summary.is_some() {
            continue;
        }
        let how = match (p.exit_code, p.exit_signal) {
            (_, Some(9)) if killed.iter().any(|k| k == p.worker.label()) => {
                "was killed (test knob --kill)".to_owned()
            }
            (_, Some(sig)) => format!("was killed by signal {sig} before it reported"),
            (Some(code), _) => {
                format!("exited with status {code} before it reported (its stderr says why)")
            }
            (None, None) => "ended before it reported".to_owned(),
        };
        failures.push(format!("{}: {how}", p.name()));
    }
    for p in procs {
        // The child's own choice (its summary) when it reported, else its events'.
        let first = p
            .summary
            .as_ref()
            .and_then(|s| s.first_failure.as_ref())
            .or(p.failure.as_ref().map(|f| &f.0));
        if let Some(f) = first {
            failures.push(format!("{}: first failure: {f}", p.name()));
        }
    }
}

/// Tells the prefill to finish once every decode process reported or ended.
async fn maybe_finish(procs: &mut [Proc], sent: &mut bool) {
    let decodes_done = procs
        .iter()
        .filter(|p| p.role == "decode")
        .all(|p| p.eof || p.summary.is_some());
    if *sent || procs.len() < 2 || !decodes_done {
        return;
    }
    *sent = true;
    let _ = procs[0].worker.send("finish").await;
}

/// Bytes in GB, MB or KB, whichever reads best.
fn gb(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else {
        format!("{:.1} KB", b / 1e3)
    }
}

fn print_report(args: &DemoArgs, setup: &Setup, r: &Report) {
    if args.json {
        println!("{}", serde_json::to_string(r).unwrap_or_default());
        return;
    }
    let decodes = r.processes.iter().filter(|p| p.role == "decode").count();
    println!(
        "  processes  1 prefill ({} rank{}, bootstrap {}) + {decodes} decode process{}",
        setup.prefill.len(),
        if setup.prefill.len() == 1 { "" } else { "s" },
        r.bootstrap.as_deref().unwrap_or("-"),
        if decodes == 1 { "" } else { "es" },
    );
    println!(
        "  requests   {} of {} succeeded ({} failed), concurrency {}",
        r.succeeded, r.requests, r.failed, r.concurrency
    );
    println!(
        "  moved      {} of KV and aux in {:.2} s = {:.2} GB/s (fill, transfer and verification \
         pipelined)",
        gb(r.bytes_moved),
        r.seconds,
        r.gbps
    );
    if let Some(l) = &r.latency_ms {
        println!(
            "  latency    p50 {:.1} ms, p99 {:.1} ms per request (room created -> Success on \
             every prefill rank)",
            l.p50, l.p99
        );
    }
    if let Some(l) = &r.transfer_ms {
        println!(
            "  transfer   p50 {:.1} ms, p99 {:.1} ms per request (every decode rank's metadata \
             in -> Success on every prefill rank)",
            l.p50, l.p99
        );
    }
    if let Some(d) = &r.descriptors_per_request {
        println!(
            "  descriptors {} per request (transport ops, KV and aux), covering {} rows{}",
            d.descriptors,
            d.rows,
            if setup.pack.is_some() {
                format!(
                    "; pack path: {} batches from pack buffers, {} gathered",
                    d.pack_batches,
                    gb(d.pack_bytes)
                )
            } else {
                " (strided ops)".to_owned()
            }
        );
    }
    let verified = r.verified_bytes == r.expected_verified_bytes;
    println!(
        "  verified   {} of {} on {decodes} decode rank{}{}",
        gb(r.verified_bytes),
        gb(r.expected_verified_bytes),
        if decodes == 1 { "" } else { "s" },
        if verified {
            ": every byte where the owner rule puts it"
        } else {
            ""
        }
    );
    if !r.killed.is_empty() {
        println!("  killed     {} (test knob --kill)", r.killed.join(", "));
    }
    if !r.frozen.is_empty() {
        println!("  frozen     {} (test knob --freeze)", r.frozen.join(", "));
    }
    if !r.failures.is_empty() {
        println!("  failures:");
        for f in &r.failures {
            for (k, line) in f.lines().enumerate() {
                println!("    {}{line}", if k == 0 { "" } else { "  " });
            }
        }
    }
    let left: Vec<String> = r
        .processes
        .iter()
        .filter_map(|p| {
            p.summary
                .as_ref()
                .filter(|s| s.rooms_left > 0)
                .map(|s| format!("{} {}: {}", p.role, p.rank, s.rooms_left))
        })
        .collect();
    if !left.is_empty() {
        println!("  rooms left after cleanup: {}", left.join(", "));
    }
    println!("  {}", if r.ok { "OK" } else { "FAILED" });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kill_specs_parse_and_are_checked() {
        assert_eq!(
            parse_kill("decode:1@3", 4, 16).unwrap(),
            KillSpec {
                decode: Some(1),
                request: 3,
                freeze: false,
            }
        );
        assert_eq!(
            parse_kill("prefill@0", 4, 16).unwrap(),
            KillSpec {
                decode: None,
                request: 0,
                freeze: false,
            }
        );
        assert!(parse_kill("decode:4@0", 4, 16).is_err());
        assert!(parse_kill("decode@0", 4, 16).is_err());
        assert!(parse_kill("prefill@16", 4, 16).is_err());
        assert!(parse_kill("prefill", 4, 16).is_err());
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
