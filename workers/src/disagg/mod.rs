//! Disaggregated prefill/decode on the simulated engine: the worker side of vLLM's
//! NixlConnector flow, on top of the [`crate::transfer`] agent.
//!
//! - **Prefill role**: the worker owns a KV block pool, a paged region registered with its
//!   agent (page = one block of `block_size * kv_bytes_per_token` real bytes). After a prefill
//!   leg (`do_remote_decode: true`) finishes, [`Disagg::publish_prefill`] fills pool pages
//!   with the prompt's blocks ([`kv::block_bytes`]), pins them (pool pages *and* the engine's
//!   cached blocks, through a [`PrefixHold`]) and returns the `kv_transfer_params` the decode
//!   leg needs. Pins end when the decode worker's `release:<id>` notification arrives or after
//!   `pin_timeout` (vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`), whichever is first.
//! - **Decode role**: [`Disagg::pull`] fetches and caches the prefill agent's metadata, reads
//!   the listed blocks by descriptor list (contiguous block ids coalesce into one descriptor),
//!   checks them (checksum, and that the first and last block belong to this prompt), tells
//!   the prefill worker to release, and installs the blocks in the engine as cached prefix
//!   blocks so the request that follows computes only the last partial block.
//! - [`params`]: `kv_transfer_params` (vLLM names) and SGLang bootstrap fields;
//! - [`kv`]: deterministic block bytes and checksums.

pub mod kv;
pub mod params;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use kvroute_proto::metadata::WorkerRole;
use parking_lot::Mutex;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use crate::sim::{EngineError, PrefixHold, SimEngine};
use crate::transfer::{
    Agent, AgentConfig, Backend, Descriptor, Memory, PagedRegion, TransferError,
};
pub use params::{Bootstrap, KvTransferParams};

/// The notification a decode worker sends when it is done with a prefill's blocks.
const RELEASE_PREFIX: &str = "release:";

/// Settings of the disaggregation layer.
#[derive(Debug, Clone)]
pub struct DisaggConfig {
    pub role: WorkerRole,
    /// Identifies this engine in `remote_engine_id` (unique per process start, so a restarted
    /// peer is noticed and its metadata fetched again).
    pub engine_id: String,
    pub block_size: u32,
    pub kv_bytes_per_token: u64,
    /// Pages of the prefill KV pool (blocks that can be pinned for transfer at once).
    pub pool_blocks: usize,
    pub pin_timeout: Duration,
    pub transfer_timeout: Duration,
    pub backend: Backend,
    /// Where a prefill worker's agent listens (port 0 = any free port).
    pub listen: SocketAddr,
    /// Host advertised in `remote_host` (default: the bound IP, or 127.0.0.1 for 0.0.0.0).
    pub advertise_host: Option<String>,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig {
            role: WorkerRole::Aggregated,
            engine_id: format!("kvroute-{}", uuid::Uuid::new_v4().simple()),
            block_size: 16,
            kv_bytes_per_token: 4096,
            pool_blocks: 16_384,
            pin_timeout: Duration::from_secs(60),
            transfer_timeout: Duration::from_secs(30),
            backend: Backend::Tcp,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise_host: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DisaggError {
    #[error("{0}")]
    BadParams(String),
    #[error("this worker (role {0}) cannot serve a prefill leg: it has no KV transfer listener")]
    NotPrefill(WorkerRole),
    #[error("KV transfer from the prefill worker failed: {0}")]
    Transfer(#[from] TransferError),
    #[error("KV transfer integrity check failed: {0}")]
    Integrity(String),
    #[error("KV transfer pool full: need {needed} blocks, {available} free")]
    PoolFull { needed: usize, available: usize },
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    #[error("KV transfer agent setup failed: {0}")]
    Setup(String),
}

impl DisaggError {
    /// The HTTP status a request failing this way gets: the prefill side or the transfer
    /// failing is a bad gateway (the sidecar may fall back to a local prefill).
    pub fn http_status(&self) -> StatusCode {
        match self {
            DisaggError::BadParams(_) | DisaggError::NotPrefill(_) => StatusCode::BAD_REQUEST,
            DisaggError::Transfer(_) | DisaggError::Integrity(_) => StatusCode::BAD_GATEWAY,
            DisaggError::PoolFull { .. } | DisaggError::Engine(_) | DisaggError::Setup(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }
}

/// Blocks pinned for one prefill until the decode worker releases them.
struct Pin {
    pages: Vec<usize>,
    _hold: Option<PrefixHold>,
    created: Instant,
}

/// The prefill worker's KV pool and its free pages.
struct Pool {
    region: Arc<PagedRegion>,
    free: Mutex<Vec<usize>>,
}

/// What a decode pull did.
#[derive(Debug)]
pub struct Pulled {
    /// Keeps the installed blocks referenced until the request is admitted and done.
    pub hold: Option<PrefixHold>,
    pub blocks: usize,
    pub tokens: usize,
    pub bytes: u64,
    /// xxh3-64 (hex) of the received bytes.
    pub checksum: String,
    pub elapsed: Duration,
}

struct DisaggMetrics {
    bytes: IntCounterVec,
    seconds: Histogram,
    tokens_received: IntCounter,
    transfers: IntCounterVec,
    pinned_blocks: IntGauge,
    pins_released: IntCounterVec,
}

impl DisaggMetrics {
    fn new(registry: &Registry) -> Result<DisaggMetrics, prometheus::Error> {
        let bytes = IntCounterVec::new(
            Opts::new(
                "kvroute_worker_kv_transfer_bytes_total",
                "KV bytes moved by the transfer agent (sent = served to decode workers, received = pulled from prefill workers).",
            ),
            &["direction"],
        )?;
        let seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_worker_kv_transfer_seconds",
                "Time a decode worker spent pulling one request's KV blocks (metadata, read, checks).",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ]),
        )?;
        let tokens_received = IntCounter::with_opts(Opts::new(
            "kvroute_worker_kv_tokens_received_total",
            "Prompt tokens whose KV a decode worker received instead of computing.",
        ))?;
        let transfers = IntCounterVec::new(
            Opts::new(
                "kvroute_worker_kv_transfers_total",
                "KV pulls by a decode worker, by result.",
            ),
            &["result"],
        )?;
        let pinned_blocks = IntGauge::with_opts(Opts::new(
            "kvroute_worker_kv_pinned_blocks",
            "Prefill KV blocks pinned for decode workers to pull.",
        ))?;
        let pins_released = IntCounterVec::new(
            Opts::new(
                "kvroute_worker_kv_pins_released_total",
                "Prefill pins released, by reason (notified by the decode worker, or timeout).",
            ),
            &["reason"],
        )?;
        for d in ["sent", "received"] {
            bytes.with_label_values(&[d]);
        }
        for r in ["ok", "error"] {
            transfers.with_label_values(&[r]);
        }
        for r in ["notified", "timeout"] {
            pins_released.with_label_values(&[r]);
        }
        registry.register(Box::new(bytes.clone()))?;
        registry.register(Box::new(seconds.clone()))?;
        registry.register(Box::new(tokens_received.clone()))?;
        registry.register(Box::new(transfers.clone()))?;
        registry.register(Box::new(pinned_blocks.clone()))?;
        registry.register(Box::new(pins_released.clone()))?;
        Ok(DisaggMetrics {
            bytes,
            seconds,
            tokens_received,
            transfers,
            pinned_blocks,
            pins_released,
        })
    }
}

/// The disaggregation layer of one worker.
pub struct Disagg {
    cfg: DisaggConfig,
    engine: SimEngine,
    agent: Agent,
    block_bytes: usize,
    /// Prefill role only.
    pool: Option<Pool>,
    advertised: Option<(String, u16)>,
    pins: Mutex<HashMap<String, Pin>>,
    /// Loaded remote agents: address → agent name.
    remotes: Mutex<HashMap<String, String>>,
    /// Blocks a decode worker received, by sequence hash (bounded, oldest dropped first).
    received: Mutex<(HashMap<u64, Bytes>, VecDeque<u64>)>,
    metrics: DisaggMetrics,
}

impl std::fmt::Debug for Disagg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disagg")
            .field("role", &self.cfg.role)
            .field("engine_id", &self.cfg.engine_id)
            .field("advertised", &self.advertised)
            .finish_non_exhaustive()
    }
}

impl Disagg {
    /// Creates the agent (falling back loudly from CUDA to TCP without a driver), and for the
    /// prefill role registers the KV pool, starts the listener, the release-notification
    /// handler and the pin-timeout sweeper. Call inside a tokio runtime.
    pub async fn start(
        cfg: DisaggConfig,
        engine: SimEngine,
        registry: &Registry,
    ) -> Result<Arc<Disagg>, DisaggError> {
        let agent_cfg = AgentConfig {
            io_timeout: cfg.transfer_timeout,
            ..AgentConfig::default()
        };
        let agent = match Agent::with_config(cfg.engine_id.clone(), cfg.backend, agent_cfg.clone())
        {
            Ok(a) => a,
            Err(TransferError::BackendUnavailable(reason)) => {
                tracing::error!(
                    reason,
                    "CUDA KV transfer backend requested but UNAVAILABLE: falling back to the TCP backend (host memory)"
                );
                Agent::with_config(cfg.engine_id.clone(), Backend::Tcp, agent_cfg)?
            }
            Err(e) => return Err(e.into()),
        };
        let block_bytes =
            (u64::from(cfg.block_size.max(1)) * cfg.kv_bytes_per_token.max(1)) as usize;
        let (pool, advertised) = if cfg.role == WorkerRole::Prefill {
            let region = Arc::new(PagedRegion::new(cfg.pool_blocks, block_bytes as u64));
            agent.register_memory(Memory::Paged(region.clone()));
            let bound = agent
                .listen(cfg.listen, cfg.advertise_host.as_deref())
                .await?;
            let host = match cfg.advertise_host.as_deref() {
                Some(h) if !h.is_empty() => h.to_string(),
                _ if bound.ip().is_unspecified() => "127.0.0.1".to_string(),
                _ => bound.ip().to_string(),
            };
            (
                Some(Pool {
                    region,
                    // Pop from the end: hand out low page numbers first.
                    free: Mutex::new((0..cfg.pool_blocks).rev().collect()),
                }),
                Some((host, bound.port())),
            )
        } else {
            (None, None)
        };
        let metrics =
            DisaggMetrics::new(registry).map_err(|e| DisaggError::Setup(e.to_string()))?;
        let notifs = agent.take_notifications();
        let d = Arc::new(Disagg {
            cfg,
            engine,
            agent,
            block_bytes,
            pool,
            advertised,
            pins: Mutex::new(HashMap::new()),
            remotes: Mutex::new(HashMap::new()),
            received: Mutex::new((HashMap::new(), VecDeque::new())),
            metrics,
        });
        if d.pool.is_some() {
            if let Some(rx) = notifs {
                tokio::spawn(notification_loop(Arc::downgrade(&d), rx));
            }
            tokio::spawn(sweep_loop(Arc::downgrade(&d)));
        }
        tracing::info!(
            role = %d.cfg.role,
            engine_id = d.cfg.engine_id,
            backend = d.agent.backend().as_str(),
            block_bytes,
            advertised = ?d.advertised,
            "KV transfer layer ready"
        );
        Ok(d)
    }

    pub fn role(&self) -> WorkerRole {
        self.cfg.role
    }

    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// host:port of this worker's agent (prefill role).
    pub fn advertised(&self) -> Option<(String, u16)> {
        self.advertised.clone()
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Requests whose blocks are pinned (prefill role).
    pub fn pinned_requests(&self) -> usize {
        self.pins.lock().len()
    }

    /// Pool pages pinned (prefill role).
    pub fn pinned_blocks(&self) -> usize {
        self.pins.lock().values().map(|p| p.pages.len()).sum()
    }

    /// Checksum (hex) of the received blocks with these sequence hashes, in order; `None` if
    /// any is not held.
    pub fn received_checksum(&self, hashes: &[u64]) -> Option<String> {
        let rx = self.received.lock();
        let mut c = kv::Checksum::new();
        for h in hashes {
            c.update(rx.0.get(h)?);
        }
        Some(c.hex())
    }

    /// Copies the agent's counters into the exported metrics (scrape time).
    pub fn refresh_metrics(&self) {
        let sent = self.agent.stats().bytes_served;
        let c = self.metrics.bytes.with_label_values(&["sent"]);
        if sent > c.get() {
            c.inc_by(sent - c.get());
        }
    }

    /// After a prefill leg: fills pool pages with the prompt's full blocks, pins them and
    /// returns the `kv_transfer_params` for the decode leg.
    pub fn publish_prefill(
        &self,
        request_id: &str,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
        dp_rank: u32,
    ) -> Result<KvTransferParams, DisaggError> {
        let (Some(pool), Some((host, port))) = (&self.pool, &self.advertised) else {
            return Err(DisaggError::NotPrefill(self.cfg.role));
        };
        let bs = self.cfg.block_size.max(1) as usize;
        let hashes = kv::prompt_block_hashes(tokens, bs, lora_name, cache_salt);
        let n = hashes.len();
        let pages: Vec<usize> = {
            let mut free = pool.free.lock();
            if free.len() < n {
                return Err(DisaggError::PoolFull {
                    needed: n,
                    available: free.len(),
                });
            }
            let at = free.len() - n;
            free.split_off(at).into_iter().rev().collect()
        };
        let mut checksum = kv::Checksum::new();
        for (i, (&h, &page)) in hashes.iter().zip(&pages).enumerate() {
            let data = kv::block_bytes(h, i, self.block_bytes);
            checksum.update(&data);
            if let Err(e) = pool.region.fill(page, data) {
                self.return_pages(&pages);
                return Err(e.into());
            }
        }
        // Pin the engine's cached blocks too, so the prefill worker's cache accounting shows
        // them in use until the decode worker has them.
        let hold = match self.engine.hold_prefix(
            dp_rank,
            lora_name.map(str::to_string),
            cache_salt.map(str::to_string),
            &tokens[..n * bs],
        ) {
            Ok(h) => Some(h),
            Err(e) => {
                tracing::warn!(request_id, error = %e, "could not pin the prefill's blocks in the engine; pool pages stay pinned");
                None
            }
        };
        let key = {
            let mut pins = self.pins.lock();
            let key = if pins.contains_key(request_id) || request_id.is_empty() {
                format!("{request_id}-{}", uuid::Uuid::new_v4().simple())
            } else {
                request_id.to_string()
            };
            pins.insert(
                key.clone(),
                Pin {
                    pages: pages.clone(),
                    _hold: hold,
                    created: Instant::now(),
                },
            );
            key
        };
        self.metrics.pinned_blocks.add(n as i64);
        tracing::debug!(
            request_id = key,
            blocks = n,
            "prefill blocks pinned for transfer"
        );
        Ok(KvTransferParams {
            do_remote_decode: false,
            do_remote_prefill: true,
            remote_engine_id: Some(self.cfg.engine_id.clone()),
            remote_block_ids: Some(pages.iter().map(|&p| p as u64).collect()),
            remote_host: Some(host.clone()),
            remote_port: Some(*port),
            remote_request_id: Some(key),
            tp_size: Some(1),
            kv_block_size: Some(self.cfg.block_size),
            kv_block_bytes: Some(self.block_bytes as u64),
            kv_num_tokens: Some((n * bs) as u32),
            kv_checksum: Some(checksum.hex()),
        })
    }

    fn return_pages(&self, pages: &[usize]) {
        if let Some(pool) = &self.pool {
            for &p in pages {
                pool.region.clear(p);
            }
            pool.free.lock().extend_from_slice(pages);
        }
    }

    /// Ends a pin: pages are cleared (later reads of them fail) and freed, the engine hold is
    /// dropped. False if no such pin.
    pub fn release(&self, key: &str, reason: &'static str) -> bool {
        let Some(pin) = self.pins.lock().remove(key) else {
            return false;
        };
        self.return_pages(&pin.pages);
        self.metrics.pinned_blocks.sub(pin.pages.len() as i64);
        self.metrics
            .pins_released
            .with_label_values(&[reason])
            .inc();
        tracing::debug!(
            request_id = key,
            reason,
            blocks = pin.pages.len(),
            "prefill pin released"
        );
        true
    }

    fn sweep(&self) {
        let timeout = self.cfg.pin_timeout;
        let expired: Vec<String> = self
            .pins
            .lock()
            .iter()
            .filter(|(_, p)| p.created.elapsed() >= timeout)
            .map(|(k, _)| k.clone())
            .collect();
        for k in expired {
            if self.release(&k, "timeout") {
                tracing::warn!(
                    request_id = k,
                    ?timeout,
                    "prefill blocks were never pulled; pin expired"
                );
            }
        }
    }

    /// The name of the loaded agent at `addr`, fetching its metadata when unknown or when
    /// the peer's engine id changed (restart).
    async fn remote_agent(
        &self,
        addr: &str,
        engine_id: Option<&str>,
    ) -> Result<String, DisaggError> {
        let cached = self.remotes.lock().get(addr).cloned();
        if let Some(name) = cached {
            if engine_id.is_none_or(|e| e == name) {
                return Ok(name);
            }
            self.agent.invalidate_remote(&name);
        }
        let md = self.agent.fetch_metadata(addr).await?;
        if let Some(e) = engine_id {
            if md.name != e {
                return Err(DisaggError::Integrity(format!(
                    "the agent at {addr} is {:?}, not the prefill engine {e:?} (restarted?)",
                    md.name
                )));
            }
        }
        // The address the peer is reached at is the one we used, whatever it advertises.
        let mut md = md;
        md.address = addr.to_string();
        let name = self.agent.load_remote(md)?;
        self.remotes.lock().insert(addr.to_string(), name.clone());
        Ok(name)
    }

    /// The decode leg's pull; see the module doc. On success the blocks are installed in the
    /// engine on `dp_rank` (held by the returned [`Pulled::hold`]).
    pub async fn pull(
        &self,
        params: &KvTransferParams,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
        dp_rank: u32,
    ) -> Result<Pulled, DisaggError> {
        let t0 = Instant::now();
        let r = self
            .pull_inner(params, tokens, lora_name, cache_salt, dp_rank, t0)
            .await;
        let result = if r.is_ok() { "ok" } else { "error" };
        self.metrics.transfers.with_label_values(&[result]).inc();
        r
    }

    async fn pull_inner(
        &self,
        params: &KvTransferParams,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
        dp_rank: u32,
        t0: Instant,
    ) -> Result<Pulled, DisaggError> {
        let bs = self.cfg.block_size.max(1) as usize;
        let bad = |m: String| Err(DisaggError::BadParams(m));
        if let Some(b) = params.kv_block_size.filter(|&b| b != self.cfg.block_size) {
            return bad(format!(
                "prefill block size {b} differs from this worker's {}",
                self.cfg.block_size
            ));
        }
        if let Some(b) = params
            .kv_block_bytes
            .filter(|&b| b != self.block_bytes as u64)
        {
            return bad(format!(
                "prefill block bytes {b} differ from this worker's {} (mismatched KV cache settings)",
                self.block_bytes
            ));
        }
        let ids = params.remote_block_ids.as_deref().unwrap_or(&[]);
        let n = ids.len();
        if n * bs > tokens.len() {
            return bad(format!(
                "{n} remote blocks cover {} tokens but the prompt has {} (different prompt?)",
                n * bs,
                tokens.len()
            ));
        }
        let addr = params.remote_addr().ok_or_else(|| {
            DisaggError::BadParams("kv_transfer_params needs remote_host and remote_port".into())
        })?;
        let remote = self
            .remote_agent(&addr, params.remote_engine_id.as_deref())
            .await?;
        let mut checksum = kv::Checksum::new();
        let mut bytes = 0u64;
        if n > 0 {
            let md = self
                .agent
                .remote(&remote)
                .ok_or_else(|| TransferError::UnknownRemote(remote.clone()))?;
            let pool = md
                .regions
                .iter()
                .find(|r| r.page_len == self.block_bytes as u64)
                .ok_or_else(|| {
                    DisaggError::Integrity(format!(
                        "agent {remote} has no KV pool with {}-byte blocks",
                        self.block_bytes
                    ))
                })?;
            let descriptors: Vec<Descriptor> = ids
                .iter()
                .map(|&id| Descriptor {
                    region: pool.id,
                    offset: id.saturating_mul(pool.page_len),
                    len: pool.page_len,
                })
                .collect();
            let dst = vec![0u8; n * self.block_bytes];
            let outcome = match self.agent.cuda() {
                Some(dev) => {
                    // CUDA backend: the blocks land in device memory through host staging.
                    let region = dev.alloc(dst.len())?;
                    self.agent
                        .read_into_device(&remote, &descriptors, &region, 0)
                        .await?
                }
                None => self.agent.read(&remote, &descriptors, dst)?.wait().await?,
            };
            bytes = outcome.bytes;
            checksum.update(&outcome.data);
            let hashes = kv::prompt_block_hashes(&tokens[..n * bs], bs, lora_name, cache_salt);
            let data = Bytes::from(outcome.data);
            // The first and last blocks must be this prompt's: catches a decode leg whose
            // prompt (or model / tokenizer) differs from the prefill leg's.
            for i in [0, n - 1] {
                let got = data.slice(i * self.block_bytes..(i + 1) * self.block_bytes);
                if got != kv::block_bytes(hashes[i], i, self.block_bytes) {
                    return Err(DisaggError::Integrity(format!(
                        "block {i} pulled from {remote} does not belong to this prompt"
                    )));
                }
            }
            if let Some(want) = &params.kv_checksum {
                if *want != checksum.hex() {
                    return Err(DisaggError::Integrity(format!(
                        "checksum {} of the pulled blocks differs from the prefill's {want}",
                        checksum.hex()
                    )));
                }
            }
            self.keep_received(&hashes, &data);
        }
        if let Some(key) = &params.remote_request_id {
            let msg = format!("{RELEASE_PREFIX}{key}");
            if let Err(e) = self.agent.notify(&remote, msg.as_bytes()).await {
                tracing::warn!(request_id = key, error = %e, "could not notify the prefill worker; its pin will time out");
            }
        }
        let hold = if n > 0 {
            match self.engine.hold_prefix(
                dp_rank,
                lora_name.map(str::to_string),
                cache_salt.map(str::to_string),
                &tokens[..n * bs],
            ) {
                Ok(h) => Some(h),
                Err(e) => {
                    tracing::warn!(error = %e, "could not install the pulled blocks; the prompt will be recomputed");
                    None
                }
            }
        } else {
            None
        };
        let elapsed = t0.elapsed();
        self.metrics.seconds.observe(elapsed.as_secs_f64());
        self.metrics
            .bytes
            .with_label_values(&["received"])
            .inc_by(bytes);
        if hold.is_some() {
            self.metrics.tokens_received.inc_by((n * bs) as u64);
        }
        tracing::debug!(remote, blocks = n, bytes, ?elapsed, "KV blocks pulled");
        Ok(Pulled {
            hold,
            blocks: n,
            tokens: n * bs,
            bytes,
            checksum: checksum.hex(),
            elapsed,
        })
    }

    fn keep_received(&self, hashes: &[u64], data: &Bytes) {
        let cap = self.cfg.pool_blocks.max(1);
        let mut rx = self.received.lock();
        let (map, order) = &mut *rx;
        for (i, &h) in hashes.iter().enumerate() {
            let block = data.slice(i * self.block_bytes..(i + 1) * self.block_bytes);
            if map.insert(h, block).is_none() {
                order.push_back(h);
            }
        }
        while order.len() > cap {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }
}

async fn notification_loop(
    d: Weak<Disagg>,
    mut rx: tokio::sync::mpsc::Receiver<crate::transfer::Notification>,
) {
    while let Some(n) = rx.recv().await {
        let Some(d) = d.upgrade() else { return };
        let msg = String::from_utf8_lossy(&n.message);
        match msg.strip_prefix(RELEASE_PREFIX) {
            Some(key) => {
                if !d.release(key, "notified") {
                    tracing::debug!(
                        request_id = key,
                        from = n.from,
                        "release for an unknown (expired?) pin"
                    );
                }
            }
            None => tracing::warn!(from = n.from, message = %msg, "unknown KV agent notification"),
        }
    }
}

async fn sweep_loop(d: Weak<Disagg>) {
    let period = match d.upgrade() {
        Some(d) => (d.cfg.pin_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(5)),
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(d) = d.upgrade() else { return };
        d.sweep();
    }
}
