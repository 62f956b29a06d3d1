//! The registry a bootstrap server serves: the prefill ranks of one deployment and the room →
//! DP-rank table, with the routes answered over them (docs/bootstrap.md).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvbridge_geometry::PoolKind;
use kvbridge_handshake::{PeerDescriptor, Role};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use kvbridge_sync::lock;

use crate::http::{RequestHead, Response};
use kvbridge_control::{Endpoint, PrefillRankInfo};

/// Most prefill ranks one deployment may declare (`dp · cp · tp · pp`).
pub const MAX_DEPLOYMENT_RANKS: u64 = 65_536;

/// SGLang's text for a `GET /route` without all four parameters (docs/bootstrap.md, "Bootstrap
/// routes").
pub const MISSING_INPUTS: &str = "Missing inputs for bootstrap server.";

fn one() -> u32 {
    1
}

/// `PUT /route`: one prefill rank registers itself (docs/bootstrap.md, "Rank registration").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankRegistration {
    /// The rank's control endpoint (e.g. `"127.0.0.1:17000"`).
    pub endpoint: Endpoint,
    /// The rank's descriptor; its TP/CP/PP ranks place it in the table.
    pub descriptor: PeerDescriptor,
    /// The rank's data-parallel rank (default 0).
    #[serde(default)]
    pub dp_rank: u32,
    /// The deployment's data-parallel size (default 1).
    #[serde(default = "one")]
    pub dp_size: u32,
}

impl RankRegistration {
    /// A registration for a deployment without data parallelism.
    pub fn new(endpoint: impl Into<Endpoint>, descriptor: PeerDescriptor) -> Self {
        Self {
            endpoint: endpoint.into(),
            descriptor,
            dp_rank: 0,
            dp_size: 1,
        }
    }

    fn coords(&self) -> RankCoords {
        RankCoords {
            dp: self.dp_rank,
            cp: self.descriptor.attn_cp_rank,
            tp: self.descriptor.attn_tp_rank,
            pp: self.descriptor.pp_rank,
        }
    }
}

impl From<PrefillRankInfo> for RankRegistration {
    fn from(info: PrefillRankInfo) -> Self {
        Self::new(info.endpoint, info.descriptor)
    }
}

/// `GET /route` with all ranks `-1`: the deployment's parameters (docs/bootstrap.md,
/// "`PrefillServerInfo`"): SGLang's fields plus what SGLang leaves out and a decode needs to
/// fail fast (`kv_pool`, `dcp_size`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillServerInfo {
    /// Attention TP size.
    pub attn_tp_size: u32,
    /// Attention CP size.
    pub attn_cp_size: u32,
    /// Data-parallel size.
    pub dp_size: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Physical page size of the prefill pool.
    pub page_size: u64,
    /// KV cache dtype string.
    pub kv_cache_dtype: String,
    /// KV layout, omitted when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
    /// Pool kind (`mha`, `mla`, `hybrid_mla`).
    pub kv_pool: PoolKind,
    /// Prefill DCP size.
    pub dcp_size: u32,
    /// Whether KV-cache sharding is on.
    pub enable_kv_cache_sharding: bool,
    /// Always true: rooms are routed by `room mod dp_size` unless `/register_dp_rank` says
    /// otherwise.
    pub follow_bootstrap_room: bool,
    /// Always `"early"` (the only policy implemented).
    pub decode_allocation_policy: String,
    /// Ranks registered so far.
    pub registered: usize,
    /// Ranks the deployment declares (`dp · cp · tp · pp`).
    pub expected: usize,
}

/// `GET /route` with concrete ranks: where one rank listens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankEndpoint {
    /// The endpoint's IP, when it is an `ip:port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_ip: Option<String>,
    /// The endpoint's port, when it is an `ip:port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_port: Option<u16>,
    /// The control endpoint.
    pub endpoint: Endpoint,
    /// The rank's descriptor.
    pub descriptor: PeerDescriptor,
}

/// `GET /ready`: whether every declared rank registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    /// `registered >= expected` (and at least one rank registered).
    pub ready: bool,
    /// Ranks registered so far.
    pub registered: usize,
    /// Ranks the deployment declares (0 before the first registration).
    pub expected: usize,
}

/// `GET /ranks`: every registered rank of one DP group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankList {
    /// The ranks, ordered by (cp, tp, pp).
    pub ranks: Vec<PrefillRankInfo>,
}

/// `POST /register_dp_rank` body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DpRankEntry {
    /// The room.
    pub bootstrap_room: u64,
    /// The prefill DP rank serving it.
    pub dp_rank: u32,
}

/// `POST /query_dp_ranks` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DpRankQuery {
    /// The rooms asked about.
    pub bootstrap_rooms: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct RankCoords {
    dp: u32,
    cp: u32,
    tp: u32,
    pp: u32,
}

#[derive(Debug, Clone)]
struct Deployment {
    /// The first row's descriptor with its rank fields zeroed: every later row must match.
    template: serde_json::Value,
    first: PeerDescriptor,
    dp_size: u32,
    expected: usize,
}

#[derive(Debug, Default)]
struct RegistryState {
    deployment: Option<Deployment>,
    ranks: BTreeMap<RankCoords, PrefillRankInfo>,
    rooms: HashMap<u64, (u32, Instant)>,
}

/// Limits of the room → DP rank table.
#[derive(Debug, Clone, Copy)]
struct RoomLimits {
    ttl: Duration,
    max_entries: usize,
    max_query: usize,
}

/// The registry behind a [`BootstrapServer`]: usable directly in-process (e.g. a prefill
/// registering its own ranks without HTTP). Cloning gives another handle to the same table.
#[derive(Debug, Clone)]
pub struct Registry {
    state: Arc<Mutex<RegistryState>>,
    limits: RoomLimits,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a registration was refused (answered with HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal(pub String);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn rank_template(d: &PeerDescriptor) -> serde_json::Value {
    let mut v = serde_json::to_value(d).unwrap_or(serde_json::Value::Null);
    if let Some(o) = v.as_object_mut() {
        for k in ["attn_tp_rank", "attn_cp_rank", "pp_rank", "dcp_rank"] {
            o.remove(k);
        }
    }
    v
}

fn short(v: &serde_json::Value) -> String {
    let s = v.to_string();
    if s.len() > 120 {
        format!("{}...", s.chars().take(120).collect::<String>())
    } else {
        s
    }
}

impl Registry {
    /// An empty registry with the default room-table limits (120 s TTL, 65 536 entries).
    pub fn new() -> Self {
        Self::with_room_limits(Duration::from_secs(120), 65_536)
    }

    /// An empty registry whose room → DP-rank entries live `ttl` and number at most
    /// `max_entries`.
    pub fn with_room_limits(ttl: Duration, max_entries: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(RegistryState::default())),
            limits: RoomLimits {
                ttl,
                max_entries: max_entries.max(1),
                max_query: 4096,
            },
        }
    }

    /// Runs `f` on the registry under its lock (the only place that takes it).
    fn with_state<R>(&self, f: impl FnOnce(&mut RegistryState) -> R) -> R {
        f(&mut lock(&self.state))
    }

    /// Registers (or re-registers, e.g. after a restart) one prefill rank.
    ///
    /// # Errors
    /// A [`Refusal`] naming the problem: not a prefill descriptor, ranks out of range, too
    /// many ranks, a bad endpoint, or deployment parameters that differ from the first
    /// registered rank's (the first row wins, as in SGLang).
    pub fn register(&self, row: RankRegistration) -> Result<(), Refusal> {
        let d = &row.descriptor;
        let bad = |m: String| Err(Refusal(m));
        if d.role != Role::Prefill {
            return bad(format!(
                "only prefill ranks register with the bootstrap server; this descriptor has role \
                 \"{}\"",
                d.role
            ));
        }
        let ep = row.endpoint.as_str();
        if ep.is_empty() || ep.len() > 255 || ep.chars().any(char::is_control) {
            return bad(format!(
                "endpoint {ep:?} must be 1..=255 printable characters, e.g. \"10.0.0.5:17000\""
            ));
        }
        for (what, rank, size) in [
            ("attn_tp_rank", d.attn_tp_rank, d.attn_tp_size),
            ("attn_cp_rank", d.attn_cp_rank, d.attn_cp_size),
            ("pp_rank", d.pp_rank, d.pp_size),
            ("dp_rank", row.dp_rank, row.dp_size),
        ] {
            if rank >= size {
                return bad(format!(
                    "{what} {rank} is out of range for size {size}; ranks count from 0"
                ));
            }
        }
        let expected = [d.attn_tp_size, d.attn_cp_size, d.pp_size, row.dp_size]
            .iter()
            .try_fold(1u64, |acc, &x| acc.checked_mul(u64::from(x)))
            .filter(|&n| n <= MAX_DEPLOYMENT_RANKS);
        let Some(expected) = expected else {
            return bad(format!(
                "the deployment declares tp {} x cp {} x pp {} x dp {} ranks, more than {}",
                d.attn_tp_size, d.attn_cp_size, d.pp_size, row.dp_size, MAX_DEPLOYMENT_RANKS
            ));
        };
        let template = rank_template(d);
        let coords = row.coords();
        let info = PrefillRankInfo {
            endpoint: row.endpoint.clone(),
            descriptor: row.descriptor.clone(),
        };
        self.with_state(|st| {
        match &st.deployment {
            None => {
                st.deployment = Some(Deployment {
                    template,
                    first: info.descriptor.clone(),
                    dp_size: row.dp_size,
                    expected: expected as usize,
                });
            }
            Some(dep) => {
                let mut diffs = Vec::new();
                if dep.dp_size != row.dp_size {
                    diffs.push(format!(
                        "dp_size: registered {}, this row {}",
                        dep.dp_size, row.dp_size
                    ));
                }
                if let (Some(a), Some(b)) = (dep.template.as_object(), template.as_object()) {
                    let keys: std::collections::BTreeSet<&String> =
                        a.keys().chain(b.keys()).collect();
                    for k in keys {
                        let (x, y) = (a.get(k), b.get(k));
                        if x != y {
                            let show =
                                |v: Option<&serde_json::Value>| v.map(short).unwrap_or("-".into());
                            diffs.push(format!(
                                "{k}: registered {}, this row {}",
                                show(x),
                                show(y)
                            ));
                        }
                    }
                }
                if !diffs.is_empty() {
                    return bad(format!(
                        "inconsistent prefill ranks: this row differs from the ranks already \
                         registered ({}); every rank of a deployment must share its parameters",
                        diffs.join("; ")
                    ));
                }
            }
        }
        if let Some(old) = st.ranks.insert(coords, info) {
            tracing::info!(old = %old.endpoint, ?coords, "bootstrap: a prefill rank registered again (restart)");
        }
        Ok(())
        })
    }

    /// Whether every declared rank registered, and how many did.
    pub fn readiness(&self) -> Readiness {
        self.with_state(|st| {
            let expected = st.deployment.as_ref().map_or(0, |d| d.expected);
            Readiness {
                ready: expected > 0 && st.ranks.len() >= expected,
                registered: st.ranks.len(),
                expected,
            }
        })
    }

    /// The deployment's parameters, once every rank registered.
    pub fn server_info(&self) -> Option<PrefillServerInfo> {
        let r = self.readiness();
        if !r.ready {
            return None;
        }
        self.with_state(|st| {
            let dep = st.deployment.as_ref()?;
            let d = &dep.first;
            Some(PrefillServerInfo {
                attn_tp_size: d.attn_tp_size,
                attn_cp_size: d.attn_cp_size,
                dp_size: dep.dp_size,
                pp_size: d.pp_size,
                page_size: d.page_size,
                kv_cache_dtype: d.kv_cache_dtype.clone(),
                kv_layout: d.kv_layout.clone(),
                kv_pool: d.kv_pool,
                dcp_size: d.dcp_size,
                enable_kv_cache_sharding: d.kv_cache_sharding,
                follow_bootstrap_room: true,
                decode_allocation_policy: "early".to_owned(),
                registered: r.registered,
                expected: r.expected,
            })
        })
    }

    /// Every registered rank of DP group `dp_rank`, ordered by (cp, tp, pp).
    pub fn ranks(&self, dp_rank: u32) -> Vec<PrefillRankInfo> {
        self.with_state(|st| {
            st.ranks
                .iter()
                .filter(|(c, _)| c.dp == dp_rank)
                .map(|(_, r)| r.clone())
                .collect()
        })
    }

    /// Forgets every rank (e.g. the prefill deployment restarts with another topology).
    pub fn clear(&self) {
        self.with_state(|st| {
            st.deployment = None;
            st.ranks.clear();
        })
    }

    fn rank(&self, c: RankCoords) -> Option<PrefillRankInfo> {
        self.with_state(|st| st.ranks.get(&c).cloned())
    }

    fn register_room(&self, e: DpRankEntry, now: Instant) -> Result<(), Response> {
        self.with_state(|st| {
            if st.rooms.len() >= self.limits.max_entries
                && !st.rooms.contains_key(&e.bootstrap_room)
            {
                let ttl = self.limits.ttl;
                st.rooms.retain(|_, (_, t)| now.duration_since(*t) < ttl);
                if st.rooms.len() >= self.limits.max_entries {
                    return Err(Response::text(
                        503,
                        format!(
                            "the room table is full ({} entries younger than {:?}); retry later",
                            st.rooms.len(),
                            ttl
                        ),
                    ));
                }
            }
            st.rooms.insert(e.bootstrap_room, (e.dp_rank, now));
            Ok(())
        })
    }

    fn query_rooms(&self, rooms: &[u64], now: Instant) -> BTreeMap<String, u32> {
        self.with_state(|st| {
            rooms
                .iter()
                .filter_map(|r| {
                    st.rooms
                        .get(r)
                        .filter(|(_, t)| now.duration_since(*t) < self.limits.ttl)
                        .map(|(dp, _)| (r.to_string(), *dp))
                })
                .collect()
        })
    }

    /// Drops room entries older than the TTL.
    pub(crate) fn purge_rooms(&self, now: Instant) {
        let ttl = self.limits.ttl;
        self.with_state(|st| st.rooms.retain(|_, (_, t)| now.duration_since(*t) < ttl));
    }

    /// Answers one HTTP request (sans-IO).
    pub(crate) fn route(&self, head: &RequestHead, body: &[u8], now: Instant) -> Response {
        let method = head.method.as_str();
        match head.path.as_str() {
            "/health" => match method {
                "GET" | "HEAD" => Response::text(200, "OK"),
                _ => Response::text(405, "Method not allowed"),
            },
            "/route" => match method {
                "PUT" => match serde_json::from_slice::<RankRegistration>(body) {
                    Ok(row) => match self.register(row) {
                        Ok(()) => Response::text(200, "OK"),
                        Err(r) => Response::text(400, r.0),
                    },
                    Err(e) => Response::text(
                        400,
                        format!(
                            "the body is not a rank registration ({{\"endpoint\": ..., \
                             \"descriptor\": {{...}}}}): {e}"
                        ),
                    ),
                },
                "GET" => self.get_route(head),
                _ => Response::text(405, "Method not allowed"),
            },
            "/ranks" if method == "GET" => {
                let dp = match head.query.get("prefill_dp_rank") {
                    None => 0,
                    Some(v) => match v.parse::<u32>() {
                        Ok(dp) => dp,
                        Err(_) => {
                            return Response::text(
                                400,
                                format!("prefill_dp_rank {v:?} is not a non-negative integer"),
                            );
                        }
                    },
                };
                let r = self.readiness();
                if !r.ready {
                    return not_ready(r.registered);
                }
                Response::json(
                    200,
                    &RankList {
                        ranks: self.ranks(dp),
                    },
                )
            }
            "/ready" if method == "GET" => {
                let r = self.readiness();
                Response::json(if r.ready { 200 } else { 503 }, &r)
            }
            "/register_dp_rank" if method == "POST" => {
                match serde_json::from_slice::<DpRankEntry>(body) {
                    Ok(e) => match self.register_room(e, now) {
                        Ok(()) => Response::text(200, "OK"),
                        Err(r) => r,
                    },
                    Err(e) => Response::text(
                        400,
                        format!(
                            "the body must be {{\"bootstrap_room\": int, \"dp_rank\": int}}: {e}"
                        ),
                    ),
                }
            }
            "/query_dp_ranks" if method == "POST" => {
                match serde_json::from_slice::<DpRankQuery>(body) {
                    Ok(q) if q.bootstrap_rooms.len() > self.limits.max_query => Response::text(
                        400,
                        format!(
                            "{} rooms asked at once; ask at most {}",
                            q.bootstrap_rooms.len(),
                            self.limits.max_query
                        ),
                    ),
                    Ok(q) => Response::json(200, &self.query_rooms(&q.bootstrap_rooms, now)),
                    Err(e) => Response::text(
                        400,
                        format!("the body must be {{\"bootstrap_rooms\": [int, ...]}}: {e}"),
                    ),
                }
            }
            "/ranks" | "/ready" | "/register_dp_rank" | "/query_dp_ranks" => {
                Response::text(405, "Method not allowed")
            }
            other => Response::text(
                404,
                format!(
                    "no route {other:?}; routes: /route, /ranks, /ready, /health, /metrics, \
                     /challenge, /register_dp_rank, /query_dp_ranks"
                ),
            ),
        }
    }

    fn get_route(&self, head: &RequestHead) -> Response {
        const PARAMS: [&str; 4] = [
            "prefill_dp_rank",
            "prefill_cp_rank",
            "target_tp_rank",
            "target_pp_rank",
        ];
        let mut v = [0i64; 4];
        for (i, name) in PARAMS.iter().enumerate() {
            match head.query.get(*name).map(String::as_str) {
                None | Some("") => return Response::text(400, MISSING_INPUTS),
                Some(s) => match s.parse::<i64>() {
                    Ok(x) if x >= -1 && x <= i64::from(u32::MAX) => v[i] = x,
                    _ => {
                        return Response::text(
                            400,
                            format!("{name} {s:?} must be -1 or a non-negative integer"),
                        );
                    }
                },
            }
        }
        if v.iter().all(|&x| x == -1) {
            return match self.server_info() {
                Some(info) => Response::json(200, &info),
                None => not_ready(self.readiness().registered),
            };
        }
        let [dp, cp, tp, pp] = v;
        let not_found = || {
            Response::text(
                404,
                format!(
                    "Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}"
                ),
            )
        };
        if v.contains(&-1) {
            return not_found();
        }
        let c = RankCoords {
            dp: dp as u32,
            cp: cp as u32,
            tp: tp as u32,
            pp: pp as u32,
        };
        match self.rank(c) {
            Some(r) => {
                let sock = r.endpoint.as_str().parse::<std::net::SocketAddr>().ok();
                Response::json(
                    200,
                    &RankEndpoint {
                        rank_ip: sock.map(|s| s.ip().to_string()),
                        rank_port: sock.map(|s| s.port()),
                        endpoint: r.endpoint,
                        descriptor: r.descriptor,
                    },
                )
            }
            None => not_found(),
        }
    }
}

fn not_ready(registered: usize) -> Response {
    Response::text(
        503,
        format!("Prefill server not fully registered yet ({registered} workers registered)."),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_entries_expire_and_the_table_is_bounded() {
        let reg = Registry::with_room_limits(Duration::from_secs(120), 2);
        let t0 = Instant::now();
        let e = |room, dp| DpRankEntry {
            bootstrap_room: room,
            dp_rank: dp,
        };
        reg.register_room(e(1, 0), t0).unwrap();
        reg.register_room(e(2, 1), t0).unwrap();
        // Full of live entries: refused with 503.
        let full = reg
            .register_room(e(3, 0), t0 + Duration::from_secs(1))
            .unwrap_err();
        assert_eq!(full.status, 503);
        // Updating a known room is always allowed.
        reg.register_room(e(2, 0), t0 + Duration::from_secs(1))
            .unwrap();
        let later = t0 + Duration::from_millis(120_500);
        assert_eq!(reg.query_rooms(&[1, 2], later).len(), 1, "room 1 expired");
        // Expired entries make room.
        reg.register_room(e(3, 1), later).unwrap();
        reg.purge_rooms(t0 + Duration::from_secs(500));
        assert!(reg.query_rooms(&[1, 2, 3], later).is_empty());
    }
}
