//! The bootstrap registry over HTTP: every route, SGLang's texts, and hostile clients.

use std::time::Duration;

use kvbridge_bootstrap::{
    BootstrapClient, BootstrapConfig, BootstrapServer, ClientConfig, HttpDirectory, MISSING_INPUTS,
    RankRegistration,
};
use kvbridge_bootstrap::{BootstrapError, PrefillDirectory};
use kvbridge_handshake::{PeerDescriptor, Role};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn prefill(tp: u32, rank: u32, page: u64) -> PeerDescriptor {
    PeerDescriptor::mla(Role::Prefill, page, 2, 576)
        .attn_tp(tp, rank)
        .build()
        .unwrap()
}

async fn server() -> BootstrapServer {
    BootstrapServer::bind(BootstrapConfig::default())
        .await
        .unwrap()
}

/// Writes `bytes`, then reads the whole answer (bounded in time).
async fn raw(addr: &str, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("the server must answer and close, not hang");
    String::from_utf8_lossy(&out).into_owned()
}

fn status(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"))
}

#[tokio::test]
async fn routes_follow_sglangs_texts() {
    let s = server().await;
    let addr = s.bootstrap_addr();
    let c = BootstrapClient::new(&addr);
    c.health().await.unwrap();

    let r = c.readiness().await.unwrap();
    assert!(!r.ready);
    assert_eq!((r.registered, r.expected), (0, 0));

    c.register(&RankRegistration::new("127.0.0.1:7001", prefill(2, 1, 64)))
        .await
        .unwrap();
    let r = c.readiness().await.unwrap();
    assert_eq!((r.ready, r.registered, r.expected), (false, 1, 2));

    // Not every rank registered: 503 with SGLang's text, on both server info and /ranks.
    let info = c
        .request(
            "GET",
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
            None,
        )
        .await
        .unwrap();
    assert_eq!(info.status, 503);
    assert_eq!(
        info.text(),
        "Prefill server not fully registered yet (1 workers registered)."
    );
    let err = c.ranks().await.unwrap_err().to_string();
    assert!(
        err.contains("HTTP 503") && err.contains("1 workers registered"),
        "{err}"
    );

    c.register(&RankRegistration::new("127.0.0.1:7000", prefill(2, 0, 64)))
        .await
        .unwrap();
    assert!(c.readiness().await.unwrap().ready);
    let info = c.server_info().await.unwrap();
    assert_eq!(info.attn_tp_size, 2);
    assert_eq!(info.page_size, 64);
    assert_eq!(info.dcp_size, 1);
    assert_eq!(info.kv_pool, kvbridge_geometry::PoolKind::Mla);
    assert_eq!((info.registered, info.expected), (2, 2));

    let e = c.rank_endpoint(0, 0, 1, 0).await.unwrap();
    assert_eq!(e.rank_ip.as_deref(), Some("127.0.0.1"));
    assert_eq!(e.rank_port, Some(7001));
    assert_eq!(e.descriptor.attn_tp_rank, 1);

    let missing = c
        .request("GET", "/route?prefill_dp_rank=0&target_tp_rank=0", None)
        .await
        .unwrap();
    assert_eq!(
        (missing.status, missing.text().as_str()),
        (400, MISSING_INPUTS)
    );
    let empty = c
        .request(
            "GET",
            "/route?prefill_dp_rank=&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
            None,
        )
        .await
        .unwrap();
    assert_eq!(empty.status, 400);
    let nf = c
        .request(
            "GET",
            "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=5&target_pp_rank=0",
            None,
        )
        .await
        .unwrap();
    assert_eq!(nf.status, 404);
    assert_eq!(
        nf.text(),
        "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=5 pp_rank=0"
    );
    let bad = c
        .request(
            "GET",
            "/route?prefill_dp_rank=x&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
            None,
        )
        .await
        .unwrap();
    assert_eq!(bad.status, 400);
    assert!(bad.text().contains("prefill_dp_rank"), "{}", bad.text());

    let ranks = c.ranks().await.unwrap();
    let eps: Vec<&str> = ranks.iter().map(|r| r.endpoint.as_str()).collect();
    assert_eq!(
        eps,
        ["127.0.0.1:7000", "127.0.0.1:7001"],
        "ordered by tp rank"
    );

    let m = c.request("DELETE", "/route", None).await.unwrap();
    assert_eq!((m.status, m.text().as_str()), (405, "Method not allowed"));
    let nf = c.request("GET", "/nope", None).await.unwrap();
    assert_eq!(nf.status, 404);
}

#[tokio::test]
async fn registrations_are_checked_and_the_first_row_wins() {
    let s = server().await;
    let c = BootstrapClient::new(s.bootstrap_addr());
    c.register(&RankRegistration::new("127.0.0.1:1", prefill(2, 0, 64)))
        .await
        .unwrap();
    let err = c
        .register(&RankRegistration::new("127.0.0.1:2", prefill(2, 1, 32)))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("HTTP 400"), "{err}");
    assert!(err.contains("inconsistent prefill ranks"), "{err}");
    assert!(
        err.contains("page_size: registered 64, this row 32"),
        "{err}"
    );

    let mut decode = prefill(2, 1, 64);
    decode.role = Role::Decode;
    let err = c
        .register(&RankRegistration::new("127.0.0.1:2", decode))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("only prefill ranks register"), "{err}");

    let mut out_of_range = prefill(2, 0, 64);
    out_of_range.attn_tp_rank = 2;
    let err = c
        .register(&RankRegistration::new("127.0.0.1:2", out_of_range))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("attn_tp_rank 2 is out of range for size 2"),
        "{err}"
    );

    // Same coordinates again (a restarted rank): replaced.
    c.register(&RankRegistration::new("127.0.0.1:9", prefill(2, 0, 64)))
        .await
        .unwrap();
    assert_eq!(s.registry().ranks(0)[0].endpoint.as_str(), "127.0.0.1:9");
    assert_eq!(s.registry().readiness().registered, 1);

    // Bodies that are not registrations.
    for body in [
        &b"{"[..],
        b"[]",
        b"{\"endpoint\": \"a:1\"}",
        b"{\"endpoint\": \"a:1\", \"descriptor\": {}, \"extra\": 1}",
    ] {
        let r = c.request("PUT", "/route", Some(body)).await.unwrap();
        assert_eq!(r.status, 400, "{}", r.text());
    }
}

#[tokio::test]
async fn dp_rank_table_answers_known_rooms() {
    // Expiry is unit-tested with explicit instants in `bootstrap::tests`.
    let s = server().await;
    let c = BootstrapClient::new(s.bootstrap_addr());
    c.register_dp_rank(11, 1).await.unwrap();
    c.register_dp_rank(12, 0).await.unwrap();
    let m = c.query_dp_ranks(&[11, 12, 13]).await.unwrap();
    assert_eq!(m.len(), 2, "unknown rooms are left out");
    assert_eq!((m[&11], m[&12]), (1, 0));
    let bad = c
        .request(
            "POST",
            "/register_dp_rank",
            Some(b"{\"bootstrap_room\": -1}"),
        )
        .await
        .unwrap();
    assert_eq!(bad.status, 400);
    let many: Vec<u64> = (0..5000).collect();
    let body = serde_json::to_vec(&serde_json::json!({ "bootstrap_rooms": many })).unwrap();
    let r = c
        .request("POST", "/query_dp_ranks", Some(&body))
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    assert!(r.text().contains("at most 4096"), "{}", r.text());
}

#[tokio::test]
async fn hostile_requests_get_a_4xx_and_the_server_keeps_serving() {
    let mut cfg = BootstrapConfig::default()
        .with_request_timeout(Duration::from_secs(2))
        .with_max_body_bytes(1024);
    cfg.max_headers = 16;
    let s = BootstrapServer::bind(cfg).await.unwrap();
    let a = s.bootstrap_addr();

    assert_eq!(status(&raw(&a, b"hello\r\n\r\n").await), 400);
    assert_eq!(status(&raw(&a, b"GET / HTTP/2.0\r\n\r\n").await), 505);
    assert_eq!(status(&raw(&a, b"\xff\xfe\r\n\r\n").await), 400);
    let huge = vec![b'a'; 20_000];
    assert_eq!(status(&raw(&a, &huge).await), 431);
    let many: String = (0..40).map(|i| format!("X-{i}: y\r\n")).collect();
    let answer = raw(&a, format!("GET /health HTTP/1.1\r\n{many}\r\n").as_bytes()).await;
    assert_eq!(status(&answer), 431);
    let answer = raw(&a, b"PUT /route HTTP/1.1\r\nContent-Length: 999999\r\n\r\n").await;
    assert_eq!(status(&answer), 413);
    assert!(answer.contains("at most 1024"), "{answer}");
    let answer = raw(
        &a,
        b"PUT /route HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    .await;
    assert_eq!(status(&answer), 501);
    assert_eq!(status(&raw(&a, b"PUT /route HTTP/1.1\r\n\r\n").await), 411);
    let answer = raw(&a, b"PUT /route HTTP/1.1\r\nContent-Length: 4\r\n\r\nnope").await;
    assert_eq!(status(&answer), 400);
    // Body shorter than announced, then the client goes away.
    let mut s1 = TcpStream::connect(&a).await.unwrap();
    s1.write_all(b"PUT /route HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        .await
        .unwrap();
    s1.shutdown().await.unwrap();
    let mut out = String::new();
    s1.read_to_string(&mut out).await.unwrap();
    assert_eq!(status(&out), 400);
    // A client that stalls mid-head gets a 408 at the deadline.
    let mut slow = TcpStream::connect(&a).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: x")
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), slow.read_to_string(&mut out))
        .await
        .expect("the server closes a stalled request")
        .unwrap();
    assert_eq!(status(&out), 408);
    // A client that connects and sends nothing is closed too.
    let mut idle = TcpStream::connect(&a).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), idle.read_to_end(&mut out))
        .await
        .expect("idle connections are closed")
        .unwrap();

    // Expect: 100-continue is honoured.
    let mut e = TcpStream::connect(&a).await.unwrap();
    let body = b"{\"bootstrap_room\":5,\"dp_rank\":0}";
    let head = format!(
        "POST /register_dp_rank HTTP/1.1\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        body.len()
    );
    e.write_all(head.as_bytes()).await.unwrap();
    let mut first = [0u8; 25];
    e.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"HTTP/1.1 100 Continue\r\n\r\n");
    e.write_all(body).await.unwrap();
    let mut out = String::new();
    e.read_to_string(&mut out).await.unwrap();
    assert_eq!(status(&out), 200, "{out}");

    BootstrapClient::new(&a).health().await.unwrap();
}

#[tokio::test]
async fn connections_over_the_limit_get_503() {
    let cfg = BootstrapConfig::default()
        .with_max_connections(1)
        .with_request_timeout(Duration::from_secs(5));
    let s = BootstrapServer::bind(cfg).await.unwrap();
    let a = s.bootstrap_addr();
    let mut holder = TcpStream::connect(&a).await.unwrap();
    holder.write_all(b"GET /health").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let answer = raw(&a, b"GET /health HTTP/1.1\r\n\r\n").await;
    assert_eq!(status(&answer), 503, "{answer}");
    assert!(answer.contains("retry shortly"), "{answer}");
    holder.write_all(b" HTTP/1.1\r\n\r\n").await.unwrap();
    let mut out = String::new();
    holder.read_to_string(&mut out).await.unwrap();
    assert_eq!(status(&out), 200);
    BootstrapClient::new(&a).health().await.unwrap();
}

#[tokio::test]
async fn client_bounds_what_a_server_sends() {
    // A server that answers garbage, and one that never stops talking.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok((mut s, _)) = l.accept().await {
            n += 1;
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            if n == 1 {
                let _ = s.write_all(b"SSH-2.0-OpenSSH\r\n\r\n").await;
            } else {
                let chunk = vec![b'x'; 64 << 10];
                while s.write_all(&chunk).await.is_ok() {}
            }
        }
    });
    let c = BootstrapClient::with_config(
        &addr,
        ClientConfig::default().with_timeout(Duration::from_secs(5)),
    );
    let e = c.health().await.unwrap_err().to_string();
    assert!(e.contains("not an HTTP/1.x response"), "{e}");
    let e = c.health().await.unwrap_err().to_string();
    assert!(e.contains("exceeds"), "{e}");
}

#[tokio::test]
async fn http_directory_waits_for_registration_then_resolves() {
    let s = server().await;
    let addr = s.bootstrap_addr();
    let dir = HttpDirectory::new().with_retry(Duration::from_millis(50), 100);
    let reg = s.registry().clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        reg.register(RankRegistration::new("127.0.0.1:7000", prefill(1, 0, 64)))
            .unwrap();
    });
    let ranks = dir.prefill_ranks(&addr).await.unwrap();
    assert_eq!(ranks.len(), 1);
    assert_eq!(ranks[0].descriptor.page_size, 64);

    // Nobody listens: a clear error after the attempts, no hang.
    drop(s);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = l.local_addr().unwrap().to_string();
    drop(l);
    let err = HttpDirectory::new()
        .with_retry(Duration::from_millis(10), 3)
        .prefill_ranks(&dead)
        .await
        .unwrap_err();
    assert!(matches!(err, BootstrapError::Directory { .. }));
    let text = err.to_string();
    assert!(text.contains("after 3 attempts"), "{text}");
    assert!(text.contains("cannot connect"), "{text}");

    // A single client call names the bootstrap service, not the directory.
    let err = BootstrapClient::new(&dead).health().await.unwrap_err();
    assert!(matches!(err, BootstrapError::Request { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("bootstrap service at {dead}")),
        "{text}"
    );
    assert!(text.contains("cannot connect"), "{text}");
}

#[tokio::test]
async fn metrics_route_serves_the_source_rendered_on_each_request() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let scrapes = Arc::new(AtomicU64::new(0));
    let counted = scrapes.clone();
    let s = BootstrapServer::builder(BootstrapConfig::default())
        .metrics(move || {
            let n = counted.fetch_add(1, Ordering::Relaxed) + 1;
            format!(
                "# HELP scrapes_total Scrapes.\n# TYPE scrapes_total counter\nscrapes_total {n}\n"
            )
        })
        .bind()
        .await
        .unwrap();
    let client = BootstrapClient::new(s.bootstrap_addr());
    for n in 1..=2 {
        let reply = client.request("GET", "/metrics", None).await.unwrap();
        assert_eq!(reply.status, 200);
        assert!(
            reply.text().ends_with(&format!("scrapes_total {n}\n")),
            "{}",
            reply.text()
        );
    }
    let answer = raw(&s.bootstrap_addr(), b"GET /metrics HTTP/1.1\r\n\r\n").await;
    assert!(
        answer.contains("Content-Type: text/plain; version=0.0.4"),
        "{answer}"
    );
    let reply = client
        .request("PUT", "/metrics", Some(b"{}"))
        .await
        .unwrap();
    assert_eq!(reply.status, 405);

    // Without a source the route says so.
    let bare = server().await;
    let reply = BootstrapClient::new(bare.bootstrap_addr())
        .request("GET", "/metrics", None)
        .await
        .unwrap();
    assert_eq!(reply.status, 404);
    assert!(
        reply.text().contains("without a metrics source"),
        "{}",
        reply.text()
    );
}

#[tokio::test]
async fn a_secret_guards_registrations_and_queries_over_http() {
    let secret = b"one secret for the deployment".to_vec();
    let s = BootstrapServer::bind(BootstrapConfig::default().with_secret(secret.clone()))
        .await
        .unwrap();
    let a = s.bootstrap_addr();
    let with = |k: &[u8]| {
        BootstrapClient::with_config(&a, ClientConfig::default().with_secret(k.to_vec()))
    };
    let row = RankRegistration::new("127.0.0.1:17000", prefill(1, 0, 64));

    // Without the secret, or with another one: refused, nothing stored.
    let err = BootstrapClient::new(&a).register(&row).await.unwrap_err();
    assert!(
        matches!(err, BootstrapError::Unauthorized { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("no Authorization header"), "{err}");
    let err = with(b"wrong").register(&row).await.unwrap_err();
    assert!(
        matches!(err, BootstrapError::Unauthorized { .. }),
        "{err:?}"
    );
    let err = BootstrapClient::new(&a).ranks().await.unwrap_err();
    assert!(
        matches!(err, BootstrapError::Unauthorized { .. }),
        "{err:?}"
    );
    assert_eq!(s.registry().readiness().registered, 0);
    // The directory does not retry a refusal (its retry budget here would take 15 minutes).
    let dir = HttpDirectory::new().with_retry(Duration::from_secs(60), 15);
    let err = dir.prefill_ranks(&a).await.unwrap_err();
    assert!(
        matches!(err, BootstrapError::Unauthorized { .. }),
        "{err:?}"
    );
    // Liveness needs no proof.
    BootstrapClient::new(&a).health().await.unwrap();

    // With the secret every route works.
    let ok = with(&secret);
    ok.register(&row).await.unwrap();
    assert!(ok.readiness().await.unwrap().ready);
    assert_eq!(ok.ranks().await.unwrap().len(), 1);
    ok.register_dp_rank(7, 0).await.unwrap();
    assert_eq!(ok.query_dp_ranks(&[7]).await.unwrap()[&7], 0);
    let dir = HttpDirectory::new().with_client_config(ClientConfig::default().with_secret(secret));
    assert_eq!(dir.prefill_ranks(&a).await.unwrap().len(), 1);

    // A client with a secret refuses a server without one.
    let open = server().await;
    let err = BootstrapClient::with_config(
        open.bootstrap_addr(),
        ClientConfig::default().with_secret(b"x".to_vec()),
    )
    .health()
    .await;
    assert!(err.is_ok(), "open routes need no challenge");
    let err = BootstrapClient::with_config(
        open.bootstrap_addr(),
        ClientConfig::default().with_secret(b"x".to_vec()),
    )
    .ranks()
    .await
    .unwrap_err();
    assert!(err.to_string().contains("the server has none"), "{err}");
}

/// A server bound on every interface names the advertised address (with the bound port), and
/// that address serves; an unspecified advertised address is refused with the fix.
#[tokio::test]
async fn the_advertised_address_is_the_one_peers_get() {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    let config = BootstrapConfig::default()
        .with_bind_addr(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
        .with_advertise_addr(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let s = BootstrapServer::bind(config).await.unwrap();
    assert!(s.local_addr().ip().is_unspecified(), "{}", s.local_addr());
    let want = format!("127.0.0.1:{}", s.local_addr().port());
    assert_eq!(s.bootstrap_addr(), want);
    let answer = raw(&want, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(status(&answer), 200, "{answer}");
    // Control: without an advertised address the bound one is named.
    let plain = server().await;
    assert_eq!(plain.bootstrap_addr(), plain.local_addr().to_string());

    let bad = BootstrapConfig::default().with_advertise_addr(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let err = BootstrapServer::bind(bad).await.unwrap_err().to_string();
    assert!(err.contains("advertise_addr 0.0.0.0"), "{err}");
}
