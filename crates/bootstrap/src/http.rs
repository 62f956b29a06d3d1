//! A minimal, bounded HTTP/1.1 codec: just what the bootstrap registry needs. Heads are parsed
//! by `httparse` (docs/ARCHITECTURE.md says why not an HTTP framework); this module adds the
//! bounds and the meaning. Parsing is sans-IO (bytes in, values or a 4xx out); the server and
//! client do the socket work.
//!
//! Supported: one request per connection (`Connection: close`), `Content-Length` bodies,
//! `Expect: 100-continue`. Refused with a status and a message: heads above the limit (431),
//! too many headers (431), `Transfer-Encoding` (501), bodies above the limit (413), a body
//! without `Content-Length` on PUT/POST (411), malformed request lines or headers (400), HTTP
//! versions other than 1.0/1.1 (505).

use std::collections::BTreeMap;

/// Limits on what a peer may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) max_head: usize,
    pub(crate) max_headers: usize,
    pub(crate) max_body: usize,
}

/// A parsed request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestHead {
    pub(crate) method: String,
    /// The request target exactly as sent (path and query, still percent-encoded).
    pub(crate) target: String,
    /// The target's path, percent-decoded.
    pub(crate) path: String,
    pub(crate) query: BTreeMap<String, String>,
    pub(crate) content_length: Option<usize>,
    pub(crate) expect_continue: bool,
    /// The `Authorization` header, when sent.
    pub(crate) authorization: Option<String>,
}

/// The `Content-Type` of Prometheus text exposition (format 0.0.4).
pub(crate) const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A response: status, content type, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Response {
    pub(crate) status: u16,
    pub(crate) content_type: &'static str,
    pub(crate) body: Vec<u8>,
}

impl Response {
    pub(crate) fn text(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into().into_bytes(),
        }
    }

    pub(crate) fn json(status: u16, value: &impl serde::Serialize) -> Self {
        match serde_json::to_vec(value) {
            Ok(body) => Self {
                status,
                content_type: "application/json",
                body,
            },
            Err(e) => Self::text(500, format!("response does not serialise: {e}")),
        }
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len()
        )
        .into_bytes();
        out.extend_from_slice(&self.body);
        out
    }
}

/// The reason phrase of a status code.
pub(crate) fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        401 => "Unauthorized",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// Maps a parse error of `httparse` to the status and message a client gets.
fn refusal(e: httparse::Error, limits: &Limits) -> Response {
    use httparse::Error as E;
    let what = match e {
        E::TooManyHeaders => {
            return Response::text(
                431,
                format!("more than {} header lines", limits.max_headers),
            );
        }
        E::Version => {
            return Response::text(505, "this HTTP version is not supported; use HTTP/1.1");
        }
        E::Token => "malformed request line; expected `METHOD /path HTTP/1.1`",
        E::HeaderName => "malformed header name; expected `Name: value` lines",
        E::HeaderValue => "malformed header value",
        E::NewLine => "malformed line ending; lines end with CRLF",
        E::Status => "malformed status",
    };
    Response::text(400, what)
}

/// Parses a request head from the start of `buf` with `httparse`.
///
/// `Ok(None)`: the head is not complete yet (read more, up to `limits.max_head`).
/// `Ok(Some((head, n)))`: the head is the first `n` bytes; the body follows.
/// `Err`: the response refusing the request (4xx/5xx with a message).
pub(crate) fn parse_request_head(
    buf: &[u8],
    limits: &Limits,
) -> std::result::Result<Option<(RequestHead, usize)>, Response> {
    let bad = |m: String| Response::text(400, m);
    // Bounded by the configured header count, not by anything the peer sends.
    let mut headers = vec![httparse::EMPTY_HEADER; limits.max_headers];
    let mut req = httparse::Request::new(&mut headers);
    let end = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(refusal(e, limits)),
    };
    let (Some(method), Some(target)) = (req.method, req.path) else {
        return Err(bad("the request line is incomplete".to_owned()));
    };
    if !target.starts_with('/') {
        return Err(bad(format!(
            "request target {:?} must be an absolute path starting with '/'",
            truncate(target)
        )));
    }
    let (raw_path, raw_query) = target.split_once('?').unwrap_or((target, ""));
    let path = percent_decode(raw_path).map_err(bad)?;
    let mut query = BTreeMap::new();
    for pair in raw_query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let k = percent_decode(k).map_err(bad)?;
        let v = percent_decode(v).map_err(bad)?;
        if query.len() >= limits.max_headers {
            return Err(bad(format!(
                "more than {} query parameters",
                limits.max_headers
            )));
        }
        query.insert(k, v);
    }
    let mut content_length: Option<usize> = None;
    let mut expect_continue = false;
    let mut authorization = None;
    for h in req.headers.iter() {
        let value = std::str::from_utf8(h.value)
            .map_err(|_| bad(format!("header {:?} is not UTF-8 text", truncate(h.name))))?
            .trim();
        match h.name.to_ascii_lowercase().as_str() {
            "content-length" => {
                let n = parse_content_length(value).map_err(bad)?;
                if content_length.is_some_and(|c| c != n) {
                    return Err(bad("conflicting Content-Length headers".to_owned()));
                }
                // Checked here, before the server allocates anything for the body.
                if n > limits.max_body {
                    return Err(Response::text(
                        413,
                        format!(
                            "the body is {n} bytes; this server accepts at most {}",
                            limits.max_body
                        ),
                    ));
                }
                content_length = Some(n);
            }
            "transfer-encoding" => {
                return Err(Response::text(
                    501,
                    "Transfer-Encoding is not supported; send the body with a Content-Length",
                ));
            }
            "expect" => expect_continue = value.eq_ignore_ascii_case("100-continue"),
            "authorization" => authorization = Some(value.to_owned()),
            _ => {}
        }
    }
    if content_length.is_none() && (method == "PUT" || method == "POST") {
        return Err(Response::text(
            411,
            format!("{method} needs a Content-Length header"),
        ));
    }
    let head = RequestHead {
        method: method.to_owned(),
        target: target.to_owned(),
        path,
        query,
        content_length,
        expect_continue,
        authorization,
    };
    Ok(Some((head, end)))
}

/// A `Content-Length` value: decimal digits only (no sign, no spaces inside).
fn parse_content_length(value: &str) -> std::result::Result<usize, String> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "Content-Length {:?} is not a non-negative integer",
            truncate(value)
        ));
    }
    value
        .parse()
        .map_err(|_| format!("Content-Length {:?} is too large", truncate(value)))
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

fn percent_decode(s: &str) -> std::result::Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = b
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("bad percent escape in {:?}", truncate(s)))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| format!("{:?} does not decode to UTF-8", truncate(s)))
}

/// A parsed response head: status and optional content length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResponseHead {
    pub(crate) status: u16,
    pub(crate) content_length: Option<usize>,
}

/// Parses a response head from the start of `buf` with `httparse`.
///
/// `Ok(None)`: not complete. `Ok(Some((head, n)))`: the head is the first `n` bytes.
pub(crate) fn parse_response_head(
    buf: &[u8],
    max_headers: usize,
) -> std::result::Result<Option<(ResponseHead, usize)>, String> {
    let mut headers = vec![httparse::EMPTY_HEADER; max_headers];
    let mut resp = httparse::Response::new(&mut headers);
    let end = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(format!("more than {max_headers} response headers"));
        }
        Err(e) => {
            let line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
            return Err(format!(
                "not an HTTP/1.x response ({e}; first line {:?})",
                truncate(&String::from_utf8_lossy(line))
            ));
        }
    };
    let status = resp
        .code
        .filter(|s| (100..600).contains(s))
        .ok_or_else(|| format!("bad status {:?}", resp.code))?;
    let mut content_length = None;
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value).unwrap_or_default().trim();
            content_length = Some(parse_content_length(v)?);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err("chunked responses are not supported".to_owned());
        }
    }
    Ok(Some((
        ResponseHead {
            status,
            content_length,
        },
        end,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        max_head: 8192,
        max_headers: 8,
        max_body: 100,
    };

    fn parse(s: &str) -> std::result::Result<RequestHead, Response> {
        let (head, n) = parse_request_head(s.as_bytes(), &L)?.expect("a complete head");
        assert_eq!(n, s.len());
        Ok(head)
    }

    #[test]
    fn parses_a_request() {
        let h = parse("GET /route?a=-1&b=%41+c HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!(h.method, "GET");
        assert_eq!(h.path, "/route");
        assert_eq!(h.query["a"], "-1");
        assert_eq!(h.query["b"], "A c");
        assert_eq!(h.content_length, None);
        let h = parse("PUT /route HTTP/1.1\r\ncontent-length: 5\r\nExpect: 100-continue\r\n\r\n")
            .unwrap();
        assert_eq!(h.content_length, Some(5));
        assert!(h.expect_continue);
    }

    #[test]
    fn refuses_bad_requests_with_a_status() {
        let st = |s: &str| parse(s).unwrap_err().status;
        assert_eq!(st("GET\r\n\r\n"), 400);
        assert_eq!(st("GET / HTTP/1.1 x\r\n\r\n"), 400);
        assert_eq!(st("GET / HTTP/2\r\n\r\n"), 505);
        assert_eq!(st("GET route HTTP/1.1\r\n\r\n"), 400);
        assert_eq!(st("G(T / HTTP/1.1\r\n\r\n"), 400);
        assert_eq!(st("GET / HTTP/1.1\r\nnocolon\r\n\r\n"), 400);
        assert_eq!(st("GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n"), 400);
        assert_eq!(st("GET / HTTP/1.1\r\nContent-Length: 101\r\n\r\n"), 413);
        assert_eq!(
            st("GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"),
            400
        );
        assert_eq!(
            st("PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            501
        );
        assert_eq!(st("PUT / HTTP/1.1\r\n\r\n"), 411);
        assert_eq!(st("GET /%zz HTTP/1.1\r\n\r\n"), 400);
        assert_eq!(st("GET /%ff HTTP/1.1\r\n\r\n"), 400);
        let many: String = (0..9).map(|i| format!("H{i}: v\r\n")).collect();
        assert_eq!(st(&format!("GET / HTTP/1.1\r\n{many}\r\n")), 431);
        assert_eq!(
            parse_request_head(&[0xff, 0xfe], &L).unwrap_err().status,
            400
        );
        assert_eq!(st("GET / HTTP/1.1\r\nContent-Length: +1\r\n\r\n"), 400);
        let not_utf8 = parse_request_head(b"GET / HTTP/1.1\r\nX: \xff\r\n\r\n", &L);
        assert_eq!(not_utf8.unwrap_err().status, 400);
    }

    #[test]
    fn incomplete_heads_ask_for_more() {
        for part in [
            "",
            "GE",
            "GET /x HTTP/1.1\r\n",
            "GET /x HTTP/1.1\r\nHost: x\r\n",
        ] {
            assert!(
                parse_request_head(part.as_bytes(), &L).unwrap().is_none(),
                "{part:?}"
            );
        }
        // A body after the head is left to the caller.
        let (h, n) = parse_request_head(b"PUT /r HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", &L)
            .unwrap()
            .unwrap();
        assert_eq!((h.content_length, n), (Some(2), 38));
        let h = parse("GET / HTTP/1.1\r\nAuthorization: KVB x\r\n\r\n").unwrap();
        assert_eq!(h.authorization.as_deref(), Some("KVB x"));
    }

    #[test]
    fn parses_responses() {
        let (h, _) = parse_response_head(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 3\r\n\r\n",
            8,
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.status, 503);
        assert_eq!(h.content_length, Some(3));
        assert!(parse_response_head(b"SSH-2.0\r\n\r\n", 8).is_err());
        assert!(parse_response_head(b"HTTP/1.1 99999 x\r\n\r\n", 8).is_err());
        assert!(
            parse_response_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", 8)
                .is_err()
        );
        assert_eq!(parse_response_head(b"HTTP/1.1 200 OK\r\n", 8), Ok(None));
        let many: String = (0..9).map(|i| format!("H{i}: v\r\n")).collect();
        let r = format!("HTTP/1.1 200 OK\r\n{many}\r\n");
        assert!(parse_response_head(r.as_bytes(), 8).is_err());
        let r = Response::text(404, "nope").encode();
        assert!(r.starts_with(b"HTTP/1.1 404 Not Found\r\n"));
        assert!(r.ends_with(b"\r\n\r\nnope"));
    }
}
