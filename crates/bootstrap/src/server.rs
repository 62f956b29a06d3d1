//! The bootstrap HTTP server: a bounded accept loop in front of a [`Registry`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;

use crate::error::{BootstrapError, Result};
use crate::http::{Limits, PROMETHEUS_TEXT, RequestHead, Response, parse_request_head};
use kvbridge_auth::Secret;
use kvbridge_control::listen::{Accepted, accept_bounded, closed};

use crate::auth::{Verifier, needs_proof};
use crate::registry::Registry;

/// Settings of a [`BootstrapServer`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BootstrapConfig {
    /// Address to listen on. Default `127.0.0.1:0` (loopback, OS-assigned port); SGLang's
    /// default port is 8998.
    pub bind_addr: SocketAddr,
    /// Address that [`BootstrapServer::bootstrap_addr`] names instead of the bound one (with
    /// the bound port): the host's address peers on other hosts reach, when the server binds
    /// `0.0.0.0` (which no peer can connect to). Default `None`: the bound address.
    pub advertise_addr: Option<IpAddr>,
    /// Longest request head (request line and headers). Default 8 KiB.
    pub max_head_bytes: usize,
    /// Most header lines (and query parameters). Default 64.
    pub max_headers: usize,
    /// Longest request body. Default 1 MiB.
    pub max_body_bytes: usize,
    /// Time a client has to send its whole request, and to read the answer. Default 5 s.
    pub request_timeout: Duration,
    /// Connections served at once; more get an immediate 503. Default 256.
    pub max_connections: usize,
    /// Age after which a room → DP-rank entry is purged. Default 120 s.
    pub room_entry_ttl: Duration,
    /// Most room → DP-rank entries held. Default 65 536.
    pub max_room_entries: usize,
    /// The shared secret every registration and query must prove (docs/bootstrap.md,
    /// "Authentication"); `None` (the default) serves everyone who can connect.
    pub secret: Option<Secret>,
    /// Most challenges open at once (issued by `GET /challenge`, not yet used); one more
    /// forgets the oldest. Default 1024.
    pub max_challenges: usize,
}

impl Default for BootstrapConfig {
    fn default() -> Self {
        Self {
            bind_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            advertise_addr: None,
            max_head_bytes: 8 << 10,
            max_headers: 64,
            max_body_bytes: 1 << 20,
            request_timeout: Duration::from_secs(5),
            max_connections: 256,
            room_entry_ttl: Duration::from_secs(120),
            max_room_entries: 65_536,
            secret: None,
            max_challenges: 1024,
        }
    }
}

impl BootstrapConfig {
    /// Sets [`bind_addr`](Self::bind_addr).
    #[must_use]
    pub fn with_bind_addr(mut self, addr: SocketAddr) -> Self {
        self.bind_addr = addr;
        self
    }

    /// Sets [`advertise_addr`](Self::advertise_addr).
    #[must_use]
    pub fn with_advertise_addr(mut self, addr: IpAddr) -> Self {
        self.advertise_addr = Some(addr);
        self
    }

    /// Sets [`request_timeout`](Self::request_timeout).
    #[must_use]
    pub fn with_request_timeout(mut self, t: Duration) -> Self {
        self.request_timeout = t;
        self
    }

    /// Sets [`max_body_bytes`](Self::max_body_bytes).
    #[must_use]
    pub fn with_max_body_bytes(mut self, n: usize) -> Self {
        self.max_body_bytes = n;
        self
    }

    /// Sets [`secret`](Self::secret): every registration and query must then prove it.
    #[must_use]
    pub fn with_secret(mut self, secret: impl Into<Secret>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// Sets [`max_challenges`](Self::max_challenges).
    #[must_use]
    pub fn with_max_challenges(mut self, n: usize) -> Self {
        self.max_challenges = n;
        self
    }

    /// Sets [`max_connections`](Self::max_connections).
    #[must_use]
    pub fn with_max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets [`max_head_bytes`](Self::max_head_bytes).
    #[must_use]
    pub fn with_max_head_bytes(mut self, v: usize) -> Self {
        self.max_head_bytes = v;
        self
    }

    /// Sets [`max_headers`](Self::max_headers).
    #[must_use]
    pub fn with_max_headers(mut self, v: usize) -> Self {
        self.max_headers = v;
        self
    }

    /// Sets [`room_entry_ttl`](Self::room_entry_ttl).
    #[must_use]
    pub fn with_room_entry_ttl(mut self, v: Duration) -> Self {
        self.room_entry_ttl = v;
        self
    }

    /// Sets [`max_room_entries`](Self::max_room_entries).
    #[must_use]
    pub fn with_max_room_entries(mut self, v: usize) -> Self {
        self.max_room_entries = v;
        self
    }

    fn validate(&self) -> Result<()> {
        let bad = |message: String| Err(BootstrapError::InvalidSetup { message });
        if self.max_head_bytes < 256 {
            return bad(format!(
                "BootstrapConfig::max_head_bytes must be at least 256, got {}",
                self.max_head_bytes
            ));
        }
        for (name, v) in [
            ("max_headers", self.max_headers),
            ("max_connections", self.max_connections),
            ("max_room_entries", self.max_room_entries),
            ("max_challenges", self.max_challenges),
        ] {
            if v == 0 {
                return bad(format!("BootstrapConfig::{name} must be at least 1, got 0"));
            }
        }
        if self.secret.as_ref().is_some_and(Secret::is_empty) {
            return bad(
                "BootstrapConfig::secret must not be empty; pass None to serve \
                        without authentication"
                    .to_owned(),
            );
        }
        if self.request_timeout.is_zero() || self.room_entry_ttl.is_zero() {
            return bad("BootstrapConfig timeouts must be positive".to_owned());
        }
        if let Some(ip) = self.advertise_addr.filter(IpAddr::is_unspecified) {
            return bad(format!(
                "BootstrapConfig::advertise_addr {ip} names no host a peer can connect to; \
                 advertise this host's address on the network the decode servers reach"
            ));
        }
        Ok(())
    }
}

/// What `GET /metrics` answers: Prometheus text, rendered when asked (e.g. from the agents'
/// `MetricsSnapshot`s). The server knows nothing about what it renders.
pub type MetricsSource = Arc<dyn Fn() -> String + Send + Sync>;

/// Builds a [`BootstrapServer`]: its config, the registry it serves and an optional metrics
/// source for `GET /metrics`.
#[must_use]
pub struct BootstrapServerBuilder {
    config: BootstrapConfig,
    registry: Option<Registry>,
    metrics: Option<MetricsSource>,
}

impl std::fmt::Debug for BootstrapServerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapServerBuilder")
            .field("config", &self.config)
            .field("registry", &self.registry)
            .field("metrics", &self.metrics.is_some())
            .finish()
    }
}

impl BootstrapServerBuilder {
    /// Serves `registry` (e.g. one the prefill also fills in-process) instead of a new one.
    pub fn registry(mut self, registry: Registry) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Answers `GET /metrics` with what `source` returns (Prometheus text format 0.0.4);
    /// without a source the route answers 404.
    pub fn metrics(mut self, source: impl Fn() -> String + Send + Sync + 'static) -> Self {
        self.metrics = Some(Arc::new(source));
        self
    }

    /// Binds the listener and starts serving. Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// [`BootstrapError::InvalidSetup`] for an invalid config or an address that cannot be
    /// bound.
    pub async fn bind(self) -> Result<BootstrapServer> {
        let config = self.config;
        config.validate()?;
        let registry = self.registry.unwrap_or_else(|| {
            Registry::with_room_limits(config.room_entry_ttl, config.max_room_entries)
        });
        let listener = TcpListener::bind(config.bind_addr).await.map_err(|e| {
            BootstrapError::InvalidSetup {
                message: format!(
                    "the bootstrap server cannot listen on {}: {e}; choose a free port (or 0)",
                    config.bind_addr
                ),
            }
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| BootstrapError::InvalidSetup {
                message: format!("the bootstrap listener has no local address: {e}"),
            })?;
        let advertised = SocketAddr::new(config.advertise_addr.unwrap_or(addr.ip()), addr.port());
        let (shutdown, _) = watch::channel(false);
        let service = Arc::new(Service::new(registry.clone(), self.metrics, config));
        tokio::spawn(accept_loop(listener, service.clone(), shutdown.subscribe()));
        tokio::spawn(purge_loop(
            registry.clone(),
            service.config.room_entry_ttl,
            shutdown.subscribe(),
        ));
        tracing::info!(%addr, %advertised, "bootstrap server listening");
        Ok(BootstrapServer {
            registry,
            addr,
            advertised,
            shutdown,
        })
    }
}

/// What one connection is served with: the registry and the routes around it.
struct Service {
    registry: Registry,
    metrics: Option<MetricsSource>,
    /// Present when a secret is configured.
    verifier: Option<Verifier>,
    config: BootstrapConfig,
}

impl Service {
    fn new(registry: Registry, metrics: Option<MetricsSource>, config: BootstrapConfig) -> Self {
        let verifier = config
            .secret
            .clone()
            .map(|s| Verifier::new(s, config.max_challenges));
        Self {
            registry,
            metrics,
            verifier,
            config,
        }
    }

    /// Answers one request (sans-IO): the proof first when a secret is set (nothing is
    /// stored or answered without it), then the server's own routes, then the registry's.
    fn route(&self, head: &RequestHead, body: &[u8], now: Instant) -> Response {
        if let Some(v) = &self.verifier {
            if needs_proof(&head.path) {
                if let Err(refused) = v.check(head, body) {
                    return refused;
                }
            }
        }
        match (head.path.as_str(), head.method.as_str()) {
            ("/challenge", "GET") => match &self.verifier {
                Some(v) => v.challenge(),
                None => Response::text(
                    404,
                    "this bootstrap server has no secret configured; requests need no proof",
                ),
            },
            ("/challenge", _) => Response::text(405, "Method not allowed"),
            ("/metrics", "GET") => match &self.metrics {
                Some(source) => Response {
                    status: 200,
                    content_type: PROMETHEUS_TEXT,
                    body: source().into_bytes(),
                },
                None => Response::text(
                    404,
                    "this bootstrap server was started without a metrics source",
                ),
            },
            ("/metrics", _) => Response::text(405, "Method not allowed"),
            _ => self.registry.route(head, body, now),
        }
    }
}

/// The bootstrap registry served over HTTP/1.1; see the [crate docs](crate).
///
/// Dropping it (or [`shutdown`](Self::shutdown)) stops the listener.
#[derive(Debug)]
pub struct BootstrapServer {
    registry: Registry,
    addr: SocketAddr,
    /// What [`bootstrap_addr`](Self::bootstrap_addr) names.
    advertised: SocketAddr,
    shutdown: watch::Sender<bool>,
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}

impl BootstrapServer {
    /// Binds the listener and starts serving an empty [`Registry`]. Must be called inside a
    /// tokio runtime.
    ///
    /// # Errors
    /// [`BootstrapError::InvalidSetup`] for an invalid config or an address that cannot be
    /// bound.
    pub async fn bind(config: BootstrapConfig) -> Result<Self> {
        Self::builder(config).bind().await
    }

    /// Like [`bind`](Self::bind), serving an existing registry.
    ///
    /// # Errors
    /// As [`bind`](Self::bind).
    pub async fn serve(config: BootstrapConfig, registry: Registry) -> Result<Self> {
        Self::builder(config).registry(registry).bind().await
    }

    /// A builder, for a metrics source or an existing registry.
    pub fn builder(config: BootstrapConfig) -> BootstrapServerBuilder {
        BootstrapServerBuilder {
            config,
            registry: None,
            metrics: None,
        }
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bootstrap address decode requests carry (`host:port`): the
    /// [`advertise_addr`](BootstrapConfig::advertise_addr) when set, else the bound address.
    pub fn bootstrap_addr(&self) -> String {
        self.advertised.to_string()
    }

    /// The registry being served.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Stops accepting connections (requests in progress finish).
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }
}

/// Resolves once `shutdown` is set (or its sender is gone).
async fn purge_loop(registry: Registry, ttl: Duration, mut shutdown: watch::Receiver<bool>) {
    let period = ttl.max(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(period) => registry.purge_rooms(Instant::now()),
            _ = closed(&mut shutdown) => return,
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    service: Arc<Service>,
    mut shutdown: watch::Receiver<bool>,
) {
    let config = &service.config;
    let limit = Arc::new(Semaphore::new(config.max_connections));
    while let Some(accepted) = accept_bounded(&listener, &limit, &mut shutdown, "bootstrap").await {
        let (stream, peer, permit) = match accepted {
            Accepted::Admitted(stream, peer, permit) => (stream, peer, permit),
            Accepted::OverLimit(stream, peer) => {
                // Best effort, never waits: the socket buffer of a fresh connection has room.
                let busy = Response::text(
                    503,
                    format!(
                        "the bootstrap server is serving {} connections already; retry shortly",
                        config.max_connections
                    ),
                );
                let _ = stream.try_write(&busy.encode());
                tracing::warn!(%peer, "bootstrap: connection limit reached");
                continue;
            }
        };
        let service = service.clone();
        tokio::spawn(async move {
            let _permit = permit;
            serve_conn(stream, peer, &service).await;
        });
    }
}

async fn serve_conn(mut stream: TcpStream, peer: SocketAddr, service: &Service) {
    let config = &service.config;
    let deadline = Instant::now() + config.request_timeout;
    let response = match tokio::time::timeout_at(deadline, read_request(&mut stream, service)).await
    {
        Ok(Ok(r)) | Ok(Err(r)) => r,
        Err(_) => Response::text(
            408,
            format!(
                "the request did not arrive completely within {:?}",
                config.request_timeout
            ),
        ),
    };
    if response.status >= 400 {
        tracing::debug!(%peer, status = response.status, "bootstrap: refused a request");
    }
    let write = async {
        stream.write_all(&response.encode()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(config.request_timeout, write).await;
}

/// Reads one request and answers it. `Err` carries an error response.
async fn read_request<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    service: &Service,
) -> std::result::Result<Response, Response> {
    let config = &service.config;
    let limits = Limits {
        max_head: config.max_head_bytes,
        max_headers: config.max_headers,
        max_body: config.max_body_bytes,
    };
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    // Parsed again after every read: the head is at most `max_head` bytes, so this stays
    // bounded, and a malformed line is refused as soon as it arrives.
    let (head, end) = loop {
        if let Some(parsed) = parse_request_head(&buf, &limits)? {
            break parsed;
        }
        if buf.len() >= limits.max_head {
            return Err(Response::text(
                431,
                format!(
                    "the request head exceeds {} bytes without ending",
                    limits.max_head
                ),
            ));
        }
        let room = (limits.max_head - buf.len()).min(chunk.len());
        let n = stream
            .read(&mut chunk[..room])
            .await
            .map_err(|e| Response::text(400, format!("read failed: {e}")))?;
        if n == 0 {
            return Err(Response::text(
                400,
                "the connection ended before the request head was complete",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let want = head.content_length.unwrap_or(0);
    let mut body = buf.split_off(end);
    if body.len() > want {
        return Err(Response::text(
            400,
            "bytes after the body: send one request per connection",
        ));
    }
    if head.expect_continue && body.len() < want {
        stream
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .map_err(|e| Response::text(400, format!("write failed: {e}")))?;
    }
    if body.len() < want {
        let missing = want - body.len();
        let got = (&mut *stream)
            .take(missing as u64)
            .read_to_end(&mut body)
            .await
            .map_err(|e| Response::text(400, format!("read failed inside the body: {e}")))?;
        if got < missing {
            return Err(Response::text(
                400,
                format!(
                    "the connection ended after {} of the body's {want} bytes",
                    want - missing + got
                ),
            ));
        }
    }
    Ok(service.route(&head, &body, Instant::now()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzz;
    use proptest::prelude::*;

    /// The answer to a connection that sent `input` and closed, checked for shape: a status
    /// in range, an encodable response, and a reason on every refusal.
    async fn answer(service: &Service, input: &[u8]) -> Response {
        let (_peer, mut conn) = fuzz::peer_sent(input).await;
        let response = match read_request(&mut conn, service).await {
            Ok(r) => r,
            Err(r) => {
                assert!((400..600).contains(&r.status), "{}", r.status);
                r
            }
        };
        assert!((100..600).contains(&response.status));
        if response.status >= 400 {
            assert!(!response.body.is_empty(), "a refusal says why");
        }
        assert!(response.encode().starts_with(b"HTTP/1.1 "));
        response
    }

    fn service() -> Service {
        Service::new(
            Registry::new(),
            Some(Arc::new(|| "# TYPE up gauge\nup 1\n".to_owned())),
            BootstrapConfig::default().with_max_body_bytes(64 * 1024),
        )
    }

    #[test]
    fn http_corpus_seeds_are_answered() {
        let rt = fuzz::runtime();
        for service in [service(), secured(16)] {
            for seed in fuzz::corpus("http") {
                let r = rt.block_on(answer(&service, &seed));
                assert!(
                    r.status < 500,
                    "{}: {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                );
            }
        }
    }

    const SECRET: &[u8] = b"bootstrap test secret";

    fn secured(max_challenges: usize) -> Service {
        let config = BootstrapConfig::default()
            .with_secret(SECRET)
            .with_max_challenges(max_challenges);
        Service::new(Registry::new(), None, config)
    }

    /// Parses `method target` with `body` (and an `Authorization` value) as the server would.
    fn head(method: &str, target: &str, body: &[u8], auth: Option<&str>) -> RequestHead {
        let mut raw = format!("{method} {target} HTTP/1.1\r\nHost: x\r\n");
        if let Some(a) = auth {
            raw.push_str(&format!("Authorization: {a}\r\n"));
        }
        raw.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        let limits = Limits {
            max_head: 8192,
            max_headers: 16,
            max_body: 1 << 20,
        };
        parse_request_head(raw.as_bytes(), &limits)
            .unwrap()
            .unwrap()
            .0
    }

    fn nonce(service: &Service) -> kvbridge_auth::Nonce {
        let r = service.route(&head("GET", "/challenge", b"", None), b"", Instant::now());
        assert_eq!(r.status, 200);
        let c: crate::auth::Challenge = serde_json::from_slice(&r.body).unwrap();
        kvbridge_auth::Nonce::from_bytes(crate::auth::unhex(&c.nonce).unwrap())
    }

    fn registration() -> Vec<u8> {
        use kvbridge_handshake::{PeerDescriptor, Role};
        let d = PeerDescriptor::mla(Role::Prefill, 64, 1, 1152)
            .build()
            .unwrap();
        serde_json::to_vec(&crate::registry::RankRegistration::new(
            "127.0.0.1:17000",
            d,
        ))
        .unwrap()
    }

    /// Sends `PUT /route` with `body` and the proof `prove` makes for (nonce, body).
    fn put(service: &Service, body: &[u8], auth: Option<String>) -> Response {
        let h = head("PUT", "/route", body, auth.as_deref());
        service.route(&h, body, Instant::now())
    }

    fn proof(
        secret: &[u8],
        n: &kvbridge_auth::Nonce,
        method: &str,
        target: &str,
        body: &[u8],
    ) -> String {
        crate::auth::authorization(&Secret::new(secret.to_vec()), n, method, target, body)
    }

    #[test]
    fn a_right_proof_registers_and_queries() {
        let s = secured(16);
        let body = registration();
        let n = nonce(&s);
        let r = put(&s, &body, Some(proof(SECRET, &n, "PUT", "/route", &body)));
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(s.registry.readiness().registered, 1);
        let n = nonce(&s);
        let auth = proof(SECRET, &n, "GET", "/ranks?prefill_dp_rank=0", b"");
        let h = head("GET", "/ranks?prefill_dp_rank=0", b"", Some(&auth));
        assert_eq!(s.route(&h, b"", Instant::now()).status, 200);
        // Liveness and the challenge stay open.
        let h = head("GET", "/health", b"", None);
        assert_eq!(s.route(&h, b"", Instant::now()).status, 200);
    }

    #[test]
    fn requests_without_the_right_proof_get_401_and_store_nothing() {
        let s = secured(16);
        let body = registration();
        let text = |r: &Response| String::from_utf8_lossy(&r.body).into_owned();
        // No proof at all: a readable reason naming the way to authenticate.
        let r = put(&s, &body, None);
        assert_eq!(r.status, 401);
        assert!(text(&r).contains("no Authorization header"), "{}", text(&r));
        assert!(text(&r).contains("GET /challenge"), "{}", text(&r));
        // A malformed header.
        let r = put(&s, &body, Some("Basic dXNlcjpwYXNz".to_owned()));
        assert_eq!(r.status, 401);
        // The wrong secret.
        let n = nonce(&s);
        let r = put(
            &s,
            &body,
            Some(proof(b"another secret", &n, "PUT", "/route", &body)),
        );
        assert_eq!(r.status, 401);
        assert!(text(&r).contains("does not match"), "{}", text(&r));
        // A body changed after the proof was made.
        let n = nonce(&s);
        let auth = proof(SECRET, &n, "PUT", "/route", &body);
        let mut tampered = body.clone();
        let at = tampered.len() - 2;
        tampered[at] = b' ';
        assert_eq!(put(&s, &tampered, Some(auth)).status, 401);
        // A proof for another route or method.
        let n = nonce(&s);
        let auth = proof(SECRET, &n, "PUT", "/route?x=1", &body);
        assert_eq!(put(&s, &body, Some(auth)).status, 401);
        let n = nonce(&s);
        let auth = proof(SECRET, &n, "POST", "/route", &body);
        assert_eq!(put(&s, &body, Some(auth)).status, 401);
        // A nonce this server never issued.
        let auth = proof(
            SECRET,
            &kvbridge_auth::Nonce::random(),
            "PUT",
            "/route",
            &body,
        );
        assert_eq!(put(&s, &body, Some(auth)).status, 401);
        // Queries are refused the same way.
        for (m, t) in [
            ("GET", "/ranks"),
            ("GET", "/ready"),
            ("POST", "/query_dp_ranks"),
        ] {
            let h = head(m, t, b"{}", None);
            assert_eq!(s.route(&h, b"{}", Instant::now()).status, 401, "{m} {t}");
        }
        assert_eq!(s.registry.readiness().registered, 0, "nothing was stored");
    }

    #[test]
    fn a_replayed_request_is_refused() {
        let s = secured(16);
        let body = registration();
        let n = nonce(&s);
        let auth = proof(SECRET, &n, "PUT", "/route", &body);
        assert_eq!(put(&s, &body, Some(auth.clone())).status, 200);
        s.registry.clear();
        let r = put(&s, &body, Some(auth));
        assert_eq!(r.status, 401);
        assert!(String::from_utf8_lossy(&r.body).contains("already used"));
        assert_eq!(s.registry.readiness().registered, 0);
        // A wrong proof spends its nonce too: no second guess on the same challenge.
        let n = nonce(&s);
        let _ = put(&s, &body, Some(proof(b"guess", &n, "PUT", "/route", &body)));
        assert_eq!(
            put(&s, &body, Some(proof(SECRET, &n, "PUT", "/route", &body))).status,
            401
        );
    }

    #[test]
    fn the_challenge_table_is_bounded() {
        let s = secured(8);
        let first = nonce(&s);
        for _ in 0..10_000 {
            nonce(&s);
        }
        assert_eq!(
            s.verifier.as_ref().unwrap().open(),
            8,
            "an attacker cannot grow it"
        );
        let body = registration();
        // The oldest challenges were forgotten; the newest still work.
        assert_eq!(
            put(
                &s,
                &body,
                Some(proof(SECRET, &first, "PUT", "/route", &body))
            )
            .status,
            401
        );
        let n = nonce(&s);
        assert_eq!(
            put(&s, &body, Some(proof(SECRET, &n, "PUT", "/route", &body))).status,
            200
        );
        // Without a secret there is no challenge to ask for.
        let open = service();
        let h = head("GET", "/challenge", b"", None);
        assert_eq!(open.route(&h, b"", Instant::now()).status, 404);
    }

    proptest! {
        #![proptest_config(fuzz::config())]

        /// Mutated bootstrap requests (request line, headers, bodies with descriptor JSON):
        /// the HTTP decoder and the routes never panic, never wait on input that ended, and
        /// answer every request with a status (a refusal with its reason).
        #[test]
        fn fuzz_bootstrap_requests(input in fuzz::mutated(fuzz::corpus("http"))) {
            let rt = fuzz::runtime();
            // Half the cases against a server with a secret (the Authorization parser).
            let service = if input.len() % 2 == 0 { service() } else { secured(16) };
            rt.block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(60),
                    answer(&service, &input),
                )
                .await
                .expect("a finished request is answered without waiting")
            });
        }
    }
}
