//! The demo's processes on either side of a [`Link`]: see [`Deployment`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::{Link, LinkOptions, Proc};

/// How one request ended on one process.
#[derive(Debug, Clone)]
pub struct End {
    /// When its event arrived.
    pub at: Instant,
    /// Succeeded (`sent` on the prefill, `verified` on a decode rank).
    pub ok: bool,
    /// The failure's cause.
    pub reason: String,
    /// Bytes the prefill reported moving for it (`sent`).
    pub bytes: u64,
}

/// A canary check of a decode rank.
#[derive(Debug, Clone)]
pub struct Canary {
    /// Bytes the canary covered.
    pub bytes: u64,
    /// Whether the room's fence was proven before the canary was written.
    pub fenced: bool,
    /// Why it is not intact (a byte landed after the fence).
    pub changed: Option<String>,
}

/// What a [`Deployment`] runs.
#[derive(Debug, Clone)]
pub struct DemoSpec {
    /// The `kvbridge-lab` binary.
    pub exe: PathBuf,
    /// `demo` and its arguments shared by every process (without `--role`, `--rank`,
    /// `--bind-addr`, `--bootstrap`, `--bootstrap-port` and `--serve`, which are added).
    pub args: Vec<String>,
    /// Decode processes (one per decode rank).
    pub decode_ranks: u32,
    /// The bootstrap server's port (fixed, so a restarted prefill serves the same address).
    pub bootstrap_port: u16,
    /// The run's secret (handed over in the environment).
    pub secret: String,
    /// Extra environment of every process (e.g. `UCX_NET_DEVICES`).
    pub env: Vec<(String, String)>,
}

/// The demo's prefill (with the bootstrap server) in side A's namespace and its decode ranks
/// in side B's, every one the `kvbridge-lab` binary's own role in `--serve` mode: requests run
/// when [`run`](Self::run) names them, and a failed one does not stop a process.
#[derive(Debug)]
pub struct Deployment {
    /// The link between the two sides.
    pub link: Link,
    /// Where every process's stderr log is.
    pub logs: PathBuf,
    /// `[0]`: the prefill; then the decode ranks.
    pub procs: Vec<Proc>,
    /// (process index, request) -> how it ended.
    pub ends: BTreeMap<(usize, u32), End>,
    /// When the prefill posted each request's first chunk.
    pub first_chunk: BTreeMap<u32, Instant>,
    /// Canary checks: (process index, request, result).
    pub canaries: Vec<(usize, u32, Canary)>,
    /// Final summaries (`done` events) per process index.
    pub done: BTreeMap<usize, Value>,
    /// (process index, request) whose request task ended: after a decode rank's fence, its
    /// pool slot is free again.
    pub released: std::collections::BTreeSet<(usize, u32)>,
    prefill_starts: u32,
    spec: DemoSpec,
}

impl Deployment {
    /// Creates the link, starts the prefill in side A and the decode ranks in side B, and
    /// waits (bounded) until each is ready. `name` names the log directory.
    pub fn start(name: &str, link: LinkOptions, spec: DemoSpec) -> Result<Self, String> {
        let link = Link::create(link)?;
        let logs =
            std::env::temp_dir().join(format!("kvbridge-netns-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&logs)
            .map_err(|e| format!("cannot create {}: {e}", logs.display()))?;
        let mut d = Deployment {
            link,
            logs,
            procs: Vec::new(),
            ends: BTreeMap::new(),
            first_chunk: BTreeMap::new(),
            canaries: Vec::new(),
            done: BTreeMap::new(),
            released: Default::default(),
            prefill_starts: 0,
            spec,
        };
        let prefill = d.spawn_prefill()?;
        d.procs.push(prefill);
        d.wait_ready(0)?;
        for r in 0..d.spec.decode_ranks {
            let mut args = d.common_args();
            args.extend(
                [
                    "--role",
                    "decode",
                    "--rank",
                    &r.to_string(),
                    "--bind-addr",
                    &d.link.b.addr.to_string(),
                    "--bootstrap",
                    &d.bootstrap(),
                ]
                .map(str::to_owned),
            );
            let log = d.logs.join(format!("decode-{r}.log"));
            let p = Proc::spawn(
                &format!("decode {r}"),
                &d.link.b.netns,
                &d.spec.exe,
                &args,
                &d.env(),
                &log,
            )?;
            d.procs.push(p);
            d.wait_ready(r as usize + 1)?;
        }
        Ok(d)
    }

    fn common_args(&self) -> Vec<String> {
        let mut a = self.spec.args.clone();
        a.extend(
            [
                "--serve",
                "--bootstrap-port",
                &self.spec.bootstrap_port.to_string(),
            ]
            .map(str::to_owned),
        );
        a
    }

    fn env(&self) -> Vec<(&str, &str)> {
        let mut env = vec![("KVBRIDGE_DEMO_SECRET", self.spec.secret.as_str())];
        env.extend(self.spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        env
    }

    /// The prefill's bootstrap address (`host:port`).
    pub fn bootstrap(&self) -> String {
        format!("{}:{}", self.link.a.addr, self.spec.bootstrap_port)
    }

    /// Starts a prefill process (not yet in [`procs`](Self::procs)) at the same address.
    pub fn spawn_prefill(&mut self) -> Result<Proc, String> {
        self.prefill_starts += 1;
        let mut args = self.common_args();
        args.extend(
            [
                "--role",
                "prefill",
                "--bind-addr",
                &self.link.a.addr.to_string(),
            ]
            .map(str::to_owned),
        );
        let log = self
            .logs
            .join(format!("prefill-{}.log", self.prefill_starts));
        Proc::spawn(
            "prefill",
            &self.link.a.netns,
            &self.spec.exe,
            &args,
            &self.env(),
            &log,
        )
    }

    /// Kills the prefill and starts a new one at the same address, ready (bounded).
    pub fn restart_prefill(&mut self) -> Result<(), String> {
        self.procs[0].kill();
        let p = self.spawn_prefill()?;
        self.procs[0] = p;
        self.wait_ready(0)
    }

    /// Reads every event that arrived; returns whether any did.
    pub fn pump(&mut self) -> bool {
        let mut any = false;
        for idx in 0..self.procs.len() {
            while let Some((at, line)) = self.procs[idx].try_line() {
                any = true;
                self.on_line(idx, at, &line);
            }
        }
        any
    }

    fn on_line(&mut self, idx: usize, at: Instant, line: &str) {
        let Ok(ev) = serde_json::from_str::<Value>(line) else {
            return;
        };
        let request = ev["request"].as_u64().map(|r| r as u32);
        let kind = ev["event"].as_str().unwrap_or("");
        if let (Some(r), "sent" | "verified" | "failed") = (request, kind) {
            self.released.insert((idx, r));
        }
        match (ev["event"].as_str().unwrap_or(""), request) {
            ("chunk", Some(r)) => {
                self.first_chunk.entry(r).or_insert(at);
            }
            ("sent" | "verified", Some(r)) => {
                self.ends.insert(
                    (idx, r),
                    End {
                        at,
                        ok: true,
                        reason: String::new(),
                        bytes: ev["bytes"].as_u64().unwrap_or(0),
                    },
                );
            }
            // A decode rank's room fails (`room_failed`) before its fence; `failed` follows.
            ("failed" | "room_failed", Some(r)) => {
                self.ends.entry((idx, r)).or_insert(End {
                    at,
                    ok: false,
                    reason: ev["reason"].as_str().unwrap_or("").to_owned(),
                    bytes: 0,
                });
            }
            ("canary", Some(r)) => self.canaries.push((
                idx,
                r,
                Canary {
                    bytes: ev["bytes_checked"].as_u64().unwrap_or(0),
                    fenced: ev["fenced"].as_bool().unwrap_or(false),
                    changed: ev["changed"].as_str().map(str::to_owned),
                },
            )),
            ("done", _) => {
                self.done.insert(idx, ev);
            }
            ("ready", _) => {
                self.done.remove(&idx);
            }
            _ => {}
        }
    }

    /// Waits (bounded) until process `idx` says it is ready.
    pub fn wait_ready(&mut self, idx: usize) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let Some((at, line)) = self.procs[idx].next_line(deadline) else {
                return Err(format!(
                    "{} did not get ready within 60 s; its log ({}):\n{}",
                    self.procs[idx].label,
                    self.procs[idx].log.display(),
                    self.procs[idx].log_tail(4000)
                ));
            };
            if line.contains("\"event\":\"ready\"") {
                return Ok(());
            }
            self.on_line(idx, at, &line);
        }
    }

    /// Names requests `range` to every process.
    pub fn run(&mut self, range: std::ops::Range<u32>) -> Result<(), String> {
        for i in range {
            for p in &mut self.procs {
                p.send(&format!("run {i}"))?;
            }
        }
        Ok(())
    }

    /// Polls events until `done(self)` or `limit` passed; false on the limit.
    pub fn until(&mut self, limit: Duration, done: impl Fn(&Self) -> bool) -> bool {
        let end = Instant::now() + limit;
        loop {
            self.pump();
            if done(self) {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Every process ended each request of `range`.
    pub fn ended(&self, range: std::ops::Range<u32>) -> bool {
        range
            .into_iter()
            .all(|r| (0..self.procs.len()).all(|i| self.ends.contains_key(&(i, r))))
    }

    /// Waits (bounded) until every decode rank released the pool slots of `range` (a failed
    /// room's after its fence or fence timeout), so new requests find free slots at once.
    pub fn wait_released(&mut self, range: std::ops::Range<u32>, limit: Duration) -> bool {
        let n = self.procs.len();
        self.until(limit, |d| {
            range
                .clone()
                .all(|r| (1..n).all(|i| d.released.contains(&(i, r))))
        })
    }

    /// Waits (bounded) for the first chunk of `request`: a transfer is in flight.
    pub fn wait_transferring(&mut self, request: u32) -> Instant {
        assert!(
            self.until(Duration::from_secs(30), |d| d
                .first_chunk
                .contains_key(&request)),
            "request {request} never started transferring; logs in {}",
            self.logs.display()
        );
        self.first_chunk[&request]
    }

    /// Waits for every process to end `range`, failing with the logs after `limit`.
    pub fn wait_ended(&mut self, range: std::ops::Range<u32>, limit: Duration) {
        let r = range.clone();
        if !self.until(limit, |d| d.ended(r.clone())) {
            let missing: Vec<String> = range
                .flat_map(|r| (0..self.procs.len()).map(move |i| (i, r)))
                .filter(|k| !self.ends.contains_key(k))
                .map(|(i, r)| format!("{} request {r}", self.procs[i].label))
                .collect();
            panic!(
                "not ended within {limit:?}: {}; logs in {}",
                missing.join(", "),
                self.logs.display()
            );
        }
    }

    /// Asserts every process succeeded every request of `range`.
    pub fn assert_succeeded(&self, range: std::ops::Range<u32>) {
        for r in range {
            for (i, p) in self.procs.iter().enumerate() {
                let e = &self.ends[&(i, r)];
                assert!(
                    e.ok,
                    "{} request {r} failed after the fault healed: {}",
                    p.label, e.reason
                );
            }
        }
    }

    /// Ends every process (`finish`), bounded, and asserts none holds a room.
    pub fn finish(&mut self) {
        for i in (0..self.procs.len()).rev() {
            let _ = self.procs[i].send("finish");
            let ok = self.until(Duration::from_secs(30), |d| d.done.contains_key(&i));
            assert!(
                ok,
                "{} did not finish within 30 s; log:\n{}",
                self.procs[i].label,
                self.procs[i].log_tail(4000)
            );
            let left = self.done[&i]["rooms_left"].as_u64();
            assert_eq!(
                left,
                Some(0),
                "{} still holds rooms: {}",
                self.procs[i].label,
                self.done[&i]
            );
        }
    }

    /// One line of the fault table for `requests` after a fault at `t0`.
    pub fn table_row(
        &self,
        fault: &str,
        requests: std::ops::Range<u32>,
        t0: Instant,
        recovery: &str,
    ) -> String {
        let mut ends = Vec::new();
        for r in requests {
            for (i, p) in self.procs.iter().enumerate() {
                if let Some(e) = self.ends.get(&(i, r)) {
                    let after = e.at.saturating_duration_since(t0).as_secs_f64();
                    let how = if e.ok {
                        "succeeded".to_owned()
                    } else {
                        format!("failed: {}", first_line(&e.reason))
                    };
                    ends.push(format!("req {r} {}: {how} ({after:.1} s)", p.label));
                }
            }
        }
        let changed = self
            .canaries
            .iter()
            .filter(|c| c.2.changed.is_some())
            .count();
        let bytes: u64 = self.canaries.iter().map(|c| c.2.bytes).sum();
        let fenced = self.canaries.iter().filter(|c| c.2.fenced).count();
        format!(
            "FAULT-TABLE | {fault} | {} | {} | canaries {} ({fenced} after a proven fence, {} bytes checked, {changed} changed) | {recovery}",
            self.transport(),
            ends.join("; "),
            self.canaries.len(),
            bytes
        )
    }

    /// The transport the processes use (their `--transport`).
    pub fn transport(&self) -> &str {
        let a = &self.spec.args;
        a.iter()
            .position(|x| x == "--transport")
            .and_then(|i| a.get(i + 1))
            .map_or("shm", String::as_str)
    }

    /// Asserts every canary checked so far is intact, and returns how many there were.
    pub fn assert_canaries(&self) -> usize {
        for (i, r, c) in &self.canaries {
            assert!(
                c.changed.is_none(),
                "{} request {r}: {}",
                self.procs[*i].label,
                c.changed.as_deref().unwrap_or("")
            );
            assert!(
                c.bytes > 0,
                "{} request {r}: the canary covered no byte",
                self.procs[*i].label
            );
        }
        self.canaries.len()
    }
}

/// The first line of `s`, at most 160 characters.
pub fn first_line(s: &str) -> String {
    let l = s.lines().next().unwrap_or("");
    if l.len() > 160 {
        format!(
            "{}...",
            &l[..l.char_indices().nth(157).map_or(l.len(), |c| c.0)]
        )
    } else {
        l.to_owned()
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        // The processes first, then (the fields' own drops) the namespaces.
        for p in &mut self.procs {
            p.kill();
        }
    }
}
