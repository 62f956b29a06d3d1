//! The prefill rank's machine driven step by step with explicit instants.

use std::time::Duration;

use super::*;
use crate::prefill::tests::cfg;
use kvbridge_control::RoomState;

const SECOND: Duration = Duration::from_secs(1);

/// The driver's handle of a decode rank, in these tests its name.
type Conn = &'static str;

fn decode(i: usize) -> Endpoint {
    Endpoint::new(format!("decode-{i}"))
}

fn info(room: u64, d: usize, session: u64) -> TransferInfo {
    TransferInfo {
        room: room.into(),
        generation: 1.into(),
        decode_endpoint: decode(d),
        session: session.into(),
        dst_pages: vec![0, 1],
        dst_aux_index: Some(0),
        is_dummy: false,
        required_dst_info_num: 1,
        decode_prefix_len: 0,
        traceparent: None,
    }
}

fn registered(d: usize, session: u64, peer: u64) -> RankEvent<Conn> {
    RankEvent::Registered {
        endpoint: decode(d),
        decode: AcceptedDecode {
            session: session.into(),
            peer: PeerId(peer),
            conn: "conn",
        },
    }
}

/// Metadata as the driver feeds it: looked up through [`PrefillMachine::sender`] first.
fn metadata(m: &PrefillMachine<Conn>, info: TransferInfo) -> RankEvent<Conn> {
    let conn = m.sender(&info).expect("an accepted sender").conn;
    RankEvent::Metadata {
        info,
        conn: Some(conn),
        invalid: None,
    }
}

/// The states the actions report, per room, in order.
fn reports(actions: &[RankAction]) -> Vec<(RoomId, RoomState, Option<FailureCause>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            RankAction::Room {
                room,
                action: Action::Report { state, reason },
            } => Some((*room, *state, reason.as_ref().map(|r| r.cause))),
            _ => None,
        })
        .collect()
}

fn sends(actions: &[RankAction]) -> Vec<(Endpoint, &ControlMessage)> {
    actions
        .iter()
        .filter_map(|a| match a {
            RankAction::Send { to, message } => Some((to.clone(), &**message)),
            _ => None,
        })
        .collect()
}

fn disconnects(actions: &[RankAction]) -> Vec<PeerId> {
    actions
        .iter()
        .filter_map(|a| match a {
            RankAction::Disconnect { peer } => Some(*peer),
            _ => None,
        })
        .collect()
}

fn machine() -> PrefillMachine<Conn> {
    PrefillMachine::new(cfg(), 8)
}

#[test]
fn a_decode_that_registers_again_with_a_new_session_fails_its_old_rooms_only() {
    let t0 = Instant::now();
    let mut m = machine();
    m.handle(registered(0, 1, 10), t0);
    m.handle(registered(1, 1, 11), t0);
    for room in [7, 8] {
        m.handle(RankEvent::Create { room: room.into() }, t0);
    }
    let a = m.handle(metadata(&m, info(7, 0, 1)), t0);
    assert_eq!(reports(&a), [(7.into(), RoomState::WaitingForInput, None)]);
    m.handle(metadata(&m, info(8, 1, 1)), t0);

    let a = m.handle(registered(0, 2, 20), t0 + SECOND);
    assert_eq!(
        reports(&a),
        [(
            7.into(),
            RoomState::Failed,
            Some(FailureCause::RemoteFailure)
        )],
        "only the room of decode 0's old session fails: {a:?}"
    );
    assert_eq!(disconnects(&a), [PeerId(10)]);
    assert_eq!(
        m.room(8.into()).unwrap().state(),
        RoomState::WaitingForInput
    );
    // Metadata of the old session is refused now; the new session is the rank's.
    let old = m.sender(&info(9, 0, 1)).unwrap_err();
    assert_eq!(old.cause, FailureCause::RemoteFailure);
    assert!(old.message.contains("old session"), "{}", old.message);
    assert_eq!(m.sender(&info(9, 0, 2)).unwrap().peer, PeerId(20));
}

#[test]
fn a_twin_registration_of_the_same_session_closes_its_own_connection() {
    let t0 = Instant::now();
    let mut m = machine();
    m.handle(registered(0, 1, 10), t0);
    m.handle(RankEvent::Create { room: 7.into() }, t0);
    m.handle(metadata(&m, info(7, 0, 1)), t0);
    let a = m.handle(registered(0, 1, 11), t0);
    assert_eq!(disconnects(&a), [PeerId(11)], "{a:?}");
    assert!(reports(&a).is_empty(), "the room goes on: {a:?}");
    assert_eq!(m.sender(&info(7, 0, 1)).unwrap().peer, PeerId(10));
    assert_eq!(m.known(&decode(0), 1.into()), Known::Accepted);
    assert_eq!(m.known(&decode(0), 2.into()), Known::New);
}

#[test]
fn a_refused_session_is_answered_as_before_and_its_metadata_refused() {
    let t0 = Instant::now();
    let mut m = machine();
    let problems = vec![WireProblem {
        code: "KVB-E001".into(),
        message: "page sizes differ".into(),
        remedy: "use one page size".into(),
    }];
    m.handle(
        RankEvent::Rejected {
            endpoint: decode(0),
            session: 1.into(),
            problems: problems.clone(),
        },
        t0,
    );
    assert_eq!(m.known(&decode(0), 1.into()), Known::Rejected(problems));
    let e = m.sender(&info(7, 0, 1)).unwrap_err();
    assert_eq!(e.cause, FailureCause::PeerRejected);
    assert!(e.message.contains("page sizes differ"), "{}", e.message);
    let e = m.sender(&info(7, 1, 1)).unwrap_err();
    assert_eq!(e.cause, FailureCause::Unregistered);
}

#[test]
fn metadata_before_the_room_is_held_and_applied_when_it_is_created() {
    let t0 = Instant::now();
    let mut m = machine();
    m.handle(registered(0, 1, 10), t0);
    let a = m.handle(metadata(&m, info(7, 0, 1)), t0);
    assert!(a.is_empty(), "{a:?}");
    assert_eq!(
        m.poll_timeout(),
        Some(t0 + 30 * SECOND),
        "held for the bootstrap timeout"
    );
    let a = m.handle(RankEvent::Create { room: 7.into() }, t0 + SECOND);
    assert_eq!(reports(&a), [(7.into(), RoomState::WaitingForInput, None)]);
    // The early deadline is gone; the room's waiting deadline is armed.
    let a = m.handle(RankEvent::Timer, t0 + 30 * SECOND);
    assert!(a.is_empty(), "nothing expires at the early deadline: {a:?}");
    assert_eq!(m.poll_timeout(), Some(t0 + 301 * SECOND));
}

#[test]
fn metadata_of_a_room_never_created_expires_and_tells_the_decode() {
    let t0 = Instant::now();
    let mut m = machine();
    m.handle(registered(0, 1, 10), t0);
    m.handle(metadata(&m, info(7, 0, 1)), t0);
    let early = m.handle(RankEvent::Timer, t0 + 29 * SECOND);
    assert!(early.is_empty(), "{early:?}");
    let a = m.handle(RankEvent::Timer, t0 + 30 * SECOND);
    assert!(
        matches!(a.first(), Some(RankAction::EarlyExpired { room }) if *room == 7.into()),
        "{a:?}"
    );
    let s = sends(&a);
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].0, decode(0));
    assert!(
        matches!(s[0].1, ControlMessage::Status(u) if u.state == RoomState::Failed
            && u.cause == Some(FailureCause::BootstrapTimeout)),
        "{s:?}"
    );
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn an_abort_of_a_room_not_created_is_acknowledged_and_remembered() {
    let t0 = Instant::now();
    let mut m = machine();
    m.handle(registered(0, 1, 10), t0);
    m.handle(metadata(&m, info(7, 0, 1)), t0);
    let abort = AbortRequest {
        room: 7.into(),
        generation: 1.into(),
        decode_endpoint: decode(0),
        reason: "client went away".into(),
    };
    let a = m.handle(RankEvent::DecodeAbort(abort), t0);
    let s = sends(&a);
    assert!(
        matches!(s.as_slice(), [(to, ControlMessage::AbortAck(ack))] if *to == decode(0) && ack.prefill_rank == 3),
        "{a:?}"
    );
    // Created after all: the room fails at once, as cancelled.
    let a = m.handle(RankEvent::Create { room: 7.into() }, t0 + SECOND);
    assert_eq!(
        reports(&a),
        [(
            7.into(),
            RoomState::Failed,
            Some(FailureCause::DuplicateRoom)
        )],
        "{a:?}"
    );
}

#[test]
fn one_timer_serves_every_room_in_deadline_order() {
    let t0 = Instant::now();
    let mut m = machine();
    m.handle(RankEvent::Create { room: 1.into() }, t0);
    m.handle(RankEvent::Create { room: 2.into() }, t0 + SECOND);
    assert_eq!(m.poll_timeout(), Some(t0 + 30 * SECOND));
    let a = m.handle(RankEvent::Timer, t0 + 30 * SECOND);
    assert_eq!(
        reports(&a),
        [(
            1.into(),
            RoomState::Failed,
            Some(FailureCause::BootstrapTimeout)
        )]
    );
    assert_eq!(m.poll_timeout(), Some(t0 + 31 * SECOND));
    let a = m.handle(RankEvent::Timer, t0 + 31 * SECOND);
    assert_eq!(
        reports(&a),
        [(
            2.into(),
            RoomState::Failed,
            Some(FailureCause::BootstrapTimeout)
        )]
    );
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn a_cleared_room_is_forgotten_and_its_deadline_with_it() {
    let t0 = Instant::now();
    let mut m = machine();
    m.handle(RankEvent::Create { room: 1.into() }, t0);
    let a = m.handle(
        RankEvent::Room {
            room: 1.into(),
            incarnation: None,
            event: Event::Clear,
        },
        t0,
    );
    assert!(
        a.iter().any(|a| matches!(
            a,
            RankAction::Room {
                action: Action::Remove,
                ..
            }
        )),
        "{a:?}"
    );
    assert!(m.room(1.into()).is_none());
    assert!(m.admit(1.into()).is_ok(), "the id may be used again");
    let a = m.handle(RankEvent::Timer, t0 + 30 * SECOND);
    assert!(a.is_empty(), "{a:?}");
}

#[test]
fn events_of_an_earlier_life_of_a_room_are_ignored() {
    let t0 = Instant::now();
    let mut m = machine();
    m.handle(RankEvent::Create { room: 1.into() }, t0);
    let first = m.room(1.into()).unwrap().incarnation();
    m.handle(
        RankEvent::Room {
            room: 1.into(),
            incarnation: None,
            event: Event::Clear,
        },
        t0,
    );
    m.handle(RankEvent::Create { room: 1.into() }, t0);
    assert_ne!(m.room(1.into()).unwrap().incarnation(), first);
    let reason = FailureReason::new(FailureCause::TransferError, "a batch of the old life");
    let a = m.handle(
        RankEvent::Room {
            room: 1.into(),
            incarnation: Some(first),
            event: Event::Fail(reason),
        },
        t0,
    );
    assert!(a.is_empty(), "{a:?}");
    assert_eq!(m.room(1.into()).unwrap().state(), RoomState::Bootstrapping);
}

#[test]
fn shutdown_fails_every_room_and_admits_none() {
    let t0 = Instant::now();
    let mut m = machine();
    for room in [1, 2] {
        m.handle(RankEvent::Create { room: room.into() }, t0);
    }
    let a = m.handle(RankEvent::Shutdown, t0);
    let mut failed: Vec<_> = reports(&a);
    failed.sort();
    assert_eq!(
        failed,
        [
            (1.into(), RoomState::Failed, Some(FailureCause::Shutdown)),
            (2.into(), RoomState::Failed, Some(FailureCause::Shutdown)),
        ]
    );
    assert!(matches!(
        m.admit(3.into()),
        Err(MachineError::Shutdown { .. })
    ));
}

#[test]
fn max_rooms_bounds_the_rooms_held() {
    let t0 = Instant::now();
    let mut m = PrefillMachine::<Conn>::new(cfg(), 2);
    for room in [1, 2] {
        m.admit(room.into()).unwrap();
        m.handle(RankEvent::Create { room: room.into() }, t0);
    }
    let e = m.admit(3.into()).unwrap_err();
    assert!(e.to_string().contains("max_rooms"), "{e}");
    assert!(matches!(
        m.admit(1.into()),
        Err(MachineError::DuplicateRoom { .. })
    ));
    // A create the driver did not admit changes nothing.
    m.handle(RankEvent::Create { room: 3.into() }, t0);
    assert!(m.room(3.into()).is_none());
}

#[test]
fn a_lost_connection_is_replaced_once() {
    let t0 = Instant::now();
    let mut m = machine();
    m.handle(registered(0, 1, 10), t0);
    m.handle(RankEvent::PeerLost { peer: PeerId(10) }, t0);
    assert!(m.is_lost(PeerId(10)));
    assert!(m.replacement(&decode(0), PeerId(10), 1.into()).is_none());
    let fresh = |peer| AcceptedDecode {
        session: 1.into(),
        peer: PeerId(peer),
        conn: "fresh",
    };
    m.replace_lost(&decode(0), PeerId(10), fresh(11)).unwrap();
    assert!(!m.is_lost(PeerId(10)));
    assert_eq!(
        m.replacement(&decode(0), PeerId(10), 1.into())
            .map(|a| a.peer),
        Some(PeerId(11))
    );
    // A second room that reconnected too finds the first replacement.
    let other = m
        .replace_lost(&decode(0), PeerId(10), fresh(12))
        .unwrap_err();
    assert_eq!(other.map(|a| a.peer), Some(PeerId(11)));
    // After the decode registered again, a late replacement is refused outright.
    m.handle(registered(0, 2, 20), t0);
    let late = m
        .replace_lost(&decode(0), PeerId(11), fresh(13))
        .unwrap_err();
    assert!(late.is_none());
}

#[test]
fn an_abort_before_any_metadata_cancels_metadata_that_comes_later() {
    // Metadata may be handled after the abort that followed it on the wire (it waited for a
    // reconnect): it must be refused, not served.
    let t0 = Instant::now();
    let mut m = machine();
    m.handle(registered(0, 1, 10), t0);
    let abort = AbortRequest {
        room: 7.into(),
        generation: 2.into(),
        decode_endpoint: decode(0),
        reason: "client went away".into(),
    };
    let a = m.handle(RankEvent::DecodeAbort(abort), t0);
    assert!(
        matches!(sends(&a).as_slice(), [(_, ControlMessage::AbortAck(_))]),
        "{a:?}"
    );
    let a = m.handle(metadata(&m, info(7, 0, 1)), t0 + SECOND);
    assert!(
        matches!(sends(&a).as_slice(), [(to, ControlMessage::Status(u))]
            if *to == decode(0) && u.cause == Some(FailureCause::DuplicateRoom)),
        "the late metadata is refused: {a:?}"
    );
    let a = m.handle(RankEvent::Create { room: 7.into() }, t0 + SECOND);
    assert_eq!(
        reports(&a),
        [(
            7.into(),
            RoomState::Failed,
            Some(FailureCause::DuplicateRoom)
        )]
    );
}

/// An event of room 7.
fn room_7(event: Event<Conn>) -> RankEvent<Conn> {
    RankEvent::Room {
        room: 7.into(),
        incarnation: None,
        event,
    }
}

/// `m` with room 7 ready at decode 0 and its driver started by a last chunk.
fn sending_room_7(mut m: PrefillMachine<Conn>, t0: Instant) -> PrefillMachine<Conn> {
    m.handle(registered(0, 1, 10), t0);
    m.handle(RankEvent::Create { room: 7.into() }, t0);
    m.handle(metadata(&m, info(7, 0, 1)), t0);
    let chunk = super::super::ChunkShape {
        pages: 2,
        tokens: 128,
        is_last: true,
        page_tokens: 64,
        layers: None,
    };
    let a = m.handle(room_7(Event::Chunk(chunk)), t0);
    assert!(
        a.iter().any(|a| matches!(
            a,
            RankAction::Room {
                action: Action::PostChunk { .. },
                ..
            }
        )),
        "{a:?}"
    );
    m
}

#[test]
fn a_poisoned_room_is_kept_after_clear_and_its_aborts_go_unacknowledged() {
    let t0 = Instant::now();
    let mut m = sending_room_7(machine(), t0);
    let reason = FailureReason::new(FailureCause::TransferError, "a batch failed");
    m.handle(room_7(Event::Fail(reason)), t0);
    let incarnation = m.room(7.into()).unwrap().incarnation();
    m.handle(
        room_7(Event::DriverEnded {
            incarnation,
            poisoned: true,
        }),
        t0,
    );
    let a = m.handle(room_7(Event::Clear), t0);
    assert!(
        !a.iter().any(|a| matches!(
            a,
            RankAction::Room {
                action: Action::Remove,
                ..
            }
        )),
        "a poisoned room is not forgotten: {a:?}"
    );
    assert!(
        m.room(7.into())
            .is_some_and(|r| r.is_cleared() && r.is_poisoned())
    );
    assert_eq!(m.visible_rooms().count(), 0, "hidden once cleared");
    let abort = AbortRequest {
        room: 7.into(),
        generation: 3.into(),
        decode_endpoint: decode(0),
        reason: "resent".into(),
    };
    let a = m.handle(RankEvent::DecodeAbort(abort), t0 + 10 * SECOND);
    assert!(sends(&a).is_empty(), "no ack: {a:?}");
    assert!(
        a.iter().any(|a| matches!(
            a,
            RankAction::Room {
                action: Action::AckWithheld { .. },
                ..
            }
        )),
        "{a:?}"
    );
    let e = m.admit(7.into()).unwrap_err();
    assert!(e.to_string().contains("poisoned"), "{e}");
}

#[test]
fn a_full_rank_names_the_poisoned_rooms_it_keeps() {
    let t0 = Instant::now();
    let mut m = sending_room_7(PrefillMachine::<Conn>::new(cfg(), 1), t0);
    let incarnation = m.room(7.into()).unwrap().incarnation();
    m.handle(room_7(Event::Clear), t0);
    m.handle(
        room_7(Event::DriverEnded {
            incarnation,
            poisoned: true,
        }),
        t0,
    );
    assert_eq!(m.poisoned_rooms(), 1);
    let e = m.admit(8.into()).unwrap_err().to_string();
    assert!(
        e.contains("max_rooms") && e.contains("1 of them are poisoned"),
        "{e}"
    );
}
