//! The few runtime pieces the suite needs (sleep, timeout, join), built on `std` so that the
//! suite needs no runtime dependency and runs on whatever executor the caller uses.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// One timer thread for the whole process: a list of (deadline, waker) and a condvar.
struct Timer {
    entries: Mutex<Vec<(Instant, Waker)>>,
    wakeup: Condvar,
}

fn timer() -> &'static Timer {
    static TIMER: OnceLock<&'static Timer> = OnceLock::new();
    TIMER.get_or_init(|| {
        let timer: &'static Timer = Box::leak(Box::new(Timer {
            entries: Mutex::new(Vec::new()),
            wakeup: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("kvbridge-suite-timer".into())
            .spawn(move || timer_loop(timer))
            .expect("the conformance suite could not start its timer thread");
        timer
    })
}

fn timer_loop(timer: &'static Timer) {
    let mut entries = timer.entries.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let now = Instant::now();
        let mut i = 0;
        while i < entries.len() {
            if entries[i].0 <= now {
                entries.swap_remove(i).1.wake();
            } else {
                i += 1;
            }
        }
        entries = match entries.iter().map(|(d, _)| *d).min() {
            None => timer
                .wakeup
                .wait(entries)
                .unwrap_or_else(|e| e.into_inner()),
            Some(next) => {
                timer
                    .wakeup
                    .wait_timeout(entries, next.saturating_duration_since(now))
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
    }
}

/// A future that completes at `deadline`.
pub(crate) struct Sleep {
    deadline: Instant,
}

impl Future for Sleep {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline {
            return Poll::Ready(());
        }
        let timer = timer();
        let mut entries = timer.entries.lock().unwrap_or_else(|e| e.into_inner());
        if !entries
            .iter()
            .any(|(d, w)| *d == self.deadline && w.will_wake(cx.waker()))
        {
            entries.push((self.deadline, cx.waker().clone()));
            timer.wakeup.notify_one();
        }
        Poll::Pending
    }
}

/// Sleeps for `duration`.
pub(crate) fn sleep(duration: Duration) -> Sleep {
    sleep_until(Instant::now() + duration)
}

/// Sleeps until `deadline`.
pub(crate) fn sleep_until(deadline: Instant) -> Sleep {
    Sleep { deadline }
}

/// Polls a future to completion on the calling thread (for the crate's own unit tests).
#[cfg(test)]
pub(crate) fn block_on<F: Future>(fut: F) -> F::Output {
    struct ThreadWaker(std::thread::Thread);
    impl std::task::Wake for ThreadWaker {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(std::sync::Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// Runs `fut` for at most `limit`; `None` when it did not finish in time.
pub(crate) async fn timeout<F: Future>(limit: Duration, fut: F) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    let mut sleep = std::pin::pin!(sleep(limit));
    std::future::poll_fn(|cx| {
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            return Poll::Ready(Some(v));
        }
        if sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        Poll::Pending
    })
    .await
}

/// Polls all futures concurrently and returns their outputs in order.
pub(crate) async fn join_all<F: Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (fut, slot) in futs.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match fut.as_mut().poll(cx) {
                    Poll::Ready(v) => *slot = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_fires_and_passes_through() {
        assert_eq!(
            block_on(timeout(
                Duration::from_millis(5),
                std::future::pending::<()>()
            )),
            None
        );
        assert_eq!(
            block_on(timeout(Duration::from_secs(5), async { 7 })),
            Some(7)
        );
        let start = Instant::now();
        block_on(sleep(Duration::from_millis(20)));
        assert!(start.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn join_all_keeps_order() {
        let futs = (0..5u64)
            .map(|i| async move {
                sleep(Duration::from_millis(10 - 2 * i)).await;
                i
            })
            .collect();
        assert_eq!(block_on(join_all(futs)), vec![0, 1, 2, 3, 4]);
    }
}
