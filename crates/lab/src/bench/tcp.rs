//! The TCP transport for `kvbridge-lab bench --transport tcp`, and its baseline: raw TCP
//! streams with no framing that move the same bytes from the same source region into the
//! receiver's own registered pool (the memory kvbridge writes).
//!
//! The baseline's receiving end is a thread of the receiver process (`raw-sink pool|ping` on
//! its stdin). Sender and sink follow the same schedule of stream counts, so nothing but the
//! bytes travels: per run, each stream carries its contiguous share, and the sink answers one
//! byte when it has them all, so a baseline run, like a transport run, is timed from the first
//! byte sent to the receiver's confirmation. A bulk pattern's run is the best of one and two
//! streams (kvbridge opens two connections per peer by default), read straight into the pool
//! once the first byte is there (the pool is claimed only while bytes arrive, as kvbridge's
//! receiver claims it). For `latency-4k` it is a one-stream raw TCP ping-pong of the same 4
//! KiB into a buffer of the sink's own (a claim would cost it a call per round trip), the
//! row's round-trip baseline.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvbridge_tcp::TcpTransport;
use kvbridge_transport::{KvTransport, MemoryRegion};

use super::TransportFuture;

/// How the baseline is described in the report.
pub(super) const BASELINE: &str = "raw TCP streams (no framing; loopback unless --peer-netns) \
     moving the bytes from the same source into the receiver's pool, best of 1 and 2 streams";

/// Creates a [`TcpTransport`] with the default configuration (OS-assigned port, one
/// connection per peer) on this run's address (127.0.0.1 unless `--bind-addr`).
pub(super) fn factory() -> TransportFuture {
    Box::pin(async {
        let net = super::net();
        let mut config = kvbridge_tcp::TcpConfig::default()
            .with_bind_addr(std::net::SocketAddr::new(net.bind, 0));
        if let Some(n) = net.tcp_connections {
            config = config.with_connections_per_peer(n);
        }
        TcpTransport::bind(config)
            .await
            .map(|t| Arc::new(t) as Arc<dyn KvTransport>)
            .map_err(|e| e.to_string())
    })
}

/// The sending end of the raw-TCP baseline, connected to the receiver's sink thread.
pub(super) struct RawTcpBaseline {
    streams: Vec<TcpStream>,
    bytes: u64,
    /// The stream counts of each run, in turn (the sink's schedule too).
    counts: &'static [usize],
    /// Seconds of each run, per entry of `counts`.
    times: Mutex<Vec<Vec<f64>>>,
}

/// What the sink reads into: the receiver's pool (bulk patterns, one and two streams per
/// run) or a buffer of its own (`latency-4k`'s ping-pong, one stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SinkMode {
    Pool,
    Ping,
}

impl SinkMode {
    pub(super) fn of(latency: bool) -> Self {
        if latency {
            SinkMode::Ping
        } else {
            SinkMode::Pool
        }
    }

    /// The stream counts of each run, in turn.
    fn counts(self) -> &'static [usize] {
        match self {
            SinkMode::Pool => &[1, 2],
            SinkMode::Ping => &[1],
        }
    }

    /// The streams the sender opens and the sink accepts: the most any run uses.
    fn streams(self) -> usize {
        self.counts().iter().copied().max().unwrap_or(1)
    }

    /// The receiver's command (`raw-sink pool`).
    pub(super) fn command(self) -> &'static str {
        match self {
            SinkMode::Pool => "raw-sink pool",
            SinkMode::Ping => "raw-sink ping",
        }
    }

    /// The mode a `raw-sink` command names.
    pub(super) fn parse(word: &str) -> Option<Self> {
        match word {
            "pool" => Some(SinkMode::Pool),
            "ping" => Some(SinkMode::Ping),
            _ => None,
        }
    }
}

impl RawTcpBaseline {
    /// Connects to the receiver's sink at `port` for `bytes` per run, as many streams as
    /// `mode` uses at most.
    pub(super) fn start(bytes: u64, port: u16, mode: SinkMode) -> Result<Self, String> {
        let counts = mode.counts();
        let streams = (0..mode.streams())
            .map(|i| {
                let mut s = TcpStream::connect((super::net().peer, port))
                    .map_err(|e| format!("connecting raw TCP stream {i} to the receiver: {e}"))?;
                let _ = s.set_nodelay(true);
                // Bounded, as every wait: a sink that stops answering fails the run.
                let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
                // Its index, so the sink orders the streams as the sender does.
                s.write_all(&[i as u8])
                    .map_err(|e| format!("raw TCP stream {i}: {e}"))?;
                Ok(s)
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Self {
            streams,
            bytes,
            counts,
            times: Mutex::new(vec![Vec::new(); counts.len()]),
        })
    }

    /// One timed run: the first `bytes` of `src` over each stream count in turn; the best
    /// seconds of them.
    pub(super) fn run(&self, src: &MemoryRegion) -> Result<f64, String> {
        let mut best = f64::INFINITY;
        for (i, &n) in self.counts.iter().enumerate() {
            let took = self.run_streams(src, n)?;
            if let Ok(mut times) = self.times.lock() {
                times[i].push(took);
            }
            best = best.min(took);
        }
        Ok(best)
    }

    /// The median GB/s of each stream count, e.g. "1 stream 2.91, 2 streams 3.40 GB/s".
    pub(super) fn per_count(&self) -> Option<String> {
        let times = self.times.lock().ok()?;
        let rows: Vec<String> = self
            .counts
            .iter()
            .zip(times.iter())
            .filter(|(_, t)| !t.is_empty())
            .map(|(n, t)| {
                let gbps = self.bytes as f64 / super::median(t.clone()) / 1e9;
                format!("{n} stream{} {gbps:.2}", if *n == 1 { "" } else { "s" })
            })
            .collect();
        (!rows.is_empty()).then(|| format!("{} GB/s", rows.join(", ")))
    }

    fn run_streams(&self, src: &MemoryRegion, n: usize) -> Result<f64, String> {
        let sources = shares(self.bytes, n)
            .into_iter()
            .map(|(at, len)| src.borrow_mut(at, len))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("raw TCP baseline source: {e}"))?;
        let start = Instant::now();
        on_streams(&self.streams[..n], &sources, |mut stream, data| {
            stream
                .write_all(data)
                .map_err(|e| format!("raw TCP baseline send: {e}"))
        })?;
        let mut ack = [0u8; 1];
        (&self.streams[0])
            .read_exact(&mut ack)
            .map_err(|e| format!("raw TCP baseline confirmation: {e}"))?;
        Ok(start.elapsed().as_secs_f64())
    }
}

impl Drop for RawTcpBaseline {
    fn drop(&mut self) {
        for s in &self.streams {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// `io` of each stream with its share: stream 0 on this thread (a ping-pong spawns nothing),
/// any other on a thread of its own; the first error.
fn on_streams<T: Sync>(
    streams: &[TcpStream],
    shares: &[T],
    io: impl Fn(&TcpStream, &T) -> Result<(), String> + Sync,
) -> Result<(), String> {
    std::thread::scope(|scope| {
        let io = &io;
        let others: Vec<_> = streams[1..]
            .iter()
            .zip(&shares[1..])
            .map(|(stream, share)| scope.spawn(move || io(stream, share)))
            .collect();
        let first = io(&streams[0], &shares[0]);
        others
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a raw TCP thread panicked".to_owned()))
            })
            .fold(first, Result::and)
    })
}

/// `[offset, len)` of each of `n` streams' contiguous shares of `bytes`.
fn shares(bytes: u64, n: usize) -> Vec<(u64, u64)> {
    let n = n as u64;
    (0..n)
        .map(|i| (bytes * i / n, bytes * (i + 1) / n - bytes * i / n))
        .collect()
}

/// The receiver's sink: listens on its bind address and serves the baseline's streams on a
/// thread of its own, reading into `pool` (or, to ping, a buffer of its own). Returns the port.
pub(super) fn start_raw_sink(
    pool: MemoryRegion,
    bytes: u64,
    mode: SinkMode,
) -> Result<u16, String> {
    let listener = TcpListener::bind((super::net().bind, 0)).map_err(|e| format!("bind: {e}"))?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    std::thread::Builder::new()
        .name("raw-tcp-sink".to_owned())
        .spawn(move || {
            let served = match mode {
                SinkMode::Pool => serve_raw_sink(&listener, &pool, bytes, mode),
                SinkMode::Ping => MemoryRegion::allocate(bytes as usize)
                    .map_err(|e| e.to_string())
                    .and_then(|own| serve_raw_sink(&listener, &own, bytes, mode)),
            };
            if let Err(e) = served {
                eprintln!("kvbridge-lab bench raw-tcp-sink: {e}");
            }
        })
        .map_err(|e| format!("cannot start the raw TCP sink thread: {e}"))?;
    Ok(port)
}

/// Accepts the sender's streams (within 60 s), numbered by their first byte.
fn accept_streams(listener: &TcpListener, n: usize) -> Result<Vec<TcpStream>, String> {
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("listener: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let mut accepted = 0;
    while accepted < n {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                let _ = s.set_nodelay(true);
                let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
                let mut index = [0u8; 1];
                s.read_exact(&mut index)
                    .map_err(|e| format!("stream index: {e}"))?;
                // The sender is gone when a run's first read sees the end: no timeout there.
                let _ = s.set_read_timeout(None);
                match streams.get_mut(usize::from(index[0])) {
                    Some(slot @ None) => *slot = Some(s),
                    _ => {
                        return Err(format!(
                            "a stream numbered {} (0 to {} are taken, once each)",
                            index[0],
                            n - 1
                        ));
                    }
                }
                accepted += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(format!("accept ({accepted} of {n} streams so far): {e}")),
        }
    }
    Ok(streams.into_iter().flatten().collect())
}

/// Serves runs on `mode`'s schedule until the sender closes. Into the receiver's pool, each
/// stream waits for its first byte before it claims its share, so the pool is free between
/// runs for kvbridge's own writes.
fn serve_raw_sink(
    listener: &TcpListener,
    dst: &MemoryRegion,
    bytes: u64,
    mode: SinkMode,
) -> Result<(), String> {
    let streams = accept_streams(listener, mode.streams())?;
    // One claim for the sink's own buffer, held throughout; the pool's are per run.
    let mut own = match mode {
        SinkMode::Ping => Some(dst.borrow_mut(0, bytes).map_err(|e| e.to_string())?),
        SinkMode::Pool => None,
    };
    for &n in mode.counts().iter().cycle() {
        let read = match own.as_mut() {
            Some(buf) => read_share(&streams[0], buf),
            None => on_streams(&streams[..n], &shares(bytes, n), |stream, &(at, len)| {
                let mut first = [0u8; 1];
                match stream.peek(&mut first) {
                    Ok(0) => return Err(String::new()),
                    Ok(_) => {}
                    Err(e) => return Err(format!("receive: {e}")),
                }
                let mut share = dst.borrow_mut(at, len).map_err(|e| e.to_string())?;
                read_share(stream, &mut share)
            }),
        };
        match read {
            Ok(()) => {}
            // The sender closed its streams: the bench is over.
            Err(e) if e.is_empty() => return Ok(()),
            Err(e) => return Err(e),
        }
        (&streams[0])
            .write_all(&[1])
            .map_err(|e| format!("confirm: {e}"))?;
    }
    Ok(())
}

/// Reads one share; the sender's end of the stream gives an empty error.
fn read_share(mut stream: &TcpStream, buf: &mut [u8]) -> Result<(), String> {
    match stream.read_exact(buf) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(String::new()),
        Err(e) => Err(format!("receive: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_bytes_once_in_order() {
        for (bytes, n) in [(4096, 1), (4096, 2), (268_435_455, 2), (7, 2)] {
            let parts = shares(bytes, n);
            assert_eq!(parts.len(), n);
            assert_eq!(parts[0].0, 0);
            for w in parts.windows(2) {
                assert_eq!(w[0].0 + w[0].1, w[1].0, "{parts:?}");
            }
            assert_eq!(parts.iter().map(|p| p.1).sum::<u64>(), bytes, "{parts:?}");
        }
    }

    #[test]
    fn sink_modes_round_trip_their_commands() {
        for mode in [SinkMode::Pool, SinkMode::Ping] {
            let word = mode.command().strip_prefix("raw-sink ").unwrap();
            assert_eq!(SinkMode::parse(word), Some(mode));
        }
        assert_eq!(SinkMode::parse("1,2"), None);
        assert_eq!(SinkMode::of(true).counts(), &[1]);
        assert_eq!(SinkMode::of(false).counts(), &[1, 2]);
    }
}
