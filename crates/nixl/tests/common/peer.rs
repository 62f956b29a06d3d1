//! What the test files with a peer process share (they include this with `#[path]`): hex text
//! for bytes on the peer's stdout lines, the checks after a peer died, the re-run over UCX's TCP
//! lane.

use std::time::Duration;

use kvbridge_conformance::child::rerun_self;
use kvbridge_transport::{KvTransport, PeerId, RegionId, TransferBatch, TransferOp};

/// Set in the re-run with `UCX_TLS=tcp`, so it does not re-run itself again.
pub(crate) const LANES_ENV: &str = "KVBRIDGE_NIXL_LANES";

/// `bytes` as lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of `hex`'s text.
///
/// # Panics
/// On text that is not hex (the peer processes only print what `hex` made).
pub(crate) fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex text from the peer"))
        .collect()
}

/// After `peer` died: a later 4 KiB batch into `remote` fails (at `post` or `wait`), a probe
/// fails; then `t` shuts down.
pub(crate) async fn later_batches_and_probes_fail(
    t: &dyn KvTransport,
    peer: PeerId,
    local: RegionId,
    remote: RegionId,
    deadline: Duration,
) {
    let later = t
        .post(
            peer,
            TransferBatch::write(vec![TransferOp::new(local, 0, remote, 0, 4096)])
                .with_timeout(deadline),
        )
        .await;
    if let Ok(id) = later {
        assert!(
            t.wait(id).await.is_err(),
            "a batch to a dead peer completed"
        );
    }
    assert!(t.probe(peer, Duration::from_secs(1)).await.is_err());
    t.shutdown().await.unwrap();
}

/// Re-runs this test binary's tests matching `filters` with `UCX_TLS=tcp` (in the re-run and,
/// by inheritance, its peer processes) and asserts that `passed` of them passed.
pub(crate) fn rerun_over_ucx_tcp(filters: &[&str], passed: usize) {
    let mut args = vec!["--test-threads=2"];
    args.extend_from_slice(filters);
    let out = rerun_self(&args, [("UCX_TLS", "tcp"), (LANES_ENV, "tcp")]);
    let text = String::from_utf8_lossy(&out.stdout);
    let want = format!("{passed} passed");
    assert!(
        out.status.success() && text.contains(&want),
        "the tests {filters:?} failed with UCX_TLS=tcp (wanted {want}):\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The failure of a batch to a peer that died: the peer lost (or the batch failed or timed
/// out), after `took`, by its `deadline` plus the commit grace (1 s) and slack for a loaded
/// machine.
pub(crate) fn assert_failed_in_time(
    err: &kvbridge_transport::TransportError,
    took: Duration,
    deadline: Duration,
    what: &str,
) {
    use kvbridge_transport::TransportError;
    assert!(
        matches!(
            err,
            TransportError::PeerLost { .. }
                | TransportError::BatchFailed { .. }
                | TransportError::TimedOut { .. }
        ),
        "unexpected error of {what} after the peer died: {err}"
    );
    assert!(
        took < deadline + Duration::from_secs(20),
        "{what} took {took:?} to fail"
    );
}
