//! The prefill room machine driven step by step with explicit instants.

use proptest::prelude::*;

use super::*;

const SECOND: Duration = Duration::from_secs(1);

pub(super) fn cfg() -> RoomConfig {
    RoomConfig {
        rank: 3,
        endpoint: Endpoint::new("prefill-0"),
        bootstrap_timeout: 30 * SECOND,
        waiting_timeout: 300 * SECOND,
    }
}

fn info(decode: usize, generation: u64, required: u32) -> TransferInfo {
    TransferInfo {
        room: 7.into(),
        generation: generation.into(),
        decode_endpoint: Endpoint::new(format!("decode-{decode}")),
        session: 1.into(),
        dst_pages: vec![0, 1],
        dst_aux_index: Some(0),
        is_dummy: false,
        required_dst_info_num: required,
        decode_prefix_len: 0,
        traceparent: None,
    }
}

/// A decode rank's metadata; `peer` stands for the driver's handle (`None`: dummy).
fn meta(decode: usize, generation: u64, required: u32, dummy: bool) -> Event<()> {
    let mut info = info(decode, generation, required);
    info.is_dummy = dummy;
    Event::Metadata(MetaPeer {
        info,
        peer: (!dummy).then_some(()),
    })
}

fn room(t0: Instant) -> PrefillRoom<()> {
    PrefillRoom::new(RoomId(7), Incarnation(2), cfg(), t0)
}

fn chunk(pages: u64, tokens: u64, is_last: bool) -> Event<()> {
    Event::Chunk(ChunkShape {
        pages,
        tokens,
        is_last,
        page_tokens: 16,
        layers: None,
    })
}

fn fail(message: &str) -> Event<()> {
    Event::Fail(FailureReason::new(FailureCause::Aborted, message))
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

/// The control messages sent: (destination, kind, state of a status).
fn sends(actions: &[Action]) -> Vec<(String, &'static str, Option<RoomState>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { to, message } => {
                let state = match &**message {
                    ControlMessage::Status(s) => Some(s.state),
                    _ => None,
                };
                Some((to.to_string(), message.kind(), state))
            }
            _ => None,
        })
        .collect()
}

fn has(actions: &[Action], f: impl Fn(&Action) -> bool) -> bool {
    actions.iter().any(f)
}

#[test]
fn ready_once_every_required_decode_rank_sent_metadata_then_waiting_deadline() {
    let t0 = Instant::now();
    let mut r = room(t0);
    assert_eq!(
        r.poll_timeout(),
        Some(t0 + 30 * SECOND),
        "bootstrap deadline"
    );
    let a = r.handle(meta(0, 1, 2, false), t0 + SECOND);
    assert!(
        reports(&a).is_empty(),
        "one of two decode ranks: still Bootstrapping"
    );
    // The same rank and generation again is a retry: nothing happens.
    assert!(r.handle(meta(0, 1, 2, false), t0 + SECOND).is_empty());
    let a = r.handle(meta(1, 1, 2, false), t0 + 2 * SECOND);
    assert_eq!(reports(&a), [RoomState::WaitingForInput]);
    assert_eq!(
        r.poll_timeout(),
        Some(t0 + 302 * SECOND),
        "waiting deadline from readiness"
    );
    // A timer firing early (or of an older life of the room) changes nothing.
    assert!(
        r.handle(
            Event::TimerFired {
                incarnation: Incarnation(2)
            },
            t0 + 100 * SECOND
        )
        .is_empty()
    );
    assert!(
        r.handle(
            Event::TimerFired {
                incarnation: Incarnation(1)
            },
            t0 + 400 * SECOND
        )
        .is_empty()
    );
    let a = r.handle(
        Event::TimerFired {
            incarnation: Incarnation(2),
        },
        t0 + 302 * SECOND,
    );
    assert_eq!(reports(&a), [RoomState::Failed]);
    let reason = r.life.reason().unwrap();
    assert_eq!(reason.cause, FailureCause::WaitingTimeout);
    assert_eq!(
        reason.message,
        "Request 7 timed out after 300.0s in KVPoll.WaitingForInput"
    );
    assert_eq!(reason.peer.as_deref(), Some("decode-0, decode-1"));
    assert_eq!(
        sends(&a),
        [
            ("decode-0".into(), "status", Some(RoomState::Failed)),
            ("decode-1".into(), "status", Some(RoomState::Failed))
        ]
    );
    assert_eq!(r.poll_timeout(), None, "a terminal room has no deadline");
}

#[test]
fn bootstrap_deadline_names_the_ranks_heard_from() {
    let t0 = Instant::now();
    let mut r = room(t0);
    let a = r.handle(
        Event::TimerFired {
            incarnation: Incarnation(2),
        },
        t0 + 30 * SECOND,
    );
    assert_eq!(reports(&a), [RoomState::Failed]);
    let reason = r.life.reason().unwrap();
    assert_eq!(reason.cause, FailureCause::BootstrapTimeout);
    assert_eq!(reason.peer.as_deref(), Some("no decode rank"));
    assert_eq!(
        reason.message,
        "Request 7 timed out after 30.0s in KVPoll.Bootstrapping"
    );
    // Metadata arriving after the failure is told at once.
    let a = r.handle(meta(0, 1, 1, false), t0 + 31 * SECOND);
    assert_eq!(
        sends(&a),
        [("decode-0".into(), "status", Some(RoomState::Failed))]
    );
}

#[test]
fn first_failure_reason_wins_and_failed_is_sticky() {
    let t0 = Instant::now();
    let mut r = room(t0);
    r.handle(meta(0, 1, 1, false), t0);
    let a = r.handle(fail("first"), t0);
    assert_eq!(reports(&a), [RoomState::Failed]);
    assert_eq!(sends(&a).len(), 1, "the decode rank is told once");
    let a = r.handle(fail("second"), t0);
    assert!(a.is_empty(), "{a:?}");
    assert_eq!(r.life.reason().unwrap().message, "first");
    // Nothing moves a Failed room: not a chunk, not a delivery.
    let a = r.handle(chunk(1, 16, true), t0);
    assert!(
        matches!(&a[..], [Action::RefuseChunk(MachineError::Transfer(e))] if e.reason.message == "first")
    );
    assert!(
        r.handle(
            Event::Delivered {
                incarnation: Incarnation(2),
                bytes: 1
            },
            t0
        )
        .is_empty()
    );
    assert_eq!(r.state(), RoomState::Failed);
}

#[test]
fn chunks_are_refused_before_ready_and_must_fill_their_pages() {
    let t0 = Instant::now();
    let mut r = room(t0);
    let a = r.handle(chunk(1, 16, false), t0);
    assert!(matches!(
        &a[..],
        [Action::RefuseChunk(MachineError::RoomNotReady { .. })]
    ));
    r.handle(meta(0, 1, 1, false), t0);
    let a = r.handle(chunk(1, 17, true), t0);
    assert!(
        matches!(&a[..], [Action::RefuseChunk(MachineError::InvalidRequest { message, .. })] if message.contains("capacity=16"))
    );
    let a = r.handle(chunk(2, 20, false), t0);
    assert!(
        matches!(&a[..], [Action::RefuseChunk(MachineError::InvalidRequest { message, .. })] if message.contains("only the last chunk"))
    );
    // Accepted chunks get consecutive offsets; the first starts the driver.
    let a = r.handle(chunk(2, 32, false), t0);
    assert_eq!(reports(&a), [RoomState::Transferring]);
    assert!(has(&a, |x| matches!(
        x,
        Action::PostChunk {
            page_offset: 0,
            token_offset: 0,
            start_driver: true
        }
    )));
    let a = r.handle(chunk(1, 5, true), t0);
    assert!(matches!(
        &a[..],
        [Action::PostChunk {
            page_offset: 2,
            token_offset: 32,
            start_driver: false
        }]
    ));
    let a = r.handle(chunk(1, 5, true), t0);
    assert!(
        matches!(&a[..], [Action::RefuseChunk(MachineError::InvalidRequest { message, .. })] if message.contains("already sent"))
    );
}

fn part(pages: u64, tokens: u64, is_last: bool, start: u32, end: u32) -> Event<()> {
    Event::Chunk(ChunkShape {
        pages,
        tokens,
        is_last,
        page_tokens: 16,
        layers: Some(LayerPart {
            start,
            end,
            total: 3,
        }),
    })
}

fn refused_with(actions: &[Action], text: &str) -> bool {
    matches!(actions, [Action::RefuseChunk(MachineError::InvalidRequest { message, .. })] if message.contains(text))
}

fn posted_at(actions: &[Action], pages: u64, tokens: u64) -> bool {
    has(actions, |x| {
        matches!(x, Action::PostChunk { page_offset, token_offset, .. }
            if (*page_offset, *token_offset) == (pages, tokens))
    })
}

#[test]
fn a_chunk_sent_layer_by_layer_advances_the_send_range_with_its_final_part() {
    let t0 = Instant::now();
    let mut r = room(t0);
    r.handle(meta(0, 1, 1, false), t0);
    // The first part is checked as a whole chunk is.
    assert!(refused_with(
        &r.handle(part(1, 20, false, 0, 1), t0),
        "capacity=16"
    ));
    assert!(refused_with(
        &r.handle(part(1, 16, false, 1, 2), t0),
        "expects layers from 0"
    ));
    assert!(refused_with(
        &r.handle(part(1, 16, false, 2, 2), t0),
        "start < end"
    ));
    assert!(refused_with(
        &r.handle(part(1, 16, false, 0, 4), t0),
        "<= 3"
    ));
    let a = r.handle(part(2, 32, false, 0, 1), t0);
    assert!(posted_at(&a, 0, 0));
    // Every part of the chunk is posted at the chunk's offsets, in order, with its shape.
    assert!(refused_with(
        &r.handle(part(2, 32, false, 2, 3), t0),
        "expects layers from 1"
    ));
    assert!(refused_with(
        &r.handle(part(1, 16, false, 1, 3), t0),
        "same pages and tokens"
    ));
    assert!(refused_with(
        &r.handle(chunk(1, 5, true), t0),
        "the rest of that chunk"
    ));
    assert!(posted_at(&r.handle(part(2, 32, false, 1, 2), t0), 0, 0));
    assert!(posted_at(&r.handle(part(2, 32, false, 2, 3), t0), 0, 0));
    // The final part advanced the send range; a last chunk goes by parts as well.
    assert!(posted_at(&r.handle(part(1, 5, true, 0, 2), t0), 2, 32));
    assert!(posted_at(&r.handle(part(1, 5, true, 2, 3), t0), 2, 32));
    assert!(refused_with(
        &r.handle(part(1, 5, true, 0, 3), t0),
        "already sent"
    ));
}

#[test]
fn a_room_of_dummies_succeeds_on_the_final_part_of_its_last_chunk_only() {
    let t0 = Instant::now();
    let mut r = room(t0);
    r.handle(meta(0, 1, 1, true), t0);
    assert!(reports(&r.handle(part(1, 3, true, 0, 2), t0)) != [RoomState::Success]);
    assert_eq!(r.state(), RoomState::Transferring);
    assert_eq!(
        reports(&r.handle(part(1, 3, true, 2, 3), t0)),
        [RoomState::Success]
    );
}

#[test]
fn success_is_told_to_every_decode_rank_but_dummies() {
    let t0 = Instant::now();
    let mut r = room(t0);
    r.handle(meta(0, 1, 2, false), t0);
    r.handle(meta(1, 1, 2, true), t0);
    r.handle(chunk(1, 10, true), t0);
    let a = r.handle(
        Event::Delivered {
            incarnation: Incarnation(2),
            bytes: 640,
        },
        t0 + 3 * SECOND,
    );
    assert_eq!(reports(&a), [RoomState::Success]);
    assert!(has(
        &a,
        |x| matches!(x, Action::Succeeded { bytes: 640, elapsed } if *elapsed == 3 * SECOND)
    ));
    assert_eq!(
        sends(&a),
        [("decode-0".into(), "status", Some(RoomState::Success))]
    );
    assert_eq!(r.poll_timeout(), None);
}

#[test]
fn a_room_of_dummy_peers_only_succeeds_on_its_last_chunk_without_a_driver() {
    let t0 = Instant::now();
    let mut r = room(t0);
    r.handle(meta(0, 1, 1, true), t0);
    let a = r.handle(chunk(1, 16, false), t0);
    assert!(!has(&a, |x| matches!(x, Action::PostChunk { .. })));
    let a = r.handle(chunk(1, 3, true), t0);
    assert_eq!(reports(&a), [RoomState::Success]);
    assert!(sends(&a).is_empty(), "dummies are never told");
}

#[test]
fn the_fence_holds_failure_notices_and_abort_acks_until_the_driver_ended() {
    let t0 = Instant::now();
    let mut r = room(t0);
    r.handle(meta(0, 4, 1, false), t0);
    r.handle(chunk(1, 16, false), t0);
    let a = r.handle(
        Event::DecodeAbort {
            from: Endpoint::new("decode-0"),
            generation: Generation(4),
            reason: "cancelled".into(),
        },
        t0,
    );
    assert_eq!(reports(&a), [RoomState::Failed]);
    assert!(has(&a, |x| matches!(x, Action::CancelBatches)));
    assert!(
        sends(&a).is_empty(),
        "batches may still land: nobody is told yet"
    );
    // Nor is a decode rank whose metadata comes in meanwhile.
    let a = r.handle(meta(1, 4, 1, false), t0);
    assert!(sends(&a).is_empty(), "{a:?}");
    assert_eq!(r.life.reason().unwrap().cause, FailureCause::RemoteFailure);
    // A driver of an older life of the room is ignored.
    assert!(
        r.handle(
            Event::DriverEnded {
                incarnation: Incarnation(1),
                poisoned: false
            },
            t0
        )
        .is_empty()
    );
    let a = r.handle(
        Event::DriverEnded {
            incarnation: Incarnation(2),
            poisoned: false,
        },
        t0,
    );
    assert_eq!(
        sends(&a),
        [
            ("decode-0".into(), "status", Some(RoomState::Failed)),
            ("decode-1".into(), "status", Some(RoomState::Failed)),
            ("decode-0".into(), "abort_ack", None)
        ]
    );
    let ack = a.iter().find_map(|x| match x {
        Action::Send { message, .. } => match &**message {
            ControlMessage::AbortAck(ack) => Some(ack.clone()),
            _ => None,
        },
        _ => None,
    });
    assert_eq!(
        ack.map(|a| (a.generation, a.prefill_rank)),
        Some((4.into(), 3))
    );
    // Once the driver ended, an abort is acknowledged at once.
    let a = r.handle(
        Event::DecodeAbort {
            from: Endpoint::new("decode-0"),
            generation: Generation(5),
            reason: "again".into(),
        },
        t0,
    );
    assert_eq!(sends(&a), [("decode-0".into(), "abort_ack", None)]);
}

#[test]
fn a_poisoned_room_never_acknowledges_an_abort() {
    let t0 = Instant::now();
    let mut r = room(t0);
    r.handle(meta(0, 1, 1, false), t0);
    r.handle(chunk(1, 16, false), t0);
    let abort = || Event::DecodeAbort {
        from: Endpoint::new("decode-0"),
        generation: Generation(1),
        reason: "x".into(),
    };
    r.handle(abort(), t0);
    let a = r.handle(
        Event::DriverEnded {
            incarnation: Incarnation(2),
            poisoned: true,
        },
        t0,
    );
    assert!(has(&a, |x| matches!(x, Action::AckWithheld { .. })));
    assert!(!sends(&a).iter().any(|s| s.1 == "abort_ack"));
    let a = r.handle(abort(), t0);
    assert!(matches!(&a[..], [Action::AckWithheld { .. }]));
}

#[test]
fn another_generation_from_the_same_rank_is_a_duplicate_room() {
    let t0 = Instant::now();
    let mut r = room(t0);
    r.handle(meta(0, 1, 2, false), t0);
    let a = r.handle(meta(0, 2, 2, false), t0);
    assert_eq!(reports(&a), [RoomState::Failed]);
    assert_eq!(r.life.reason().unwrap().cause, FailureCause::DuplicateRoom);
}

#[test]
fn a_gone_peer_fails_only_the_rooms_it_sent_metadata_for() {
    let t0 = Instant::now();
    let mut r = room(t0);
    r.handle(meta(0, 1, 1, false), t0);
    let gone = |decode: &str, session| Event::PeerGone {
        endpoint: Endpoint::new(decode),
        session,
        reason: FailureReason::new(FailureCause::RemoteFailure, "restarted"),
    };
    assert!(r.handle(gone("decode-1", None), t0).is_empty());
    assert!(
        r.handle(gone("decode-0", Some(SessionId(9))), t0)
            .is_empty(),
        "another session"
    );
    let a = r.handle(gone("decode-0", Some(SessionId(1))), t0);
    assert_eq!(reports(&a), [RoomState::Failed]);
}

#[test]
fn clear_aborts_and_the_room_is_removed_once_fenced() {
    let t0 = Instant::now();
    let mut r = room(t0);
    r.handle(meta(0, 1, 1, false), t0);
    r.handle(chunk(1, 16, false), t0);
    let a = r.handle(Event::Clear, t0);
    assert_eq!(reports(&a), [RoomState::Failed]);
    assert_eq!(
        r.life.reason().unwrap().message,
        "Cleared before the transfer ended"
    );
    assert!(!has(&a, |x| matches!(x, Action::Remove)), "still fencing");
    assert!(r.is_cleared());
    let a = r.handle(
        Event::DriverEnded {
            incarnation: Incarnation(2),
            poisoned: false,
        },
        t0,
    );
    assert!(has(&a, |x| matches!(x, Action::Remove)));
    // Without a driver, a cleared room goes at once.
    let mut r = room(t0);
    let a = r.handle(Event::Clear, t0);
    assert!(has(&a, |x| matches!(x, Action::Remove)));
}

#[test]
fn send_progress_posts_aux_after_the_kv_and_counts_every_rank() {
    let mut p = SendProgress::new(2);
    let b = BatchId;
    assert!(
        p.handle(BatchEvent::Posted {
            peer: 0,
            id: b(1),
            aux: false
        })
        .is_empty()
    );
    assert!(
        p.handle(BatchEvent::Posted {
            peer: 1,
            id: b(2),
            aux: false
        })
        .is_empty()
    );
    assert_eq!(p.handle(BatchEvent::LastChunkPosted), []);
    assert_eq!(
        p.handle(BatchEvent::Done {
            id: b(1),
            bytes: 10
        }),
        [BatchAction::PostAux { peer: 0 }]
    );
    p.handle(BatchEvent::Posted {
        peer: 0,
        id: b(3),
        aux: true,
    });
    let mut ids = p.in_flight();
    ids.sort_by_key(|i| i.0);
    assert_eq!(ids, [b(2), b(3)], "what a fence would cancel");
    assert_eq!(p.handle(BatchEvent::Done { id: b(3), bytes: 1 }), []);
    assert_eq!(
        p.handle(BatchEvent::Done {
            id: b(2),
            bytes: 10
        }),
        [BatchAction::PostAux { peer: 1 }]
    );
    assert_eq!(
        p.handle(BatchEvent::NoAux { peer: 1 }),
        [BatchAction::Delivered { bytes: 21 }]
    );
    assert_eq!(
        p.handle(BatchEvent::NoAux { peer: 1 }),
        [],
        "delivered once"
    );
}

fn early_meta(decode: usize) -> MetaPeer<()> {
    MetaPeer {
        info: info(decode, 1, 1),
        peer: Some(()),
    }
}

#[test]
fn early_metadata_is_held_for_the_bootstrap_timeout_then_answered() {
    let t0 = Instant::now();
    let mut e = EarlyRooms::new(cfg(), 4);
    assert!(e.metadata(RoomId(7), early_meta(0), None, 0, t0).is_ok());
    assert!(
        e.metadata(RoomId(7), early_meta(1), None, 0, t0 + SECOND)
            .is_ok()
    );
    assert_eq!(
        e.poll_timeout(RoomId(7)),
        Some(t0 + 30 * SECOND),
        "from the first"
    );
    assert!(
        e.expire(RoomId(7), t0 + 29 * SECOND).is_empty(),
        "not due yet"
    );
    let a = e.expire(RoomId(7), t0 + 30 * SECOND);
    assert_eq!(
        sends(&a),
        [
            ("decode-0".into(), "status", Some(RoomState::Failed)),
            ("decode-1".into(), "status", Some(RoomState::Failed))
        ]
    );
    assert_eq!(e.poll_timeout(RoomId(7)), None);
    assert!(e.take(RoomId(7)).0.is_empty(), "dropped");
}

#[test]
fn a_room_created_in_time_inherits_its_early_metadata_and_failure() {
    let t0 = Instant::now();
    let mut e = EarlyRooms::new(cfg(), 4);
    e.metadata(RoomId(7), early_meta(0), None, 0, t0).unwrap();
    let (held, tomb) = e.take(RoomId(7));
    assert_eq!(held.len(), 1);
    assert!(tomb.is_none());
    // Invalid metadata: told now, and remembered for the room's creation.
    let bad = FailureReason::new(FailureCause::Planning, "misaligned prefix");
    let refused = e.metadata(RoomId(8), early_meta(0), Some(bad.clone()), 0, t0);
    assert_eq!(refused.unwrap_err().0, bad);
    // Further metadata of that room is refused with the same reason.
    let refused = e.metadata(RoomId(8), early_meta(1), None, 0, t0);
    assert_eq!(refused.unwrap_err().0, bad);
    assert_eq!(e.take(RoomId(8)).1, Some(bad));
}

#[test]
fn an_abort_before_creation_cancels_the_room_and_the_table_is_bounded() {
    let t0 = Instant::now();
    let mut e = EarlyRooms::new(cfg(), 2);
    let from = Endpoint::new("decode-0");
    assert!(!e.abort(RoomId(8), &from, t0), "nothing held");
    // Remembered as cancelled all the same: metadata that comes after the abort (it waited
    // for a reconnect) is refused.
    let late = e
        .metadata(RoomId(8), early_meta(0), None, 0, t0)
        .unwrap_err();
    assert_eq!(late.0.cause, FailureCause::DuplicateRoom);
    e.metadata(RoomId(7), early_meta(0), None, 0, t0).unwrap();
    assert!(e.abort(RoomId(7), &from, t0));
    let (held, tomb) = e.take(RoomId(7));
    assert!(held.is_empty());
    assert_eq!(tomb.map(|r| r.cause), Some(FailureCause::DuplicateRoom));
    // One room held by the agent plus one held here: the next room is refused.
    e.metadata(RoomId(1), early_meta(0), None, 1, t0).unwrap();
    let refused = e
        .metadata(RoomId(2), early_meta(0), None, 1, t0)
        .unwrap_err();
    assert_eq!(refused.0.cause, FailureCause::ControlChannel);
    assert!(
        refused.0.message.contains("max_rooms"),
        "{}",
        refused.0.message
    );
    // A tombstone is forgotten after the bootstrap timeout.
    e.metadata(RoomId(3), early_meta(0), Some(refused.0.clone()), 0, t0)
        .unwrap_err();
    e.expire(RoomId(3), t0 + 30 * SECOND);
    assert!(e.take(RoomId(3)).1.is_none());
}

/// One step of a random history of a room.
#[derive(Debug, Clone)]
enum Step {
    Meta {
        decode: usize,
        generation: u64,
        required: u32,
        dummy: bool,
    },
    Fail,
    Gone {
        decode: usize,
    },
    Abort {
        decode: usize,
    },
    Chunk {
        pages: u64,
        tokens: u64,
        last: bool,
    },
    Delivered {
        stale: bool,
    },
    DriverEnded {
        stale: bool,
        poisoned: bool,
    },
    Timer {
        stale: bool,
        after_s: u64,
    },
    Clear,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0..3usize, 1..3u64, 0..4u32, any::<bool>()).prop_map(
            |(decode, generation, required, dummy)| Step::Meta {
                decode,
                generation,
                required,
                dummy
            }
        ),
        Just(Step::Fail),
        (0..3usize).prop_map(|decode| Step::Gone { decode }),
        (0..3usize).prop_map(|decode| Step::Abort { decode }),
        (0..3u64, 0..40u64, any::<bool>()).prop_map(|(pages, tokens, last)| Step::Chunk {
            pages,
            tokens,
            last
        }),
        any::<bool>().prop_map(|stale| Step::Delivered { stale }),
        (any::<bool>(), any::<bool>())
            .prop_map(|(stale, poisoned)| Step::DriverEnded { stale, poisoned }),
        (any::<bool>(), 0..400u64).prop_map(|(stale, after_s)| Step::Timer { stale, after_s }),
        Just(Step::Clear),
    ]
}

proptest! {
    /// Over any order of events: states follow the update rule (Failed sticky, otherwise
    /// monotonic), the first failure reason stays, nobody is told of a failure or gets an
    /// abort ack while the driver may still have batches in flight, each decode rank hears of
    /// the failure once, a poisoned room acks nothing, and a terminal room has no deadline.
    #[test]
    fn lifecycle_invariants_hold_over_random_event_orders(steps in proptest::collection::vec(step(), 1..40)) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut r = room(t0);
        let mut state = RoomState::Bootstrapping;
        let mut first_reason: Option<String> = None;
        let mut driver_running = false;
        let mut poisoned = false;
        let mut told_failed: HashSet<String> = HashSet::new();
        let mut removed = false;
        for s in steps {
            let inc = |stale: bool| Incarnation(if stale { 1 } else { 2 });
            let event = match s {
                Step::Meta { decode, generation, required, dummy } => meta(decode, generation, required, dummy),
                Step::Fail => fail("fail"),
                Step::Gone { decode } => Event::PeerGone {
                    endpoint: Endpoint::new(format!("decode-{decode}")),
                    session: None,
                    reason: FailureReason::new(FailureCause::RemoteFailure, "gone"),
                },
                Step::Abort { decode } => Event::DecodeAbort {
                    from: Endpoint::new(format!("decode-{decode}")),
                    generation: Generation(1),
                    reason: "abort".into(),
                },
                Step::Chunk { pages, tokens, last } => chunk(pages, tokens, last),
                Step::Delivered { stale } => Event::Delivered { incarnation: inc(stale), bytes: 1 },
                Step::DriverEnded { stale, poisoned } => Event::DriverEnded { incarnation: inc(stale), poisoned },
                Step::Timer { stale, after_s } => {
                    now += Duration::from_secs(after_s);
                    Event::TimerFired { incarnation: inc(stale) }
                }
                Step::Clear => Event::Clear,
            };
            let ended = matches!(event, Event::DriverEnded { incarnation: Incarnation(2), .. });
            if ended && driver_running {
                driver_running = false;
                if let Event::DriverEnded { poisoned: p, .. } = event {
                    poisoned |= p;
                }
            }
            let actions = r.handle(event, now);
            prop_assert!(!removed || actions.is_empty() || !has(&actions, |a| matches!(a, Action::Remove)), "removed twice");
            for a in &actions {
                match a {
                    Action::Report { state: next, reason } => {
                        prop_assert_eq!(*next, RoomState::apply(state, *next), "update rule");
                        prop_assert!(*next != state, "a report is a change");
                        if state == RoomState::Failed {
                            prop_assert!(false, "Failed is sticky, got {:?}", next);
                        }
                        state = *next;
                        if *next == RoomState::Failed {
                            let reason = reason.as_ref().map(|r| r.message.clone());
                            prop_assert!(reason.is_some(), "a local failure has its reason");
                            first_reason.get_or_insert(reason.unwrap());
                        }
                    }
                    Action::PostChunk { start_driver, .. } => {
                        prop_assert!(state == RoomState::Transferring);
                        if *start_driver {
                            prop_assert!(!driver_running);
                            driver_running = true;
                        } else {
                            prop_assert!(driver_running);
                        }
                    }
                    Action::Send { to, message } => {
                        match &**message {
                            ControlMessage::Status(s) if s.state == RoomState::Failed => {
                                prop_assert!(!driver_running, "failure told while batches may land");
                                prop_assert!(told_failed.insert(to.to_string()), "told twice");
                            }
                            ControlMessage::AbortAck(_) => {
                                prop_assert!(!driver_running, "ack while batches may land");
                                prop_assert!(!poisoned, "a poisoned room acked");
                            }
                            _ => {}
                        }
                    }
                    Action::Remove => {
                        prop_assert!(r.is_cleared() && !driver_running);
                        removed = true;
                    }
                    _ => {}
                }
            }
            prop_assert_eq!(r.state(), state);
            if let Some(first) = &first_reason {
                prop_assert_eq!(&r.life.reason().unwrap().message, first, "first reason wins");
            }
            if state.is_terminal() {
                prop_assert_eq!(r.poll_timeout(), None);
            }
        }
    }
}
