//! What a seed draws: the topology, the fault rates, the rooms and when each side's caller
//! creates, aborts and clears them, and the process restarts.

use std::time::Duration;

use kvbridge_handshake::{PeerDescriptor, Role};

use super::rng::Rng;
use kvbridge_control::RoomId;

const SEC: Duration = Duration::from_secs(1);

/// The agents' timeouts in the simulation: short, so a schedule ends within minutes of
/// virtual time, and ordered as the defaults are (a fence outlasts a batch and its grace).
pub(super) const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(20);
pub(super) const WAITING_TIMEOUT: Duration = Duration::from_secs(20);
pub(super) const BATCH_TIMEOUT: Duration = Duration::from_secs(3);
pub(super) const FENCE_GRACE: Duration = SEC;
pub(super) const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
pub(super) const HEARTBEAT_MAX_FAILURES: u32 = 3;
pub(super) const CONTROL_SEND_TIMEOUT: Duration = SEC;
pub(super) const FENCE_TIMEOUT: Duration = Duration::from_secs(12);
pub(super) const ABORT_RESEND_INTERVAL: Duration = SEC;
/// How late past a promised instant a check still accepts (the callers react within it).
pub(super) const SLACK: Duration = SEC;
/// Tokens per page (DCP 1, so also the virtual page).
pub(super) const PAGE_TOKENS: u64 = 16;
/// How often a decode caller asks for a fence before it gives up the proof and clears.
pub(super) const FENCE_ASKS: u32 = 3;
/// How often a caller retries a creation the agent refused (the id still held, no pages).
pub(super) const CREATE_TRIES: u32 = 60;
pub(super) const ADDR: &str = "bootstrap.sim:8998";

/// A deliberately broken rule of the harness, to show the invariants catch it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Sabotage {
    /// The prefill driver keeps posting queued chunks after `CancelBatches`.
    pub(super) post_after_cancel: bool,
    /// The transport reports some batches done without their bytes landing.
    pub(super) done_without_bytes: bool,
    /// The prefill driver never reports `DriverEnded`.
    pub(super) drop_driver_ended: bool,
    /// A cancel returns at once while its batch goes on and may still land.
    pub(super) cancel_lies: bool,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Topology {
    pub(super) mla: bool,
    pub(super) prefill_tp: u32,
    pub(super) decode_tp: u32,
    pub(super) has_aux: bool,
}

impl Topology {
    pub(super) fn descriptor(&self, role: Role, rank: u32) -> PeerDescriptor {
        let tp = match role {
            Role::Prefill => self.prefill_tp,
            Role::Decode => self.decode_tp,
        };
        let b = if self.mla {
            PeerDescriptor::mla(role, PAGE_TOKENS, 2, 64)
        } else {
            PeerDescriptor::mha(role, PAGE_TOKENS, 1, 8, 128).kv_cache_dtype("bfloat16")
        };
        let aux = if self.has_aux { vec![32] } else { Vec::new() };
        b.attn_tp(tp, rank)
            .aux_item_lens(aux)
            .build()
            .expect("a valid simulated descriptor")
    }
}

/// Fault rates and delays of one schedule.
#[derive(Debug, Clone)]
pub(super) struct Knobs {
    pub(super) topology: Topology,
    pub(super) message_delay_ms: u64,
    pub(super) p_drop: f64,
    pub(super) p_duplicate: f64,
    pub(super) p_send_fails: f64,
    pub(super) batch_ms: u64,
    pub(super) p_batch_error: f64,
    pub(super) p_batch_lost: f64,
    pub(super) p_batch_slow: f64,
    pub(super) p_batch_hangs: f64,
    pub(super) p_cancel_hangs: f64,
    pub(super) p_cancel_fails: f64,
    pub(super) p_connect_fails: f64,
    pub(super) p_resolve_fails: f64,
    /// How often a room's decode ranks advertise a prefix the prefill cannot plan.
    pub(super) p_bad_prefix: f64,
}

impl Knobs {
    /// Whether every batch of the schedule can be proven final (so every fence must be).
    pub(super) fn fences_provable(&self) -> bool {
        self.p_batch_hangs == 0.0 && self.p_cancel_hangs == 0.0 && self.p_cancel_fails == 0.0
    }
}

/// When one side's caller acts on one room (offsets from the start of the schedule).
#[derive(Debug, Clone, Copy)]
pub(super) struct SideTimes {
    pub(super) start: Duration,
    pub(super) abort: Option<Duration>,
    pub(super) clear: Option<Duration>,
}

/// One request: its room id (a later plan may use the id again) and what each rank's caller
/// does with it (`None`: that rank's caller never creates it).
#[derive(Debug, Clone)]
pub(super) struct RoomPlan {
    pub(super) room: RoomId,
    pub(super) tokens: u64,
    pub(super) prefix: u64,
    /// The decode ranks advertise a prefix one token past `prefix` (not a whole page).
    pub(super) misaligned: bool,
    pub(super) prefill: Vec<Option<SideTimes>>,
    pub(super) decode: Vec<Option<SideTimes>>,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Restart {
    Prefill(usize),
    Decode(usize),
}

#[derive(Debug, Clone)]
pub(super) struct Schedule {
    pub(super) knobs: Knobs,
    pub(super) plans: Vec<RoomPlan>,
    pub(super) restarts: Vec<(Duration, Restart)>,
}

impl Schedule {
    /// The schedule of `seed`: one calm in four (no faults at all), the others with fault
    /// rates drawn from zero to a few percent each.
    pub(super) fn draw(rng: &mut Rng) -> Self {
        let calm = rng.chance(0.25);
        let knobs = draw_knobs(rng, calm);
        let t = knobs.topology;
        let rooms = rng.between(10, 30) as usize;
        let caller_faults = if calm { 0.0 } else { rng.unit() * 0.15 };
        let mut plans: Vec<RoomPlan> = Vec::with_capacity(rooms);
        for i in 0..rooms {
            let mut plan = draw_plan(rng, i, &plans, t, caller_faults);
            plan.misaligned = plan.prefix + 1 < plan.tokens && rng.chance(knobs.p_bad_prefix);
            plans.push(plan);
        }
        let mut restarts = Vec::new();
        if !calm {
            for _ in 0..rng.below(3) {
                let at = rng.millis(2_000, 25_000);
                let which = if rng.chance(0.5) {
                    Restart::Decode(rng.below(u64::from(t.decode_tp)) as usize)
                } else {
                    Restart::Prefill(rng.below(u64::from(t.prefill_tp)) as usize)
                };
                restarts.push((at, which));
            }
        }
        Self {
            knobs,
            plans,
            restarts,
        }
    }

    /// The last instant a caller starts something.
    pub(super) fn last_start(&self) -> Duration {
        let sides = self
            .plans
            .iter()
            .flat_map(|p| p.prefill.iter().chain(&p.decode));
        sides.flatten().map(|s| s.start).max().unwrap_or_default()
    }
}

fn draw_knobs(rng: &mut Rng, calm: bool) -> Knobs {
    let mut topologies = Vec::new();
    for mla in [true, false] {
        for prefill_tp in [1, 2, 4] {
            for decode_tp in [1, 2, 4] {
                if prefill_tp + decode_tp <= 6 {
                    topologies.push((mla, prefill_tp, decode_tp));
                }
            }
        }
    }
    let (mla, prefill_tp, decode_tp) = rng.pick(&topologies);
    let topology = Topology {
        mla,
        prefill_tp,
        decode_tp,
        has_aux: rng.chance(0.8),
    };
    let off = if calm { 1.0 } else { 0.4 };
    Knobs {
        topology,
        message_delay_ms: rng.between(1, 40),
        p_drop: rng.probability(off, 0.05),
        p_duplicate: rng.probability(off, 0.05),
        p_send_fails: rng.probability(off, 0.02),
        batch_ms: rng.between(5, 300),
        p_batch_error: rng.probability(off, 0.04),
        p_batch_lost: rng.probability(off, 0.03),
        p_batch_slow: rng.probability(off, 0.03),
        p_batch_hangs: rng.probability(off.max(0.6), 0.03),
        p_cancel_hangs: rng.probability(off.max(0.7), 0.2),
        p_cancel_fails: rng.probability(off.max(0.7), 0.1),
        p_connect_fails: rng.probability(off.max(0.6), 0.05),
        p_resolve_fails: rng.probability(off.max(0.6), 0.05),
        p_bad_prefix: rng.probability(off.max(0.6), 0.05),
    }
}

fn draw_plan(rng: &mut Rng, i: usize, earlier: &[RoomPlan], t: Topology, faults: f64) -> RoomPlan {
    // One plan in ten uses an earlier room id again, well after that one began.
    let reuse = (!earlier.is_empty() && rng.chance(0.1))
        .then(|| &earlier[rng.below(earlier.len() as u64) as usize]);
    let (room, base) = match reuse {
        Some(e) => {
            let first = e.prefill.iter().chain(&e.decode).flatten().map(|s| s.start);
            let first = first.min().unwrap_or_default();
            (e.room, first + rng.millis(25_000, 45_000))
        }
        None => (RoomId(1000 + i as u64), rng.millis(0, 15_000)),
    };
    let pages = rng.between(1, 8);
    let tokens = (pages - 1) * PAGE_TOKENS + rng.between(1, PAGE_TOKENS);
    let prefix = rng.below(pages) * PAGE_TOKENS;
    let side = |rng: &mut Rng| {
        if rng.chance(faults * 0.3) {
            return None;
        }
        // Most creations land within a few milliseconds of each other; some seconds later,
        // so the prefill holds the decode's metadata first, or the decode waits.
        let start = if rng.chance(0.2) {
            base + rng.millis(0, 3_000)
        } else {
            base + rng.millis(0, 20)
        };
        let later = |rng: &mut Rng, p: f64| rng.chance(p).then(|| start + rng.millis(0, 4_000));
        Some(SideTimes {
            start,
            abort: later(rng, faults * 0.5),
            clear: later(rng, faults * 0.3),
        })
    };
    let prefill = (0..t.prefill_tp).map(|_| side(rng)).collect();
    let decode = (0..t.decode_tp).map(|_| side(rng)).collect();
    RoomPlan {
        room,
        tokens,
        prefix,
        misaligned: false,
        prefill,
        decode,
    }
}
