//! The decode room machine driven by hand, with explicit instants.

use kvbridge_handshake::Role;
use proptest::prelude::*;

use super::*;
use kvbridge_control::{CONTROL_PROTOCOL_VERSION, TransportInfo};

const ADDR: &str = "prefill.test:8998";
const SESSION: u64 = 7;
const SEC: Duration = Duration::from_secs(1);

fn ep(name: &str) -> Endpoint {
    Endpoint::new(name)
}

fn prefill_ep(i: u32) -> Endpoint {
    ep(&format!("prefill-{i}"))
}

/// The decode and prefill descriptors of a topology: MLA (one real prefill rank, the others
/// dummies) or MHA (every prefill rank sends its heads), prefill TP `tp`, decode TP 1.
fn descriptors(mla: bool, tp: u32) -> (PeerDescriptor, Vec<PeerDescriptor>) {
    let d = |role, tp, rank| {
        let b = if mla {
            PeerDescriptor::mla(role, 16, 2, 64)
        } else {
            PeerDescriptor::mha(role, 16, 1, 8, 128).kv_cache_dtype("bfloat16")
        };
        b.attn_tp(tp, rank).build().unwrap()
    };
    (
        d(Role::Decode, 1, 0),
        (0..tp).map(|r| d(Role::Prefill, tp, r)).collect(),
    )
}

struct Rig {
    m: DecodeMachine,
    t0: Instant,
    prefills: Vec<PeerDescriptor>,
}

impl Rig {
    fn new(mla: bool, tp: u32, config: DecodeConfig) -> Self {
        let (decode, prefills) = descriptors(mla, tp);
        let registration = Registration {
            protocol: CONTROL_PROTOCOL_VERSION,
            decode_endpoint: ep("decode-0"),
            session: SESSION.into(),
            descriptor: decode,
            transport: TransportInfo {
                name: "loopback".into(),
                descriptor: Vec::new(),
            },
            kv_regions: Vec::new(),
            aux_regions: Vec::new(),
        };
        let t0 = Instant::now();
        Self {
            m: DecodeMachine::new(config, registration, true, t0),
            t0,
            prefills,
        }
    }

    fn one_to_one() -> Self {
        Self::new(true, 1, DecodeConfig::default())
    }

    fn at(&mut self, secs: f64, event: Event) -> Vec<Action> {
        let now = self.t0 + Duration::from_secs_f64(secs);
        self.m.handle(event, now)
    }

    fn ranks(&self) -> Vec<PrefillRankInfo> {
        self.prefills
            .iter()
            .enumerate()
            .map(|(i, d)| PrefillRankInfo {
                endpoint: prefill_ep(i as u32),
                descriptor: d.clone(),
            })
            .collect()
    }

    fn resolved(&self) -> Event {
        Event::Resolved {
            addr: ADDR.into(),
            ranks: self.ranks(),
        }
    }

    fn accept(&self, i: u32) -> Event {
        reply(
            i,
            SESSION,
            RegistrationOutcome::Accepted {
                descriptor: self.prefills[i as usize].clone(),
            },
        )
    }

    /// Receives `room` and registers with every prefill rank; returns the metadata actions.
    fn make_waiting(&mut self, room: u64, secs: f64) -> Vec<Action> {
        let a = self.at(secs, receive(room));
        let mut out = a.clone();
        if a.contains(&Action::Resolve { addr: ADDR.into() }) {
            let ev = self.resolved();
            out.extend(self.at(secs, ev));
        }
        for i in 0..self.prefills.len() as u32 {
            let ev = self.accept(i);
            out.extend(self.at(secs, ev));
        }
        assert_eq!(self.m.state(RoomId(room)), Some(RoomState::WaitingForInput));
        out
    }
}

fn receive(room: u64) -> Event {
    Event::Receive {
        room: RoomId(room),
        request: RoomRequest {
            addr: ADDR.into(),
            dst_pages: vec![4, 5, 6],
            prefix: 0,
            aux_index: 2,
        },
    }
}

fn reply(i: u32, session: u64, result: RegistrationOutcome) -> Event {
    Event::Control {
        from: prefill_ep(i),
        message: ControlMessage::RegisterReply(RegistrationReply {
            protocol: CONTROL_PROTOCOL_VERSION,
            prefill_endpoint: prefill_ep(i),
            prefill_rank: i,
            session: session.into(),
            result,
        }),
    }
}

fn rejected(i: u32) -> Event {
    reply(
        i,
        SESSION,
        RegistrationOutcome::Rejected {
            problems: vec![WireProblem {
                code: "KVB-E001".into(),
                message: "Page size mismatch".into(),
                remedy: "use one page size".into(),
            }],
        },
    )
}

fn status(room: u64, generation: Generation, rank: u32, state: RoomState) -> Event {
    Event::Control {
        from: prefill_ep(rank),
        message: ControlMessage::Status(StatusUpdate {
            room: room.into(),
            generation,
            state,
            prefill_rank: rank,
            reason: (state == RoomState::Failed).then(|| "boom".to_owned()),
            cause: (state == RoomState::Failed).then_some(FailureCause::TransferError),
        }),
    }
}

fn ack(room: u64, generation: Generation, rank: u32) -> Event {
    Event::Control {
        from: prefill_ep(rank),
        message: ControlMessage::AbortAck(AbortAck {
            room: room.into(),
            generation,
            prefill_rank: rank,
            prefill_endpoint: prefill_ep(rank),
        }),
    }
}

/// The messages of one kind sent, with their destinations.
fn sent<T>(actions: &[Action], pick: impl Fn(&ControlMessage) -> Option<T>) -> Vec<(Endpoint, T)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { to, message } => pick(message).map(|m| (to.clone(), m)),
            _ => None,
        })
        .collect()
}

fn infos(actions: &[Action]) -> Vec<(Endpoint, TransferInfo)> {
    sent(actions, |m| match m {
        ControlMessage::TransferInfo(t) => Some(t.clone()),
        _ => None,
    })
}

fn aborts(actions: &[Action]) -> Vec<(Endpoint, AbortRequest)> {
    sent(actions, |m| match m {
        ControlMessage::Abort(t) => Some(t.clone()),
        _ => None,
    })
}

fn sends(actions: &[Action], kind: &str) -> Vec<Endpoint> {
    sent(actions, |m| (m.kind() == kind).then_some(()))
        .into_iter()
        .map(|(to, ())| to)
        .collect()
}

fn reports(actions: &[Action]) -> Vec<RoomState> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Report { state, .. } => Some(*state),
            _ => None,
        })
        .collect()
}

fn generation_of(actions: &[Action]) -> Generation {
    infos(actions)[0].1.generation
}

fn cause(r: &Rig, room: u64) -> FailureCause {
    r.m.failure(RoomId(room)).unwrap().reason.cause
}

fn message(r: &Rig, room: u64) -> String {
    r.m.failure(RoomId(room)).unwrap().reason.message
}

#[test]
fn a_room_resolves_registers_sends_its_metadata_and_succeeds() {
    let mut r = Rig::one_to_one();
    let a = r.at(0.0, receive(1));
    assert_eq!(a, vec![Action::Resolve { addr: ADDR.into() }]);
    assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Bootstrapping));
    let ev = r.resolved();
    let a = r.at(0.1, ev);
    assert_eq!(sends(&a, "register"), vec![prefill_ep(0)]);
    let ev = r.accept(0);
    let a = r.at(0.2, ev);
    let sent = infos(&a);
    assert_eq!(sent.len(), 1);
    let (to, info) = &sent[0];
    assert_eq!(to, &prefill_ep(0));
    assert_eq!(info.dst_pages, vec![4, 5, 6]);
    assert_eq!(info.dst_aux_index, Some(2));
    assert_eq!((info.session, info.is_dummy), (SESSION.into(), false));
    assert_eq!(reports(&a), vec![RoomState::WaitingForInput]);
    assert_eq!(r.m.registered_peers(), vec![prefill_ep(0)]);
    assert_eq!(r.m.transfer_time(RoomId(1)), None, "not succeeded yet");
    let g = info.generation;
    let a = r.at(1.0, status(1, g, 0, RoomState::Success));
    // From the metadata (0.2 s) to Success (1.0 s), not from the room's creation.
    let took = r.m.transfer_time(RoomId(1)).unwrap();
    assert!((took.as_secs_f64() - 0.8).abs() < 1e-6, "{took:?}");
    assert_eq!(
        a,
        vec![Action::Report {
            room: RoomId(1),
            state: RoomState::Success,
            elapsed: SEC,
        }]
    );
    // A second room reuses the resolution and the registration.
    let a = r.at(2.0, receive(2));
    assert_eq!(infos(&a).len(), 1, "{a:?}");
    assert!(sends(&a, "register").is_empty());
}

#[test]
fn success_needs_every_required_rank_once_and_of_the_current_generation() {
    let mut r = Rig::new(false, 2, DecodeConfig::default());
    let a = r.make_waiting(1, 0.0);
    assert_eq!(infos(&a).len(), 2);
    assert!(infos(&a).iter().all(|(_, i)| !i.is_dummy));
    let g = generation_of(&a);
    let stale = Generation::from(g.get() + 100);
    assert!(
        r.at(1.0, status(1, stale, 0, RoomState::Success))
            .is_empty()
    );
    assert!(
        r.at(1.0, status(1, stale, 1, RoomState::Success))
            .is_empty()
    );
    assert!(r.at(1.0, status(1, g, 0, RoomState::Success)).is_empty());
    assert!(
        r.at(1.0, status(1, g, 0, RoomState::Success)).is_empty(),
        "the same rank twice is one response"
    );
    assert!(
        r.at(1.0, status(1, g, 9, RoomState::Success)).is_empty(),
        "not a peer of the room"
    );
    assert_eq!(r.m.state(RoomId(1)), Some(RoomState::WaitingForInput));
    let a = r.at(1.0, status(1, g, 1, RoomState::Success));
    assert_eq!(reports(&a), vec![RoomState::Success]);
}

#[test]
fn dummy_ranks_learn_the_room_but_their_success_does_not_count() {
    let mut r = Rig::new(true, 2, DecodeConfig::default());
    let a = r.make_waiting(1, 0.0);
    let sent = infos(&a);
    assert_eq!(sent.len(), 2);
    let (real, dummy): (Vec<_>, Vec<_>) = sent.iter().partition(|(_, i)| !i.is_dummy);
    assert_eq!((real.len(), dummy.len()), (1, 1), "{sent:?}");
    let dummy_info = &dummy[0].1;
    assert!(dummy_info.dst_pages.is_empty());
    assert_eq!(dummy_info.dst_aux_index, None);
    let rank = |e: &Endpoint| if e == &prefill_ep(0) { 0 } else { 1 };
    let g = generation_of(&a);
    assert!(
        r.at(1.0, status(1, g, rank(&dummy[0].0), RoomState::Success))
            .is_empty()
    );
    assert_eq!(r.m.state(RoomId(1)), Some(RoomState::WaitingForInput));
    let a = r.at(1.0, status(1, g, rank(&real[0].0), RoomState::Success));
    assert_eq!(reports(&a), vec![RoomState::Success]);
}

#[test]
fn the_first_failure_wins_and_failed_is_sticky() {
    let mut r = Rig::one_to_one();
    let a = r.make_waiting(1, 0.0);
    let g = generation_of(&a);
    let a = r.at(1.0, status(1, g, 0, RoomState::Failed));
    assert_eq!(reports(&a), vec![RoomState::Failed]);
    assert_eq!(message(&r, 1), "boom");
    assert_eq!(cause(&r, 1), FailureCause::TransferError);
    for ev in [
        Event::Abort { room: RoomId(1) },
        status(1, g, 0, RoomState::Success),
        status(1, g, 0, RoomState::Failed),
    ] {
        let a = r.at(2.0, ev);
        assert!(reports(&a).is_empty(), "{a:?}");
        assert!(aborts(&a).is_empty(), "one abort per failure: {a:?}");
    }
    assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Failed));
    assert_eq!(message(&r, 1), "boom", "first reason wins");
    // A Failed status after Success is ignored.
    let a = r.make_waiting(2, 3.0);
    let g = generation_of(&a);
    r.at(4.0, status(2, g, 0, RoomState::Success));
    assert!(r.at(4.0, status(2, g, 0, RoomState::Failed)).is_empty());
    assert_eq!(r.m.state(RoomId(2)), Some(RoomState::Success));
}

#[test]
fn only_acks_of_the_abort_generation_fence_the_room() {
    let mut r = Rig::new(false, 2, DecodeConfig::default());
    let a = r.make_waiting(1, 0.0);
    let g = generation_of(&a);
    let a = r.at(1.0, Event::Abort { room: RoomId(1) });
    assert_eq!(cause(&r, 1), FailureCause::Aborted);
    let sent = aborts(&a);
    assert_eq!(sent.len(), 2);
    let abort_g = sent[0].1.generation;
    assert_ne!(abort_g, g, "the abort arms a fresh generation");
    assert!(sent.iter().all(|(_, x)| x.reason == "Aborted by AbortReq."));
    assert_eq!(r.m.is_fenced(RoomId(1)), Some(false));
    assert!(r.at(1.5, ack(1, g, 0)).is_empty(), "the room's generation");
    assert!(r.at(1.5, ack(1, abort_g, 1)).is_empty());
    assert!(r.at(1.5, ack(1, abort_g, 1)).is_empty(), "twice is once");
    assert_eq!(
        r.m.is_fenced(RoomId(1)),
        Some(false),
        "rank 0 acked only a stale one"
    );
    let a = r.at(2.0, ack(1, abort_g, 0));
    assert_eq!(
        a,
        vec![Action::Fenced {
            room: RoomId(1),
            acks: 2
        }]
    );
    assert_eq!(r.m.is_fenced(RoomId(1)), Some(true));
    let f = r.m.forget(RoomId(1), None).unwrap();
    assert_eq!(
        (f.acked, f.unfenced),
        (vec![prefill_ep(1), prefill_ep(0)], false)
    );
}

#[test]
fn a_room_that_never_sent_its_metadata_is_fenced_at_once() {
    let mut r = Rig::one_to_one();
    r.at(0.0, receive(1));
    let a = r.at(0.5, Event::Abort { room: RoomId(1) });
    assert!(aborts(&a).is_empty());
    assert!(a.contains(&Action::Fenced {
        room: RoomId(1),
        acks: 0
    }));
    assert_eq!(r.m.is_fenced(RoomId(1)), Some(true));
    // The late directory answer does not revive it.
    let ev = r.resolved();
    assert!(sends(&r.at(1.0, ev), "register").is_empty());
    assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Failed));
}

#[test]
fn the_fence_resends_aborts_and_is_bounded_by_one_deadline() {
    let config = DecodeConfig {
        fence_timeout: 10 * SEC,
        abort_resend_interval: 2 * SEC,
        heartbeat_interval: 1000 * SEC,
        ..DecodeConfig::default()
    };
    let mut r = Rig::new(false, 2, config);
    r.make_waiting(1, 0.0);
    let a = r.at(1.0, Event::Abort { room: RoomId(1) });
    let abort_g = aborts(&a)[0].1.generation;
    r.at(1.0, ack(1, abort_g, 0));
    assert!(r.at(1.0, Event::FenceWanted { room: RoomId(1) }).is_empty());
    assert_eq!(r.m.poll_timeout(), Some(r.t0 + 3 * SEC));
    let a = r.at(3.0, Event::Timer);
    assert_eq!(
        sends(&a, "abort"),
        vec![prefill_ep(1)],
        "only the peer that has not acknowledged"
    );
    // A second waiter shares the deadline.
    r.at(5.0, Event::FenceWanted { room: RoomId(1) });
    assert!(
        r.at(10.9, Event::Timer)
            .iter()
            .all(|a| !matches!(a, Action::FenceTimedOut { .. }))
    );
    let a = r.at(11.0, Event::Timer);
    assert!(
        a.contains(&Action::FenceTimedOut {
            room: RoomId(1),
            waited: 10 * SEC,
            pending: vec![prefill_ep(1)],
        }),
        "{a:?}"
    );
    assert_eq!(r.m.is_fenced(RoomId(1)), Some(false));
    assert!(r.m.forget(RoomId(9), None).is_none());
    // Asked again: a new deadline; the ack fences the room.
    r.at(12.0, Event::FenceWanted { room: RoomId(1) });
    let a = r.at(12.5, ack(1, abort_g, 1));
    assert!(a.contains(&Action::Fenced {
        room: RoomId(1),
        acks: 2
    }));
    assert!(
        r.at(22.0, Event::Timer)
            .iter()
            .all(|a| !matches!(a, Action::FenceTimedOut { .. }))
    );
}

#[test]
fn bootstrap_timeout_names_the_silent_registration_or_the_directory() {
    let mut r = Rig::one_to_one();
    r.at(0.0, receive(1));
    let ev = r.resolved();
    r.at(0.0, ev);
    assert_eq!(
        r.m.poll_timeout(),
        Some(r.t0 + 5 * SEC),
        "the first heartbeat"
    );
    r.at(29.9, Event::Timer);
    assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Bootstrapping));
    let a = r.at(30.0, Event::Timer);
    assert_eq!(reports(&a), vec![RoomState::Failed]);
    assert_eq!(cause(&r, 1), FailureCause::BootstrapTimeout);
    assert_eq!(
        message(&r, 1),
        "Prefill bootstrap failed: registration with prefill-0 did not finish within 30.0s \
         (bootstrap_addr: prefill.test:8998)"
    );
    assert_eq!(
        r.m.failure(RoomId(1)).unwrap().reason.peer.as_deref(),
        Some("prefill-0")
    );
    assert_eq!(
        r.m.is_fenced(RoomId(1)),
        Some(true),
        "nothing was published"
    );
    // Without a directory answer.
    r.at(31.0, receive(2));
    let ev = r.resolved();
    r.at(31.0, ev);
    r.at(
        40.0,
        Event::Receive {
            room: RoomId(3),
            request: RoomRequest {
                addr: "other:1".into(),
                ..match receive(3) {
                    Event::Receive { request, .. } => request,
                    _ => unreachable!(),
                }
            },
        },
    );
    r.at(70.0, Event::Timer);
    assert!(message(&r, 3).contains("the directory lookup of other:1 did not finish"));
}

#[test]
fn waiting_timeout_names_the_peers_that_did_not_succeed_and_aborts_them() {
    let mut r = Rig::new(false, 2, DecodeConfig::default());
    let a = r.make_waiting(1, 0.0);
    let g = generation_of(&a);
    r.at(10.0, status(1, g, 0, RoomState::Success));
    let a = r.at(300.0, Event::Timer);
    assert_eq!(reports(&a), vec![RoomState::Failed]);
    assert_eq!(cause(&r, 1), FailureCause::WaitingTimeout);
    assert_eq!(
        message(&r, 1),
        "Request 1 timed out after 300.0s in KVPoll.WaitingForInput"
    );
    assert_eq!(
        r.m.failure(RoomId(1)).unwrap().reason.peer.as_deref(),
        Some("prefill-1")
    );
    assert_eq!(aborts(&a).len(), 2, "both peers knew the pages");
}

#[test]
fn a_peer_that_misses_its_heartbeats_is_lost_with_its_rooms() {
    let config = DecodeConfig {
        heartbeat_interval: 2 * SEC,
        heartbeat_max_failures: 2,
        ..DecodeConfig::default()
    };
    let mut r = Rig::new(true, 1, config);
    r.make_waiting(1, 0.0);
    let a = r.at(2.0, Event::Timer);
    let ping = a
        .iter()
        .find_map(|a| match a {
            Action::Send {
                message: ControlMessage::Ping(h),
                ..
            } => Some(*h),
            _ => None,
        })
        .expect("a ping");
    // Answered: the count starts again.
    let pong = Event::Control {
        from: prefill_ep(0),
        message: ControlMessage::Pong(ping),
    };
    r.at(2.5, pong);
    r.at(4.0, Event::Timer);
    r.at(6.0, Event::Timer);
    assert_eq!(r.m.state(RoomId(1)), Some(RoomState::WaitingForInput));
    let a = r.at(8.0, Event::Timer);
    assert!(a.contains(&Action::ForgetPeer {
        endpoint: prefill_ep(0)
    }));
    assert_eq!(cause(&r, 1), FailureCause::PeerLost);
    assert_eq!(
        message(&r, 1),
        "Lost connection with prefill instance (bootstrap_addr: prefill.test:8998): \
         prefill-0 did not answer 2 consecutive heartbeats"
    );
    assert!(r.m.registered_peers().is_empty());
    // The next room resolves and registers again.
    let a = r.at(9.0, receive(2));
    assert_eq!(a, vec![Action::Resolve { addr: ADDR.into() }]);
}

#[test]
fn a_refusal_fails_the_waiting_rooms_and_is_remembered_for_a_heartbeat_interval() {
    let mut r = Rig::one_to_one();
    r.at(0.0, receive(1));
    r.at(0.0, receive(2));
    let ev = r.resolved();
    let a = r.at(0.0, ev);
    assert_eq!(
        sends(&a, "register"),
        vec![prefill_ep(0)],
        "one registration per peer"
    );
    let a = r.at(0.1, rejected(0));
    assert_eq!(reports(&a), vec![RoomState::Failed, RoomState::Failed]);
    assert_eq!(cause(&r, 2), FailureCause::PeerRejected);
    assert!(message(&r, 1).contains("Page size mismatch"));
    let a = r.at(1.0, receive(3));
    assert!(sends(&a, "register").is_empty());
    assert_eq!(cause(&r, 3), FailureCause::PeerRejected);
    let a = r.at(6.0, receive(4));
    assert_eq!(sends(&a, "register"), vec![prefill_ep(0)], "asked again");
}

#[test]
fn an_undeliverable_registration_fails_the_room_with_the_channel_error() {
    let mut r = Rig::one_to_one();
    r.at(0.0, receive(1));
    let ev = r.resolved();
    r.at(0.0, ev);
    let a = r.at(
        1.0,
        Event::SendFailed {
            to: prefill_ep(0),
            kind: "register",
            room: None,
            error: "did not complete within 1s".into(),
        },
    );
    assert_eq!(reports(&a), vec![RoomState::Failed]);
    assert_eq!(cause(&r, 1), FailureCause::ControlChannel);
    assert_eq!(
        message(&r, 1),
        "_register_kv_args to prefill prefill-0 failed: did not complete within 1s"
    );
    // A lost metadata message fails its room too.
    let mut r = Rig::one_to_one();
    r.make_waiting(1, 0.0);
    let a = r.at(
        1.0,
        Event::SendFailed {
            to: prefill_ep(0),
            kind: "transfer_info",
            room: Some(RoomId(1)),
            error: "closed".into(),
        },
    );
    assert_eq!(reports(&a), vec![RoomState::Failed]);
    assert_eq!(aborts(&a).len(), 1);
    assert_eq!(cause(&r, 1), FailureCause::ControlChannel);
}

#[test]
fn an_unregistered_status_makes_the_next_room_register_again() {
    let mut r = Rig::one_to_one();
    let a = r.make_waiting(1, 0.0);
    let g = generation_of(&a);
    let ev = Event::Control {
        from: prefill_ep(0),
        message: ControlMessage::Status(StatusUpdate {
            room: 1.into(),
            generation: g,
            state: RoomState::Failed,
            prefill_rank: 0,
            reason: Some("without registering with prefill prefill-0 first".into()),
            cause: Some(FailureCause::Unregistered),
        }),
    };
    r.at(1.0, ev);
    assert_eq!(cause(&r, 1), FailureCause::Unregistered);
    let a = r.at(2.0, receive(2));
    assert_eq!(sends(&a, "register"), vec![prefill_ep(0)]);
}

#[test]
fn replies_to_another_session_are_ignored_and_pings_answered() {
    let mut r = Rig::one_to_one();
    r.at(0.0, receive(1));
    let ev = r.resolved();
    r.at(0.0, ev);
    let stale = reply(
        0,
        SESSION + 1,
        RegistrationOutcome::Accepted {
            descriptor: r.prefills[0].clone(),
        },
    );
    assert!(r.at(0.1, stale).is_empty());
    assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Bootstrapping));
    let ping = Event::Control {
        from: ep("anyone"),
        message: ControlMessage::Ping(Heartbeat { nonce: 3 }),
    };
    assert_eq!(
        r.at(0.2, ping),
        vec![Action::Send {
            to: ep("anyone"),
            message: ControlMessage::Pong(Heartbeat { nonce: 3 }),
        }]
    );
}

#[test]
fn shutdown_fails_the_rooms_in_flight_and_admits_no_more() {
    let mut r = Rig::one_to_one();
    let a = r.make_waiting(1, 0.0);
    r.at(0.5, status(1, generation_of(&a), 0, RoomState::Success));
    r.make_waiting(2, 1.0);
    let a = r.at(2.0, Event::Shutdown);
    assert_eq!(reports(&a), vec![RoomState::Failed]);
    assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Success));
    assert_eq!(cause(&r, 2), FailureCause::Shutdown);
    assert!(matches!(
        r.m.admit(RoomId(3)),
        Err(MachineError::Shutdown { .. })
    ));
    assert!(matches!(Rig::one_to_one().m.admit(RoomId(1)), Ok(())));
    assert!(matches!(
        r.m.admit(RoomId(1)),
        Err(MachineError::Shutdown { .. })
    ));
}

#[test]
fn a_held_room_id_is_refused_and_forget_respects_the_incarnation() {
    let mut r = Rig::one_to_one();
    r.at(0.0, receive(1));
    assert!(matches!(
        r.m.admit(RoomId(1)),
        Err(MachineError::DuplicateRoom { .. })
    ));
    let first = r.m.incarnation(RoomId(1)).unwrap();
    r.m.forget(RoomId(1), None);
    r.at(1.0, receive(1));
    let second = r.m.incarnation(RoomId(1)).unwrap();
    assert_ne!(first, second);
    assert!(
        r.m.forget(RoomId(1), Some(first)).is_none(),
        "an older life"
    );
    assert!(r.m.forget(RoomId(1), Some(second)).is_some());
    assert_eq!(r.m.room_count(), 0);
}

/// One step of a random run over rooms 1..=3 and the two MHA prefill ranks (both real).
#[derive(Debug, Clone)]
enum Op {
    Receive(u64),
    Resolve(bool),
    Reply(u32, bool),
    Status(u64, u32, bool, bool),
    Abort(u64),
    Ack(u64, u32, bool),
    FenceWanted(u64),
    SendFailed(u32, Option<u64>),
    Forget(u64),
    Advance(u64),
    Shutdown,
}

fn op() -> impl Strategy<Value = Op> {
    let room = 1..=3u64;
    let rank = 0..2u32;
    prop_oneof![
        30 => room.clone().prop_map(Op::Receive),
        20 => prop::bool::weighted(0.8).prop_map(Op::Resolve),
        30 => (rank.clone(), prop::bool::weighted(0.9)).prop_map(|(r, a)| Op::Reply(r, a)),
        40 => (room.clone(), rank.clone(), prop::bool::weighted(0.7), prop::bool::weighted(0.8))
            .prop_map(|(m, r, s, c)| Op::Status(m, r, s, c)),
        10 => room.clone().prop_map(Op::Abort),
        30 => (room.clone(), rank.clone(), prop::bool::weighted(0.8))
            .prop_map(|(m, r, c)| Op::Ack(m, r, c)),
        10 => room.clone().prop_map(Op::FenceWanted),
        5 => (rank, prop::option::of(room.clone())).prop_map(|(r, m)| Op::SendFailed(r, m)),
        5 => room.prop_map(Op::Forget),
        20 => (0..3_000u64).prop_map(Op::Advance),
        3 => (0..400_000u64).prop_map(Op::Advance),
        1 => Just(Op::Shutdown),
    ]
}

/// What the run has seen of one life of a room.
#[derive(Debug, Default)]
struct Life {
    states: Vec<RoomState>,
    generation: Option<Generation>,
    metadata_to: BTreeSet<Endpoint>,
    successes: BTreeSet<u32>,
    abort_generation: Option<Generation>,
    acked: BTreeSet<Endpoint>,
    first_reason: Option<FailureReason>,
    fenced: bool,
}

fn check(lives: &mut HashMap<RoomId, Life>, m: &DecodeMachine, actions: &[Action]) {
    for a in actions {
        match a {
            Action::Send { to, message } => match message {
                ControlMessage::TransferInfo(t) => {
                    let l = lives.get_mut(&t.room).unwrap();
                    l.generation = Some(t.generation);
                    l.metadata_to.insert(to.clone());
                }
                ControlMessage::Abort(x) => {
                    let l = lives.get_mut(&x.room).unwrap();
                    let g = x.generation;
                    assert!(!l.metadata_to.is_empty(), "abort of a room never published");
                    assert_ne!(Some(g), l.generation, "an abort generation is fresh");
                    assert!(
                        l.abort_generation.is_none_or(|a| a == g),
                        "one abort generation per life"
                    );
                    l.abort_generation = Some(g);
                }
                _ => {}
            },
            Action::Report { room, state, .. } => {
                let l = lives.get_mut(room).unwrap();
                let last = l.states.last().copied().unwrap_or(RoomState::Bootstrapping);
                assert_ne!(last, RoomState::Failed, "Failed is sticky");
                assert!(
                    *state == RoomState::Failed || *state > last,
                    "{last} -> {state}: states only move forward"
                );
                if *state == RoomState::Success {
                    assert!(l.successes.len() >= 2, "Success before every required rank");
                }
                l.states.push(*state);
            }
            Action::Fenced { room, acks } => {
                let l = lives.get_mut(room).unwrap();
                assert_eq!(l.states.last(), Some(&RoomState::Failed));
                assert!(!l.fenced, "fenced twice");
                if *acks == 0 {
                    assert!(l.metadata_to.is_empty(), "fenced without the acks");
                } else {
                    assert_eq!(l.acked, l.metadata_to, "fenced before every ack");
                }
                l.fenced = true;
            }
            _ => {}
        }
    }
    for (room, l) in lives.iter_mut() {
        if let Some(e) = m.failure(*room) {
            match &l.first_reason {
                None => l.first_reason = Some(e.reason),
                Some(first) => assert_eq!(first, &e.reason, "the first reason wins"),
            }
        }
        assert_eq!(
            m.state(*room),
            Some(*l.states.last().unwrap_or(&RoomState::Bootstrapping))
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random orders of requests, answers, statuses, aborts, acks (current and stale
    /// generations), send failures, time and shutdown: states only move forward, Failed is
    /// sticky with its first reason, Success needs both ranks of the current generation,
    /// and a room is fenced only by every ack of its abort generation (or when nothing was
    /// published).
    #[test]
    fn lifecycle_rules_hold_in_any_event_order(ops in prop::collection::vec(op(), 1..80)) {
        let mut r = Rig::new(false, 2, DecodeConfig::default());
        let mut now = 0u64;
        let mut lives: HashMap<RoomId, Life> = HashMap::new();
        for op in ops {
            let t = |ms: u64| ms as f64 / 1000.0;
            let event = match op {
                Op::Receive(room) => {
                    if r.m.admit(RoomId(room)).is_err() {
                        continue;
                    }
                    lives.insert(RoomId(room), Life::default());
                    receive(room)
                }
                Op::Resolve(true) => r.resolved(),
                Op::Resolve(false) => Event::ResolveFailed {
                    addr: ADDR.into(),
                    message: "not registered yet".into(),
                },
                Op::Reply(i, true) => r.accept(i),
                Op::Reply(i, false) => rejected(i),
                Op::Status(room, rank, success, current) => {
                    let Some(l) = lives.get_mut(&RoomId(room)) else { continue };
                    let g = l.generation.unwrap_or(Generation(0));
                    let g = if current { g } else { Generation(g.get() + 1000) };
                    let state = if success { RoomState::Success } else { RoomState::Failed };
                    if current && success && l.metadata_to.contains(&prefill_ep(rank)) {
                        l.successes.insert(rank);
                    }
                    status(room, g, rank, state)
                }
                Op::Abort(room) => Event::Abort { room: RoomId(room) },
                Op::Ack(room, rank, current) => {
                    let Some(l) = lives.get_mut(&RoomId(room)) else { continue };
                    let g = if current {
                        l.abort_generation.unwrap_or(Generation(0))
                    } else {
                        l.generation.unwrap_or(Generation(0))
                    };
                    if current && l.abort_generation.is_some() && l.metadata_to.contains(&prefill_ep(rank)) {
                        l.acked.insert(prefill_ep(rank));
                    }
                    ack(room, g, rank)
                }
                Op::FenceWanted(room) => Event::FenceWanted { room: RoomId(room) },
                Op::SendFailed(rank, room) => Event::SendFailed {
                    to: prefill_ep(rank),
                    kind: if room.is_some() { "transfer_info" } else { "register" },
                    room: room.map(RoomId),
                    error: "closed".into(),
                },
                Op::Forget(room) => {
                    r.m.forget(RoomId(room), None);
                    lives.remove(&RoomId(room));
                    continue;
                }
                Op::Advance(ms) => {
                    now += ms;
                    Event::Timer
                }
                Op::Shutdown => Event::Shutdown,
            };
            let actions = r.at(t(now), event);
            check(&mut lives, &r.m, &actions);
            prop_assert!(r.m.poll_timeout().is_some());
        }
    }
}
