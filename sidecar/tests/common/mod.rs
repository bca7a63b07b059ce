//! Test scaffolding for the sidecar's integration tests: simulated worker processes (the real
//! `kvroute-worker` binary), an in-process sidecar on a real socket, a recording upstream that
//! answers with canned responses, and a small HTTP client.
//!
//! Worker processes and the HTTP client come from the workspace's test harness
//! (`kvroute-tests`), so process supervision lives in one place.

#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use kvroute_sidecar::config::Config;
use kvroute_sidecar::server::{serve, App};
use kvroute_tests::harness::stack::{self, StackOptions, WorkerHandle};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub use kvroute_tests::harness::client::{
    get, header, header_list, new_client as client, send, Headers,
};

pub const MODEL: &str = "Qwen/Qwen3-0.6B";

pub fn free_port() -> u16 {
    kvroute_tests::harness::free_port().expect("a free port")
}

/// A running simulated worker (the real `kvroute-worker` binary).
pub struct Worker {
    pub addr: String,
    pub url: String,
    pub handle: WorkerHandle,
}

/// Starts `kvroute-worker --engine sim` with `name` and `extra` flags; waits for /health.
pub async fn start_worker(name: &str, speedup: f64, extra: &[&str]) -> Worker {
    let opts = StackOptions {
        speedup,
        log_dir: std::env::temp_dir().join(format!("kvroute-sidecar-tests-{}", std::process::id())),
        ..StackOptions::default()
    };
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let handle = stack::start_worker(name, &opts, &extra)
        .await
        .expect("worker starts");
    Worker {
        addr: handle.http.clone(),
        url: format!("http://{}", handle.http),
        handle,
    }
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

pub async fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<(u16, Headers, Bytes)> {
    kvroute_tests::harness::client::request(&client(), method, url, headers, body).await
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
