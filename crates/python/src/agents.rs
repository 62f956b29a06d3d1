//! The coordinator from Python: `PrefillAgent`, `DecodeAgent` (one request's lifecycle per
//! room, SGLang's `KVPoll` states) and `BootstrapServer`, thin wrappers over
//! `kvbridge_coordinator`.
//!
//! Across processes each agent talks over its own `NetChannel` (TCP on 127.0.0.1 unless told
//! otherwise), prefill ranks publish themselves to a `BootstrapServer` (HTTP), and a decode
//! resolves a request's `bootstrap_addr` through `HttpDirectory`; KV bytes move through the
//! agent's `Engine`. Waits detach the interpreter like the engine's.

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use kvbridge_coordinator::bootstrap::{
    BootstrapClient, BootstrapConfig, BootstrapServer as RustBootstrapServer, ClientConfig,
    HttpDirectory, RankRegistration,
};
use kvbridge_coordinator::net_channel::{NetChannel, NetChannelConfig};
use kvbridge_coordinator::{
    Chunk, CoordinatorError, DecodeAgent as RustDecodeAgent, DecodeConfig, EntryRegion, KvMemory,
    PrefillAgent as RustPrefillAgent, PrefillConfig, ReceiveRequest, RoomState,
};
use kvbridge_handshake::PeerDescriptor;
use kvbridge_transport::RegionId;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{IntoPyDict, PyDict, PyTuple};

use crate::engine::{Engine, Memory, block_on, runtime, seconds, wait_for};
use crate::errors::{self, Kind, invalid};

static KVPOLL: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `kvbridge.KVPoll`: an `IntEnum` with SGLang's names and values.
fn kvpoll(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    KVPOLL
        .get_or_try_init(py, || {
            let members = PyDict::new(py);
            for s in RoomState::ALL {
                members.set_item(s.as_str(), s as u8)?;
            }
            let enum_ = py.import("enum")?.getattr("IntEnum")?.call(
                ("KVPoll", members),
                Some(&[("module", "kvbridge")].into_py_dict(py)?),
            )?;
            Ok::<_, PyErr>(enum_.unbind())
        })
        .map(|c| c.bind(py))
}

fn poll_value<'py>(py: Python<'py>, state: RoomState) -> PyResult<Bound<'py, PyAny>> {
    kvpoll(py)?.call1((state as u8,))
}

/// A peer descriptor from Python: its JSON text, a dict in the JSON shape, or an object with
/// `to_json()` / `to_dict()` (a `kvbridge.PeerDescriptor`).
fn descriptor(obj: &Bound<'_, PyAny>) -> PyResult<PeerDescriptor> {
    let py = obj.py();
    let text: String = if let Ok(s) = obj.extract::<String>() {
        s
    } else if obj.hasattr("to_json")? {
        obj.call_method0("to_json")?.extract()?
    } else {
        let value = if obj.hasattr("to_dict")? {
            obj.call_method0("to_dict")?
        } else {
            obj.clone()
        };
        py.import("json")?
            .call_method1("dumps", (value,))
            .map_err(|e| {
                invalid(format!(
                    "descriptor must be a PeerDescriptor, its JSON text or a dict in the JSON \
                     shape: {e}"
                ))
            })?
            .extract()?
    };
    PeerDescriptor::from_str(&text).map_err(|e| invalid(format!("bad peer descriptor: {e}")))
}

/// One KV entry or aux buffer: a `Memory` (whole), a region id the engine registered (whole),
/// or a `(region, offset, len)` tuple.
fn entry(engine: &Engine, item: &Bound<'_, PyAny>) -> PyResult<EntryRegion> {
    if let Ok(m) = item.cast::<Memory>() {
        let m = m.get();
        return Ok(EntryRegion::whole(RegionId(m.region()), m.nbytes() as u64));
    }
    if let Ok(id) = item.extract::<u64>() {
        let len = engine.core().region_len(RegionId(id)).ok_or_else(|| {
            Kind::UnknownRegion.err(format!(
                "region {id} was not registered with this engine; pass a region id that its \
                 register / register_buffer / allocate returned"
            ))
        })?;
        return Ok(EntryRegion::whole(RegionId(id), len));
    }
    if let Ok((region, offset, len)) = item.extract::<(u64, u64, u64)>() {
        return Ok(EntryRegion {
            region: RegionId(region),
            offset,
            len,
        });
    }
    Err(invalid(
        "each KV entry / aux buffer must be a kvbridge.Memory, a registered region id, or a \
         (region, offset, len) tuple of non-negative ints",
    ))
}

fn memory(engine: &Engine, kv: &Bound<'_, PyAny>, aux: &Bound<'_, PyAny>) -> PyResult<KvMemory> {
    let list = |obj: &Bound<'_, PyAny>| -> PyResult<Vec<EntryRegion>> {
        obj.try_iter()?.map(|i| entry(engine, &i?)).collect()
    };
    Ok(KvMemory {
        kv: list(kv)?,
        aux: list(aux)?,
    })
}

/// Page ids from any int sequence or numpy integer array; negative ids are refused.
fn pages(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let list = if obj.hasattr("tolist")? {
        obj.call_method0("tolist")?
    } else {
        obj.clone()
    };
    let values: Vec<i128> = list
        .extract()
        .map_err(|_| invalid("page ids must be a sequence or 1-D numpy array of ints"))?;
    values
        .into_iter()
        .map(|v| {
            u64::try_from(v)
                .map_err(|_| invalid(format!("page ids must be between 0 and 2**64-1, got {v}")))
        })
        .collect()
}

/// The bootstrap client settings for `secret` (the registry proves it when one is set).
fn client_config(secret: Option<&[u8]>) -> ClientConfig {
    let c = ClientConfig::default();
    match secret {
        Some(s) => c.with_secret(s),
        None => c,
    }
}

/// The control channel's settings: `bind` its listening `ip:port` (default 127.0.0.1:0, one
/// host only), `advertise` the IP it names to peers (needed when binding 0.0.0.0).
fn net_config(
    secret: Option<Vec<u8>>,
    bind: Option<&str>,
    advertise: Option<&str>,
) -> PyResult<NetChannelConfig> {
    let mut c = NetChannelConfig::default();
    if let Some(addr) = bind {
        let addr: SocketAddr = addr.parse().map_err(|e| {
            invalid(format!(
                "bind must be the control channel's ip:port such as 10.0.0.5:0 (port 0: any \
                 free one), got {addr:?}: {e}"
            ))
        })?;
        c = c.with_bind_addr(addr);
    }
    if let Some(ip) = crate::engine::advertise_ip(advertise)? {
        c = c.with_advertise_addr(ip);
    }
    Ok(match secret {
        Some(s) => c.with_secret(s),
        None => c,
    })
}

fn set(d: &mut Duration, v: Option<Duration>) {
    if let Some(v) = v {
        *d = v;
    }
}

/// A room's wait from Python: Success returns the state, Failed raises `KVTransferError`,
/// a timeout returns the (non-final) state at that moment.
fn wait_room<F>(
    py: Python<'_>,
    timeout: Option<f64>,
    fut: F,
    poll: impl Fn() -> Result<RoomState, CoordinatorError>,
) -> PyResult<Bound<'_, PyAny>>
where
    F: std::future::Future<Output = Result<(), CoordinatorError>> + Send,
{
    let limit = seconds("timeout", timeout)?;
    match wait_for(py, limit, fut)? {
        Some(Ok(())) => poll_value(py, RoomState::Success),
        Some(Err(e)) => Err(errors::coordinator(e)),
        None => poll_value(py, poll().map_err(errors::coordinator)?),
    }
}

fn metrics_dict<'py>(
    py: Python<'py>,
    m: &kvbridge_coordinator::MetricsSnapshot,
) -> PyResult<Bound<'py, PyAny>> {
    let json = serde_json::to_string(m).map_err(|e| Kind::Base.err(e.to_string()))?;
    py.import("json")?.call_method1("loads", (json,))
}

/// The methods both agents share (room state, abort, metrics, lifecycle), added to the
/// class's own methods in one `#[pymethods]` block, and its `Drop`.
macro_rules! agent_methods {
    ($class:ident, $($own:tt)*) => {
        #[pymethods]
        impl $class {
            $($own)*

            /// This rank's control endpoint.
            #[getter]
            fn endpoint(&self) -> String {
                self.agent.endpoint().0
            }

            /// The room's state (`KVPoll`).
            fn poll<'py>(&self, py: Python<'py>, room: u64) -> PyResult<Bound<'py, PyAny>> {
                poll_value(py, self.agent.poll(room).map_err(errors::coordinator)?)
            }

            /// Why the room failed (SGLang's `KVTransferError` text), or None.
            fn failure(&self, room: u64) -> Option<String> {
                self.agent.failure(room).map(|e| e.to_string())
            }

            /// Waits until the room ends: returns `KVPoll.Success`, raises `KVTransferError` if
            /// it failed, or returns the current state if `timeout` seconds pass first.
            #[pyo3(signature = (room, timeout=None))]
            fn wait<'py>(
                &self,
                py: Python<'py>,
                room: u64,
                timeout: Option<f64>,
            ) -> PyResult<Bound<'py, PyAny>> {
                let agent = self.agent.clone();
                wait_room(py, timeout, async move { agent.wait(room).await }, || {
                    self.agent.poll(room)
                })
            }

            /// Fails the room (a decode also tells its prefill peers to stop writing).
            fn abort(&self, room: u64) {
                let _rt = runtime().map(|rt| rt.enter());
                self.agent.abort(room);
            }

            /// Forgets a finished room.
            fn clear(&self, room: u64) {
                self.agent.clear(room);
            }

            /// Counters and the latency histogram, as a dict.
            fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
                metrics_dict(py, &self.agent.metrics())
            }

            /// Stops the agent (rooms in flight fail).
            fn close(&self) {
                let _rt = runtime().map(|rt| rt.enter());
                self.agent.shutdown();
            }

            fn __enter__(slf: Py<Self>) -> Py<Self> {
                slf
            }

            #[pyo3(signature = (*_exc))]
            fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> bool {
                self.close();
                false
            }
        }

        impl Drop for $class {
            fn drop(&mut self) {
                let _rt = runtime().map(|rt| rt.enter());
                self.agent.shutdown();
            }
        }
    };
}

/// The bootstrap registry prefill ranks publish themselves to (SGLang's bootstrap server):
/// HTTP on `host:port` (port 0: any free port). Run one per prefill deployment.
#[pyclass(module = "kvbridge", frozen)]
pub(crate) struct BootstrapServer {
    server: RustBootstrapServer,
}

#[pymethods]
impl BootstrapServer {
    /// With `secret`, every registration and query must prove it (the agents' `secret`).
    /// `advertise`: the IP that `addr` names when `host` is 0.0.0.0 (this host's address on
    /// the network the decode servers reach).
    #[new]
    #[pyo3(signature = (host="127.0.0.1", port=0, *, secret=None, advertise=None))]
    fn new(
        py: Python<'_>,
        host: &str,
        port: u16,
        secret: Option<Vec<u8>>,
        advertise: Option<&str>,
    ) -> PyResult<Self> {
        let ip = host.parse().map_err(|e| {
            invalid(format!(
                "host must be an IP address such as 127.0.0.1, got {host:?}: {e}"
            ))
        })?;
        let mut config = BootstrapConfig::default().with_bind_addr(SocketAddr::new(ip, port));
        if let Some(ip) = crate::engine::advertise_ip(advertise)? {
            config = config.with_advertise_addr(ip);
        }
        if let Some(s) = secret {
            config = config.with_secret(s);
        }
        let server = block_on(py, async move { RustBootstrapServer::bind(config).await })?
            .map_err(|e| errors::coordinator(e.into()))?;
        Ok(Self { server })
    }

    /// `host:port`, what requests carry as their `bootstrap_addr`.
    #[getter]
    fn addr(&self) -> String {
        self.server.bootstrap_addr()
    }

    /// Stops serving.
    fn close(&self) {
        self.server.shutdown();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close();
        false
    }
}

/// A prefill rank's agent: rooms, chunks, SGLang's poll states. See `docs/python.md`.
#[pyclass(module = "kvbridge", frozen)]
pub(crate) struct PrefillAgent {
    agent: RustPrefillAgent,
}

agent_methods! { PrefillAgent,
    /// Starts the agent for `engine`'s rank: `descriptor` is its `PeerDescriptor` (role
    /// prefill), `kv` one entry per KV item (`kv_item_lens` order), `aux` one per aux buffer;
    /// it registers itself with the `BootstrapServer` at `bootstrap_addr`. Timeouts are seconds
    /// (defaults: SGLang's). `bind` is the control channel's `ip:port` (default 127.0.0.1:0,
    /// one host only) and `advertise` the IP it names to decode ranks (when binding 0.0.0.0).
    #[new]
    #[pyo3(signature = (engine, descriptor, kv, aux=None, *, bootstrap_addr, secret=None,
                        bootstrap_timeout=None, waiting_timeout=None, batch_timeout=None,
                        bind=None, advertise=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine: &Engine,
        descriptor: &Bound<'_, PyAny>,
        kv: &Bound<'_, PyAny>,
        aux: Option<&Bound<'_, PyAny>>,
        bootstrap_addr: String,
        secret: Option<Vec<u8>>,
        bootstrap_timeout: Option<f64>,
        waiting_timeout: Option<f64>,
        batch_timeout: Option<f64>,
        bind: Option<&str>,
        advertise: Option<&str>,
    ) -> PyResult<Self> {
        let net = net_config(secret.clone(), bind, advertise)?;
        let desc = self::descriptor(descriptor)?;
        let empty = PyTuple::empty(py).into_any();
        let mem = memory(engine, kv, aux.unwrap_or(&empty))?;
        let mut config = PrefillConfig::default();
        set(
            &mut config.bootstrap_timeout,
            seconds("bootstrap_timeout", bootstrap_timeout)?,
        );
        set(
            &mut config.waiting_timeout,
            seconds("waiting_timeout", waiting_timeout)?,
        );
        set(
            &mut config.batch_timeout,
            seconds("batch_timeout", batch_timeout)?,
        );
        let transport = engine.core().transport.clone();
        let client = BootstrapClient::with_config(bootstrap_addr, client_config(secret.as_deref()));
        let agent = block_on(py, async move {
            let channel = NetChannel::bind(net).await?;
            let agent = RustPrefillAgent::builder(desc, mem, transport, Arc::new(channel))
                .config(config)
                .start()?;
            let registered = client
                .register(&RankRegistration::from(agent.rank_info()))
                .await;
            if let Err(e) = registered {
                agent.shutdown();
                return Err(e.into());
            }
            Ok(agent)
        })?
        .map_err(errors::coordinator)?;
        Ok(Self { agent })
    }

    /// Creates a room (Bootstrapping) for a request; the decode's metadata completes it.
    /// `traceparent` (W3C text) parents the room's spans to the engine's request span (the
    /// decode ranks' room spans become links); without it they join the first decode rank's.
    #[pyo3(signature = (room, *, traceparent=None))]
    fn create_room(&self, room: u64, traceparent: Option<&str>) -> PyResult<()> {
        let parent = crate::telemetry::traceparent(traceparent)?;
        let _rt = runtime()?.enter();
        match &parent {
            Some(tp) => self.agent.create_room_with_parent(room, tp),
            None => self.agent.create_room(room),
        }
        .map_err(errors::coordinator)
    }

    /// Waits until every decode rank of the room sent its metadata; returns the prefix (tokens)
    /// the decode already holds, from which the chunks start. Raises on failure, and
    /// `TimedOutError` if `timeout` seconds pass first (the room goes on).
    #[pyo3(signature = (room, timeout=None))]
    fn wait_ready(&self, py: Python<'_>, room: u64, timeout: Option<f64>) -> PyResult<u64> {
        let limit = seconds("timeout", timeout)?;
        let agent = self.agent.clone();
        match wait_for(py, limit, async move { agent.wait_ready(room).await })? {
            Some(r) => r.map_err(errors::coordinator),
            None => Err(Kind::TimedOut.err(format!(
                "room {room} was not ready after {timeout:?} s (no metadata from every decode \
                 rank yet); wait again, or check that the decode called receive() with this \
                 prefill's bootstrap address"
            ))),
        }
    }

    /// Sends one chunk: `pages` are prefill page ids, `num_kv_tokens` its tokens; the last
    /// chunk (`last=True`) carries the prefill's aux row. `layers=(start, end)` sends KV
    /// entries `start..end` of the chunk only: a chunk sent layer by layer is handed over
    /// in order, every part with the same pages and tokens, and the part that reaches the
    /// last entry completes it. Returns once the chunk's batches are queued.
    #[pyo3(signature = (room, pages, num_kv_tokens, *, last=false, aux_index=None, layers=None))]
    #[allow(clippy::too_many_arguments)]
    fn send_chunk(
        &self,
        py: Python<'_>,
        room: u64,
        pages: &Bound<'_, PyAny>,
        num_kv_tokens: u64,
        last: bool,
        aux_index: Option<u64>,
        layers: Option<(usize, usize)>,
    ) -> PyResult<()> {
        let pages = self::pages(pages)?;
        let mut chunk = if last {
            Chunk::last(pages, num_kv_tokens, aux_index)
        } else {
            Chunk::new(pages, num_kv_tokens)
        };
        if let Some((start, end)) = layers {
            chunk = chunk.for_layers(start..end);
        }
        let agent = self.agent.clone();
        block_on(py, async move { agent.send_chunk(room, chunk).await })?
            .map_err(errors::coordinator)
    }

    /// Sends the room's whole KV as its last chunk the moment every decode rank's metadata
    /// has come, without waiting for the caller: `pages` are the request's prefill page ids
    /// from token 0, each holding `page_tokens` tokens (the page size times the DCP size),
    /// and `num_kv_tokens` its tokens; what the decode holds already (its prefix) is skipped.
    /// Returns at once. A room that fails or is cleared first is left as it is; a send that
    /// fails aborts the room, with the reason in kvbridge's log (`KVBRIDGE_LOG`).
    #[pyo3(signature = (room, pages, num_kv_tokens, page_tokens, *, aux_index=None))]
    fn send_when_ready(
        &self,
        room: u64,
        pages: &Bound<'_, PyAny>,
        num_kv_tokens: u64,
        page_tokens: u64,
        aux_index: Option<u64>,
    ) -> PyResult<()> {
        let pages = self::pages(pages)?;
        if page_tokens == 0 {
            return Err(invalid(
                "page_tokens is 0; pass the tokens one prefill page id holds (page size x DCP size)",
            ));
        }
        let held = (pages.len() as u64).saturating_mul(page_tokens);
        if held < num_kv_tokens {
            return Err(invalid(format!(
                "{} pages of {page_tokens} tokens hold {held} tokens, fewer than num_kv_tokens \
                 {num_kv_tokens}; pass the request's whole page table from token 0",
                pages.len()
            )));
        }
        let agent = self.agent.clone();
        runtime()?.spawn(async move {
            let Ok(prefix) = agent.wait_ready(room).await else {
                return; // failed or cleared first: its poll says why
            };
            let first = usize::try_from(prefix / page_tokens).unwrap_or(usize::MAX);
            let rest = pages.get(first..).map(<[u64]>::to_vec).unwrap_or_default();
            let chunk = Chunk::last(rest, num_kv_tokens.saturating_sub(prefix), aux_index);
            if let Err(e) = agent.send_chunk(room, chunk).await {
                tracing::warn!(%room, error = %e, "send_when_ready: the room's KV was not sent; room aborted");
                agent.abort(room);
            }
        });
        Ok(())
    }

}

/// A decode rank's agent: asks prefill ranks for a room's KV and reports SGLang's poll states.
#[pyclass(module = "kvbridge", frozen)]
pub(crate) struct DecodeAgent {
    agent: RustDecodeAgent,
}

agent_methods! { DecodeAgent,
    /// Starts the agent for `engine`'s rank (`descriptor` of role decode, `kv`/`aux` as for
    /// `PrefillAgent`). Timeouts and the heartbeat are seconds (defaults: SGLang's;
    /// `control_send_timeout` bounds each control message to a prefill, SGLang's 1 s). `bind`
    /// and `advertise` as for `PrefillAgent`: prefill ranks send to this control channel.
    #[new]
    #[pyo3(signature = (engine, descriptor, kv, aux=None, *, secret=None,
                        bootstrap_timeout=None, waiting_timeout=None, heartbeat_interval=None,
                        fence_timeout=None, control_send_timeout=None, bind=None,
                        advertise=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine: &Engine,
        descriptor: &Bound<'_, PyAny>,
        kv: &Bound<'_, PyAny>,
        aux: Option<&Bound<'_, PyAny>>,
        secret: Option<Vec<u8>>,
        bootstrap_timeout: Option<f64>,
        waiting_timeout: Option<f64>,
        heartbeat_interval: Option<f64>,
        fence_timeout: Option<f64>,
        control_send_timeout: Option<f64>,
        bind: Option<&str>,
        advertise: Option<&str>,
    ) -> PyResult<Self> {
        let net = net_config(secret.clone(), bind, advertise)?;
        let desc = self::descriptor(descriptor)?;
        let empty = PyTuple::empty(py).into_any();
        let mem = memory(engine, kv, aux.unwrap_or(&empty))?;
        let mut config = DecodeConfig::default();
        set(
            &mut config.bootstrap_timeout,
            seconds("bootstrap_timeout", bootstrap_timeout)?,
        );
        set(
            &mut config.waiting_timeout,
            seconds("waiting_timeout", waiting_timeout)?,
        );
        set(
            &mut config.heartbeat_interval,
            seconds("heartbeat_interval", heartbeat_interval)?,
        );
        set(
            &mut config.fence_timeout,
            seconds("fence_timeout", fence_timeout)?,
        );
        set(
            &mut config.control_send_timeout,
            seconds("control_send_timeout", control_send_timeout)?,
        );
        let transport = engine.core().transport.clone();
        let directory = HttpDirectory::new().with_client_config(client_config(secret.as_deref()));
        let agent = block_on(py, async move {
            let channel = NetChannel::bind(net).await?;
            RustDecodeAgent::builder(
                desc,
                mem,
                transport,
                Arc::new(channel),
                Arc::new(directory),
            )
            .config(config)
            .start()
        })?
        .map_err(errors::coordinator)?;
        Ok(Self { agent })
    }

    /// Tokens of a virtual page (`page_size · dcp_size`): cached prefixes are rounded down to it.
    #[getter]
    fn virtual_page_size(&self) -> u64 {
        self.agent.virtual_page_size()
    }

    /// Starts receiving a room from the prefill deployment at `bootstrap_addr`: `page_table`
    /// holds the request's decode page ids from token 0, `cached_prefix_len` the tokens already
    /// held, `aux_index` the decode's aux row. `traceparent` (W3C text) parents the room's
    /// spans to the engine's request span.
    #[pyo3(signature = (room, bootstrap_addr, page_table, cached_prefix_len=0, aux_index=0, *,
                        traceparent=None))]
    #[allow(clippy::too_many_arguments)]
    fn receive(
        &self,
        room: u64,
        bootstrap_addr: String,
        page_table: &Bound<'_, PyAny>,
        cached_prefix_len: u64,
        aux_index: u64,
        traceparent: Option<&str>,
    ) -> PyResult<()> {
        let parent = crate::telemetry::traceparent(traceparent)?;
        let request = ReceiveRequest {
            bootstrap_addr,
            page_table: pages(page_table)?,
            cached_prefix_len,
            aux_index,
        };
        let _rt = runtime()?.enter();
        match &parent {
            Some(tp) => self.agent.receive_with_parent(room, request, tp),
            None => self.agent.receive(room, request),
        }
        .map_err(errors::coordinator)
    }

    /// Seconds from the room's metadata sent to its prefill ranks to their Success (the
    /// transfer as this rank sees it, and what the prefill waited for after the metadata
    /// came; not the registration before it). None until it succeeded.
    fn transfer_time(&self, room: u64) -> Option<f64> {
        self.agent.transfer_time(room).map(|d| d.as_secs_f64())
    }

    /// Whether every prefill peer confirmed it stopped writing a failed room's pages.
    fn is_fenced(&self, room: u64) -> PyResult<bool> {
        self.agent.is_fenced(room).map_err(errors::coordinator)
    }

    /// Waits until a failed room's pages may be reused (every sender acknowledged the abort);
    /// returns the endpoints that acknowledged. Raises `TimedOutError` after `fence_timeout`.
    fn release_when_fenced(&self, py: Python<'_>, room: u64) -> PyResult<Vec<String>> {
        let agent = self.agent.clone();
        let report = wait_for(py, None, async move { agent.release_when_fenced(room).await })?
            .ok_or_else(|| Kind::Base.err("release_when_fenced ended without an answer"))?
            .map_err(errors::coordinator)?;
        Ok(report.acked_by.into_iter().map(|e| e.0).collect())
    }

}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("KVPoll", kvpoll(m.py())?)?;
    m.add_class::<BootstrapServer>()?;
    m.add_class::<PrefillAgent>()?;
    m.add_class::<DecodeAgent>()?;
    Ok(())
}
