//! Counters and a latency histogram per agent, read as a [`MetricsSnapshot`].

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

use crate::state::{FailureCause, RoomState};

/// Upper bounds (milliseconds) of the transfer latency histogram buckets; a last, unbounded
/// bucket catches the rest.
pub const LATENCY_BUCKETS_MS: [u64; 14] = [
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000,
];

/// A fixed-bucket latency histogram.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LatencyHistogram {
    /// Upper bound of each bucket in milliseconds ([`LATENCY_BUCKETS_MS`]).
    pub bounds_ms: Vec<u64>,
    /// Samples per bucket; one more entry than `bounds_ms` (the overflow bucket).
    pub counts: Vec<u64>,
    /// Number of samples.
    pub count: u64,
    /// Sum of all samples in microseconds.
    pub sum_us: u64,
}

impl LatencyHistogram {
    fn new() -> Self {
        Self {
            bounds_ms: LATENCY_BUCKETS_MS.to_vec(),
            counts: vec![0; LATENCY_BUCKETS_MS.len() + 1],
            count: 0,
            sum_us: 0,
        }
    }

    fn record(&mut self, d: Duration) {
        let ms = d.as_millis();
        let i = LATENCY_BUCKETS_MS
            .iter()
            .position(|&b| ms <= u128::from(b))
            .unwrap_or(LATENCY_BUCKETS_MS.len());
        self.counts[i] += 1;
        self.count += 1;
        self.sum_us = self
            .sum_us
            .saturating_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    /// The upper bound (ms) of the bucket holding quantile `q` (0..=1); `None` when empty or
    /// in the overflow bucket.
    pub fn quantile_upper_ms(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return self.bounds_ms.get(i).copied();
            }
        }
        None
    }
}

/// A point-in-time copy of an agent's metrics.
///
/// Every counter counts from the agent's start and never decreases; the unit of each field is
/// stated below (docs/ARCHITECTURE.md, "Observability", has the same table). A batch is one
/// transport batch (one chunk's KV, or the aux rows, for one decode peer); each posted batch
/// ends up counted once, in `batches_done` or in `batches_failed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MetricsSnapshot {
    /// Rooms currently held, by state (rooms).
    pub rooms_by_state: BTreeMap<RoomState, u64>,
    /// Rooms created since start (rooms).
    pub rooms_created: u64,
    /// Rooms that reached Success (rooms).
    pub rooms_succeeded: u64,
    /// Rooms that reached Failed (rooms).
    pub rooms_failed: u64,
    /// Bytes the transport copied in batches that completed (bytes; prefill: sent, decode: 0,
    /// the decode does not post): the sum of the posted byte ranges, KV and aux rows. The page
    /// path copies whole pages, so a chunk whose last page is partly filled counts the whole
    /// page; the row paths (DCP, resharding, head slices) count only the rows moved. A failed
    /// or cancelled batch's bytes are not counted.
    pub bytes_transferred: u64,
    /// Batches posted to the transport (batches).
    pub batches_posted: u64,
    /// Batches that completed (batches).
    pub batches_done: u64,
    /// Batches that failed, timed out, or were cancelled by the fence after the room failed
    /// (batches).
    pub batches_failed: u64,
    /// Transfer operations posted, summed over all batches (descriptors; a strided op is
    /// one).
    pub descriptors_posted: u64,
    /// Rows the posted operations cover (rows; a strided op of `count` rows counts `count`,
    /// a contiguous one 1): what a transport without strided ops moves one by one.
    pub rows_posted: u64,
    /// Batches posted from a pack buffer (batches; prefill with pack buffers).
    pub pack_batches: u64,
    /// Bytes gathered into pack buffers (bytes).
    pub pack_bytes: u64,
    /// Times a batch found every pack buffer in use and waited for one (waits).
    pub pack_waits: u64,
    /// Failed rooms by cause (rooms; causes in docs/errors.md, "Transfer failure causes").
    pub failures_by_cause: BTreeMap<FailureCause, u64>,
    /// Rooms whose pages were proven fenced after a failure (rooms; decode).
    pub rooms_fenced: u64,
    /// Control messages sent (messages).
    pub control_sent: u64,
    /// Control messages received (messages).
    pub control_received: u64,
    /// Time from a room's creation to Success (milliseconds buckets, microsecond sum).
    pub transfer_latency: LatencyHistogram,
}

/// The live counters behind a snapshot (shared by an agent's tasks).
#[derive(Debug)]
pub(crate) struct Metrics {
    pub(crate) rooms_created: AtomicU64,
    pub(crate) rooms_succeeded: AtomicU64,
    pub(crate) rooms_failed: AtomicU64,
    pub(crate) bytes_transferred: AtomicU64,
    pub(crate) batches_posted: AtomicU64,
    pub(crate) batches_done: AtomicU64,
    pub(crate) batches_failed: AtomicU64,
    pub(crate) descriptors_posted: AtomicU64,
    pub(crate) rows_posted: AtomicU64,
    pub(crate) pack_batches: AtomicU64,
    pub(crate) pack_bytes: AtomicU64,
    pub(crate) pack_waits: AtomicU64,
    pub(crate) rooms_fenced: AtomicU64,
    pub(crate) control_sent: AtomicU64,
    pub(crate) control_received: AtomicU64,
    /// Only [`Metrics::with_recorded`] locks it.
    recorded: Mutex<Recorded>,
}

/// The metrics that are not plain counters.
#[derive(Debug)]
struct Recorded {
    failures: BTreeMap<FailureCause, u64>,
    latency: LatencyHistogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            rooms_created: AtomicU64::new(0),
            rooms_succeeded: AtomicU64::new(0),
            rooms_failed: AtomicU64::new(0),
            bytes_transferred: AtomicU64::new(0),
            batches_posted: AtomicU64::new(0),
            batches_done: AtomicU64::new(0),
            batches_failed: AtomicU64::new(0),
            descriptors_posted: AtomicU64::new(0),
            rows_posted: AtomicU64::new(0),
            pack_batches: AtomicU64::new(0),
            pack_bytes: AtomicU64::new(0),
            pack_waits: AtomicU64::new(0),
            rooms_fenced: AtomicU64::new(0),
            control_sent: AtomicU64::new(0),
            control_received: AtomicU64::new(0),
            recorded: Mutex::new(Recorded {
                failures: BTreeMap::new(),
                latency: LatencyHistogram::new(),
            }),
        }
    }
}

pub(crate) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Ordering::Relaxed);
}

impl Metrics {
    /// Runs `f` on the recorded metrics under their lock (the only place that takes it).
    fn with_recorded<R>(&self, f: impl FnOnce(&mut Recorded) -> R) -> R {
        let mut r = self.recorded.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut r)
    }

    pub(crate) fn failed(&self, cause: FailureCause) {
        inc(&self.rooms_failed);
        self.with_recorded(|r| *r.failures.entry(cause).or_default() += 1);
    }

    pub(crate) fn succeeded(&self, latency: Duration) {
        inc(&self.rooms_succeeded);
        self.with_recorded(|r| r.latency.record(latency));
    }

    /// Counts rooms by state, for [`snapshot`](Self::snapshot).
    pub(crate) fn count_states(
        states: impl Iterator<Item = RoomState>,
    ) -> BTreeMap<RoomState, u64> {
        let mut m = BTreeMap::new();
        for s in states {
            *m.entry(s).or_insert(0) += 1;
        }
        m
    }

    pub(crate) fn snapshot(&self, rooms_by_state: BTreeMap<RoomState, u64>) -> MetricsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let (failures_by_cause, transfer_latency) =
            self.with_recorded(|r| (r.failures.clone(), r.latency.clone()));
        MetricsSnapshot {
            rooms_by_state,
            rooms_created: get(&self.rooms_created),
            rooms_succeeded: get(&self.rooms_succeeded),
            rooms_failed: get(&self.rooms_failed),
            bytes_transferred: get(&self.bytes_transferred),
            batches_posted: get(&self.batches_posted),
            batches_done: get(&self.batches_done),
            batches_failed: get(&self.batches_failed),
            descriptors_posted: get(&self.descriptors_posted),
            rows_posted: get(&self.rows_posted),
            pack_batches: get(&self.pack_batches),
            pack_bytes: get(&self.pack_bytes),
            pack_waits: get(&self.pack_waits),
            failures_by_cause,
            rooms_fenced: get(&self.rooms_fenced),
            control_sent: get(&self.control_sent),
            control_received: get(&self.control_received),
            transfer_latency,
        }
    }
}

/// Prometheus text exposition (format 0.0.4), rendered from snapshots.
///
/// Names and units follow the Prometheus conventions: base units (seconds, bytes), counters
/// end in `_total`, one `# HELP` and `# TYPE` per family, each family's samples together.
/// docs/ARCHITECTURE.md ("Observability") lists the families.
pub mod prometheus {
    use std::fmt::Write as _;

    use super::{LATENCY_BUCKETS_MS, MetricsSnapshot};
    use crate::state::RoomState;

    /// The counters, each `(name, help, value of a snapshot)`.
    type Counter = (&'static str, &'static str, fn(&MetricsSnapshot) -> u64);

    const COUNTERS: [Counter; 15] = [
        (
            "kvbridge_rooms_created_total",
            "Rooms created since start.",
            |m| m.rooms_created,
        ),
        (
            "kvbridge_rooms_succeeded_total",
            "Rooms that reached Success.",
            |m| m.rooms_succeeded,
        ),
        (
            "kvbridge_rooms_failed_total",
            "Rooms that reached Failed.",
            |m| m.rooms_failed,
        ),
        (
            "kvbridge_bytes_transferred_total",
            "Bytes copied by transport batches that completed.",
            |m| m.bytes_transferred,
        ),
        (
            "kvbridge_batches_posted_total",
            "Transport batches posted.",
            |m| m.batches_posted,
        ),
        (
            "kvbridge_batches_done_total",
            "Transport batches that completed.",
            |m| m.batches_done,
        ),
        (
            "kvbridge_batches_failed_total",
            "Transport batches that failed, timed out or were cancelled by a fence.",
            |m| m.batches_failed,
        ),
        (
            "kvbridge_descriptors_posted_total",
            "Transfer operations posted (a strided operation counts one).",
            |m| m.descriptors_posted,
        ),
        (
            "kvbridge_rows_posted_total",
            "Rows the posted operations cover.",
            |m| m.rows_posted,
        ),
        (
            "kvbridge_pack_batches_total",
            "Batches posted from a pack buffer.",
            |m| m.pack_batches,
        ),
        (
            "kvbridge_pack_bytes_total",
            "Bytes gathered into pack buffers.",
            |m| m.pack_bytes,
        ),
        (
            "kvbridge_pack_waits_total",
            "Times a batch waited for a free pack buffer.",
            |m| m.pack_waits,
        ),
        (
            "kvbridge_rooms_fenced_total",
            "Failed rooms whose pages were proven fenced.",
            |m| m.rooms_fenced,
        ),
        (
            "kvbridge_control_messages_sent_total",
            "Control messages sent.",
            |m| m.control_sent,
        ),
        (
            "kvbridge_control_messages_received_total",
            "Control messages received.",
            |m| m.control_received,
        ),
    ];

    /// Renders several agents' snapshots as one exposition, each agent's samples carrying its
    /// labels (e.g. `[("role", "prefill"), ("rank", "0")]`). Label names outside
    /// `[a-zA-Z_][a-zA-Z0-9_]*` have the other characters replaced by `_`; values are escaped.
    pub fn render<'a, L>(agents: impl IntoIterator<Item = (L, &'a MetricsSnapshot)>) -> String
    where
        L: AsRef<[(&'a str, &'a str)]>,
    {
        let agents: Vec<(String, &MetricsSnapshot)> = agents
            .into_iter()
            .map(|(l, m)| (label_set(l.as_ref()), m))
            .collect();
        let mut out = String::new();
        latency(&mut out, &agents);
        for (name, help, value) in COUNTERS {
            family(&mut out, name, "counter", help);
            for (labels, m) in &agents {
                sample(&mut out, name, labels, &[], value(m));
            }
        }
        family(
            &mut out,
            "kvbridge_failed_transfers_total",
            "counter",
            "Failed rooms by cause (docs/errors.md, Transfer failure causes).",
        );
        for (labels, m) in &agents {
            for (cause, n) in &m.failures_by_cause {
                let cause = [("cause", cause.as_str())];
                sample(
                    &mut out,
                    "kvbridge_failed_transfers_total",
                    labels,
                    &cause,
                    *n,
                );
            }
        }
        family(
            &mut out,
            "kvbridge_rooms",
            "gauge",
            "Rooms currently held, by state.",
        );
        for (labels, m) in &agents {
            for state in RoomState::ALL {
                let n = m.rooms_by_state.get(&state).copied().unwrap_or(0);
                let state = [("state", state.as_str())];
                sample(&mut out, "kvbridge_rooms", labels, &state, n);
            }
        }
        out
    }

    fn latency(out: &mut String, agents: &[(String, &MetricsSnapshot)]) {
        const NAME: &str = "kvbridge_transfer_latency_seconds";
        family(
            out,
            NAME,
            "histogram",
            "Time from a room's creation to Success, in seconds.",
        );
        for (labels, m) in agents {
            let h = &m.transfer_latency;
            let mut cumulative = 0u64;
            for (i, n) in h.counts.iter().enumerate() {
                cumulative += n;
                let le = match LATENCY_BUCKETS_MS.get(i) {
                    Some(ms) => format!("{}", *ms as f64 / 1000.0),
                    None => "+Inf".to_owned(),
                };
                let bucket = format!("{NAME}_bucket");
                sample(out, &bucket, labels, &[("le", &le)], cumulative);
            }
            let sum = h.sum_us as f64 / 1e6;
            let _ = writeln!(out, "{NAME}_sum{} {sum}", braces(labels, ""));
            sample(out, &format!("{NAME}_count"), labels, &[], h.count);
        }
    }

    fn family(out: &mut String, name: &str, kind: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(out: &mut String, name: &str, labels: &str, extra: &[(&str, &str)], v: u64) {
        let _ = writeln!(out, "{name}{} {v}", braces(labels, &label_set(extra)));
    }

    /// `{a="1",b="2"}` from two rendered label lists, or nothing when both are empty.
    fn braces(a: &str, b: &str) -> String {
        match (a.is_empty(), b.is_empty()) {
            (true, true) => String::new(),
            (false, true) => format!("{{{a}}}"),
            (true, false) => format!("{{{b}}}"),
            (false, false) => format!("{{{a},{b}}}"),
        }
    }

    fn label_set(labels: &[(&str, &str)]) -> String {
        let mut s = String::new();
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str(&label_name(k));
            s.push_str("=\"");
            for c in v.chars() {
                match c {
                    '\\' => s.push_str("\\\\"),
                    '"' => s.push_str("\\\""),
                    '\n' => s.push_str("\\n"),
                    c => s.push(c),
                }
            }
            s.push('"');
        }
        s
    }

    fn label_name(k: &str) -> String {
        let mut s: String = k
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        if !s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
            s.insert(0, '_');
        }
        s
    }
}

impl MetricsSnapshot {
    /// This snapshot in Prometheus text format, every sample carrying `labels`
    /// (e.g. `&[("role", "prefill"), ("rank", "0")]`); [`prometheus::render`] renders several
    /// agents at once.
    pub fn to_prometheus(&self, labels: &[(&str, &str)]) -> String {
        prometheus::render([(labels, self)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_and_quantiles() {
        let mut h = LatencyHistogram::new();
        assert_eq!(h.quantile_upper_ms(0.5), None);
        for ms in [1, 3, 3, 40, 100_000] {
            h.record(Duration::from_millis(ms));
        }
        assert_eq!(h.count, 5);
        assert_eq!(h.counts[0], 1);
        assert_eq!(h.counts[2], 2);
        assert_eq!(h.counts[5], 1);
        assert_eq!(*h.counts.last().unwrap(), 1);
        assert_eq!(h.quantile_upper_ms(0.5), Some(5));
        assert_eq!(h.quantile_upper_ms(0.8), Some(50));
        assert_eq!(h.quantile_upper_ms(1.0), None);
    }

    /// One parsed sample line: name, labels (unescaped), value.
    type Sample = (String, BTreeMap<String, String>, f64);

    /// A strict reader of the text exposition format: every family announced by `# HELP`
    /// then `# TYPE` before its samples, samples of a family together, label values quoted
    /// with `\\`, `\"` and `\n` escapes. Returns the families' types and the samples.
    fn parse_exposition(text: &str) -> (BTreeMap<String, String>, Vec<Sample>) {
        let mut types = BTreeMap::new();
        let mut samples = Vec::new();
        let mut current: Option<String> = None;
        let mut pending_help: Option<String> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap().to_owned();
                assert!(!types.contains_key(&name), "family {name} announced twice");
                pending_help = Some(name);
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert_eq!(
                    pending_help.take().as_deref(),
                    Some(name),
                    "HELP precedes TYPE"
                );
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{kind}");
                types.insert(name.to_owned(), kind.to_owned());
                current = Some(name.to_owned());
                continue;
            }
            assert!(!line.starts_with('#'), "{line}");
            let name_end = line.find(['{', ' ']).unwrap();
            let name = &line[..name_end];
            let family = current.as_deref().expect("a sample after its TYPE");
            let ok = name == family
                || (types[family] == "histogram"
                    && [
                        format!("{family}_bucket"),
                        format!("{family}_sum"),
                        format!("{family}_count"),
                    ]
                    .contains(&name.to_owned()));
            assert!(ok, "sample {name} outside its family {family}");
            let mut labels = BTreeMap::new();
            let mut rest = &line[name_end..];
            if let Some(r) = rest.strip_prefix('{') {
                let mut chars = r.char_indices();
                loop {
                    let (start, c) = chars.next().unwrap();
                    if c == '}' {
                        rest = &r[start + 1..];
                        break;
                    }
                    let eq = r[start..].find('=').unwrap() + start;
                    let key = r[start..eq].trim_start_matches(',').to_owned();
                    assert!(
                        key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                        "{key}"
                    );
                    while chars.next().unwrap().0 < eq {}
                    assert_eq!(chars.next().unwrap().1, '"');
                    let mut value = String::new();
                    loop {
                        match chars.next().unwrap().1 {
                            '"' => break,
                            '\\' => match chars.next().unwrap().1 {
                                'n' => value.push('\n'),
                                c @ ('\\' | '"') => value.push(c),
                                c => panic!("bad escape \\{c}"),
                            },
                            '\n' => panic!("raw newline in a label value"),
                            c => value.push(c),
                        }
                    }
                    labels.insert(key, value);
                    if let Some((_, ',')) = chars.clone().next() {
                        chars.next();
                    }
                }
            }
            let value: f64 = rest.trim_start_matches(' ').parse().unwrap();
            samples.push((name.to_owned(), labels, value));
        }
        (types, samples)
    }

    fn snapshot(seed: u64) -> MetricsSnapshot {
        let m = Metrics::default();
        add(&m.bytes_transferred, 1_000 + seed);
        add(&m.batches_posted, 7);
        add(&m.batches_done, 6);
        inc(&m.batches_failed);
        add(&m.descriptors_posted, 40);
        add(&m.rows_posted, 400);
        m.failed(FailureCause::PeerLost);
        m.failed(FailureCause::PeerLost);
        m.failed(FailureCause::BatchTimeout);
        for ms in [1, 3, 40, 100_000] {
            m.succeeded(Duration::from_millis(ms + seed));
        }
        let states = [
            RoomState::Transferring,
            RoomState::Transferring,
            RoomState::Failed,
        ];
        m.snapshot(Metrics::count_states(states.into_iter()))
    }

    fn value(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
        let hits: Vec<f64> = samples
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && want
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.2)
            .collect();
        assert_eq!(hits.len(), 1, "{name} {want:?}: {hits:?}");
        hits[0]
    }

    #[test]
    fn prometheus_text_parses_and_carries_the_snapshot() {
        let (p, d) = (snapshot(0), snapshot(1));
        // A label value with every character the format escapes.
        let text = prometheus::render([
            (&[("role", "prefill"), ("rank", "0")][..], &p),
            (&[("role", "decode"), ("rank", "a\"b\\c\nd")][..], &d),
        ]);
        let (types, samples) = parse_exposition(&text);
        assert_eq!(types["kvbridge_transfer_latency_seconds"], "histogram");
        assert_eq!(types["kvbridge_rooms"], "gauge");
        assert!(
            types
                .iter()
                .filter(|(n, _)| n.ends_with("_total"))
                .all(|(_, t)| t == "counter")
        );
        for (labels, m) in [(("role", "prefill"), &p), (("role", "decode"), &d)] {
            let l = [labels];
            let v = |name: &str| value(&samples, name, &l) as u64;
            assert_eq!(v("kvbridge_bytes_transferred_total"), m.bytes_transferred);
            assert_eq!(v("kvbridge_descriptors_posted_total"), m.descriptors_posted);
            assert_eq!(v("kvbridge_rows_posted_total"), m.rows_posted);
            assert_eq!(v("kvbridge_batches_posted_total"), m.batches_posted);
            assert_eq!(v("kvbridge_batches_failed_total"), m.batches_failed);
            let cause = |c| {
                value(
                    &samples,
                    "kvbridge_failed_transfers_total",
                    &[labels, ("cause", c)],
                )
            };
            assert_eq!(cause("peer_lost"), 2.0);
            assert_eq!(cause("batch_timeout"), 1.0);
            let state = |s| value(&samples, "kvbridge_rooms", &[labels, ("state", s)]);
            assert_eq!(
                (state("Transferring"), state("Failed"), state("Success")),
                (2.0, 1.0, 0.0)
            );
            // Buckets are cumulative, in seconds, and +Inf equals the count.
            let buckets: Vec<(String, f64)> = samples
                .iter()
                .filter(|(n, l, _)| {
                    n == "kvbridge_transfer_latency_seconds_bucket" && l["role"] == labels.1
                })
                .map(|(_, l, v)| (l["le"].clone(), *v))
                .collect();
            assert_eq!(buckets.len(), LATENCY_BUCKETS_MS.len() + 1);
            assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{buckets:?}");
            assert_eq!(buckets[0].0, "0.001");
            assert_eq!(buckets.last().unwrap().0, "+Inf");
            let count = value(&samples, "kvbridge_transfer_latency_seconds_count", &l);
            assert_eq!(buckets.last().unwrap().1, count);
            assert_eq!(count as u64, m.transfer_latency.count);
            let mut cumulative = 0;
            for (i, (le, n)) in buckets.iter().enumerate() {
                cumulative += m.transfer_latency.counts[i];
                assert_eq!(*n as u64, cumulative, "le={le}");
            }
            let sum = value(&samples, "kvbridge_transfer_latency_seconds_sum", &l);
            assert!(
                (sum - m.transfer_latency.sum_us as f64 / 1e6).abs() < 1e-9,
                "{sum}"
            );
        }
        assert_eq!(
            value(
                &samples,
                "kvbridge_rooms_failed_total",
                &[("rank", "a\"b\\c\nd")]
            ),
            3.0
        );
        assert_eq!(p.to_prometheus(&[("role", "prefill")]).lines().count(), {
            let single = prometheus::render([(&[("role", "prefill")][..], &p)]);
            single.lines().count()
        });
        // No labels at all is still valid exposition.
        let (_, bare) = parse_exposition(&p.to_prometheus(&[]));
        assert!(
            bare.iter()
                .any(|(n, l, _)| n == "kvbridge_rooms_created_total" && l.is_empty())
        );
        // Label names are made valid.
        let odd = p.to_prometheus(&[("1-rank", "0")]);
        assert!(odd.contains("_1_rank=\"0\""), "{odd}");
        parse_exposition(&odd);
    }

    proptest::proptest! {
        /// Any snapshot and any label value render as valid exposition that carries the
        /// snapshot's values back.
        #[test]
        fn any_snapshot_round_trips_through_the_exposition(
            latencies_us in proptest::collection::vec(0u64..60_000_000, 0..40),
            bytes in proptest::prelude::any::<u64>(),
            failures in proptest::collection::vec(0usize..3, 0..10),
            label in "[ -~\\n\\\\\"]{0,12}",
        ) {
            let m = Metrics::default();
            add(&m.bytes_transferred, bytes);
            let causes = [FailureCause::PeerLost, FailureCause::Aborted, FailureCause::Planning];
            for &c in &failures {
                m.failed(causes[c]);
            }
            for &us in &latencies_us {
                m.succeeded(Duration::from_micros(us));
            }
            let snap = m.snapshot(BTreeMap::new());
            let text = snap.to_prometheus(&[("rank", label.as_str())]);
            let (_, samples) = parse_exposition(&text);
            let l = [("rank", label.as_str())];
            proptest::prop_assert_eq!(
                value(&samples, "kvbridge_bytes_transferred_total", &l),
                bytes as f64
            );
            proptest::prop_assert_eq!(
                value(&samples, "kvbridge_rooms_failed_total", &l) as usize,
                failures.len()
            );
            let count = value(&samples, "kvbridge_transfer_latency_seconds_count", &l);
            proptest::prop_assert_eq!(count as usize, latencies_us.len());
            let inf = samples
                .iter()
                .find(|(n, ls, _)| n.ends_with("_bucket") && ls["le"] == "+Inf")
                .unwrap();
            proptest::prop_assert_eq!(inf.2, count);
            for (n, ls, _) in &samples {
                proptest::prop_assert_eq!(&ls["rank"], &label, "{}", n);
            }
        }
    }
}
