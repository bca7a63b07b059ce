//! Where the EPP learns which workers exist. Every source publishes the full current list on a
//! `watch` channel (`None` until its first successful read); the ingest manager diffs it.
//! Local sources: a fixed list from flags, or a JSON file that is re-read when it changes, so a
//! worker can be dropped from a running EPP. Kubernetes (InferencePool + Pods) plugs in behind the
//! same channel.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use tokio::sync::watch;

/// How to reach one worker.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
pub struct WorkerEndpoint {
    /// Stable name (a pod name on Kubernetes).
    pub name: String,
    /// host:port of the worker's `WorkerControl` gRPC service.
    pub grpc: String,
    /// host:port the gateway should send requests to (a sidecar, or the engine itself).
    /// Defaults to the `http_endpoint` the worker reports in its metadata.
    #[serde(default)]
    pub http: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("worker spec {spec:?}: {why} (expected name=NAME,grpc=HOST:PORT[,http=HOST:PORT])")]
    BadFlag { spec: String, why: String },
    #[error("reading worker file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing worker file {path}: {source} (expected {{\"workers\": [{{\"name\", \"grpc\", \"http\"?}}]}} or a plain array)")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("worker list has two workers named {0:?}")]
    DuplicateName(String),
    #[error("worker {name:?}: address {addr:?} is not host:port")]
    BadAddress { name: String, addr: String },
}

/// Parses `name=w0,grpc=127.0.0.1:9500[,http=127.0.0.1:8000]`.
pub fn parse_worker_flag(spec: &str) -> Result<WorkerEndpoint, DiscoveryError> {
    let bad = |why: &str| DiscoveryError::BadFlag {
        spec: spec.to_string(),
        why: why.to_string(),
    };
    let (mut name, mut grpc, mut http) = (None, None, None);
    for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| bad("each part must be key=value"))?;
        match k.trim() {
            "name" => name = Some(v.trim().to_string()),
            "grpc" => grpc = Some(v.trim().to_string()),
            "http" => http = Some(v.trim().to_string()),
            other => return Err(bad(&format!("unknown key {other:?}"))),
        }
    }
    let ep = WorkerEndpoint {
        name: name.ok_or_else(|| bad("missing name"))?,
        grpc: grpc.ok_or_else(|| bad("missing grpc"))?,
        http,
    };
    validate(std::slice::from_ref(&ep))?;
    Ok(ep)
}

fn is_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

fn validate(list: &[WorkerEndpoint]) -> Result<(), DiscoveryError> {
    let mut names = std::collections::HashSet::new();
    for w in list {
        if !names.insert(w.name.as_str()) {
            return Err(DiscoveryError::DuplicateName(w.name.clone()));
        }
        for addr in std::iter::once(&w.grpc).chain(w.http.iter()) {
            if !is_host_port(addr) {
                return Err(DiscoveryError::BadAddress {
                    name: w.name.clone(),
                    addr: addr.clone(),
                });
            }
        }
    }
    Ok(())
}

/// Parses a worker file: `{"workers": [...]}` or a bare array.
pub fn parse_worker_file(path: &Path, text: &str) -> Result<Vec<WorkerEndpoint>, DiscoveryError> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum File {
        Wrapped { workers: Vec<WorkerEndpoint> },
        Bare(Vec<WorkerEndpoint>),
    }
    let list = match serde_json::from_str::<File>(text) {
        Ok(File::Wrapped { workers }) | Ok(File::Bare(workers)) => workers,
        Err(source) => {
            return Err(DiscoveryError::Parse {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    validate(&list)?;
    Ok(list)
}

pub type WorkerList = Option<Vec<WorkerEndpoint>>;

/// A fixed list (from flags): synced at once.
pub fn static_workers(list: Vec<WorkerEndpoint>) -> watch::Receiver<WorkerList> {
    let (tx, rx) = watch::channel(Some(list));
    // Keep the sender alive for the life of the process so receivers never see a closed channel.
    std::mem::forget(tx);
    rx
}

/// Watches a JSON worker file, re-reading it when its modification time changes. A file that
/// fails to read or parse keeps the last good list (and is logged), so a half-written edit
/// never empties the pool.
pub fn watch_file(path: PathBuf, interval: Duration) -> watch::Receiver<WorkerList> {
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        let mut last_mtime: Option<SystemTime> = None;
        loop {
            let mtime = tokio::fs::metadata(&path)
                .await
                .and_then(|m| m.modified())
                .ok();
            if mtime.is_some() && mtime != last_mtime {
                match tokio::fs::read_to_string(&path).await {
                    Ok(text) => match parse_worker_file(&path, &text) {
                        Ok(list) => {
                            last_mtime = mtime;
                            tracing::info!(path = %path.display(), workers = list.len(), "worker file loaded");
                            tx.send_replace(Some(list));
                        }
                        Err(e) => tracing::error!("{e}; keeping the previous worker list"),
                    },
                    Err(e) => tracing::error!(path = %path.display(), "reading worker file: {e}"),
                }
            } else if mtime.is_none() && last_mtime.is_none() {
                tracing::warn!(path = %path.display(), "worker file does not exist yet");
            }
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(interval).await;
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_flags() {
        let w = parse_worker_flag("name=w0,grpc=127.0.0.1:9500,http=127.0.0.1:8000").expect("ok");
        assert_eq!(w.name, "w0");
        assert_eq!(w.http.as_deref(), Some("127.0.0.1:8000"));
        for bad in [
            "grpc=1.2.3.4:5",
            "name=w",
            "name=w,grpc=nohost",
            "name=w,grpc=h:0",
            "name=w,grpc=h:1,x=y",
            "junk",
        ] {
            let err = parse_worker_flag(bad).expect_err(bad).to_string();
            assert!(err.contains(bad) || err.contains("host:port"), "{err}");
        }
    }

    #[test]
    fn parses_files() {
        let p = Path::new("w.json");
        let a =
            parse_worker_file(p, r#"{"workers":[{"name":"a","grpc":"h:1"}]}"#).expect("wrapped");
        let b = parse_worker_file(p, r#"[{"name":"a","grpc":"h:1"}]"#).expect("bare");
        assert_eq!(a, b);
        let dup = parse_worker_file(
            p,
            r#"[{"name":"a","grpc":"h:1"},{"name":"a","grpc":"h:2"}]"#,
        );
        assert!(matches!(dup, Err(DiscoveryError::DuplicateName(_))));
        let err = parse_worker_file(p, "{not json")
            .expect_err("bad")
            .to_string();
        assert!(err.contains("w.json"), "{err}");
    }

    #[tokio::test]
    async fn file_watch_follows_edits_and_keeps_last_good() {
        let dir = std::env::temp_dir().join(format!("kvroute-disc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("workers.json");
        std::fs::write(
            &path,
            r#"[{"name":"a","grpc":"h:1"},{"name":"b","grpc":"h:2"}]"#,
        )
        .expect("write");
        let mut rx = watch_file(path.clone(), Duration::from_millis(20));
        rx.wait_for(|l| l.as_ref().is_some_and(|l| l.len() == 2))
            .await
            .expect("first list");
        // A broken edit is ignored...
        tokio::time::sleep(Duration::from_millis(1100)).await; // mtime granularity
        std::fs::write(&path, "[{").expect("write");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(rx.borrow().as_ref().map(|l| l.len()), Some(2));
        // ...and a good one replaces the list.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        std::fs::write(&path, r#"[{"name":"a","grpc":"h:1"}]"#).expect("write");
        tokio::time::timeout(
            Duration::from_secs(5),
            rx.wait_for(|l| l.as_ref().is_some_and(|l| l.len() == 1)),
        )
        .await
        .expect("in time")
        .expect("updated");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
