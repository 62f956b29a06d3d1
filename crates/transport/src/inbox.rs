//! The notification inbox every receiving side needs: a bounded queue behind
//! [`KvTransport::recv_notification`](crate::KvTransport::recv_notification), written once.
//!
//! Runtime-agnostic, like the batch table: [`NotificationInbox::recv`] is a plain future (it
//! registers its waker), [`NotificationInbox::try_push`] never blocks, and
//! [`NotificationInbox::wait_for_room`] blocks the calling thread for transports whose mover is
//! an OS thread of its own (never call it on an async runtime's worker thread).
//!
//! Contract point 4 is the caller's: push a batch's notification only in the step that declares
//! the batch done ([`Batches::step`](crate::batch::Batches::step) returning
//! [`Step::Finish`](crate::batch::Step::Finish)`(`[`Outcome::Done`](crate::batch::Outcome::Done)`)`),
//! and while the inbox is full return [`Step::Continue`](crate::batch::Step::Continue), so the
//! batch times out at its deadline rather than dropping the notification.
//!
//! # Example
//!
//! ```
//! use kvbridge_transport::inbox::NotificationInbox;
//! use kvbridge_transport::{Bytes, Notification, PeerId};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let inbox = NotificationInbox::new("my-engine", 2);
//! inbox.try_push(Notification::new(PeerId(1), Bytes::from_static(b"a"))).unwrap();
//! inbox.try_push(Notification::new(PeerId(1), Bytes::from_static(b"b"))).unwrap();
//! // Full: the notification comes back, nothing is dropped.
//! assert!(inbox.try_push(Notification::new(PeerId(1), Bytes::from_static(b"c"))).is_err());
//! assert_eq!(inbox.recv().await.unwrap().payload, "a");
//! inbox.close();
//! // Closed: what is queued is still delivered, then `Closed`.
//! assert_eq!(inbox.recv().await.unwrap().payload, "b");
//! assert!(inbox.recv().await.is_err());
//! # });
//! ```

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::Instant;

use crate::sync::lock;
use crate::{Notification, Result, TransportError};

/// Waiting `recv`s remembered before all are woken at once (each re-registers): bounds the list
/// when callers drop `recv` futures before a notification arrives (a `select!` with a timer).
const MAX_WAITERS: usize = 64;

/// A bounded queue of notifications, with wake-ups for its readers and for a mover waiting for
/// room. Share it (`Arc`) between the side that delivers notifications and the transport's
/// `recv_notification`.
#[derive(Debug)]
pub struct NotificationInbox {
    transport: &'static str,
    capacity: usize,
    state: Mutex<State>,
    room: Condvar,
}

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<Notification>,
    readers: Vec<Waker>,
    closed: bool,
}

impl NotificationInbox {
    /// An inbox of transport `transport` (named in its `Closed` error) that holds at most
    /// `capacity` notifications (at least one).
    pub fn new(transport: &'static str, capacity: usize) -> Self {
        Self {
            transport,
            capacity: capacity.max(1),
            state: Mutex::default(),
            room: Condvar::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Queues `n` and wakes the readers; hands `n` back when the inbox is full or closed.
    ///
    /// # Errors
    /// The notification itself, when it was not queued.
    pub fn try_push(&self, n: Notification) -> std::result::Result<(), Notification> {
        let readers = {
            let mut st = self.state();
            if st.closed || st.queue.len() >= self.capacity {
                return Err(n);
            }
            st.queue.push_back(n);
            std::mem::take(&mut st.readers)
        };
        readers.into_iter().for_each(Waker::wake);
        Ok(())
    }

    /// Blocks this thread until the inbox has room, it is closed, or `deadline` passes; whether
    /// it has room. For movers that run on an OS thread of their own, never on an async
    /// runtime's worker thread.
    pub fn wait_for_room(&self, deadline: Instant) -> bool {
        let mut st = self.state();
        loop {
            if st.closed {
                return false;
            }
            if st.queue.len() < self.capacity {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = match self.room.wait_timeout(st, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }

    /// The next notification, in the order they were pushed; waits for one. Once the inbox is
    /// closed, what is queued is still delivered, then [`TransportError::Closed`].
    ///
    /// # Errors
    /// [`TransportError::Closed`] once the inbox is closed and empty.
    pub async fn recv(&self) -> Result<Notification> {
        std::future::poll_fn(|cx| {
            let mut st = self.state();
            if let Some(n) = st.queue.pop_front() {
                drop(st);
                self.room.notify_one();
                return Poll::Ready(Ok(n));
            }
            if st.closed {
                return Poll::Ready(Err(TransportError::Closed {
                    transport: self.transport,
                }));
            }
            if !st.readers.iter().any(|w| w.will_wake(cx.waker())) {
                if st.readers.len() >= MAX_WAITERS {
                    // Spurious wake-ups are allowed: each live reader polls and registers again.
                    std::mem::take(&mut st.readers)
                        .into_iter()
                        .for_each(Waker::wake);
                }
                st.readers.push(cx.waker().clone());
            }
            Poll::Pending
        })
        .await
    }

    /// Closes the inbox (at shutdown): no push is taken any more, readers get what is queued and
    /// then `Closed`, and a mover waiting for room returns.
    pub fn close(&self) {
        let readers = {
            let mut st = self.state();
            st.closed = true;
            std::mem::take(&mut st.readers)
        };
        readers.into_iter().for_each(Waker::wake);
        self.room.notify_all();
    }

    /// Notifications queued now.
    pub fn len(&self) -> usize {
        self.state().queue.len()
    }

    /// Whether none is queued now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most notifications it holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Wake};
    use std::time::Duration;

    use bytes::Bytes;

    use super::*;
    use crate::PeerId;

    fn note(i: u8) -> Notification {
        Notification::new(PeerId(u64::from(i)), Bytes::from(vec![i]))
    }

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Polls a fresh `recv` once with a counting waker.
    fn poll_once(inbox: &NotificationInbox, count: &Arc<Count>) -> Poll<Result<Notification>> {
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut fut = std::pin::pin!(inbox.recv());
        fut.as_mut().poll(&mut cx)
    }

    #[test]
    fn notifications_come_out_in_order_and_a_full_inbox_hands_them_back() {
        let inbox = NotificationInbox::new("t", 2);
        inbox.try_push(note(1)).unwrap();
        inbox.try_push(note(2)).unwrap();
        let back = inbox.try_push(note(3)).unwrap_err();
        assert_eq!(back.payload, Bytes::from(vec![3]));
        assert_eq!(inbox.len(), 2);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        for want in [1, 2] {
            match poll_once(&inbox, &count) {
                Poll::Ready(Ok(n)) => assert_eq!(n.from, PeerId(want)),
                other => panic!("expected notification {want}, got {other:?}"),
            }
        }
        assert!(poll_once(&inbox, &count).is_pending());
    }

    #[test]
    fn a_push_wakes_a_waiting_reader_and_close_ends_it_after_the_queue() {
        let inbox = NotificationInbox::new("t", 4);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        assert!(poll_once(&inbox, &count).is_pending());
        inbox.try_push(note(1)).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        inbox.close();
        assert!(
            inbox.try_push(note(2)).is_err(),
            "a closed inbox takes nothing"
        );
        assert!(matches!(poll_once(&inbox, &count), Poll::Ready(Ok(_))));
        assert!(matches!(
            poll_once(&inbox, &count),
            Poll::Ready(Err(TransportError::Closed { transport: "t" }))
        ));
    }

    #[test]
    fn abandoned_readers_do_not_pile_up() {
        let inbox = NotificationInbox::new("t", 4);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        // Each poll uses a waker of its own (a new task each time) and drops its future.
        for _ in 0..1000 {
            let own = Arc::new(Count(AtomicUsize::new(0)));
            assert!(poll_once(&inbox, &own).is_pending());
        }
        assert!(inbox.state().readers.len() <= MAX_WAITERS);
        assert!(poll_once(&inbox, &count).is_pending());
        inbox.try_push(note(1)).unwrap();
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "the live reader is woken"
        );
    }

    #[test]
    fn a_mover_waiting_for_room_wakes_when_a_reader_takes_one() {
        let inbox = Arc::new(NotificationInbox::new("t", 1));
        inbox.try_push(note(1)).unwrap();
        assert!(!inbox.wait_for_room(Instant::now() + Duration::from_millis(20)));
        let mover = {
            let inbox = inbox.clone();
            std::thread::spawn(move || {
                inbox.wait_for_room(Instant::now() + Duration::from_secs(30))
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        let count = Arc::new(Count(AtomicUsize::new(0)));
        assert!(matches!(poll_once(&inbox, &count), Poll::Ready(Ok(_))));
        assert!(mover.join().unwrap(), "room after the reader took one");
        inbox.close();
        assert!(!inbox.wait_for_room(Instant::now() + Duration::from_secs(30)));
    }
}
