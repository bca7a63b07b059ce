//! Test scaffolding for the sidecar's integration tests: simulated worker processes (the real
//! `kvroute-worker` binary), an in-process sidecar on a real socket, a recording upstream that
//! answers with canned responses, and a small HTTP client.
//!
//! The process handling is a copy of `tests/src/harness/process.rs` (parent-death signal, kill
//! on drop): depending on `kvroute-tests` would pull the EPP into this crate's test build.

#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvroute_sidecar::config::Config;
use kvroute_sidecar::server::{serve, App};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub const MODEL: &str = "Qwen/Qwen3-0.6B";

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

pub fn model_dir() -> PathBuf {
    let dir = std::env::var("KVROUTE_MODEL_DIR")
        .ok()
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".cache/models/qwen3"));
    assert!(
        dir.join("tokenizer.json").exists(),
        "no tokenizer.json in {}: run ./dev setup (or set KVROUTE_MODEL_DIR)",
        dir.display()
    );
    dir
}

/// target/<profile>/kvroute-worker; built once if it is missing.
pub fn worker_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let mut dir = exe.parent().unwrap().to_path_buf();
        if dir.ends_with("deps") {
            dir.pop();
        }
        let p = dir.join("kvroute-worker");
        if !p.exists() {
            let status = Command::new(env!("CARGO"))
                .args(["build", "-p", "kvroute-worker", "--bin", "kvroute-worker"])
                .current_dir(workspace_root())
                .status()
                .expect("running cargo build for kvroute-worker");
            assert!(status.success(), "building kvroute-worker failed");
        }
        p
    })
    .clone()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process killed (SIGTERM, then SIGKILL) on drop.
pub struct ChildProcess {
    child: Option<Child>,
    pub log: PathBuf,
}

impl ChildProcess {
    pub fn spawn(name: &str, program: &Path, args: &[String]) -> ChildProcess {
        let dir =
            std::env::temp_dir().join(format!("kvroute-sidecar-tests-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
        // SAFETY: prctl is async-signal-safe; it asks the kernel to signal the child when this
        // process dies, so no worker outlives a killed test run.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        ChildProcess {
            child: Some(child),
            log,
        }
    }

    pub fn exited(&mut self) -> bool {
        matches!(
            self.child.as_mut().map(|c| c.try_wait()),
            Some(Ok(Some(_))) | None
        )
    }

    pub fn log_tail(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A running simulated worker.
pub struct Worker {
    pub addr: String,
    pub url: String,
    pub process: ChildProcess,
}

/// Starts `kvroute-worker --engine sim` with `name` and `extra` flags; waits for /health.
pub async fn start_worker(name: &str, speedup: f64, extra: &[&str]) -> Worker {
    let addr = format!("127.0.0.1:{}", free_port());
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut args: Vec<String> = vec![
        "--engine".into(),
        "sim".into(),
        "--listen".into(),
        addr.clone(),
        "--grpc-listen".into(),
        grpc,
        "--model".into(),
        MODEL.into(),
        "--model-dir".into(),
        model_dir().display().to_string(),
        "--name".into(),
        name.into(),
        "--speedup".into(),
        speedup.to_string(),
        "--kv-blocks".into(),
        "4096".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut process = ChildProcess::spawn(name, &worker_bin(), &args);
    let url = format!("http://{addr}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok((200, _, _)) = get(&format!("{url}/health")).await {
            break;
        }
        assert!(
            !process.exited(),
            "worker {name} exited:\n{}",
            process.log_tail()
        );
        assert!(
            Instant::now() < deadline,
            "worker {name} not healthy:\n{}",
            process.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Worker { addr, url, process }
}

/// An in-process sidecar on a real socket; stopped on drop.
pub struct Sidecar {
    pub url: String,
    pub app: Arc<App>,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

pub async fn start_sidecar(cfg: Config) -> Sidecar {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = App::new(cfg).unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let a = app.clone();
    tokio::spawn(async move {
        let _ = serve(listener, a, async {
            let _ = rx.await;
        })
        .await;
    });
    Sidecar {
        url: format!("http://{addr}"),
        app,
        stop: Some(tx),
    }
}

/// A config for `engines` (`name=..,url=..` specs) with other settings at their defaults.
pub fn config(engines: &[String]) -> Config {
    let refs: Vec<&str> = engines.iter().map(String::as_str).collect();
    let mut c = Config::for_engines(&refs).unwrap();
    c.shutdown_grace = Duration::from_millis(200);
    c
}

// ---------------------------------------------------------------- HTTP client helpers

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub type Headers = Vec<(String, String)>;

fn header_list(h: &hyper::HeaderMap) -> Headers {
    h.iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

pub async fn get(url: &str) -> anyhow::Result<(u16, Headers, Bytes)> {
    request("GET", url, &[], Bytes::new()).await
}

pub async fn send(
    c: &HttpClient,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<hyper::Response<Incoming>> {
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    Ok(c.request(req.body(Full::new(body.into()))?).await?)
}

pub async fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<(u16, Headers, Bytes)> {
    let resp = send(&client(), method, url, headers, body).await?;
    let status = resp.status().as_u16();
    let h = header_list(resp.headers());
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, h, body))
}

pub async fn post_json(
    url: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> (u16, Headers, Bytes) {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    request("POST", url, &h, body.to_string()).await.unwrap()
}

/// `data:` payloads of an SSE body, `[DONE]` included.
pub fn sse_data(body: &[u8]) -> Vec<String> {
    std::str::from_utf8(body)
        .unwrap()
        .split("\n\n")
        .filter_map(|ev| ev.trim().strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// A Prometheus sample value (first series whose line starts with `name`).
pub async fn metric(base_url: &str, name: &str) -> f64 {
    let (_, _, body) = get(&format!("{base_url}/metrics")).await.unwrap();
    let text = String::from_utf8_lossy(&body);
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

// ---------------------------------------------------------------- recording upstream

/// One request a [`Recorder`] received.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub path: String,
    pub headers: Headers,
    pub body: serde_json::Value,
}

/// What a [`Recorder`] answers: status, content type, body chunks (sent as separate frames),
/// and a delay before the headers.
#[derive(Debug, Clone)]
pub struct Canned {
    pub status: u16,
    pub content_type: &'static str,
    pub chunks: Vec<String>,
    pub delay: Duration,
}

impl Canned {
    pub fn json(status: u16, v: serde_json::Value) -> Canned {
        Canned {
            status,
            content_type: "application/json",
            chunks: vec![v.to_string()],
            delay: Duration::ZERO,
        }
    }
}

type Responder = Arc<dyn Fn(&Recorded) -> Canned + Send + Sync>;

/// A small HTTP upstream that records every request and answers with a canned response; a
/// stand-in where the test must see exactly what the sidecar sent.
pub struct Recorder {
    pub addr: SocketAddr,
    pub url: String,
    pub requests: Arc<Mutex<Vec<Recorded>>>,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

impl Recorder {
    pub async fn start(respond: impl Fn(&Recorded) -> Canned + Send + Sync + 'static) -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests: Arc<Mutex<Vec<Recorded>>> = Arc::default();
        let respond: Responder = Arc::new(respond);
        let (tx, mut rx) = oneshot::channel::<()>();
        let reqs = requests.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                    _ = &mut rx => return,
                };
                let reqs = reqs.clone();
                let respond = respond.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                        let reqs = reqs.clone();
                        let respond = respond.clone();
                        async move {
                            let path = req.uri().path().to_string();
                            let headers = header_list(req.headers());
                            let bytes = req
                                .into_body()
                                .collect()
                                .await
                                .map(|c| c.to_bytes())
                                .unwrap_or_default();
                            let body =
                                serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
                            let rec = Recorded {
                                path,
                                headers,
                                body,
                            };
                            let canned = respond(&rec);
                            reqs.lock().unwrap().push(rec);
                            tokio::time::sleep(canned.delay).await;
                            let frames = futures::stream::iter(
                                canned
                                    .chunks
                                    .into_iter()
                                    .map(|c| Ok::<_, Infallible>(Frame::data(Bytes::from(c)))),
                            );
                            let mut resp = hyper::Response::new(StreamBody::new(frames));
                            *resp.status_mut() =
                                hyper::StatusCode::from_u16(canned.status).unwrap();
                            resp.headers_mut()
                                .insert("content-type", canned.content_type.parse().unwrap());
                            Ok::<_, Infallible>(resp)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Recorder {
            addr,
            url: format!("http://{addr}"),
            requests,
            stop: Some(tx),
        }
    }

    pub fn recorded(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }
}
