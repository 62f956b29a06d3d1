//! The floor under any tokio-driven TCP round trip: a 4 KiB ping-pong between two processes
//! over loopback, each end on a tokio runtime (no kvbridge), beside the same ping-pong with
//! blocking sockets. `kvbridge-lab bench --transport tcp --pattern latency-4k` compares the TCP
//! transport with the blocking one; this example shows how much of the gap is the runtime's
//! wake-up path (epoll) rather than the transport (see `docs/benchmarks.md`, TCP latency).
//!
//! Run: `cargo run --release -p kvbridge-tcp --example runtime_ping_pong`

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ROUNDS: usize = 20_000;
const PING: usize = 4096;
const PONG: usize = 16;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let [_, role, port] = args.as_slice() {
        let port: u16 = port.parse().expect("the port is a number");
        match role.as_str() {
            "tokio-echo" => on_a_worker(tokio_echo(port)),
            "blocking-echo" => blocking_echo(port),
            other => panic!("unknown role {other}"),
        }
        return;
    }
    for kind in ["blocking", "tokio"] {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1");
        let port = listener.local_addr().expect("local address").port();
        drop(listener);
        let mut echo = std::process::Command::new(std::env::current_exe().expect("this binary"))
            .args([format!("{kind}-echo"), port.to_string()])
            .spawn()
            .expect("start the echo process");
        let stream = connect(port);
        let mut rounds = if kind == "tokio" {
            on_a_worker(tokio_pings(stream))
        } else {
            blocking_pings(stream)
        };
        let _ = echo.wait();
        rounds.sort();
        let at = |q: usize| rounds[rounds.len() * q / 100].as_secs_f64() * 1e6;
        println!(
            "{kind:>8} ping-pong of {PING} B: p50 {:.1} us, p99 {:.1} us ({ROUNDS} rounds)",
            at(50),
            at(99)
        );
    }
}

/// Runs `task` as a task on a two-worker runtime (as `kvbridge-lab bench` runs its loop): a future
/// that `block_on` drives would be woken across threads on every reply.
fn on_a_worker<T: Send + 'static>(
    task: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async { tokio::spawn(task).await.expect("the task ran") })
}

/// Connects to the echo process, retrying while it starts.
fn connect(port: u16) -> TcpStream {
    let start = Instant::now();
    loop {
        match TcpStream::connect((Ipv4Addr::LOCALHOST, port)) {
            Ok(s) => {
                s.set_nodelay(true).expect("TCP_NODELAY");
                return s;
            }
            Err(e) if start.elapsed() > Duration::from_secs(10) => {
                panic!("the echo process did not listen: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn accept(port: u16) -> TcpStream {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("bind the echo port");
    let (s, _) = listener.accept().expect("accept");
    s.set_nodelay(true).expect("TCP_NODELAY");
    s
}

fn blocking_echo(port: u16) {
    let mut s = accept(port);
    let mut buf = vec![0u8; PING];
    while s.read_exact(&mut buf).is_ok() {
        s.write_all(&buf[..PONG]).expect("reply");
    }
}

async fn tokio_echo(port: u16) {
    let s = accept(port);
    s.set_nonblocking(true).expect("non-blocking");
    let mut s = tokio::net::TcpStream::from_std(s).expect("a tokio stream");
    let mut buf = vec![0u8; PING];
    while s.read_exact(&mut buf).await.is_ok() {
        s.write_all(&buf[..PONG]).await.expect("reply");
    }
}

fn blocking_pings(mut s: TcpStream) -> Vec<Duration> {
    let (ping, mut pong) = (vec![1u8; PING], [0u8; PONG]);
    (0..ROUNDS)
        .map(|_| {
            let t = Instant::now();
            s.write_all(&ping).expect("ping");
            s.read_exact(&mut pong).expect("pong");
            t.elapsed()
        })
        .collect()
}

async fn tokio_pings(s: TcpStream) -> Vec<Duration> {
    s.set_nonblocking(true).expect("non-blocking");
    let mut s = tokio::net::TcpStream::from_std(s).expect("a tokio stream");
    let (ping, mut pong) = (vec![1u8; PING], [0u8; PONG]);
    let mut rounds = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        s.write_all(&ping).await.expect("ping");
        s.read_exact(&mut pong).await.expect("pong");
        rounds.push(t.elapsed());
    }
    rounds
}
