//! Descriptors a hostile or broken peer could hand over: refused by `connect` with
//! `BadDescriptor`, never a crash, and the transport keeps working afterwards.
#![cfg(feature = "nixl")]

mod common;

use common::runtime_ready;
use kvbridge_nixl::NixlTransport;
use kvbridge_nixl::descriptor::Descriptor;
use kvbridge_transport::{KvTransport, KvTransportExt, TransportError};

async fn refused(t: &NixlTransport, bytes: &[u8], what: &str) -> String {
    match t.connect(bytes).await {
        Err(e @ TransportError::BadDescriptor { .. }) => e.to_string(),
        other => panic!("{what}: expected BadDescriptor, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_and_truncated_descriptors_are_refused() {
    if !runtime_ready() {
        return;
    }
    let a = NixlTransport::new().unwrap();
    let b = NixlTransport::new().unwrap();
    b.allocate_registered(4096).await.unwrap();
    let good = b.local_descriptor();
    let decoded = Descriptor::decode(&good).unwrap();

    let text = refused(
        &a,
        b"kvbridge-shm:1:00:/tmp/x",
        "another transport's descriptor",
    )
    .await;
    assert!(text.contains("magic"), "{text}");
    for cut in [0, 7, 8, 20, good.len() / 2, good.len() - 1] {
        let text = refused(&a, &good[..cut], "a truncated descriptor").await;
        assert!(text.contains("bytes"), "{text}");
    }
    let mut flipped = good.to_vec();
    flipped[40] ^= 0x55;
    let text = refused(&a, &flipped, "an altered descriptor").await;
    assert!(text.contains("checksum"), "{text}");

    // A well-formed envelope around metadata that is not NIXL's: NIXL's parser refuses it.
    let junk = Descriptor {
        metadata: vec![0xA5; 512],
        ..decoded.clone()
    };
    let text = refused(&a, &junk.encode(), "junk NIXL metadata").await;
    assert!(text.contains("NIXL refused"), "{text}");
    // The envelope names another agent than the metadata it carries.
    let liar = Descriptor {
        name: "kvbridge-someone-else".to_owned(),
        ..decoded
    };
    let text = refused(&a, &liar.encode(), "a descriptor naming another agent").await;
    assert!(text.contains("kvbridge-someone-else"), "{text}");
    // Its own descriptor.
    refused(&a, &a.local_descriptor(), "its own descriptor").await;

    // After all that, the real descriptor still connects.
    let peer = a.connect(&good).await.unwrap();
    a.probe(peer, std::time::Duration::from_secs(5))
        .await
        .unwrap();
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}
