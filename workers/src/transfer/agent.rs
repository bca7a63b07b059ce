//! The NIXL-shaped KV transfer agent: memory registration, metadata exchange, descriptor-list
//! reads with completion handles, notifications, and the TCP server that serves them.
//!
//! Lifecycle, as in NIXL: each side creates an [`Agent`]; the target registers memory
//! ([`Agent::register_memory`]) and listens; the initiator fetches the target's
//! [`AgentMetadata`] ([`Agent::fetch_metadata`], the side-channel handshake) and loads it
//! ([`Agent::load_remote`]); it then posts reads by descriptor list ([`Agent::read`]), waits
//! for their completion ([`Transfer::wait`]) and tells the target it is done with a
//! notification ([`Agent::notify`]); the target drains notifications
//! ([`Agent::take_notifications`]) and releases what it pinned.
//!
//! Efficiency choices (the transfer is on the TTFT critical path): one request frame carries
//! the whole descriptor list, adjacent descriptors are coalesced before sending, the target
//! answers with one header plus the raw bytes gathered with vectored writes straight out of the
//! registered memory (no copy on the target), and the initiator reads straight into its
//! destination buffer (no copy on the initiator). Connections are pooled per peer and use
//! `TCP_NODELAY` so the small control frames never wait for Nagle.

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::cuda::{CudaDevice, DeviceRegion};
use super::frame::{read_frame, Frame, MAX_FRAME_LEN};
use super::TransferError;

/// Largest single read a target serves (a bound on what one request can make it send).
pub const MAX_READ_BYTES: u64 = 64 << 30;

/// Idle connections kept per peer.
const POOL_PER_PEER: usize = 8;

/// Which data path the agent uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Host memory over TCP.
    Tcp,
    /// Device memory (CUDA, through cudarc), staged through host buffers for the TCP hop.
    Cuda,
}

impl Backend {
    pub fn as_str(&self) -> &'static str {
        match self {
            Backend::Tcp => "tcp",
            Backend::Cuda => "cuda",
        }
    }
}

/// A byte range of a registered region of a remote (or local) agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Descriptor {
    pub region: u64,
    pub offset: u64,
    pub len: u64,
}

/// A registered region as advertised in metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    pub id: u64,
    pub len: u64,
    /// Page size of a paged region (0 = one contiguous buffer). For a KV pool this is the
    /// block size in bytes, so block `i` lives at offset `i * page_len`.
    pub page_len: u64,
    pub device: bool,
}

/// What an initiator needs to read from an agent (NIXL's serialized agent metadata).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMetadata {
    pub name: String,
    /// host:port of the agent's listener ("" if it does not listen).
    pub address: String,
    pub backend: String,
    pub regions: Vec<RegionInfo>,
}

impl AgentMetadata {
    pub fn region(&self, id: u64) -> Option<&RegionInfo> {
        self.regions.iter().find(|r| r.id == id)
    }
}

/// A registered region of this agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionHandle {
    pub id: u64,
    pub len: u64,
}

/// Host memory split into equal pages that are filled and cleared independently (a KV block
/// pool: a page is one block). Reading a page that is not filled is an error, so a peer can
/// never read a block after it was released.
#[derive(Debug)]
pub struct PagedRegion {
    page_len: u64,
    pages: Vec<RwLock<Option<Bytes>>>,
}

impl PagedRegion {
    pub fn new(pages: usize, page_len: u64) -> PagedRegion {
        PagedRegion {
            page_len: page_len.max(1),
            pages: (0..pages).map(|_| RwLock::new(None)).collect(),
        }
    }

    pub fn page_len(&self) -> u64 {
        self.page_len
    }

    pub fn pages(&self) -> usize {
        self.pages.len()
    }

    pub fn len(&self) -> u64 {
        self.page_len * self.pages.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Stores a page's bytes (exactly `page_len` of them).
    pub fn fill(&self, page: usize, data: Bytes) -> Result<(), TransferError> {
        if data.len() as u64 != self.page_len {
            return Err(TransferError::BadDescriptor(format!(
                "page data is {} bytes, page size is {}",
                data.len(),
                self.page_len
            )));
        }
        let slot = self.pages.get(page).ok_or_else(|| {
            TransferError::BadDescriptor(format!("page {page} outside {} pages", self.pages()))
        })?;
        *slot.write() = Some(data);
        Ok(())
    }

    pub fn clear(&self, page: usize) {
        if let Some(slot) = self.pages.get(page) {
            *slot.write() = None;
        }
    }

    pub fn get(&self, page: usize) -> Option<Bytes> {
        self.pages.get(page).and_then(|s| s.read().clone())
    }

    /// The bytes of `[offset, offset+len)` as zero-copy slices of the pages.
    fn slices(&self, offset: u64, len: u64, out: &mut Vec<Bytes>) -> Result<(), String> {
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let page = (pos / self.page_len) as usize;
            let in_page = pos % self.page_len;
            let take = (self.page_len - in_page).min(end - pos);
            let data = self
                .get(page)
                .ok_or_else(|| format!("page {page} is not populated (released?)"))?;
            out.push(data.slice(in_page as usize..(in_page + take) as usize));
            pos += take;
        }
        Ok(())
    }
}

/// Memory to register with an agent.
#[derive(Debug, Clone)]
pub enum Memory {
    /// An immutable host buffer.
    Host(Bytes),
    /// A paged host region (KV block pool).
    Paged(Arc<PagedRegion>),
    /// CUDA device memory, served through host staging.
    Device(Arc<DeviceRegion>),
}

impl Memory {
    fn info(&self, id: u64) -> RegionInfo {
        match self {
            Memory::Host(b) => RegionInfo {
                id,
                len: b.len() as u64,
                page_len: 0,
                device: false,
            },
            Memory::Paged(p) => RegionInfo {
                id,
                len: p.len(),
                page_len: p.page_len(),
                device: false,
            },
            Memory::Device(d) => RegionInfo {
                id,
                len: d.len() as u64,
                page_len: 0,
                device: true,
            },
        }
    }

    /// Appends the bytes of a validated range.
    fn slices(&self, offset: u64, len: u64, out: &mut Vec<Bytes>) -> Result<(), String> {
        match self {
            Memory::Host(b) => {
                out.push(b.slice(offset as usize..(offset + len) as usize));
                Ok(())
            }
            Memory::Paged(p) => p.slices(offset, len, out),
            // Device → host staging: the TCP hop needs host memory.
            Memory::Device(d) => d
                .read_range(offset as usize, len as usize)
                .map(|v| out.push(Bytes::from(v)))
                .map_err(|e| e.to_string()),
        }
    }
}

/// A notification received from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The peer's socket address.
    pub from: String,
    pub message: Vec<u8>,
}

/// A finished read.
#[derive(Debug)]
pub struct ReadOutcome {
    /// The destination buffer, filled with the descriptors' bytes in order.
    pub data: Vec<u8>,
    pub bytes: u64,
    /// Descriptors sent after coalescing.
    pub descriptors: usize,
    pub elapsed: Duration,
}

/// A posted read (NIXL's transfer handle): poll it with [`is_done`](Self::is_done) or await
/// it with [`wait`](Self::wait). Dropping it aborts the transfer.
#[derive(Debug)]
pub struct Transfer {
    pub id: u64,
    handle: JoinHandle<Result<ReadOutcome, TransferError>>,
}

impl Transfer {
    pub fn is_done(&self) -> bool {
        self.handle.is_finished()
    }

    pub async fn wait(mut self) -> Result<ReadOutcome, TransferError> {
        match (&mut self.handle).await {
            Ok(r) => r,
            Err(e) => Err(TransferError::Protocol(format!(
                "transfer task failed: {e}"
            ))),
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

/// Counters of one agent.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AgentStats {
    pub bytes_served: u64,
    pub reads_served: u64,
    pub bytes_read: u64,
    pub reads_done: u64,
    pub notifications: u64,
}

#[derive(Debug, Default)]
struct Counters {
    bytes_served: AtomicU64,
    reads_served: AtomicU64,
    bytes_read: AtomicU64,
    reads_done: AtomicU64,
    notifications: AtomicU64,
}

/// Tunables.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Bound on a whole read or notification round trip.
    pub io_timeout: Duration,
    /// Queue of undelivered notifications; a full queue back-pressures the sending peer.
    pub notification_queue: usize,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            io_timeout: Duration::from_secs(30),
            notification_queue: 4096,
        }
    }
}

#[derive(Debug)]
struct AgentInner {
    name: String,
    backend: Backend,
    cfg: AgentConfig,
    cuda: Option<CudaDevice>,
    regions: RwLock<HashMap<u64, Memory>>,
    next_region: AtomicU64,
    next_xfer: AtomicU64,
    address: RwLock<String>,
    remotes: RwLock<HashMap<String, AgentMetadata>>,
    pool: Mutex<HashMap<String, Vec<TcpStream>>>,
    notif_tx: mpsc::Sender<Notification>,
    notif_rx: Mutex<Option<mpsc::Receiver<Notification>>>,
    counters: Counters,
    stop: CancellationToken,
}

impl Drop for AgentInner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A KV transfer agent. Cheap to clone; the listener stops when the last clone is dropped or
/// on [`shutdown`](Self::shutdown).
#[derive(Debug, Clone)]
pub struct Agent {
    inner: Arc<AgentInner>,
}

impl Agent {
    /// Creates an agent. [`Backend::Cuda`] needs a CUDA driver and fails with
    /// [`TransferError::BackendUnavailable`] without one (callers log it and fall back to TCP).
    pub fn new(name: impl Into<String>, backend: Backend) -> Result<Agent, TransferError> {
        Self::with_config(name, backend, AgentConfig::default())
    }

    pub fn with_config(
        name: impl Into<String>,
        backend: Backend,
        cfg: AgentConfig,
    ) -> Result<Agent, TransferError> {
        let cuda = match backend {
            Backend::Tcp => None,
            Backend::Cuda => Some(CudaDevice::open(0)?),
        };
        let (notif_tx, notif_rx) = mpsc::channel(cfg.notification_queue.max(1));
        Ok(Agent {
            inner: Arc::new(AgentInner {
                name: name.into(),
                backend,
                cfg,
                cuda,
                regions: RwLock::new(HashMap::new()),
                next_region: AtomicU64::new(1),
                next_xfer: AtomicU64::new(1),
                address: RwLock::new(String::new()),
                remotes: RwLock::new(HashMap::new()),
                pool: Mutex::new(HashMap::new()),
                notif_tx,
                notif_rx: Mutex::new(Some(notif_rx)),
                counters: Counters::default(),
                stop: CancellationToken::new(),
            }),
        })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// The CUDA device of a [`Backend::Cuda`] agent.
    pub fn cuda(&self) -> Option<&CudaDevice> {
        self.inner.cuda.as_ref()
    }

    /// Binds the agent's listener and starts serving reads, metadata and notifications.
    /// `advertise_host` replaces the bound IP in the advertised address (needed when binding
    /// 0.0.0.0). Returns the bound address.
    pub async fn listen(
        &self,
        addr: SocketAddr,
        advertise_host: Option<&str>,
    ) -> Result<SocketAddr, TransferError> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let host = match advertise_host {
            Some(h) if !h.is_empty() => h.to_string(),
            _ if local.ip().is_unspecified() => "127.0.0.1".to_string(),
            _ => local.ip().to_string(),
        };
        let advertised = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{}", local.port())
        } else {
            format!("{host}:{}", local.port())
        };
        *self.inner.address.write() = advertised.clone();
        let weak = Arc::downgrade(&self.inner);
        let stop = self.inner.stop.clone();
        tokio::spawn(accept_loop(listener, weak, stop));
        tracing::info!(agent = %self.inner.name, %local, advertised, backend = self.inner.backend.as_str(), "KV transfer agent listening");
        Ok(local)
    }

    /// Stops the listener (open connections finish their current request).
    pub fn shutdown(&self) {
        self.inner.stop.cancel();
    }

    /// Registers memory that peers may read; the handle names it in descriptors.
    pub fn register_memory(&self, mem: Memory) -> RegionHandle {
        let id = self.inner.next_region.fetch_add(1, Ordering::Relaxed);
        let info = mem.info(id);
        self.inner.regions.write().insert(id, mem);
        RegionHandle { id, len: info.len }
    }

    /// Unregisters a region; later reads of it fail. False if it was not registered.
    pub fn deregister_memory(&self, handle: &RegionHandle) -> bool {
        self.inner.regions.write().remove(&handle.id).is_some()
    }

    /// This agent's metadata, to hand to initiators.
    pub fn metadata(&self) -> AgentMetadata {
        metadata_of(&self.inner)
    }

    /// Asks the agent listening at `addr` (host:port) for its metadata.
    pub async fn fetch_metadata(&self, addr: &str) -> Result<AgentMetadata, TransferError> {
        let timeout = self.inner.cfg.io_timeout;
        let fut = async {
            let mut conn = self.inner.checkout(addr).await?;
            conn.write_all(&Frame::GetMetadata.to_bytes()).await?;
            match read_frame(&mut conn, MAX_FRAME_LEN).await? {
                Some(Frame::Metadata(md)) => {
                    self.inner.checkin(addr, conn);
                    Ok(md)
                }
                Some(Frame::Error { message, .. }) => Err(TransferError::Remote(message)),
                Some(f) => Err(TransferError::Protocol(format!(
                    "expected Metadata, got {f:?}"
                ))),
                None => Err(TransferError::Closed),
            }
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| TransferError::Timeout(timeout))?
    }

    /// Loads a peer's metadata so reads can name it; returns its name. Loading a name again
    /// replaces the old metadata (the peer restarted or registered more memory).
    pub fn load_remote(&self, md: AgentMetadata) -> Result<String, TransferError> {
        if md.address.is_empty() {
            return Err(TransferError::UnknownRemote(format!(
                "agent {:?} advertises no address",
                md.name
            )));
        }
        let name = md.name.clone();
        self.inner.remotes.write().insert(name.clone(), md);
        Ok(name)
    }

    /// Forgets a peer's metadata and its pooled connections.
    pub fn invalidate_remote(&self, name: &str) {
        if let Some(md) = self.inner.remotes.write().remove(name) {
            self.inner.pool.lock().remove(&md.address);
        }
    }

    pub fn remote(&self, name: &str) -> Option<AgentMetadata> {
        self.inner.remotes.read().get(name).cloned()
    }

    /// Posts a read of `descriptors` (regions of the loaded peer `remote`) into `dst`, whose
    /// length must equal the descriptors' total. Descriptors are checked against the peer's
    /// metadata before anything is sent; adjacent ones are coalesced.
    pub fn read(
        &self,
        remote: &str,
        descriptors: &[Descriptor],
        dst: Vec<u8>,
    ) -> Result<Transfer, TransferError> {
        let md = self
            .remote(remote)
            .ok_or_else(|| TransferError::UnknownRemote(remote.to_string()))?;
        let total = validate(&md, descriptors)?;
        if total != dst.len() as u64 {
            return Err(TransferError::DestinationSize {
                expected: total,
                got: dst.len() as u64,
            });
        }
        let descriptors = coalesce(descriptors);
        let id = self.inner.next_xfer.fetch_add(1, Ordering::Relaxed);
        let inner = self.inner.clone();
        let handle = tokio::spawn(async move {
            let timeout = inner.cfg.io_timeout;
            let t0 = Instant::now();
            let n = descriptors.len();
            let data =
                tokio::time::timeout(timeout, inner.do_read(&md.address, id, descriptors, dst))
                    .await
                    .map_err(|_| TransferError::Timeout(timeout))??;
            inner
                .counters
                .bytes_read
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            inner.counters.reads_done.fetch_add(1, Ordering::Relaxed);
            Ok(ReadOutcome {
                bytes: data.len() as u64,
                data,
                descriptors: n,
                elapsed: t0.elapsed(),
            })
        });
        Ok(Transfer { id, handle })
    }

    /// Sends a notification to a loaded peer and waits for its acknowledgement.
    pub async fn notify(&self, remote: &str, message: &[u8]) -> Result<(), TransferError> {
        let md = self
            .remote(remote)
            .ok_or_else(|| TransferError::UnknownRemote(remote.to_string()))?;
        let addr = md.address;
        let timeout = self.inner.cfg.io_timeout;
        let fut = async {
            let mut conn = self.inner.checkout(&addr).await?;
            conn.write_all(
                &Frame::Notify {
                    message: message.to_vec(),
                }
                .to_bytes(),
            )
            .await?;
            match read_frame(&mut conn, MAX_FRAME_LEN).await? {
                Some(Frame::NotifyAck) => {
                    self.inner.checkin(&addr, conn);
                    Ok(())
                }
                Some(Frame::Error { message, .. }) => Err(TransferError::Remote(message)),
                Some(f) => Err(TransferError::Protocol(format!(
                    "expected NotifyAck, got {f:?}"
                ))),
                None => Err(TransferError::Closed),
            }
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| TransferError::Timeout(timeout))?
    }

    /// The receiver of notifications from peers; `None` after the first call (one consumer).
    pub fn take_notifications(&self) -> Option<mpsc::Receiver<Notification>> {
        self.inner.notif_rx.lock().take()
    }

    pub fn stats(&self) -> AgentStats {
        let c = &self.inner.counters;
        AgentStats {
            bytes_served: c.bytes_served.load(Ordering::Relaxed),
            reads_served: c.reads_served.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            reads_done: c.reads_done.load(Ordering::Relaxed),
            notifications: c.notifications.load(Ordering::Relaxed),
        }
    }
}

/// Checks descriptors against a peer's metadata; returns their total length.
fn validate(md: &AgentMetadata, descriptors: &[Descriptor]) -> Result<u64, TransferError> {
    if descriptors.is_empty() {
        return Err(TransferError::BadDescriptor("empty descriptor list".into()));
    }
    let mut total: u64 = 0;
    for (i, d) in descriptors.iter().enumerate() {
        let r = md.region(d.region).ok_or_else(|| {
            TransferError::BadDescriptor(format!(
                "descriptor {i}: agent {} has no region {}",
                md.name, d.region
            ))
        })?;
        check_range(r.len, d)
            .map_err(|e| TransferError::BadDescriptor(format!("descriptor {i}: {e}")))?;
        total = total
            .checked_add(d.len)
            .ok_or_else(|| TransferError::BadDescriptor("total length overflows".into()))?;
    }
    if total > MAX_READ_BYTES {
        return Err(TransferError::BadDescriptor(format!(
            "read of {total} bytes exceeds the limit of {MAX_READ_BYTES}"
        )));
    }
    Ok(total)
}

fn check_range(region_len: u64, d: &Descriptor) -> Result<(), String> {
    if d.len == 0 {
        return Err("zero-length descriptor".into());
    }
    match d.offset.checked_add(d.len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(format!(
            "range {}+{} is outside region {} of {} bytes",
            d.offset, d.len, d.region, region_len
        )),
    }
}

/// Merges runs of descriptors that are contiguous in the same region (consecutive KV blocks
/// of a pool become one descriptor), preserving order.
pub fn coalesce(descriptors: &[Descriptor]) -> Vec<Descriptor> {
    let mut out: Vec<Descriptor> = Vec::with_capacity(descriptors.len());
    for d in descriptors {
        if let Some(last) = out.last_mut() {
            if last.region == d.region && last.offset.checked_add(last.len) == Some(d.offset) {
                last.len += d.len;
                continue;
            }
        }
        out.push(*d);
    }
    out
}

impl AgentInner {
    async fn checkout(&self, addr: &str) -> Result<TcpStream, TransferError> {
        if let Some(conn) = self.pool.lock().get_mut(addr).and_then(|v| v.pop()) {
            return Ok(conn);
        }
        let conn = TcpStream::connect(addr)
            .await
            .map_err(|e| TransferError::Connect {
                addr: addr.to_string(),
                source: e,
            })?;
        conn.set_nodelay(true)?;
        Ok(conn)
    }

    fn checkin(&self, addr: &str, conn: TcpStream) {
        let mut pool = self.pool.lock();
        let v = pool.entry(addr.to_string()).or_default();
        if v.len() < POOL_PER_PEER {
            v.push(conn);
        }
    }

    async fn do_read(
        &self,
        addr: &str,
        xfer_id: u64,
        descriptors: Vec<Descriptor>,
        mut dst: Vec<u8>,
    ) -> Result<Vec<u8>, TransferError> {
        let mut conn = self.checkout(addr).await?;
        let req = Frame::Read {
            xfer_id,
            descriptors,
        }
        .to_bytes();
        if let Err(e) = conn.write_all(&req).await {
            // A pooled connection may have been closed by the peer meanwhile: retry once on a
            // fresh one.
            tracing::debug!(error = %e, "pooled connection failed; reconnecting");
            self.pool.lock().remove(addr);
            conn = self.checkout(addr).await?;
            conn.write_all(&req).await?;
        }
        match read_frame(&mut conn, MAX_FRAME_LEN).await? {
            Some(Frame::ReadOk { xfer_id: id, total }) => {
                if id != xfer_id || total != dst.len() as u64 {
                    return Err(TransferError::Protocol(format!(
                        "ReadOk for transfer {id} with {total} bytes, expected transfer {xfer_id} with {}",
                        dst.len()
                    )));
                }
            }
            Some(Frame::Error { message, .. }) => {
                // The request was fully consumed: the connection is still usable.
                self.checkin(addr, conn);
                return Err(TransferError::Remote(message));
            }
            Some(f) => {
                return Err(TransferError::Protocol(format!(
                    "expected ReadOk, got {f:?}"
                )))
            }
            None => return Err(TransferError::Closed),
        }
        conn.read_exact(&mut dst).await?;
        self.checkin(addr, conn);
        Ok(dst)
    }

    fn resolve(&self, descriptors: &[Descriptor]) -> Result<(Vec<Bytes>, u64), String> {
        let regions = self.regions.read();
        let mut total: u64 = 0;
        for d in descriptors {
            let mem = regions
                .get(&d.region)
                .ok_or_else(|| format!("agent {} has no region {}", self.name, d.region))?;
            check_range(mem.info(d.region).len, d)?;
            total = total
                .checked_add(d.len)
                .filter(|t| *t <= MAX_READ_BYTES)
                .ok_or_else(|| format!("read exceeds the limit of {MAX_READ_BYTES} bytes"))?;
        }
        let mut slices = Vec::with_capacity(descriptors.len());
        for d in descriptors {
            // Present: checked above under the same read lock.
            if let Some(mem) = regions.get(&d.region) {
                mem.slices(d.offset, d.len, &mut slices)?;
            }
        }
        Ok((slices, total))
    }
}

async fn accept_loop(listener: TcpListener, agent: Weak<AgentInner>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "KV agent accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(inner) = agent.upgrade() else { break };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "set_nodelay failed");
        }
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                r = serve_conn(&inner, stream, peer) => {
                    if let Err(e) = r {
                        tracing::debug!(%peer, error = %e, "KV agent connection ended with an error");
                    }
                }
            }
        });
    }
    tracing::debug!("KV agent listener stopped");
}

/// Serves one connection: requests are answered in order until EOF or a malformed frame
/// (which gets an `Error` frame, then the connection is closed: its framing is lost).
async fn serve_conn(
    inner: &AgentInner,
    mut stream: TcpStream,
    peer: SocketAddr,
) -> Result<(), TransferError> {
    loop {
        let frame = match read_frame(&mut stream, MAX_FRAME_LEN).await {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(()),
            Err(TransferError::Frame(e)) => {
                let msg = format!("malformed frame: {e}");
                tracing::warn!(%peer, error = %e, "KV agent received a malformed frame; closing");
                let _ = stream
                    .write_all(
                        &Frame::Error {
                            xfer_id: 0,
                            message: msg,
                        }
                        .to_bytes(),
                    )
                    .await;
                graceful_close(stream).await;
                return Err(e.into());
            }
            Err(e) => return Err(e),
        };
        match frame {
            Frame::GetMetadata => {
                stream
                    .write_all(&Frame::Metadata(metadata_of(inner)).to_bytes())
                    .await?;
            }
            Frame::Read {
                xfer_id,
                descriptors,
            } => match inner.resolve(&descriptors) {
                Ok((slices, total)) => {
                    let header = Frame::ReadOk { xfer_id, total }.to_bytes();
                    write_all_vectored(&mut stream, &header, &slices).await?;
                    inner
                        .counters
                        .bytes_served
                        .fetch_add(total, Ordering::Relaxed);
                    inner.counters.reads_served.fetch_add(1, Ordering::Relaxed);
                }
                Err(message) => {
                    tracing::debug!(%peer, xfer_id, message, "KV read rejected");
                    stream
                        .write_all(&Frame::Error { xfer_id, message }.to_bytes())
                        .await?;
                }
            },
            Frame::Notify { message } => {
                inner.counters.notifications.fetch_add(1, Ordering::Relaxed);
                let n = Notification {
                    from: peer.to_string(),
                    message,
                };
                if inner.notif_tx.send(n).await.is_err() {
                    tracing::debug!("notification receiver dropped; notification discarded");
                }
                stream.write_all(&Frame::NotifyAck.to_bytes()).await?;
            }
            other => {
                let message = format!("unexpected request frame {other:?}");
                stream
                    .write_all(
                        &Frame::Error {
                            xfer_id: 0,
                            message,
                        }
                        .to_bytes(),
                    )
                    .await?;
                graceful_close(stream).await;
                return Err(TransferError::Protocol("unexpected request frame".into()));
            }
        }
    }
}

/// Writes `header` then every slice, with as few syscalls as the kernel allows (up to
/// [`IOV_BATCH`] buffers per `writev`), handling partial writes.
async fn write_all_vectored(
    stream: &mut TcpStream,
    header: &[u8],
    slices: &[Bytes],
) -> std::io::Result<()> {
    let bufs: Vec<&[u8]> = std::iter::once(header)
        .chain(slices.iter().map(|b| &b[..]))
        .filter(|b| !b.is_empty())
        .collect();
    let (mut idx, mut off) = (0usize, 0usize);
    let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(IOV_BATCH.min(bufs.len()));
    while idx < bufs.len() {
        iov.clear();
        let end = (idx + IOV_BATCH).min(bufs.len());
        iov.push(IoSlice::new(&bufs[idx][off..]));
        iov.extend(bufs[idx + 1..end].iter().map(|b| IoSlice::new(b)));
        let mut n = stream.write_vectored(&iov).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 && idx < bufs.len() {
            let rem = bufs[idx].len() - off;
            if n >= rem {
                n -= rem;
                idx += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// Closes after an error frame without a reset: closing with unread input makes the kernel
/// send RST, which can destroy the error frame before the peer reads it. So send FIN, then
/// discard what the peer still sends, briefly and boundedly.
async fn graceful_close(mut stream: TcpStream) {
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    let drain = async {
        let mut left = 1usize << 20;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(200), drain).await;
}

/// Buffers per `writev` (Linux IOV_MAX is 1024).
const IOV_BATCH: usize = 512;

fn metadata_of(inner: &AgentInner) -> AgentMetadata {
    let mut regions: Vec<RegionInfo> = inner
        .regions
        .read()
        .iter()
        .map(|(&id, m)| m.info(id))
        .collect();
    regions.sort_by_key(|r| r.id);
    AgentMetadata {
        name: inner.name.clone(),
        address: inner.address.read().clone(),
        backend: inner.backend.as_str().into(),
        regions,
    }
}
