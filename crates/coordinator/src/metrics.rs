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
}
