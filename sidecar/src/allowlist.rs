//! The SSRF allowlist: the only hosts a prefill leg may be sent to.
//!
//! Prefill targets arrive in request headers (`x-prefiller-host-port`) or are resolved from
//! them (`x-dynamo-prefill-instance-id` → `--prefill`), so without a check a request that
//! reached the sidecar could make it POST to any address inside the cluster. Every target is
//! compared with the pool's worker endpoints (`--pool-endpoints`, and `--pool-file`, re-read when
//! it changes so it can follow the InferencePool's pods), as llm-d's
//! `--enable-ssrf-protection` does. An entry is `host:port` (that port only) or a bare `host`
//! (any port, llm-d's pod-IP rule). An empty allowlist allows nothing.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::RwLock;

use crate::config::{normalize_authority, ConfigError};

#[derive(Debug, Default, Clone)]
struct Entries {
    /// Canonical `host:port`.
    exact: HashSet<String>,
    /// Hosts allowed on any port.
    hosts: HashSet<String>,
}

impl Entries {
    fn add(&mut self, raw: &str) {
        let raw = raw.trim();
        if raw.is_empty() {
            return;
        }
        match split_host_port(raw) {
            Some((h, p)) => {
                self.exact.insert(normalize_authority(h, p));
            }
            None => {
                self.hosts.insert(
                    raw.trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_ascii_lowercase(),
                );
            }
        }
    }
}

/// `host:port` → (host, port); `None` for a bare host.
pub fn split_host_port(s: &str) -> Option<(&str, u16)> {
    let (h, p) = s.rsplit_once(':')?;
    // A bare IPv6 address has colons but no brackets: it is a host, not host:port.
    if h.contains(':') && !h.ends_with(']') {
        return None;
    }
    let port = p.parse::<u16>().ok()?;
    Some((h, port))
}

/// The allowlist shared by all requests.
#[derive(Debug)]
pub struct Allowlist {
    fixed: Vec<String>,
    file: Option<PathBuf>,
    current: RwLock<Arc<Entries>>,
    file_mtime: RwLock<Option<SystemTime>>,
}

impl Allowlist {
    /// Builds the list from the flags; reads the pool file once (an unreadable file is an
    /// error at start-up, later it keeps the last good list).
    pub fn new(fixed: Vec<String>, file: Option<PathBuf>) -> Result<Allowlist, ConfigError> {
        let list = Allowlist {
            fixed,
            file,
            current: RwLock::new(Arc::new(Entries::default())),
            file_mtime: RwLock::new(None),
        };
        list.reload()?;
        Ok(list)
    }

    /// Is `host:port` (as the request named it) allowed?
    pub fn allows(&self, host: &str, port: u16) -> bool {
        let e = self.current.read().clone();
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        e.hosts.contains(&host) || e.exact.contains(&normalize_authority(&host, port))
    }

    /// Number of entries (for logs).
    pub fn len(&self) -> usize {
        let e = self.current.read();
        e.exact.len() + e.hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Re-reads the pool file and rebuilds the list.
    pub fn reload(&self) -> Result<(), ConfigError> {
        let mut e = Entries::default();
        for f in &self.fixed {
            e.add(f);
        }
        if let Some(path) = &self.file {
            let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
            for item in read_pool_file(path)? {
                e.add(&item);
            }
            *self.file_mtime.write() = mtime;
        }
        *self.current.write() = Arc::new(e);
        Ok(())
    }

    /// Polls the pool file's modification time and reloads it when it changes, until the
    /// process exits. A bad file is logged and the previous list kept.
    pub async fn watch(self: Arc<Self>, every: Duration) {
        let Some(path) = self.file.clone() else {
            return;
        };
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let mtime = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
            if mtime.is_some() && mtime != *self.file_mtime.read() {
                match self.reload() {
                    Ok(()) => {
                        tracing::info!(entries = self.len(), file = %path.display(), "pool allowlist reloaded")
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "pool file unreadable; keeping the previous allowlist")
                    }
                }
            }
        }
    }
}

fn read_pool_file(path: &Path) -> Result<Vec<String>, ConfigError> {
    let err = |why: String| ConfigError::PoolFile {
        path: path.display().to_string(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    serde_json::from_str::<Vec<String>>(&text).map_err(|e| {
        err(format!(
            "expected a JSON list of \"host:port\" strings: {e}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_and_host_entries() {
        let a = Allowlist::new(vec!["10.0.0.1:8000".into(), "10.0.0.2".into()], None).unwrap();
        assert!(a.allows("10.0.0.1", 8000));
        assert!(!a.allows("10.0.0.1", 8001));
        assert!(a.allows("10.0.0.2", 1234));
        assert!(!a.allows("169.254.169.254", 80));
        let empty = Allowlist::new(vec![], None).unwrap();
        assert!(!empty.allows("127.0.0.1", 80));
    }

    #[test]
    fn pool_file_is_merged_and_reloaded() {
        let dir = std::env::temp_dir().join(format!("kvroute-sidecar-pool-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("pool.json");
        std::fs::write(&f, r#"["Pod-A:9000"]"#).unwrap();
        let a = Allowlist::new(vec![], Some(f.clone())).unwrap();
        assert!(a.allows("pod-a", 9000));
        std::fs::write(&f, r#"["pod-b:9000"]"#).unwrap();
        a.reload().unwrap();
        assert!(!a.allows("pod-a", 9000));
        assert!(a.allows("pod-b", 9000));
        std::fs::write(&f, "not json").unwrap();
        assert!(a.reload().is_err());
    }

    #[test]
    fn splits_host_port() {
        assert_eq!(split_host_port("h:1"), Some(("h", 1)));
        assert_eq!(split_host_port("[::1]:8"), Some(("[::1]", 8)));
        assert_eq!(split_host_port("::1"), None);
        assert_eq!(split_host_port("h"), None);
    }
}
