//! Registration sequences that once deadlocked the prefill: a refused decode registering again
//! with the same session, and the same `register` message arriving on two connections. Each
//! scenario runs on a thread of its own and is awaited with a bound, so a deadlock (threads
//! parked on the agent's lock forever) fails the test instead of hanging it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Spec, mla, rig};
use kvbridge_coordinator::net_channel::{NetChannel, NetChannelConfig};
use kvbridge_coordinator::{
    CONTROL_PROTOCOL_VERSION, ControlChannel, ControlMessage, Endpoint, FailureCause, Heartbeat,
    KvMemory, PrefillAgent, ProtocolVersion, Registration, RegistrationOutcome, TransportInfo,
    WireRegion,
};
use kvbridge_mock::LoopbackTransport;
use kvbridge_transport::KvTransport;

/// Runs `scenario` on its own thread and runtime; fails if it does not end within `limit`
/// (real time: a deadlocked runtime cannot fire its own timers).
fn within(limit: Duration, paused: bool, scenario: impl AsyncFnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(paused)
            .build()
            .unwrap();
        rt.block_on(scenario());
        let _ = tx.send(());
    });
    match rx.recv_timeout(limit) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("the scenario did not finish within {limit:?}: the prefill deadlocked")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            panic!("the scenario panicked (see its output above)")
        }
    }
}

#[test]
fn a_refused_decode_registers_again_for_its_next_room_and_is_refused_again() {
    within(Duration::from_secs(120), true, async || {
        let r = rig(Spec::refused_page_size()).await;
        let d = &r.decodes[0].0;
        let heartbeat = kvbridge_coordinator::DecodeConfig::default().heartbeat_interval;
        for room in [1, 2, 3] {
            d.receive(room, common::request(vec![0, 1])).unwrap();
            let err = common::bounded(d.wait(room)).await.unwrap_err().to_string();
            assert!(err.contains("Page size mismatch"), "room {room}: {err}");
            assert_eq!(
                d.failure(room).unwrap().reason.cause,
                FailureCause::PeerRejected
            );
            // The refusal is remembered for a heartbeat interval; after it the decode asks
            // again, with the same session.
            tokio::time::sleep(heartbeat * 2).await;
        }
        // The prefill still runs its control loop: it answers a ping.
        let probe = r.hub.channel("probe").unwrap();
        probe
            .send(
                &Endpoint::new("prefill-0"),
                ControlMessage::Ping(Heartbeat { nonce: 5 }),
            )
            .await
            .unwrap();
        let pong = common::bounded(probe.recv()).await.unwrap();
        assert_eq!(pong.message, ControlMessage::Pong(Heartbeat { nonce: 5 }));
        assert_eq!(r.prefills[0].0.room_count(), 0);
    });
}

/// A registration the prefill refuses (its transport is unknown), claiming `decode`.
fn refused_registration(
    desc: kvbridge_handshake::PeerDescriptor,
    mem: &KvMemory,
    decode: &Endpoint,
) -> ControlMessage {
    let wire = |e: &kvbridge_coordinator::EntryRegion| WireRegion {
        region: e.region.0,
        offset: e.offset,
        len: e.len,
    };
    ControlMessage::Register(Registration {
        protocol: CONTROL_PROTOCOL_VERSION,
        decode_endpoint: decode.clone(),
        session: 42.into(),
        descriptor: desc,
        transport: TransportInfo {
            name: "no-such-transport".into(),
            descriptor: Vec::new(),
        },
        kv_regions: mem.kv.iter().map(wire).collect(),
        aux_regions: mem.aux.iter().map(wire).collect(),
    })
}

#[test]
fn the_same_register_message_on_two_connections_is_answered_twice() {
    within(Duration::from_secs(120), false, async || {
        let cfg = || {
            NetChannelConfig::default()
                .with_handshake_timeout(Duration::from_secs(10))
                .with_frame_timeout(Duration::from_secs(10))
        };
        let pd = mla("prefill", 16, 2, 64, 1, 0, 1);
        let pt: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
        let pmem = KvMemory::allocate(&*pt, &pd, 8, 2).await.unwrap();
        let pch = Arc::new(NetChannel::bind(cfg()).await.unwrap());
        let prefill = PrefillAgent::builder(pd, pmem.memory.clone(), pt, pch)
            .start()
            .unwrap();
        let to = prefill.endpoint();
        // The replies go to the claimed decode endpoint: a channel of the test listens there.
        let decode = NetChannel::bind(cfg()).await.unwrap();
        let dd = mla("decode", 16, 2, 64, 1, 0, 1);
        let dt = LoopbackTransport::new();
        let dmem = KvMemory::allocate(&dt, &dd, 8, 2).await.unwrap();
        let msg = refused_registration(dd, &dmem.memory, &decode.local_endpoint());
        // Two connections (two senders), the same message on each.
        let a = NetChannel::bind(cfg()).await.unwrap();
        let b = NetChannel::bind(cfg()).await.unwrap();
        a.send(&to, msg.clone()).await.unwrap();
        b.send(&to, msg).await.unwrap();
        for _ in 0..2 {
            let reply = tokio::time::timeout(Duration::from_secs(30), decode.recv())
                .await
                .expect("a registration reply within 30 s")
                .unwrap();
            let ControlMessage::RegisterReply(reply) = reply.message else {
                panic!("expected a registration reply, got {reply:?}")
            };
            let RegistrationOutcome::Rejected { problems } = reply.result else {
                panic!("an unknown transport must be refused")
            };
            assert!(
                problems.iter().any(|p| p.code == "KVB-TRANSPORT"),
                "{problems:?}"
            );
        }
        // The prefill keeps serving: a ping on a third connection is answered.
        a.send(&to, ControlMessage::Ping(Heartbeat { nonce: 3 }))
            .await
            .unwrap();
        let pong = tokio::time::timeout(Duration::from_secs(30), a.recv())
            .await
            .expect("a pong within 30 s")
            .unwrap();
        assert_eq!(pong.message, ControlMessage::Pong(Heartbeat { nonce: 3 }));
    });
}

/// A prefill serves a decode of the same control-protocol major whatever its minor (older or
/// newer), and refuses another major with `KVB-PROTOCOL` naming both versions.
#[test]
fn registrations_of_the_same_major_pass_the_version_check_and_another_major_is_refused() {
    within(Duration::from_secs(120), false, async || {
        let hub = kvbridge_coordinator::InProcessControlHub::new();
        let pd = mla("prefill", 16, 2, 64, 1, 0, 1);
        let pt: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
        let pmem = KvMemory::allocate(&*pt, &pd, 8, 2).await.unwrap();
        let prefill = PrefillAgent::builder(
            pd,
            pmem.memory.clone(),
            pt,
            Arc::new(hub.channel("prefill-0").unwrap()),
        )
        .start()
        .unwrap();
        let decode = hub.channel("decode-0").unwrap();
        let dd = mla("decode", 16, 2, 64, 1, 0, 1);
        let dmem = KvMemory::allocate(&LoopbackTransport::new(), &dd, 8, 2)
            .await
            .unwrap();
        let ours = CONTROL_PROTOCOL_VERSION;
        let cases = [
            (ProtocolVersion::new(ours.major, 0), false),
            (ours, false),
            (ProtocolVersion::new(ours.major, ours.minor + 5), false),
            (ProtocolVersion::new(ours.major + 1, 0), true),
        ];
        for (session, (version, refused)) in (1u64..).zip(cases) {
            let ControlMessage::Register(mut reg) =
                refused_registration(dd.clone(), &dmem.memory, &decode.local_endpoint())
            else {
                unreachable!()
            };
            reg.protocol = version;
            reg.session = session.into();
            decode
                .send(&prefill.endpoint(), ControlMessage::Register(reg))
                .await
                .unwrap();
            let reply = common::bounded(decode.recv()).await.unwrap();
            let ControlMessage::RegisterReply(reply) = reply.message else {
                panic!("expected a registration reply, got {reply:?}")
            };
            let RegistrationOutcome::Rejected { problems } = reply.result else {
                panic!("the unknown transport is refused after the version check")
            };
            let version_problem = problems.iter().find(|p| p.code == "KVB-PROTOCOL");
            assert_eq!(
                version_problem.is_some(),
                refused,
                "{version}: {problems:?}"
            );
            if let Some(p) = version_problem {
                assert!(
                    p.message.contains(&format!("decode speaks {version}"))
                        && p.message.contains(&format!("this prefill speaks {ours}")),
                    "{p}"
                );
                assert!(p.remedy.contains("same major version"), "{p}");
            } else {
                assert!(
                    problems.iter().any(|p| p.code == "KVB-TRANSPORT"),
                    "{problems:?}"
                );
            }
        }
    });
}
