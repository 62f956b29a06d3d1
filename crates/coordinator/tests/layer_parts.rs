//! Chunks sent layer by layer (`Chunk::for_layers`): the decode ends with exactly the bytes of
//! whole chunks, every path of the planner included, and a room concludes only with the final
//! part of its last chunk. Every decode byte verified against the owner rule.

mod common;

use std::time::Duration;

use common::{Request, Spec, bounded, mha, mla, rig};
use kvbridge_coordinator::{Chunk, CoordinatorError, RoomState};

fn by_layer(req: Request) -> Request {
    Request {
        layers_per_part: Some(1),
        ..req
    }
}

#[tokio::test(start_paused = true)]
async fn mla_chunks_sent_one_layer_at_a_time_land_as_whole_chunks_do() {
    let r = rig(Spec::mla_one_to_one()).await;
    let req = by_layer(Request {
        chunk_pages: 2,
        ..Request::new(12, 16 * 7 + 5)
    });
    for out in r.run(&req).await {
        out.unwrap();
    }
    r.verify(&req);
    // 4 chunks of 2 layers, one KV batch a part, then the aux batch after the last.
    assert_eq!(r.prefills[0].0.metrics().batches_posted, 4 * 2 + 1);
}

#[tokio::test(start_paused = true)]
async fn head_slices_go_layer_by_layer_in_parts_of_two_entries() {
    let r = rig(Spec::new(
        (0..2).map(|i| mha("prefill", 4, 2, 8, 16, 2, i)).collect(),
        (0..4).map(|i| mha("decode", 4, 2, 8, 16, 4, i)).collect(),
    ))
    .await;
    let req = Request {
        chunk_pages: 3,
        layers_per_part: Some(2),
        ..Request::new(7, 37)
    };
    for out in r.run(&req).await {
        out.unwrap();
    }
    assert_eq!(r.verify(&req), 4 * (4 * 37 * 2 * 16 * 2));
}

#[tokio::test(start_paused = true)]
async fn a_dcp_relayout_goes_layer_by_layer_with_a_cached_prefix() {
    let r = rig(Spec::new(
        vec![mla("prefill", 4, 3, 48, 1, 0, 1)],
        (0..4).map(|i| mla("decode", 4, 3, 48, 4, i, 4)).collect(),
    ))
    .await;
    let req = by_layer(Request {
        chunk_pages: 5,
        cached_prefix: 16,
        ..Request::new(11, 71)
    });
    for out in r.run(&req).await {
        out.unwrap();
    }
    assert_eq!(r.verify(&req), 3 * 71 * 48);
}

#[tokio::test(start_paused = true)]
async fn the_room_waits_for_the_final_part_of_its_last_chunk() {
    let r = rig(Spec::mla_one_to_one()).await;
    let req = Request::new(5, 40);
    r.start(&req).await;
    let (agent, _) = &r.prefills[0];
    let held = agent.wait_ready(5).await.unwrap();
    assert_eq!(held, 0);
    let table = r.prefill_layout(0, &req).page_table;
    let last = Chunk::last(table, 40, Some(req.prefill_aux_row));
    agent
        .send_chunk(5, last.clone().for_layers(0..1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(agent.poll(5).unwrap(), RoomState::Transferring);
    assert_eq!(r.decodes[0].0.poll(5).unwrap(), RoomState::WaitingForInput);
    // Out of order, a whole chunk in the middle, or a layer the rank lacks: refused with why,
    // and the room goes on.
    for (bad, why) in [
        (last.clone().for_layers(0..1), "expects layers from 1"),
        (last.clone(), "the rest of that chunk"),
        (last.clone().for_layers(1..3), "2 KV entries"),
    ] {
        let e = agent.send_chunk(5, bad).await.unwrap_err();
        assert!(
            matches!(&e, CoordinatorError::InvalidRequest { .. }) && e.to_string().contains(why),
            "{e}"
        );
    }
    agent.send_chunk(5, last.for_layers(1..2)).await.unwrap();
    bounded(r.decodes[0].0.wait(5)).await.unwrap();
    r.verify(&req);
}
