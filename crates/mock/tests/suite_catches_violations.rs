//! The conformance suite must fail transports that break the contract. Each test wraps
//! `LoopbackTransport` in a decorator that breaks one contract point and checks that the case
//! covering it panics, naming that point.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvbridge_conformance::TransportPair;
use kvbridge_mock::{LoopbackConfig, LoopbackTransport};
use kvbridge_transport::{
    BatchId, BatchState, Capabilities, KvTransport, MemoryRegion, Notification, PeerId, RegionId,
    Result, TransferBatch,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flaw {
    /// Drops the second half of every batch's descriptors.
    DropsDescriptors,
    /// Delivers the notification before the data.
    NotifiesEarly,
    /// Reports success for batch ids it never handed out.
    AcceptsUnknownBatches,
    /// Claims not to support reads, but performs them.
    UndeclaredReads,
    /// Reports `Cancelled` without stopping the copy.
    CancelDoesNotFence,
    /// `wait` never returns.
    HangingWait,
    /// Registers device memory without declaring `device_memory`.
    UndeclaredDeviceMemory,
    /// Delivers the notification of a batch that was cancelled or timed out.
    NotifiesFailedBatches,
    /// `deregister` returns at once and leaves the region to the batches in flight.
    DeregisterDoesNotFence,
}

struct Broken {
    inner: LoopbackTransport,
    flaw: Flaw,
    /// The notification and peer of each posted batch ([`Flaw::NotifiesFailedBatches`]).
    notifications: Mutex<HashMap<BatchId, (PeerId, Bytes)>>,
}

impl Broken {
    /// Delivers `batch`'s notification although it failed ([`Flaw::NotifiesFailedBatches`]).
    async fn notify_anyway(&self, batch: BatchId) {
        let taken = self.notifications.lock().unwrap().remove(&batch);
        if let Some((peer, n)) = taken {
            let _ = self
                .inner
                .post(peer, TransferBatch::write(vec![]).with_notification(n))
                .await;
        }
    }
}

#[async_trait::async_trait]
impl KvTransport for Broken {
    fn name(&self) -> &'static str {
        "broken-loopback"
    }
    fn capabilities(&self) -> Capabilities {
        let caps = self.inner.capabilities();
        if self.flaw == Flaw::UndeclaredReads {
            caps.with_reads(false)
        } else {
            caps
        }
    }
    fn allocate(&self, len: usize) -> Result<MemoryRegion> {
        self.inner.allocate(len)
    }
    async fn register(&self, region: MemoryRegion) -> Result<RegionId> {
        if self.flaw == Flaw::UndeclaredDeviceMemory && !region.kind().is_host() {
            return Ok(RegionId(u64::MAX));
        }
        self.inner.register(region).await
    }
    async fn deregister(&self, region: RegionId) -> Result<()> {
        if self.flaw == Flaw::DeregisterDoesNotFence {
            return Ok(());
        }
        self.inner.deregister(region).await
    }
    fn local_descriptor(&self) -> Bytes {
        self.inner.local_descriptor()
    }
    async fn connect(&self, descriptor: &[u8]) -> Result<PeerId> {
        self.inner.connect(descriptor).await
    }
    async fn disconnect(&self, peer: PeerId) -> Result<()> {
        self.inner.disconnect(peer).await
    }
    async fn post(&self, peer: PeerId, mut batch: TransferBatch) -> Result<BatchId> {
        match self.flaw {
            Flaw::DropsDescriptors => {
                let keep = batch.ops.len().div_ceil(2);
                batch.ops.truncate(keep);
            }
            Flaw::NotifiesEarly => {
                if let Some(n) = batch.notification.take() {
                    let early = TransferBatch::write(vec![]).with_notification(n);
                    self.inner.post(peer, early).await?;
                }
            }
            _ => {}
        }
        let notification = batch.notification.clone();
        let id = self.inner.post(peer, batch).await?;
        if let (Flaw::NotifiesFailedBatches, Some(n)) = (self.flaw, notification) {
            self.notifications.lock().unwrap().insert(id, (peer, n));
        }
        Ok(id)
    }
    fn batch_state(&self, batch: BatchId) -> Result<BatchState> {
        self.inner.batch_state(batch)
    }
    async fn wait(&self, batch: BatchId) -> Result<()> {
        match self.flaw {
            Flaw::HangingWait => std::future::pending().await,
            Flaw::AcceptsUnknownBatches => match self.inner.wait(batch).await {
                Err(kvbridge_transport::TransportError::UnknownBatch { .. }) => Ok(()),
                other => other,
            },
            Flaw::NotifiesFailedBatches => {
                let r = self.inner.wait(batch).await;
                if matches!(r, Err(kvbridge_transport::TransportError::TimedOut { .. })) {
                    self.notify_anyway(batch).await;
                }
                r
            }
            _ => self.inner.wait(batch).await,
        }
    }
    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        if self.flaw == Flaw::CancelDoesNotFence {
            return Ok(BatchState::Cancelled);
        }
        let state = self.inner.cancel(batch).await?;
        if self.flaw == Flaw::NotifiesFailedBatches && state != BatchState::Done {
            self.notify_anyway(batch).await;
        }
        Ok(state)
    }
    async fn recv_notification(&self) -> Result<Notification> {
        self.inner.recv_notification().await
    }
    async fn probe(&self, peer: PeerId, timeout: Duration) -> Result<()> {
        self.inner.probe(peer, timeout).await
    }
    async fn shutdown(&self) -> Result<()> {
        self.inner.shutdown().await
    }
}

fn pair(flaw: Flaw) -> TransportPair {
    // Small copy steps make batches take long enough for cancel and notification races.
    let config = LoopbackConfig::default().with_chunk_bytes(512);
    let make = || {
        Arc::new(Broken {
            inner: LoopbackTransport::with_config(config.clone()),
            flaw,
            notifications: Mutex::new(HashMap::new()),
        })
    };
    TransportPair::new(make(), make())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "contract 6")]
async fn dropped_descriptors_fail_random_batches() {
    kvbridge_conformance::random_batches(pair(Flaw::DropsDescriptors)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "contract 4")]
async fn early_notifications_fail_notification_after_data() {
    kvbridge_conformance::notification_after_data(pair(Flaw::NotifiesEarly)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "contract 4")]
async fn early_notifications_fail_notifications_only_for_completed_batches() {
    // Deterministic: the early notification arrives although the batch is then cancelled.
    kvbridge_conformance::notifications_only_for_completed_batches(pair(Flaw::NotifiesEarly)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "contract 4")]
async fn notifying_failed_batches_fails_notifications_only_for_completed_batches() {
    kvbridge_conformance::notifications_only_for_completed_batches(pair(
        Flaw::NotifiesFailedBatches,
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "contract 7")]
async fn accepting_unknown_batches_fails_unknown_ids() {
    kvbridge_conformance::unknown_ids_refused(pair(Flaw::AcceptsUnknownBatches)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "contract 8")]
async fn undeclared_reads_fail_reads_or_unsupported() {
    kvbridge_conformance::reads_or_unsupported(pair(Flaw::UndeclaredReads)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "contract 3")]
async fn a_deregister_that_does_not_fence_reads_fails_local_deregister_fences_reads() {
    kvbridge_conformance::local_deregister_fences_reads(pair(Flaw::DeregisterDoesNotFence)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "[broken-loopback]")]
async fn unfenced_cancel_fails_cancel_fences() {
    kvbridge_conformance::cancel_fences(pair(Flaw::CancelDoesNotFence)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "did not return within")]
async fn hanging_wait_fails_by_a_bound_instead_of_hanging() {
    kvbridge_conformance::deadline_expiry(pair(Flaw::HangingWait)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(
    expected = "contract 8 (capabilities are declared): the sender does not declare \
                           device_memory"
)]
async fn undeclared_device_memory_fails_device_memory_refused_unless_declared() {
    kvbridge_conformance::device_memory_refused_unless_declared(pair(Flaw::UndeclaredDeviceMemory))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wrapper_passes_cases_its_flaw_does_not_touch() {
    // Control: the decorator itself (small copy steps included) is not what the cases catch.
    kvbridge_conformance::random_batches(pair(Flaw::UndeclaredReads)).await;
    kvbridge_conformance::cancel_fences(pair(Flaw::UndeclaredReads)).await;
    kvbridge_conformance::notification_after_data(pair(Flaw::UndeclaredReads)).await;
    kvbridge_conformance::device_memory_refused_unless_declared(pair(Flaw::UndeclaredReads)).await;
    kvbridge_conformance::notifications_only_for_completed_batches(pair(Flaw::UndeclaredReads))
        .await;
}

/// How long after `cancel` returned [`LateWriter`] lands the cancelled batch's bytes: far past
/// a 50 ms quiet window, well inside the batch's deadline.
const LATE_BY: Duration = Duration::from_millis(300);

/// Fences a cancelled batch as the inner transport does and reports it `Cancelled`, but keeps
/// one retry slot: [`LATE_BY`] after `cancel` returned it posts the cancelled batch's
/// descriptors again, unless a later cancel took the slot first. So the last batch cancelled
/// lands after the fence.
struct LateWriter {
    inner: Arc<LoopbackTransport>,
    /// Posted batches not yet cancelled, each with its peer, to replay if cancelled.
    posted: Mutex<HashMap<BatchId, (PeerId, TransferBatch)>>,
    /// Bumped by every cancel; a retry runs only if it is still the newest.
    slot: Arc<AtomicU64>,
}

#[async_trait::async_trait]
impl kvbridge_transport::Delegate for LateWriter {
    fn inner(&self) -> &dyn KvTransport {
        &*self.inner
    }

    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        let replay = TransferBatch::write(batch.ops.clone());
        let id = self.inner.post(peer, batch).await?;
        self.posted
            .lock()
            .expect("posted table")
            .insert(id, (peer, replay));
        Ok(id)
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        let state = self.inner.cancel(batch).await?;
        let replay = self.posted.lock().expect("posted table").remove(&batch);
        if let (BatchState::Cancelled, Some((peer, replay))) = (&state, replay) {
            let mine = self.slot.fetch_add(1, Ordering::SeqCst) + 1;
            let slot = Arc::clone(&self.slot);
            let inner = Arc::clone(&self.inner);
            tokio::spawn(async move {
                tokio::time::sleep(LATE_BY).await;
                if slot.load(Ordering::SeqCst) != mine {
                    return;
                }
                if let Ok(id) = inner.post(peer, replay).await {
                    let _ = inner.wait(id).await;
                }
            });
        }
        Ok(state)
    }
}

fn late_writer_pair() -> TransportPair {
    // Small copy steps keep the batch in flight when `cancel` comes, so it is cancelled.
    let config = LoopbackConfig::default().with_chunk_bytes(512);
    let make = || {
        Arc::new(LateWriter {
            inner: Arc::new(LoopbackTransport::with_config(config.clone())),
            posted: Mutex::default(),
            slot: Arc::default(),
        })
    };
    TransportPair::new(make(), make())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "contract 3 (fencing): after batch")]
async fn a_write_landing_after_cancel_fails_cancel_fences() {
    kvbridge_conformance::cancel_fences(late_writer_pair()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "did not return within 250.001ms")]
async fn the_pair_s_limits_bound_the_cases() {
    // The first batch of `deadline_expiry` has a 1 µs deadline, so its `wait` is bounded by that
    // plus the pair's deadline grace; `boxed` keeps the limits.
    let limits =
        kvbridge_conformance::Limits::default().with_deadline_grace(Duration::from_millis(250));
    let pair = pair(Flaw::HangingWait).with_limits(limits).boxed();
    assert_eq!(pair.limits(), limits);
    kvbridge_conformance::deadline_expiry(pair).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_late_writer_passes_cases_that_do_not_cancel() {
    // Control: what fails `cancel_fences` is the late write, not the decorator.
    kvbridge_conformance::random_batches(late_writer_pair()).await;
    kvbridge_conformance::notification_after_data(late_writer_pair()).await;
}
