//! The bootstrap HTTP client and the [`PrefillDirectory`] built on it.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use kvbridge_auth::{NONCE_LEN, Nonce, Secret};
use kvbridge_control::PrefillRankInfo;

use crate::auth::{Challenge, authorization, needs_proof, unhex};
use crate::directory::PrefillDirectory;
use crate::error::{BootstrapError, Result};
use crate::http::parse_response_head;
use crate::registry::{
    DpRankEntry, DpRankQuery, PrefillServerInfo, RankEndpoint, RankList, RankRegistration,
    Readiness,
};

/// Settings of a [`BootstrapClient`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClientConfig {
    /// Deadline of one request: connect, send, and read the whole answer (SGLang: 5 s). With
    /// a secret, the challenge is fetched within the same deadline.
    pub timeout: Duration,
    /// Longest answer accepted (head and body). Default 4 MiB.
    pub max_response_bytes: usize,
    /// The server's shared secret: every request but `/health`, `/challenge` and `/metrics`
    /// then carries a proof of it (docs/bootstrap.md, "Authentication"). Default `None`.
    pub secret: Option<Secret>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(5),
            max_response_bytes: 4 << 20,
            secret: None,
        }
    }
}

impl ClientConfig {
    /// Sets [`timeout`](Self::timeout).
    #[must_use]
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// Sets [`secret`](Self::secret).
    #[must_use]
    pub fn with_secret(mut self, secret: impl Into<Secret>) -> Self {
        self.secret = Some(secret.into());
        self
    }
    /// Sets [`max_response_bytes`](Self::max_response_bytes).
    #[must_use]
    pub fn with_max_response_bytes(mut self, v: usize) -> Self {
        self.max_response_bytes = v;
        self
    }
}

/// An answer: status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpReply {
    /// HTTP status.
    pub status: u16,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl HttpReply {
    /// The body as (lossy) UTF-8.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A client of one bootstrap server (`host:port`). Every call opens one connection.
#[derive(Debug, Clone)]
pub struct BootstrapClient {
    addr: String,
    config: ClientConfig,
}

impl BootstrapClient {
    /// A client of the bootstrap server at `addr` (`host:port`), with default settings.
    pub fn new(addr: impl Into<String>) -> Self {
        Self::with_config(addr, ClientConfig::default())
    }

    /// A client with explicit settings.
    pub fn with_config(addr: impl Into<String>, config: ClientConfig) -> Self {
        Self {
            addr: addr.into(),
            config,
        }
    }

    /// The server's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn error(&self, reason: String) -> BootstrapError {
        BootstrapError::Request {
            addr: self.addr.clone(),
            reason,
        }
    }

    /// Sends one request and reads the answer, whatever its status. With a secret configured
    /// and a route that needs it, fetches a challenge first and proves the secret.
    ///
    /// # Errors
    /// [`BootstrapError::Request`] when the server cannot be reached, does not answer in
    /// time, or answers something that is not bounded HTTP/1.x.
    pub async fn request(
        &self,
        method: &str,
        path_and_query: &str,
        body: Option<&[u8]>,
    ) -> Result<HttpReply> {
        match tokio::time::timeout(
            self.config.timeout,
            self.exchange(method, path_and_query, body),
        )
        .await
        {
            Ok(r) => r.map_err(|reason| {
                self.error(format!("{method} {path_and_query} failed: {reason}"))
            }),
            Err(_) => Err(self.error(format!(
                "{method} {path_and_query} got no complete answer within {:?}",
                self.config.timeout
            ))),
        }
    }

    async fn exchange(
        &self,
        method: &str,
        target: &str,
        body: Option<&[u8]>,
    ) -> std::result::Result<HttpReply, String> {
        let path = target.split('?').next().unwrap_or(target);
        let authorization = match &self.config.secret {
            Some(secret) if needs_proof(path) => {
                Some(self.prove(secret, method, target, body).await?)
            }
            _ => None,
        };
        self.send(method, target, body, authorization.as_deref())
            .await
    }

    /// Fetches a challenge and returns the `Authorization` value answering it.
    async fn prove(
        &self,
        secret: &Secret,
        method: &str,
        target: &str,
        body: Option<&[u8]>,
    ) -> std::result::Result<String, String> {
        let reply = self.send("GET", "/challenge", None, None).await?;
        match reply.status {
            200 => {}
            404 => {
                return Err(
                    "this client has a shared secret but the server has none (GET /challenge \
                     answered 404); configure the same secret on both"
                        .to_owned(),
                );
            }
            s => {
                return Err(format!(
                    "GET /challenge answered HTTP {s}: {}",
                    reply.text()
                ));
            }
        }
        let nonce = serde_json::from_slice::<Challenge>(&reply.body)
            .ok()
            .and_then(|c| unhex::<NONCE_LEN>(&c.nonce))
            .ok_or_else(|| {
                format!(
                    "GET /challenge answered {:?}, not {{\"nonce\": \"<64 hex digits>\"}}",
                    reply.text().chars().take(120).collect::<String>()
                )
            })?;
        Ok(authorization(
            secret,
            &Nonce::from_bytes(nonce),
            method,
            target,
            body.unwrap_or_default(),
        ))
    }

    /// One request on one connection, with an optional `Authorization` header.
    async fn send(
        &self,
        method: &str,
        target: &str,
        body: Option<&[u8]>,
        authorization: Option<&str>,
    ) -> std::result::Result<HttpReply, String> {
        let mut stream = TcpStream::connect(&self.addr)
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let _ = stream.set_nodelay(true);
        let mut req = format!(
            "{method} {target} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
            self.addr
        );
        if let Some(a) = authorization {
            req.push_str(&format!("Authorization: {a}\r\n"));
        }
        if let Some(b) = body {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        req.push_str("\r\n");
        let mut bytes = req.into_bytes();
        if let Some(b) = body {
            bytes.extend_from_slice(b);
        }
        stream
            .write_all(&bytes)
            .await
            .map_err(|e| format!("sending the request failed: {e}"))?;
        let max = self.config.max_response_bytes;
        let mut buf = Vec::new();
        let got = (&mut stream)
            .take(max as u64 + 1)
            .read_to_end(&mut buf)
            .await
            .map_err(|e| format!("reading the answer failed: {e}"))?;
        if got > max {
            return Err(format!("the answer exceeds {max} bytes"));
        }
        let (head, end) = parse_response_head(&buf, 100)?.ok_or_else(|| {
            "the server closed the connection before a complete answer".to_owned()
        })?;
        let mut body = buf.split_off(end);
        if let Some(n) = head.content_length {
            if body.len() < n {
                return Err(format!(
                    "the answer's body has {} of its {n} bytes",
                    body.len()
                ));
            }
            body.truncate(n);
        }
        Ok(HttpReply {
            status: head.status,
            body,
        })
    }

    /// The error for a 401 answer.
    fn unauthorized(&self, method: &str, target: &str, reply: &HttpReply) -> BootstrapError {
        BootstrapError::Unauthorized {
            addr: self.addr.clone(),
            route: format!("{method} {target}"),
            reason: reply.text(),
        }
    }

    async fn expect_ok(&self, method: &str, target: &str, body: Option<&[u8]>) -> Result<Vec<u8>> {
        let reply = self.request(method, target, body).await?;
        if reply.status == 200 {
            Ok(reply.body)
        } else if reply.status == 401 {
            Err(self.unauthorized(method, target, &reply))
        } else {
            Err(self.error(format!(
                "{method} {target} answered HTTP {}: {}",
                reply.status,
                reply.text()
            )))
        }
    }

    fn parse<T: serde::de::DeserializeOwned>(&self, what: &str, body: &[u8]) -> Result<T> {
        serde_json::from_slice(body).map_err(|e| {
            self.error(format!(
                "the answer to {what} is not the expected JSON: {e}"
            ))
        })
    }

    /// `GET /health`.
    ///
    /// # Errors
    /// [`BootstrapError::Request`] unless the server answers 200.
    pub async fn health(&self) -> Result<()> {
        self.expect_ok("GET", "/health", None).await.map(|_| ())
    }

    /// `GET /ready`: whether every declared rank registered (a 503 answer is not an error).
    ///
    /// # Errors
    /// [`BootstrapError::Request`] when unreachable or the answer is not readiness JSON.
    pub async fn readiness(&self) -> Result<Readiness> {
        let reply = self.request("GET", "/ready", None).await?;
        if reply.status == 401 {
            return Err(self.unauthorized("GET", "/ready", &reply));
        }
        if reply.status != 200 && reply.status != 503 {
            return Err(self.error(format!(
                "GET /ready answered HTTP {}: {}",
                reply.status,
                reply.text()
            )));
        }
        self.parse("GET /ready", &reply.body)
    }

    /// `PUT /route`: registers one prefill rank.
    ///
    /// # Errors
    /// [`BootstrapError::Request`] with the server's 400 message when it refuses the row.
    pub async fn register(&self, row: &RankRegistration) -> Result<()> {
        let body = serde_json::to_vec(row)
            .map_err(|e| self.error(format!("the registration does not serialise: {e}")))?;
        self.expect_ok("PUT", "/route", Some(&body))
            .await
            .map(|_| ())
    }

    /// `GET /route` with all ranks `-1`: the deployment's parameters.
    ///
    /// # Errors
    /// [`BootstrapError::Request`]; a 503 while not every rank registered.
    pub async fn server_info(&self) -> Result<PrefillServerInfo> {
        let target =
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1";
        let body = self.expect_ok("GET", target, None).await?;
        self.parse("GET /route", &body)
    }

    /// `GET /route` with concrete ranks: where one rank listens.
    ///
    /// # Errors
    /// [`BootstrapError::Request`]; a 404 when no such rank registered.
    pub async fn rank_endpoint(&self, dp: u32, cp: u32, tp: u32, pp: u32) -> Result<RankEndpoint> {
        let target = format!(
            "/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}"
        );
        let body = self.expect_ok("GET", &target, None).await?;
        self.parse("GET /route", &body)
    }

    /// `GET /ranks`: every rank of DP group 0, once every rank registered.
    ///
    /// # Errors
    /// [`BootstrapError::Request`]; a 503 while not every rank registered.
    pub async fn ranks(&self) -> Result<Vec<PrefillRankInfo>> {
        let body = self.expect_ok("GET", "/ranks", None).await?;
        Ok(self.parse::<RankList>("GET /ranks", &body)?.ranks)
    }

    /// `POST /register_dp_rank`.
    ///
    /// # Errors
    /// [`BootstrapError::Request`].
    pub async fn register_dp_rank(&self, bootstrap_room: u64, dp_rank: u32) -> Result<()> {
        let body = serde_json::to_vec(&DpRankEntry {
            bootstrap_room,
            dp_rank,
        })
        .unwrap_or_default();
        self.expect_ok("POST", "/register_dp_rank", Some(&body))
            .await
            .map(|_| ())
    }

    /// `POST /query_dp_ranks`: the DP rank of each known room.
    ///
    /// # Errors
    /// [`BootstrapError::Request`].
    pub async fn query_dp_ranks(&self, rooms: &[u64]) -> Result<BTreeMap<u64, u32>> {
        let body = serde_json::to_vec(&DpRankQuery {
            bootstrap_rooms: rooms.to_vec(),
        })
        .unwrap_or_default();
        let body = self
            .expect_ok("POST", "/query_dp_ranks", Some(&body))
            .await?;
        let m: BTreeMap<String, u32> = self.parse("POST /query_dp_ranks", &body)?;
        Ok(m.into_iter()
            .filter_map(|(k, v)| k.parse().ok().map(|k| (k, v)))
            .collect())
    }
}

/// A [`PrefillDirectory`] that asks the bootstrap server at each bootstrap address
/// (`GET /ranks`), retrying while the deployment is not fully registered or not reachable
/// (SGLang: every 1 s, 15 times).
#[derive(Debug, Clone)]
pub struct HttpDirectory {
    config: ClientConfig,
    retry_interval: Duration,
    max_attempts: u32,
}

impl Default for HttpDirectory {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpDirectory {
    /// A directory with SGLang's retry policy (1 s apart, 15 attempts) and 5 s requests.
    pub fn new() -> Self {
        Self {
            config: ClientConfig::default(),
            retry_interval: Duration::from_secs(1),
            max_attempts: 15,
        }
    }

    /// Sets the retry policy (at least one attempt).
    #[must_use]
    pub fn with_retry(mut self, interval: Duration, max_attempts: u32) -> Self {
        self.retry_interval = interval;
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// Sets the per-request client settings.
    #[must_use]
    pub fn with_client_config(mut self, config: ClientConfig) -> Self {
        self.config = config;
        self
    }
}

#[async_trait::async_trait]
impl PrefillDirectory for HttpDirectory {
    async fn prefill_ranks(&self, bootstrap_addr: &str) -> Result<Vec<PrefillRankInfo>> {
        let client = BootstrapClient::with_config(bootstrap_addr, self.config.clone());
        let mut attempt = 0;
        loop {
            attempt += 1;
            let err = match client.ranks().await {
                Ok(r) => return Ok(r),
                // A wrong or missing secret does not fix itself: no retry.
                Err(e @ BootstrapError::Unauthorized { .. }) => return Err(e),
                Err(e) => e,
            };
            if attempt >= self.max_attempts {
                return Err(BootstrapError::Directory {
                    addr: bootstrap_addr.to_owned(),
                    reason: format!(
                        "Could not fetch prefill parallel info from {bootstrap_addr} after \
                         {attempt} attempts; last error: {err}"
                    ),
                });
            }
            tracing::debug!(addr = bootstrap_addr, attempt, error = %err, "bootstrap not ready, retrying");
            tokio::time::sleep(self.retry_interval).await;
        }
    }
}
