use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

const T: &str = "t";

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn lost(peer: PeerId) -> TransportError {
    TransportError::PeerLost {
        peer,
        transport: T,
        reason: "gone".into(),
    }
}

fn is_unknown<X: std::fmt::Debug>(r: &Result<X>) -> bool {
    matches!(r, Err(TransportError::UnknownBatch { .. }))
}

/// A timer that never fires.
fn never(_: Instant) -> std::future::Pending<()> {
    std::future::pending()
}

#[test]
fn wait_returns_the_final_state_exactly_once() {
    let b = Batches::new(T);
    let now = Instant::now();
    let id = b.insert(PeerId(1), secs(60), now).unwrap();
    assert!(!b.step(id, now, || Step::Finish(Outcome::Done)));
    assert_eq!(b.state(id, now).unwrap(), BatchState::Done);
    assert!(block_on(b.wait(id, never)).is_ok());
    assert!(is_unknown(&block_on(b.wait(id, never))));
    assert!(is_unknown(&b.state(id, now)));
    assert!(is_unknown(&b.cancel(id, now)));
}

#[test]
fn wait_wakes_when_another_thread_finishes() {
    let b = Arc::new(Batches::new(T));
    let id = b.insert(PeerId(1), secs(600), Instant::now()).unwrap();
    let mover = {
        let b = Arc::clone(&b);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b.finish(id, Outcome::Failed(lost(PeerId(1))), Instant::now())
        })
    };
    // The timer never fires: only the finish can end this wait.
    let r = block_on(b.wait(id, never));
    assert!(mover.join().unwrap());
    assert!(matches!(r, Err(TransportError::PeerLost { .. })), "{r:?}");
}

#[test]
fn wait_ends_at_the_deadline_without_a_mover() {
    let b = Batches::new(T);
    let id = b
        .insert(PeerId(1), Duration::from_millis(30), Instant::now())
        .unwrap();
    let r = block_on(b.wait(id, sleep_until));
    assert!(
        matches!(r, Err(TransportError::TimedOut { batch, timeout }) if batch == id && timeout == Duration::from_millis(30)),
        "{r:?}"
    );
    assert!(is_unknown(&b.state(id, Instant::now())));
}

#[test]
fn step_never_runs_after_cancel_or_deadline() {
    let b = Batches::new(T);
    let now = Instant::now();
    let a = b.insert(PeerId(1), secs(10), now).unwrap();
    assert!(b.step(a, now, || Step::Continue));
    assert_eq!(b.cancel(a, now).unwrap(), BatchState::Cancelled);
    assert!(!b.step(a, now, || panic!("moved bytes of a cancelled batch")));
    // Cancel again: still the same final state.
    assert_eq!(b.cancel(a, now).unwrap(), BatchState::Cancelled);

    let late = b.insert(PeerId(1), secs(10), now).unwrap();
    assert!(!b.step(late, now + secs(10), || panic!(
        "moved bytes after the deadline"
    )));
    assert_eq!(b.state(late, now).unwrap(), BatchState::TimedOut);
    assert!(matches!(
        block_on(b.wait(late, never)),
        Err(TransportError::TimedOut { .. })
    ));
    assert!(matches!(
        block_on(b.wait(a, never)),
        Err(TransportError::Cancelled { batch }) if batch == a
    ));
}

/// `step_many` tells the mover which batches it may move, records each step, and never runs
/// when none is pending: a cancelled or expired batch is reported not pending (its bytes must
/// not move) while the others go on, finish or fail.
#[test]
fn step_many_moves_only_pending_batches_and_records_each_step() {
    let b = Batches::new(T);
    let now = Instant::now();
    let ids: Vec<BatchId> = (0..4)
        .map(|k| b.insert(PeerId(k), secs(10 + k), now).unwrap())
        .collect();
    assert_eq!(b.cancel(ids[1], now).unwrap(), BatchState::Cancelled);
    // At now + 10 s the first batch (timeout 10 s) has expired.
    let later = now + secs(10);
    let still = b.step_many(&ids, later, |pending| {
        assert_eq!(pending, [false, false, true, true]);
        vec![
            Step::Finish(Outcome::Done),
            Step::Finish(Outcome::Done),
            Step::Continue,
            Step::Finish(Outcome::Failed(lost(PeerId(3)))),
        ]
    });
    assert_eq!(still, [false, false, true, false]);
    assert_eq!(b.state(ids[0], later).unwrap(), BatchState::TimedOut);
    assert_eq!(b.state(ids[1], later).unwrap(), BatchState::Cancelled);
    assert_eq!(b.state(ids[2], later).unwrap(), BatchState::Pending);
    assert!(matches!(
        b.state(ids[3], later).unwrap(),
        BatchState::Failed(_)
    ));
    let still = b.step_many(&ids, later, |_| Vec::new());
    // A step left out is no step: the batch stays as it was.
    assert_eq!(still, [false, false, false, false]);
    assert_eq!(b.state(ids[2], later).unwrap(), BatchState::Pending);
    assert!(b.step_many(&ids[2..3], later, |_| vec![Step::Finish(Outcome::Done)]) == [false]);
    assert_eq!(b.state(ids[2], later).unwrap(), BatchState::Done);
    let none = b.step_many(&ids, later, |_| panic!("ran with no batch pending"));
    assert_eq!(none, [false; 4]);
}

#[test]
fn fail_where_fails_one_peer_only_and_keeps_final_states() {
    let b = Batches::new(T);
    let now = Instant::now();
    let p1 = b.insert(PeerId(1), secs(10), now).unwrap();
    let p2 = b.insert(PeerId(2), secs(10), now).unwrap();
    let done = b.insert(PeerId(1), secs(10), now).unwrap();
    b.finish(done, Outcome::Done, now);
    b.fail_where(|p| p == PeerId(1), |_, p| lost(p));
    assert!(matches!(b.state(p1, now).unwrap(), BatchState::Failed(m) if m.contains("gone")));
    assert_eq!(b.state(p2, now).unwrap(), BatchState::Pending);
    assert_eq!(b.state(done, now).unwrap(), BatchState::Done);
    assert_eq!(b.peer(p2), Some(PeerId(2)));
}

#[test]
fn limit_refuses_then_frees_on_wait_and_ids_are_not_reused() {
    let b = Batches::from_table(BatchTable::new(T).with_limit(2));
    let now = Instant::now();
    let a = b.insert(PeerId(1), secs(1), now).unwrap();
    let c = b.insert(PeerId(1), secs(1), now).unwrap();
    let err = b.insert(PeerId(1), secs(1), now).unwrap_err();
    assert!(err.to_string().contains("2 batches are waiting"), "{err}");
    b.forget(c);
    assert!(is_unknown(&b.state(c, now)));
    let d = b.insert(PeerId(1), secs(1), now).unwrap();
    assert!(d > c && c > a);
}

#[test]
fn huge_timeouts_do_not_panic() {
    let b = Batches::new(T);
    let now = Instant::now();
    let id = b.insert(PeerId(1), Duration::MAX, now).unwrap();
    assert!(b.deadline(id).unwrap() > now + secs(3600));
    assert_eq!(b.state(id, now + secs(3600)).unwrap(), BatchState::Pending);
}

#[test]
fn a_committing_batch_is_not_cancelled_and_is_fenced_before_it_times_out() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let b = Batches::from_table(BatchTable::new(T).with_commit_grace(secs(5)));
    let now = Instant::now();
    let fenced = Arc::new(AtomicUsize::new(0));
    let fence = |n: &Arc<AtomicUsize>| {
        let n = Arc::clone(n);
        Fence::new(move || {
            n.fetch_add(1, Ordering::SeqCst);
        })
    };
    // Ends by its writer: the fence never runs.
    let done = b.insert(PeerId(1), secs(10), now).unwrap();
    assert!(!b.step(done, now, || Step::Commit(fence(&fenced))));
    assert!(!b.step(done, now, || panic!("moved bytes of a committing batch")));
    assert_eq!(b.cancel(done, now).unwrap(), BatchState::Pending);
    b.fail_where(|_| true, |_, p| lost(p));
    assert_eq!(b.state(done, now + secs(12)).unwrap(), BatchState::Pending);
    assert!(b.finish(done, Outcome::Done, now + secs(12)));
    assert_eq!(b.cancel(done, now).unwrap(), BatchState::Done);
    assert!(block_on(b.wait(done, never)).is_ok());
    assert_eq!(fenced.load(Ordering::SeqCst), 0);

    // Still committing at deadline + grace: fenced once, then timed out.
    let stuck = b.insert(PeerId(1), secs(10), now).unwrap();
    assert!(!b.step(stuck, now, || Step::Commit(fence(&fenced))));
    assert_eq!(b.end(stuck), Some(now + secs(15)));
    assert_eq!(
        b.state(stuck, now + secs(15)).unwrap(),
        BatchState::TimedOut
    );
    assert_eq!(
        b.state(stuck, now + secs(20)).unwrap(),
        BatchState::TimedOut
    );
    assert!(!b.finish(stuck, Outcome::Done, now + secs(20)));
    assert_eq!(fenced.load(Ordering::SeqCst), 1);
}

#[test]
fn settle_and_wait_follow_a_commit_to_its_end() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let b = Arc::new(Batches::from_table(
        BatchTable::new(T).with_commit_grace(Duration::from_millis(40)),
    ));
    // The writer reports: `settle` (what `cancel` waits with) sees it, `wait` collects it.
    let id = b.insert(PeerId(1), secs(600), Instant::now()).unwrap();
    assert!(!b.step(id, Instant::now(), || Step::Commit(Fence::none())));
    let writer = {
        let b = Arc::clone(&b);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b.finish(id, Outcome::Done, Instant::now())
        })
    };
    assert_eq!(block_on(b.settle(id, never)).unwrap(), BatchState::Done);
    assert!(writer.join().unwrap());
    assert!(block_on(b.wait(id, never)).is_ok());
    assert!(is_unknown(&block_on(b.settle(id, never))));

    // No writer: `wait` sleeps past the deadline into the grace, fences, times out.
    let fenced = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&fenced);
    let id = b
        .insert(PeerId(1), Duration::from_millis(20), Instant::now())
        .unwrap();
    assert!(
        !b.step(id, Instant::now(), || Step::Commit(Fence::new(move || {
            f.store(true, Ordering::SeqCst)
        })))
    );
    let r = block_on(b.wait(id, sleep_until));
    assert!(matches!(r, Err(TransportError::TimedOut { .. })), "{r:?}");
    assert!(fenced.load(Ordering::SeqCst));
}

/// One event of a random run.
#[derive(Debug, Clone)]
enum Event {
    Post { peer: u64, timeout_ms: u64 },
    Advance(u64),
    Step { batch: u64, finish: Option<u8> },
    Commit(u64),
    Cancel(u64),
    State(u64),
    Wait(u64),
    FailPeer(u64),
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (0..3u64, 0..50u64).prop_map(|(peer, timeout_ms)| Event::Post { peer, timeout_ms }),
        (0..20u64).prop_map(Event::Advance),
        (0..12u64, proptest::option::of(0..3u8))
            .prop_map(|(batch, finish)| Event::Step { batch, finish }),
        (0..12u64).prop_map(Event::Cancel),
        (0..12u64).prop_map(Event::Commit),
        (0..12u64).prop_map(Event::State),
        (0..12u64).prop_map(Event::Wait),
        (0..3u64).prop_map(Event::FailPeer),
    ]
}

fn rank(s: &BatchState) -> &'static str {
    match s {
        BatchState::Pending => "pending",
        BatchState::Done => "done",
        BatchState::Cancelled => "cancelled",
        BatchState::TimedOut => "timed out",
        BatchState::Failed(_) => "failed",
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any order of posts, steps, cancels, states, waits, peer failures and time passing, on
    /// known and unknown ids: states only move from pending to one final state and stay there,
    /// `wait` collects each batch exactly once, cancel of a final batch returns its state,
    /// nothing moves once a batch is final, nothing is pending past its deadline, unknown ids
    /// are refused, ids are never reused.
    #[test]
    fn lifecycle_holds_in_any_event_order(events in proptest::collection::vec(event(), 1..80)) {
        let grace = Duration::from_millis(10);
        let b = Batches::from_table(BatchTable::new(T).with_commit_grace(grace));
        let fences: Arc<Mutex<HashMap<BatchId, usize>>> = Arc::default();
        let mut committing: HashSet<BatchId> = HashSet::new();
        let t0 = Instant::now();
        let mut now = t0;
        let mut posted: Vec<(BatchId, Instant)> = Vec::new();
        let mut seen: HashMap<BatchId, &'static str> = HashMap::new();
        let mut collected: HashSet<BatchId> = HashSet::new();
        let mut ids = HashSet::new();
        let pick = |posted: &[(BatchId, Instant)], i: u64| {
            // Indices past the posted ones are ids never handed out.
            posted.get(i as usize).map(|p| p.0).unwrap_or(BatchId(1_000 + i))
        };
        for ev in events {
            match ev {
                Event::Post { peer, timeout_ms } => {
                    let id = b.insert(PeerId(peer), Duration::from_millis(timeout_ms), now).unwrap();
                    prop_assert!(ids.insert(id), "id {} reused", id);
                    prop_assert!(posted.last().is_none_or(|p| p.0 < id));
                    posted.push((id, now + Duration::from_millis(timeout_ms)));
                }
                Event::Advance(ms) => now += Duration::from_millis(ms),
                Event::Step { batch, finish } => {
                    let id = pick(&posted, batch);
                    let mut ran = false;
                    let outcome = match finish {
                        None => None,
                        Some(0) => Some(Outcome::Done),
                        Some(1) => Some(Outcome::Failed(lost(PeerId(9)))),
                        Some(_) => Some(Outcome::Cancelled),
                    };
                    let more = b.step(id, now, || {
                        ran = true;
                        outcome.map_or(Step::Continue, Step::Finish)
                    });
                    let was_final = seen.get(&id).is_some_and(|s| *s != "pending");
                    prop_assert!(!(ran && (was_final || collected.contains(&id) || committing.contains(&id))),
                        "a step ran for {} after it was reported final", id);
                    if ran && !more {
                        seen.insert(id, "final");
                    }
                }
                Event::Commit(i) => {
                    let id = pick(&posted, i);
                    let f = Arc::clone(&fences);
                    let mut ran = false;
                    b.step(id, now, || {
                        ran = true;
                        Step::Commit(Fence::new(move || {
                            *f.lock().unwrap().entry(id).or_default() += 1;
                        }))
                    });
                    prop_assert!(!(ran && committing.contains(&id)));
                    if ran {
                        committing.insert(id);
                    }
                }
                Event::Cancel(i) => {
                    let id = pick(&posted, i);
                    let r = b.cancel(id, now);
                    if collected.contains(&id) || !ids.contains(&id) {
                        prop_assert!(is_unknown(&r));
                        continue;
                    }
                    let state = r.unwrap();
                    prop_assert!(state.is_final() || committing.contains(&id),
                        "cancel left {} pending without a commit", id);
                    if let Some(prev) = seen.get(&id).filter(|s| **s != "pending" && **s != "final") {
                        prop_assert_eq!(*prev, rank(&state), "cancel changed a final state");
                    }
                    seen.insert(id, rank(&state));
                }
                Event::State(i) => {
                    let id = pick(&posted, i);
                    let r = b.state(id, now);
                    if collected.contains(&id) || !ids.contains(&id) {
                        prop_assert!(is_unknown(&r));
                        continue;
                    }
                    let state = r.unwrap();
                    let mut deadline = posted.iter().find(|p| p.0 == id).unwrap().1;
                    if committing.contains(&id) {
                        deadline += grace;
                    }
                    prop_assert!(!(state == BatchState::Pending && now >= deadline),
                        "{} pending past its deadline", id);
                    if let Some(prev) = seen.get(&id) {
                        if *prev != "pending" {
                            prop_assert!(state.is_final(), "{} went back to pending", id);
                            if *prev != "final" {
                                prop_assert_eq!(*prev, rank(&state), "{} changed its final state", id);
                            }
                        }
                    }
                    seen.insert(id, rank(&state));
                }
                Event::Wait(i) => {
                    let id = pick(&posted, i);
                    let r = b.collect(id, now);
                    if collected.contains(&id) || !ids.contains(&id) {
                        prop_assert!(matches!(&r, Poll::Ready(r) if is_unknown(r)));
                        continue;
                    }
                    match r {
                        Poll::Pending => {
                            prop_assert!(seen.get(&id).is_none_or(|s| *s == "pending"));
                        }
                        Poll::Ready(r) => {
                            prop_assert!(!is_unknown(&r));
                            let kind = match &r {
                                Ok(()) => "done",
                                Err(TransportError::Cancelled { .. }) => "cancelled",
                                Err(TransportError::TimedOut { .. }) => "timed out",
                                Err(_) => "failed",
                            };
                            if let Some(prev) = seen.get(&id).filter(|s| **s != "pending" && **s != "final") {
                                prop_assert_eq!(*prev, kind, "wait disagrees with the state reported");
                            }
                            collected.insert(id);
                        }
                    }
                }
                Event::FailPeer(p) => b.fail_where(|peer| peer == PeerId(p), |_, peer| lost(peer)),
            }
        }
        // Every batch still tracked is collected exactly once at the end of time.
        let end = now + Duration::from_secs(1);
        for (id, _) in &posted {
            let first = b.collect(*id, end);
            let second = b.collect(*id, end);
            prop_assert!(matches!(&second, Poll::Ready(r) if is_unknown(r)));
            prop_assert_eq!(collected.contains(id), matches!(&first, Poll::Ready(r) if is_unknown(r)));
        }
        prop_assert!(b.is_empty());
        // A fence runs at most once, and only for a committing batch.
        for (id, n) in fences.lock().unwrap().iter() {
            prop_assert!(*n == 1 && committing.contains(id), "fence of {} ran {} times", id, n);
        }
    }
}

proptest! {
    /// Two different ids never share a hash under [`LocalIds`] (one multiplication by an odd
    /// number is a bijection), and ids differing in one low bit differ in the high bits too
    /// (the tag a hash table compares first).
    #[test]
    fn local_ids_never_collide(a in any::<u64>(), b in any::<u64>()) {
        use std::hash::BuildHasher;
        let h = LocalIds::default();
        prop_assume!(a != b);
        prop_assert_ne!(h.hash_one(a), h.hash_one(b));
        prop_assert_ne!(h.hash_one(a) >> 57, h.hash_one(a ^ 1) >> 57);
    }
}

/// One lock for both: the batch is known, committing (the mover gets no step, cancel leaves it
/// to the fence) and due at `now + timeout`.
#[test]
fn insert_committed_is_insert_then_commit() {
    let batches = Batches::new("t");
    let t0 = Instant::now();
    let (id, deadline) = batches
        .insert_committed(PeerId(1), Duration::from_secs(5), t0, Fence::none())
        .unwrap();
    assert_eq!(deadline, t0 + Duration::from_secs(5));
    assert_eq!(batches.deadline(id), Some(deadline));
    assert!(!batches.step(id, t0, || Step::Continue));
    assert_eq!(batches.cancel(id, t0).unwrap(), BatchState::Pending);
    assert!(batches.finish(id, Outcome::Done, t0));
    assert!(matches!(batches.collect(id, t0), Poll::Ready(Ok(()))));
}

/// Runs `fut` to completion on a fresh current-thread runtime with timers.
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread tokio runtime")
        .block_on(fut)
}

/// The batch table's sleep, on tokio's timers.
fn sleep_until(deadline: std::time::Instant) -> tokio::time::Sleep {
    tokio::time::sleep_until(deadline.into())
}

#[test]
fn a_batch_s_timeout_is_what_it_was_posted_with_until_collected() {
    let b = Batches::new(T);
    let now = Instant::now();
    let id = b.insert(PeerId(1), secs(7), now).unwrap();
    assert_eq!(b.timeout(id), Some(secs(7)));
    assert_eq!(b.deadline(id), Some(now + secs(7)));
    // Timed out, the error names the same timeout.
    let later = now + secs(8);
    match b.collect(id, later) {
        Poll::Ready(Err(TransportError::TimedOut { timeout, .. })) => assert_eq!(timeout, secs(7)),
        other => panic!("expected TimedOut, got {other:?}"),
    }
    assert_eq!(b.timeout(id), None);
}
