//! Compile-time checks: agents and their futures can move across threads (tokio::spawn).

use kvbridge_coordinator::{
    Chunk, DecodeAgent, InProcessChannel, InProcessControlHub, PrefillAgent, StaticDirectory,
};

fn is_send<T: Send>(_: &T) {}
fn is_send_sync<T: Send + Sync>() {}

#[test]
fn public_types_are_send_and_sync() {
    is_send_sync::<PrefillAgent>();
    is_send_sync::<DecodeAgent>();
    is_send_sync::<InProcessControlHub>();
    is_send_sync::<InProcessChannel>();
    is_send_sync::<StaticDirectory>();
}

#[allow(dead_code, clippy::let_underscore_future)]
fn public_futures_are_send(p: PrefillAgent, d: DecodeAgent) {
    let f = async move {
        let _ = p.send_chunk(1, Chunk::new(vec![], 0)).await;
        let _ = p.wait_ready(1).await;
        let _ = p.wait(1).await;
        let _ = p.poll_agreed(1).await;
        let _ = d.wait(1).await;
        let _ = d.release_when_fenced(1).await;
        let _ = d.poll_agreed(1).await;
    };
    is_send(&f);
}
