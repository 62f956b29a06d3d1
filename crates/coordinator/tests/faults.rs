//! Aborts, fencing, heartbeat, every timeout, and refused peers — deterministic, in virtual time.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{ADDR, AUX_LENS, Request, Spec, bounded, mha, mla, rig};
use kvbridge_coordinator::{
    CONTROL_PROTOCOL_VERSION, ControlChannel, ControlMessage, CoordinatorError, DecodeAgent,
    DecodeConfig, Endpoint, FailureCause, KvMemory, PrefillConfig, ReceiveRequest, Registration,
    RegistrationOutcome, RoomState, SharedMin, TransferInfo, TransportInfo,
};
use kvbridge_handshake::{PeerDescriptor, Role};
use kvbridge_mock::{FaultScript, LoopbackTransport};
use kvbridge_transport::KvTransport;
use tokio::time::sleep;

const SENTINEL: u8 = 0xEE;

fn prefill_ep() -> Endpoint {
    Endpoint::new("prefill-0")
}

/// Marks every decode KV byte with the sentinel, as if the pages were handed to another request.
fn reuse_pages(r: &common::Rig) {
    for (_, rank) in &r.decodes {
        for region in &rank.mem.kv_regions {
            region.fill(0, region.len() as u64, SENTINEL).unwrap();
        }
    }
}

fn pages_untouched_since_reuse(r: &common::Rig) -> bool {
    r.decodes.iter().all(|(_, rank)| {
        rank.mem.kv_regions.iter().all(|region| {
            region
                .to_vec(0, region.len() as u64)
                .unwrap()
                .iter()
                .all(|&b| b == SENTINEL)
        })
    })
}

/// One prefill rank whose second batch (the last chunk's KV) is held back for 10 s, one decode
/// rank, a 2-chunk request; returns once the first chunk landed and the second is in flight.
async fn delayed_second_chunk() -> (common::Rig, Request) {
    let mut spec = Spec::mla_one_to_one();
    spec.faults = vec![FaultScript::new().delay_batch(1, Duration::from_secs(10))];
    let r = rig(spec).await;
    let req = Request {
        chunk_pages: 2,
        ..Request::new(77, 64)
    };
    r.start(&req).await;
    r.send_all(0, &req).await.unwrap();
    sleep(Duration::from_secs(1)).await;
    let m = r.prefills[0].0.metrics();
    assert_eq!(
        (m.batches_posted, m.batches_done),
        (2, 1),
        "chunk 0 landed, chunk 1 held back"
    );
    (r, req)
}

#[tokio::test(start_paused = true)]
async fn abort_mid_transfer_releases_pages_only_once_fenced() {
    let (r, req) = delayed_second_chunk().await;
    let decode = r.decodes[0].0.clone();
    // The abort cannot reach the prefill for now: no proof, no release.
    r.hub.set_partitioned(&prefill_ep(), true);
    decode.abort(req.room);
    let release = tokio::spawn({
        let d = decode.clone();
        async move { d.release_when_fenced(77).await }
    });
    sleep(Duration::from_secs(3)).await;
    assert!(
        !release.is_finished(),
        "released without proof that no byte can land"
    );
    assert!(!decode.is_fenced(77).unwrap());
    // Once the abort gets through (it is re-sent), the prefill cancels the held batch, then acks.
    r.hub.set_partitioned(&prefill_ep(), false);
    let report = bounded(release).await.unwrap().unwrap();
    assert_eq!(report.acked_by, vec![prefill_ep()]);
    assert_eq!(decode.room_count(), 0, "a released room is forgotten");
    let p = &r.prefills[0].0;
    assert_eq!(p.poll(77).unwrap(), RoomState::Failed);
    assert!(
        p.failure(77)
            .unwrap()
            .to_string()
            .contains("Aborted by decode decode-0: Aborted by AbortReq.")
    );
    // The pages are reused; the held batch's deadline passes: no late byte lands.
    reuse_pages(&r);
    sleep(Duration::from_secs(30)).await;
    assert!(
        pages_untouched_since_reuse(&r),
        "a late write landed in released pages"
    );
    assert_eq!(decode.metrics().rooms_fenced, 1);
    assert_eq!(decode.failure(77), None, "forgotten after release");
    // The abort's initiator reports `aborted`, its peer `remote_failure`.
    let pm = p.metrics();
    assert_eq!(
        pm.failures_by_cause.get(&FailureCause::RemoteFailure),
        Some(&1)
    );
    assert_eq!(pm.failures_by_cause.get(&FailureCause::Aborted), None);
    let dm = decode.metrics();
    assert_eq!(dm.failures_by_cause.get(&FailureCause::Aborted), Some(&1));
    assert_eq!(dm.failures_by_cause.get(&FailureCause::RemoteFailure), None);
    // The held batch was cancelled by the fence: counted as failed, its bytes not counted.
    assert_eq!(
        (pm.batches_posted, pm.batches_done, pm.batches_failed),
        (2, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn without_fencing_the_held_batch_lands_in_reused_pages() {
    // The same scenario, but the decode reuses the pages right after aborting (no fence): the
    // held batch lands 10 s later in memory that belongs to someone else. This is what
    // release_when_fenced prevents.
    let (r, req) = delayed_second_chunk().await;
    r.hub.set_partitioned(&prefill_ep(), true);
    r.decodes[0].0.abort(req.room);
    r.decodes[0].0.clear(req.room);
    reuse_pages(&r);
    sleep(Duration::from_secs(30)).await;
    assert!(
        !pages_untouched_since_reuse(&r),
        "the unfenced scenario must show the late write"
    );
}

#[tokio::test(start_paused = true)]
async fn prefill_abort_is_reported_to_the_decode_and_acknowledged() {
    let (r, req) = delayed_second_chunk().await;
    r.prefills[0].0.abort(req.room);
    let d = &r.decodes[0].0;
    let err = bounded(d.wait(req.room)).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "KVTransferError(bootstrap_room=77): Aborted by prefill prefill-0: Aborted by AbortReq. \
         [cause: remote_failure; peer: prefill-0]"
    );
    assert_eq!(
        d.failure(req.room).unwrap().reason.cause,
        FailureCause::RemoteFailure
    );
    let report = bounded(d.release_when_fenced(req.room)).await.unwrap();
    assert_eq!(report.acked_by, vec![prefill_ep()]);
    reuse_pages(&r);
    sleep(Duration::from_secs(30)).await;
    assert!(pages_untouched_since_reuse(&r));
    assert_eq!(
        r.prefills[0]
            .0
            .metrics()
            .failures_by_cause
            .get(&FailureCause::Aborted),
        Some(&1)
    );
    let dm = d.metrics();
    assert_eq!(
        dm.failures_by_cause.get(&FailureCause::RemoteFailure),
        Some(&1)
    );
    assert_eq!(dm.failures_by_cause.get(&FailureCause::Aborted), None);
    // The fence cancelled the held batch: one posted batch done, one counted as failed.
    let pm = r.prefills[0].0.metrics();
    assert_eq!(
        (pm.batches_posted, pm.batches_done, pm.batches_failed),
        (2, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn heartbeat_declares_a_silent_prefill_dead_and_keeps_its_pages_quarantined() {
    let mut spec = Spec::mla_one_to_one();
    spec.decode_config = DecodeConfig::default()
        .with_heartbeat_interval(Duration::from_secs(2))
        .with_heartbeat_max_failures(2)
        .with_fence_timeout(Duration::from_secs(10));
    let r = rig(spec).await;
    let req = Request::new(5, 40);
    r.start(&req).await;
    let p = &r.prefills[0].0;
    assert_eq!(bounded(p.wait_ready(5)).await.unwrap(), 0);
    // The prefill goes silent before sending anything.
    r.hub.set_partitioned(&prefill_ep(), true);
    let d = &r.decodes[0].0;
    let started = tokio::time::Instant::now();
    let err = bounded(d.wait(5)).await.unwrap_err().to_string();
    assert!(
        started.elapsed() <= Duration::from_secs(7),
        "two missed beats of 2 s"
    );
    assert!(
        err.contains("Lost connection with prefill instance (bootstrap_addr: prefill.test:8998)"),
        "{err}"
    );
    assert!(
        err.contains("prefill-0 did not answer 2 consecutive heartbeats"),
        "{err}"
    );
    assert_eq!(d.failure(5).unwrap().reason.cause, FailureCause::PeerLost);
    assert!(d.registered_peers().is_empty(), "a dead peer is forgotten");
    // No ack can come: the pages stay quarantined.
    match bounded(d.release_when_fenced(5)).await {
        Err(CoordinatorError::FenceTimeout { room, pending, .. }) if room.get() == 5 => {
            assert_eq!(pending, "prefill-0")
        }
        other => panic!("expected a fence timeout, got {other:?}"),
    }
    // The prefill comes back: the re-sent abort is acknowledged, and new rooms work again.
    r.hub.set_partitioned(&prefill_ep(), false);
    bounded(d.release_when_fenced(5)).await.unwrap();
    let req2 = Request::new(6, 40);
    for out in r.run(&req2).await {
        out.unwrap();
    }
    r.verify_with(&req2, false);
}

#[tokio::test(start_paused = true)]
async fn prefill_bootstrap_timeout() {
    let r = rig(Spec::mla_one_to_one()).await;
    let p = &r.prefills[0].0;
    p.create_room(3).unwrap();
    let err = bounded(p.wait(3)).await.unwrap_err().to_string();
    assert_eq!(
        err,
        "KVTransferError(bootstrap_room=3): Request 3 timed out after 300.0s in KVPoll.Bootstrapping \
         [cause: bootstrap_timeout; peer: no decode rank]"
    );
    assert_eq!(
        p.metrics()
            .failures_by_cause
            .get(&FailureCause::BootstrapTimeout),
        Some(&1)
    );
    assert!(matches!(
        p.send_chunk(3, kvbridge_coordinator::Chunk::new(vec![0], 16))
            .await,
        Err(CoordinatorError::Transfer(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn decode_waiting_timeout_aborts_and_is_fenced() {
    let mut spec = Spec::mla_one_to_one();
    spec.prefill_config = PrefillConfig::default().with_waiting_timeout(Duration::from_secs(600));
    let r = rig(spec).await;
    let req = Request::new(4, 40);
    r.start(&req).await;
    // The prefill never sends.
    let d = &r.decodes[0].0;
    let err = bounded(d.wait(4)).await.unwrap_err().to_string();
    assert_eq!(
        err,
        "KVTransferError(bootstrap_room=4): Request 4 timed out after 300.0s in KVPoll.WaitingForInput \
         [cause: waiting_timeout; peer: prefill-0]"
    );
    bounded(d.release_when_fenced(4)).await.unwrap();
    let p = &r.prefills[0].0;
    assert_eq!(p.poll(4).unwrap(), RoomState::Failed);
    assert_eq!(
        p.failure(4).unwrap().reason.cause,
        FailureCause::RemoteFailure
    );
}

#[tokio::test(start_paused = true)]
async fn decode_bootstrap_timeout_when_the_prefill_never_answers() {
    let r = rig(Spec::mla_one_to_one()).await;
    r.hub.set_partitioned(&prefill_ep(), true);
    let req = Request::new(21, 40);
    r.start(&req).await;
    let d = &r.decodes[0].0;
    let err = bounded(d.wait(21)).await.unwrap_err().to_string();
    assert!(
        err.contains("Prefill bootstrap failed: registration with prefill-0 did not finish within 30.0s (bootstrap_addr: prefill.test:8998)"),
        "{err}"
    );
    assert_eq!(
        d.failure(21).unwrap().reason.peer.as_deref(),
        Some("prefill-0")
    );
    // Nothing was published, so there is nothing to fence.
    assert!(d.is_fenced(21).unwrap());
    bounded(d.release_when_fenced(21)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn unknown_bootstrap_address_fails_at_once() {
    let r = rig(Spec::mla_one_to_one()).await;
    let d = &r.decodes[0].0;
    d.receive(
        1,
        ReceiveRequest {
            bootstrap_addr: "nowhere:1".into(),
            page_table: vec![0, 1],
            cached_prefix_len: 0,
            aux_index: 0,
        },
    )
    .unwrap();
    let err = bounded(d.wait(1)).await.unwrap_err().to_string();
    assert!(
        err.contains("could not fetch prefill parallel info from bootstrap_addr: nowhere:1"),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn batch_deadline_fails_the_room_on_both_sides() {
    let mut spec = Spec::mla_one_to_one();
    spec.faults = vec![FaultScript::new().stall_batch(0)];
    spec.prefill_config = PrefillConfig::default()
        .with_batch_timeout(Duration::from_secs(5))
        .with_fence_grace(Duration::from_secs(1));
    let r = rig(spec).await;
    let req = Request::new(31, 40);
    let started = tokio::time::Instant::now();
    let outs = r.run(&req).await;
    assert!(
        started.elapsed() <= Duration::from_secs(7),
        "the batch deadline bounds the wait"
    );
    let err = outs[0].as_ref().unwrap_err().to_string();
    assert!(
        err.contains("Failed to send kv chunk of 31 to decode-0"),
        "{err}"
    );
    assert!(
        err.contains("did not complete within its deadline of 5s"),
        "{err}"
    );
    let d = &r.decodes[0].0;
    assert_eq!(
        d.failure(31).unwrap().reason.cause,
        FailureCause::BatchTimeout
    );
    assert_eq!(
        d.failure(31).unwrap().reason.peer.as_deref(),
        Some("prefill-0")
    );
    let p = &r.prefills[0].0;
    assert_eq!(
        p.failure(31).unwrap().reason.cause,
        FailureCause::BatchTimeout
    );
    assert_eq!(p.metrics().batches_failed, 1);
    bounded(d.release_when_fenced(31)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn failed_batch_fails_the_room_and_names_the_peer() {
    let mut spec = Spec::mla_one_to_one();
    spec.faults = vec![FaultScript::new().fail_batch(1)];
    let r = rig(spec).await;
    let req = Request {
        chunk_pages: 1,
        ..Request::new(32, 40)
    };
    let outs = r.run(&req).await;
    let e = r.decodes[0].0.failure(32).unwrap();
    assert_eq!(e.reason.cause, FailureCause::TransferError);
    assert!(
        outs[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("Failed to send kv chunk of 32 to decode-0")
    );
    // On the prefill, the transport's error is kept as the typed source.
    let p = r.prefills[0].0.failure(32).unwrap();
    let source = std::error::Error::source(&p)
        .and_then(|s| s.downcast_ref::<kvbridge_transport::TransportError>());
    assert!(source.is_some(), "{p:?}");
    bounded(r.decodes[0].0.release_when_fenced(32))
        .await
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn control_send_timeout_fails_the_room_naming_the_peer() {
    let r = rig(Spec::mla_one_to_one()).await;
    // The prefill stops reading its control socket: the registration send never completes.
    r.hub.set_stalled(&prefill_ep(), true);
    let req = Request::new(41, 40);
    r.start(&req).await;
    let d = &r.decodes[0].0;
    let started = tokio::time::Instant::now();
    let err = bounded(d.wait(41)).await.unwrap_err().to_string();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the 1 s send deadline, not the 30 s bootstrap timeout"
    );
    assert!(
        err.contains("_register_kv_args to prefill prefill-0 failed"),
        "{err}"
    );
    assert!(err.contains("did not complete within 1s"), "{err}");
    assert_eq!(
        d.failure(41).unwrap().reason.cause,
        FailureCause::ControlChannel
    );
}

#[tokio::test(start_paused = true)]
async fn metadata_for_a_room_the_prefill_never_creates_expires() {
    let mut spec = Spec::mla_one_to_one();
    spec.decode_config = DecodeConfig::default().with_waiting_timeout(Duration::from_secs(900));
    let r = rig(spec).await;
    let d = &r.decodes[0].0;
    d.receive(50, common::request(vec![0, 1, 2])).unwrap();
    let err = bounded(d.wait(50)).await.unwrap_err().to_string();
    assert!(
        err.contains(
            "prefill prefill-0 never created room 50 within the bootstrap timeout of 300.0s"
        ),
        "{err}"
    );
}

/// A registration straight from a test "decode" endpoint, to see the prefill's answer.
fn registration(
    desc: kvbridge_handshake::PeerDescriptor,
    transport: &dyn KvTransport,
    mem: &KvMemory,
    from: &Endpoint,
) -> ControlMessage {
    let wire = |e: &kvbridge_coordinator::EntryRegion| kvbridge_coordinator::WireRegion {
        region: e.region.0,
        offset: e.offset,
        len: e.len,
    };
    ControlMessage::Register(Registration {
        protocol: CONTROL_PROTOCOL_VERSION,
        decode_endpoint: from.clone(),
        session: 1.into(),
        descriptor: desc,
        transport: TransportInfo {
            name: transport.name().into(),
            descriptor: transport.local_descriptor().to_vec(),
        },
        kv_regions: mem.kv.iter().map(wire).collect(),
        aux_regions: mem.aux.iter().map(wire).collect(),
    })
}

#[tokio::test(start_paused = true)]
async fn incompatible_decode_is_refused_with_every_problem_and_the_prefill_keeps_serving() {
    let r = rig(Spec::mla_one_to_one()).await;
    // The seed's misconfiguration: a GQA decode with DCP, another page size and dtype.
    let bad = PeerDescriptor::mha(Role::Decode, 32, 1, 8, 128)
        .kv_cache_dtype("fp8_e4m3")
        .attn_tp(2, 0)
        .dcp(2)
        .kv_item_lens(vec![65536, 65536])
        .aux_item_lens(AUX_LENS.to_vec())
        .build()
        .unwrap();
    let transport = LoopbackTransport::new();
    let mem = KvMemory::allocate(&transport, &bad, 4, 2).await.unwrap();
    let rogue = r.hub.channel("rogue-decode").unwrap();
    let me = rogue.local_endpoint();
    rogue
        .send(
            &prefill_ep(),
            registration(bad.clone(), &transport, &mem.memory, &me),
        )
        .await
        .unwrap();
    let reply = bounded(rogue.recv()).await.unwrap();
    let ControlMessage::RegisterReply(reply) = reply.message else {
        panic!("expected a registration reply, got {reply:?}")
    };
    let RegistrationOutcome::Rejected { problems } = reply.result else {
        panic!("an incompatible decode must be refused")
    };
    let text: Vec<&str> = problems.iter().map(|p| p.message.as_str()).collect();
    assert!(problems.len() >= 3, "{text:?}");
    assert!(
        text.iter()
            .any(|m| m.contains("prefill kv_pool=mla but decode kv_pool=mha")),
        "{text:?}"
    );
    assert!(
        text.iter()
            .any(|m| m.starts_with("KV cache dtype mismatch")),
        "{text:?}"
    );
    assert!(
        text.contains(&"PD decode DCP requires an MLA or hybrid-MLA KV pool."),
        "{text:?}"
    );
    assert!(
        problems
            .iter()
            .all(|p| !p.remedy.is_empty() && p.code.starts_with("KVB-"))
    );
    // Its metadata is answered with the same problems instead of being served.
    rogue
        .send(
            &prefill_ep(),
            ControlMessage::TransferInfo(TransferInfo {
                room: 90.into(),
                generation: 1.into(),
                decode_endpoint: me.clone(),
                session: 1.into(),
                dst_pages: vec![0],
                dst_aux_index: Some(0),
                is_dummy: false,
                required_dst_info_num: 1,
                decode_prefix_len: 0,
                traceparent: None,
            }),
        )
        .await
        .unwrap();
    let status = bounded(rogue.recv()).await.unwrap();
    let ControlMessage::Status(status) = status.message else {
        panic!("{status:?}")
    };
    assert_eq!(status.state, RoomState::Failed);
    assert!(
        status
            .reason
            .unwrap()
            .contains("PD decode DCP requires an MLA or hybrid-MLA KV pool.")
    );
    // The prefill still serves its compatible decode.
    let req = Request::new(91, 50);
    for out in r.run(&req).await {
        out.unwrap();
    }
    r.verify(&req);
}

#[tokio::test(start_paused = true)]
async fn a_decode_refused_by_the_prefill_fails_its_rooms_at_once_with_the_problems() {
    let r = rig(Spec::refused_page_size()).await;
    let d = &r.decodes[0].0;
    for room in [1, 2] {
        d.receive(room, common::request(vec![0, 1])).unwrap();
    }
    for room in [1, 2] {
        let started = tokio::time::Instant::now();
        let err = bounded(d.wait(room)).await.unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "refused at once, not by a timeout"
        );
        let text = err.to_string();
        assert!(text.contains("Page size mismatch: prefill server has page_size=16, but decode server has page_size=64."), "{text}");
        let e = d.failure(room).unwrap();
        assert_eq!(e.reason.cause, FailureCause::PeerRejected);
        assert_eq!(e.reason.peer.as_deref(), Some("prefill-0"));
    }
    // A decode-side misfit (checked before any message) fails the same way, all problems listed.
    let mut bad = PeerDescriptor::mha(Role::Decode, 16, 1, 8, 128)
        .kv_cache_dtype("fp8_e4m3")
        .kv_item_lens(vec![65536, 65536])
        .aux_item_lens(AUX_LENS.to_vec())
        .build()
        .unwrap();
    bad.dcp_size = 2; // more DCP ranks than TP ranks: the builder refuses it, the test needs it
    let transport: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
    let mem = KvMemory::allocate(&*transport, &bad, 4, 2).await.unwrap();
    let agent = DecodeAgent::builder(
        bad,
        mem.memory,
        transport,
        Arc::new(r.hub.channel("decode-bad").unwrap()),
        Arc::new(r.dir.clone()),
    )
    .start()
    .unwrap();
    agent.receive(3, common::request(vec![0])).unwrap();
    let text = bounded(agent.wait(3)).await.unwrap_err().to_string();
    assert!(text.contains("KV cache dtype mismatch"), "{text}");
    assert!(
        text.contains("PD decode DCP requires an MLA or hybrid-MLA KV pool."),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn agreement_hook_fails_every_rank_when_one_fails() {
    let group = SharedMin::group(2);
    let r = rig(Spec::new(
        vec![mla("prefill", 4, 2, 32, 1, 0, 1)],
        (0..2).map(|i| mla("decode", 4, 2, 32, 2, i, 2)).collect(),
    ))
    .await;
    // Re-create the decode agents with the shared agreement.
    let mut agents = Vec::new();
    for (i, (old, rank)) in r.decodes.iter().enumerate() {
        old.shutdown();
        let a = DecodeAgent::builder(
            rank.desc.clone(),
            rank.mem.memory.clone(),
            rank.transport.clone(),
            Arc::new(r.hub.channel(format!("decode-agreed-{i}")).unwrap()),
            Arc::new(r.dir.clone()),
        )
        .agreement(Arc::new(group[i].clone()))
        .start()
        .unwrap();
        agents.push(a);
    }
    for (i, a) in agents.iter().enumerate() {
        a.receive(
            8,
            ReceiveRequest {
                bootstrap_addr: ADDR.into(),
                page_table: vec![1, 2],
                cached_prefix_len: 0,
                aux_index: i as u64,
            },
        )
        .unwrap();
    }
    r.prefills[0].0.create_room(8).unwrap();
    bounded(r.prefills[0].0.wait_ready(8)).await.unwrap();
    agents[0].abort(8);
    assert_eq!(agents[1].poll(8).unwrap(), RoomState::WaitingForInput);
    assert_eq!(agents[0].poll_agreed(8).await.unwrap(), RoomState::Failed);
    assert_eq!(agents[1].poll_agreed(8).await.unwrap(), RoomState::Failed);
}

#[tokio::test(start_paused = true)]
async fn a_prefill_restarted_at_the_same_endpoint_is_registered_again() {
    let mut r = rig(Spec::mla_one_to_one()).await;
    let first = Request::new(1, 40);
    for out in r.run(&first).await {
        out.unwrap();
    }
    // The prefill process dies and a new one takes its endpoint (and the directory entry).
    let (old, old_rank) = r.prefills.remove(0);
    old.shutdown();
    drop(old);
    let mut channel = None;
    for _ in 0..100 {
        tokio::task::yield_now().await;
        if let Ok(c) = r.hub.channel("prefill-0") {
            channel = Some(c);
            break;
        }
    }
    let channel = channel.expect("the dead prefill's endpoint is released");
    let transport: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
    let mem = KvMemory::allocate(&*transport, &old_rank.desc, r.prefill_pages, 8)
        .await
        .unwrap();
    let agent = kvbridge_coordinator::PrefillAgent::builder(
        old_rank.desc.clone(),
        mem.memory.clone(),
        transport.clone(),
        Arc::new(channel),
    )
    .start()
    .unwrap();
    r.dir.insert(ADDR, vec![agent.rank_info()]);
    r.prefills.push((
        agent,
        common::Rank {
            desc: old_rank.desc,
            mem,
            transport,
        },
    ));
    // The decode still believes it is registered: the new prefill refuses the metadata...
    let second = Request::new(2, 40);
    r.start(&second).await;
    let d = &r.decodes[0].0;
    let err = bounded(d.wait(2)).await.unwrap_err().to_string();
    assert!(
        err.contains("without registering with prefill prefill-0 first"),
        "{err}"
    );
    assert_eq!(
        d.failure(2).unwrap().reason.cause,
        FailureCause::Unregistered
    );
    bounded(d.release_when_fenced(2)).await.unwrap();
    r.prefills[0].0.clear(2);
    // ...and the next room registers again and goes through.
    let third = Request::new(3, 40);
    for out in r.run(&third).await {
        out.unwrap();
    }
    r.verify_with(&third, false);
}

/// A transport whose batches never finish by themselves; `cancel` takes `cancel_takes` and
/// then reports the batch cancelled (its `wait` returns), or never returns (`None`: it breaks
/// the contract).
struct BrokenTransport {
    inner: LoopbackTransport,
    next: std::sync::atomic::AtomicU64,
    cancel_takes: Option<Duration>,
    cancelled: tokio::sync::watch::Sender<std::collections::HashSet<u64>>,
}

impl BrokenTransport {
    fn new(cancel_takes: Option<Duration>) -> Self {
        BrokenTransport {
            inner: LoopbackTransport::new(),
            next: std::sync::atomic::AtomicU64::new(1),
            cancel_takes,
            cancelled: tokio::sync::watch::Sender::new(Default::default()),
        }
    }
}

#[async_trait::async_trait]
impl KvTransport for BrokenTransport {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn capabilities(&self) -> kvbridge_transport::Capabilities {
        self.inner.capabilities()
    }
    async fn register(
        &self,
        region: kvbridge_transport::MemoryRegion,
    ) -> kvbridge_transport::Result<kvbridge_transport::RegionId> {
        self.inner.register(region).await
    }
    async fn deregister(
        &self,
        region: kvbridge_transport::RegionId,
    ) -> kvbridge_transport::Result<()> {
        self.inner.deregister(region).await
    }
    fn local_descriptor(&self) -> bytes::Bytes {
        self.inner.local_descriptor()
    }
    async fn connect(
        &self,
        descriptor: &[u8],
    ) -> kvbridge_transport::Result<kvbridge_transport::PeerId> {
        self.inner.connect(descriptor).await
    }
    async fn disconnect(&self, peer: kvbridge_transport::PeerId) -> kvbridge_transport::Result<()> {
        self.inner.disconnect(peer).await
    }
    async fn post(
        &self,
        _peer: kvbridge_transport::PeerId,
        _batch: kvbridge_transport::TransferBatch,
    ) -> kvbridge_transport::Result<kvbridge_transport::BatchId> {
        Ok(kvbridge_transport::BatchId(
            self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        ))
    }
    fn batch_state(
        &self,
        _batch: kvbridge_transport::BatchId,
    ) -> kvbridge_transport::Result<kvbridge_transport::BatchState> {
        Ok(kvbridge_transport::BatchState::Pending)
    }
    async fn wait(&self, batch: kvbridge_transport::BatchId) -> kvbridge_transport::Result<()> {
        let mut rx = self.cancelled.subscribe();
        let _ = rx.wait_for(|c| c.contains(&batch.0)).await;
        Err(kvbridge_transport::TransportError::Cancelled { batch })
    }
    async fn cancel(
        &self,
        batch: kvbridge_transport::BatchId,
    ) -> kvbridge_transport::Result<kvbridge_transport::BatchState> {
        match self.cancel_takes {
            Some(d) => {
                sleep(d).await;
                self.cancelled.send_modify(|c| {
                    c.insert(batch.0);
                });
                Ok(kvbridge_transport::BatchState::Cancelled)
            }
            None => std::future::pending().await,
        }
    }
    async fn recv_notification(
        &self,
    ) -> kvbridge_transport::Result<kvbridge_transport::Notification> {
        self.inner.recv_notification().await
    }
    async fn probe(
        &self,
        peer: kvbridge_transport::PeerId,
        timeout: Duration,
    ) -> kvbridge_transport::Result<()> {
        self.inner.probe(peer, timeout).await
    }
    async fn shutdown(&self) -> kvbridge_transport::Result<()> {
        self.inner.shutdown().await
    }
}

#[tokio::test(start_paused = true)]
async fn a_batch_that_cannot_be_fenced_poisons_the_room_and_its_pages_stay_quarantined() {
    let mut spec = Spec::mla_one_to_one();
    spec.prefill_transport = Some(|| Arc::new(BrokenTransport::new(None)));
    spec.prefill_config = PrefillConfig::default()
        .with_batch_timeout(Duration::from_secs(5))
        .with_fence_grace(Duration::from_secs(1));
    spec.decode_config = DecodeConfig::default().with_fence_timeout(Duration::from_secs(20));
    let r = rig(spec).await;
    let req = Request::new(61, 40);
    let outs = r.run(&req).await;
    let err = outs[0].as_ref().unwrap_err().to_string();
    assert!(err.contains("did not finish batch"), "{err}");
    let d = &r.decodes[0].0;
    assert_eq!(
        d.failure(61).unwrap().reason.cause,
        FailureCause::BatchTimeout
    );
    // The prefill cannot prove its batch stopped, so it never acknowledges the abort.
    match bounded(d.release_when_fenced(61)).await {
        Err(CoordinatorError::FenceTimeout { pending, .. }) => assert_eq!(pending, "prefill-0"),
        other => panic!("a poisoned room must not be released: {other:?}"),
    }
    assert!(!d.is_fenced(61).unwrap());
}

#[tokio::test(start_paused = true)]
async fn the_fence_cancels_every_batch_at_once_under_one_deadline() {
    // 40 batches in flight, each cancel takes half the grace: cancelled one after the other
    // they would take 20 grace periods; concurrently, the whole fence ends within one.
    let grace = Duration::from_secs(2);
    let mut spec = Spec::mla_one_to_one();
    spec.prefill_transport = Some(|| Arc::new(BrokenTransport::new(Some(Duration::from_secs(1)))));
    spec.prefill_config = PrefillConfig::default().with_fence_grace(grace);
    let r = rig(spec).await;
    let req = Request {
        chunk_pages: 1,
        ..Request::new(81, 40 * 16)
    };
    r.start(&req).await;
    r.send_all(0, &req).await.unwrap();
    let p = &r.prefills[0].0;
    bounded(async {
        while p.metrics().batches_posted < 40 {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let d = &r.decodes[0].0;
    let started = tokio::time::Instant::now();
    p.abort(81);
    // The decode is told only once the fence ended.
    bounded(async {
        while d.failure(81).is_none() {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let fenced_in = started.elapsed();
    assert!(
        fenced_in <= grace,
        "the fence took {fenced_in:?} of virtual time, more than one fence_grace ({grace:?})"
    );
    assert_eq!(p.metrics().batches_failed, 40, "every batch was cancelled");
}

#[tokio::test(start_paused = true)]
async fn prefill_waiting_timeout_when_the_last_chunk_never_comes() {
    let mut spec = Spec::mla_one_to_one();
    spec.decode_config = DecodeConfig::default().with_waiting_timeout(Duration::from_secs(900));
    let r = rig(spec).await;
    let req = Request::new(71, 40);
    r.start(&req).await;
    let p = &r.prefills[0].0;
    bounded(p.wait_ready(71)).await.unwrap();
    // One chunk, never the last one.
    p.send_chunk(71, kvbridge_coordinator::Chunk::new(vec![0], 16))
        .await
        .unwrap();
    let err = bounded(p.wait(71)).await.unwrap_err().to_string();
    assert_eq!(
        err,
        "KVTransferError(bootstrap_room=71): Request 71 timed out after 300.0s in KVPoll.Transferring \
         [cause: waiting_timeout; peer: decode-0]"
    );
    assert_eq!(
        p.failure(71).unwrap().reason.peer.as_deref(),
        Some("decode-0")
    );
    // The decode hears it at once, and the pages are fenced (nothing in flight).
    let d = &r.decodes[0].0;
    let e = d.failure(71).expect("the decode is told");
    assert_eq!(e.reason.cause, FailureCause::WaitingTimeout);
    bounded(d.release_when_fenced(71)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn shutdown_fails_only_the_rooms_in_flight() {
    let r = rig(Spec::mla_one_to_one()).await;
    let done = Request::new(1, 40);
    for out in r.run(&done).await {
        out.unwrap();
    }
    let d = &r.decodes[0].0;
    d.receive(2, common::request(vec![0, 1])).unwrap();
    d.shutdown();
    assert_eq!(
        d.poll(1).unwrap(),
        RoomState::Success,
        "an ended room stays as it ended"
    );
    bounded(d.wait(1)).await.unwrap();
    assert_eq!(d.failure(2).unwrap().reason.cause, FailureCause::Shutdown);
    assert!(matches!(
        d.receive(3, common::request(vec![0])),
        Err(CoordinatorError::Shutdown { .. })
    ));
}

/// Posts through the prefill's transport while a slow post is under way: each post first
/// sleeps a second (virtual time), so the room can fail between two decode ranks' batches.
static SLOW_POSTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

struct SlowPosts(LoopbackTransport);

#[async_trait::async_trait]
impl kvbridge_transport::Delegate for SlowPosts {
    fn inner(&self) -> &dyn KvTransport {
        &self.0
    }

    async fn post(
        &self,
        peer: kvbridge_transport::PeerId,
        batch: kvbridge_transport::TransferBatch,
    ) -> kvbridge_transport::Result<kvbridge_transport::BatchId> {
        SLOW_POSTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.0.post(peer, batch).await
    }
}

fn slow_posts() -> Arc<dyn KvTransport> {
    Arc::new(SlowPosts(LoopbackTransport::new()))
}

#[tokio::test(start_paused = true)]
async fn a_room_that_fails_while_its_chunk_is_posted_posts_no_more_of_it() {
    // One prefill rank sends each chunk to two decode ranks (its heads split between them).
    let mut spec = Spec::new(
        vec![mha("prefill", 4, 2, 8, 16, 1, 0)],
        (0..2).map(|i| mha("decode", 4, 2, 8, 16, 2, i)).collect(),
    );
    spec.prefill_transport = Some(slow_posts);
    let r = rig(spec).await;
    let req = Request::new(43, 16);
    r.start(&req).await;
    let prefill = &r.prefills[0].0;
    let (sent, ()) = tokio::join!(r.send_all(0, &req), async {
        // Half-way through the first decode rank's post.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(SLOW_POSTS.load(std::sync::atomic::Ordering::SeqCst), 1);
        prefill.abort(43);
    });
    // The chunk was handed over before the abort; what matters is what was posted.
    let _ = sent;
    let e = bounded(prefill.wait(43)).await.unwrap_err();
    assert!(e.to_string().contains("Aborted by AbortReq."), "{e}");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        SLOW_POSTS.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the second decode rank's batch of the chunk in hand must not be posted after the room \
         failed"
    );
}
