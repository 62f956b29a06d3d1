//! The TCP transport for `kvbridge-lab bench --transport tcp`, and its baseline: a raw TCP stream
//! over loopback between two processes, moving the same number of bytes with no framing.
//!
//! The baseline's receiving end is a third process (this binary with `--role raw-tcp-sink`):
//! it reads each run's bytes straight into a pre-faulted pool of the pattern's size and answers
//! one byte when it has them all, so a baseline run, like a transport run, is timed from the
//! first byte sent to the receiver's confirmation. For `latency-4k` that is a raw TCP
//! ping-pong of the same 4 KiB (send, the peer replies), the row's round-trip baseline.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Instant;

use kvbridge_tcp::TcpTransport;
use kvbridge_transport::{KvTransport, MemoryRegion};

use super::TransportFuture;

/// How the baseline is described in the report.
pub(super) const BASELINE: &str =
    "a raw TCP stream (two processes, no framing; loopback unless --peer-netns) moving the bytes";

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

/// The sending end of the raw-TCP baseline, connected to a sink process.
pub(super) struct RawTcpBaseline {
    sink: Child,
    stream: TcpStream,
    bytes: u64,
}

impl RawTcpBaseline {
    /// Starts the sink process for `bytes` per run and connects to it.
    pub(super) fn start(bytes: u64) -> Result<Self, String> {
        let mut sink =
            super::peer_command(&["bench", "--transport", "tcp", "--role", "raw-tcp-sink"])?
                .arg("--pool-bytes")
                .arg(bytes.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot start the raw TCP sink process: {e}"))?;
        let port = sink
            .stdout
            .take()
            .and_then(|out| BufReader::new(out).lines().next())
            .and_then(Result::ok)
            .and_then(|line| {
                line.strip_prefix("PORT ")
                    .and_then(|p| p.parse::<u16>().ok())
            });
        let Some(port) = port else {
            let _ = sink.kill();
            let _ = sink.wait();
            return Err("the raw TCP sink process did not report its port".to_owned());
        };
        let stream = TcpStream::connect((super::net().peer, port))
            .map_err(|e| format!("connecting to the raw TCP sink: {e}"))?;
        let _ = stream.set_nodelay(true);
        Ok(Self {
            sink,
            stream,
            bytes,
        })
    }

    /// One timed run: streams the first `bytes` of `src` and waits for the sink's confirmation.
    pub(super) fn run(&self, src: &MemoryRegion) -> Result<f64, String> {
        let data = src
            .borrow_mut(0, self.bytes)
            .map_err(|e| format!("raw TCP baseline source: {e}"))?;
        let mut stream = &self.stream;
        let start = Instant::now();
        stream
            .write_all(&data)
            .map_err(|e| format!("raw TCP baseline send: {e}"))?;
        let mut ack = [0u8; 1];
        stream
            .read_exact(&mut ack)
            .map_err(|e| format!("raw TCP baseline confirmation: {e}"))?;
        Ok(start.elapsed().as_secs_f64())
    }
}

impl Drop for RawTcpBaseline {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let _ = self.sink.wait();
    }
}

/// The sink process: accepts one connection, then reads `bytes` per run into a pre-faulted
/// pool and answers one byte, until the sender closes.
pub(super) fn raw_sink(bytes: u64) -> ExitCode {
    let run = || -> Result<(), String> {
        let pool = MemoryRegion::allocate(bytes as usize).map_err(|e| e.to_string())?;
        let mut dst = pool.borrow_mut(0, bytes).map_err(|e| e.to_string())?;
        let listener =
            TcpListener::bind((super::net().bind, 0)).map_err(|e| format!("bind: {e}"))?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        println!("PORT {port}");
        std::io::stdout().flush().map_err(|e| e.to_string())?;
        let (mut s, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
        let _ = s.set_nodelay(true);
        loop {
            match s.read_exact(&mut dst) {
                Ok(()) => s.write_all(&[1]).map_err(|e| format!("confirm: {e}"))?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(format!("receive: {e}")),
            }
        }
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvbridge-lab bench raw-tcp-sink: {e}");
            ExitCode::from(1)
        }
    }
}
