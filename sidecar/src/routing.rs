//! Reads the EPP's routing hints and resolves them to upstreams: the local engine that decodes
//! (or serves aggregated) and, for disaggregated requests, the prefill worker.
//!
//! Header names follow Dynamo's direct-mode frontend (`x-dynamo-worker-instance-id`,
//! `x-dynamo-dp-rank`, `x-dynamo-prefill-instance-id`, `x-dynamo-prefill-dp-rank`, with their
//! legacy aliases) and llm-d's P/D sidecar (`x-prefiller-host-port`); see
//! routing-and-disagg.md §7.2, §7.3 and §8. **Trust model:** the hints are trusted because the
//! only path to the sidecar is through the gateway, whose EPP overwrites or strips them
//! (DESIGN contract 2); the sidecar's port must not be exposed otherwise. The one thing that is
//! checked anyway is where a prefill leg may go (the SSRF allowlist): a mistake there would
//! turn the sidecar into an open relay inside the cluster.

use std::sync::Arc;

use http::{HeaderMap, StatusCode};
use kvroute_proto::hints;

use crate::allowlist::{split_host_port, Allowlist};
use crate::config::{Config, EngineSpec};

/// Decode-worker id headers, in priority order (Dynamo's name, then legacy aliases).
const WORKER_ID_HEADERS: &[&str] = &[
    hints::WORKER_INSTANCE_ID,
    "x-worker-instance-id",
    "x-dynamo-decode-worker-id",
];
const DP_RANK_HEADERS: &[&str] = &[hints::DP_RANK, "x-dp-rank", "x-data-parallel-rank"];
const PREFILL_ID_HEADERS: &[&str] = &[
    hints::PREFILL_INSTANCE_ID,
    "x-prefill-instance-id",
    "x-dynamo-prefill-worker-id",
];

/// Where a prefill leg goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillTarget {
    /// `http://host:port`.
    pub base_url: String,
    pub host: String,
    pub port: u16,
    pub dp_rank: Option<u32>,
    /// SGLang bootstrap port of this prefill worker.
    pub bootstrap_port: Option<u16>,
}

/// The resolved route of one request.
#[derive(Debug, Clone)]
pub struct Route {
    pub engine: Arc<EngineSpec>,
    /// The dp rank to ask the engine for, when the engine entry serves several ranks itself.
    pub dp_rank: Option<u32>,
    pub prefill: Option<PrefillTarget>,
}

impl Route {
    /// `aggregated` or `disaggregated` (metric label).
    pub fn mode(&self) -> &'static str {
        if self.prefill.is_some() {
            "disaggregated"
        } else {
            "aggregated"
        }
    }
}

/// Why a request could not be routed; each maps to an HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("direct routing requires {} (set by the EPP); this sidecar serves only requests routed by the gateway's endpoint picker (start it with --serve-without-hint to serve such requests on its first local engine)", hints::WORKER_INSTANCE_ID)]
    MissingHint,
    #[error("invalid {header} header {value:?}: {why}")]
    BadHeader {
        header: &'static str,
        value: String,
        why: String,
    },
    #[error("instance_id={id} not found on this sidecar (local engines: {known})")]
    UnknownInstance { id: u64, known: String },
    #[error("instance_id={id} dp_rank={rank} not found on this sidecar")]
    UnknownDpRank { id: u64, rank: u32 },
    #[error("prefill instance_id={id} not found (configure it with --prefill name={id},url=...)")]
    UnknownPrefill { id: u64 },
    #[error("prefill target {target} is not a worker of this pool (SSRF allowlist: --pool-endpoints / --pool-file)")]
    Forbidden { target: String },
    #[error(
        "{} is disaggregated but no prefill worker was given ({} or {})",
        hints::ROUTING_MODE,
        hints::PREFILL_INSTANCE_ID,
        hints::PREFILLER_HOST_PORT
    )]
    DisaggWithoutPrefill,
}

impl RouteError {
    pub fn status(&self) -> StatusCode {
        match self {
            RouteError::MissingHint
            | RouteError::BadHeader { .. }
            | RouteError::DisaggWithoutPrefill => StatusCode::BAD_REQUEST,
            RouteError::Forbidden { .. } => StatusCode::FORBIDDEN,
            // The EPP picked a worker this pod does not run (stale view, pod restarted): a
            // server-side condition the gateway may retry elsewhere, not a client error.
            RouteError::UnknownInstance { .. }
            | RouteError::UnknownDpRank { .. }
            | RouteError::UnknownPrefill { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    pub fn error_type(&self) -> &'static str {
        match self.status() {
            StatusCode::BAD_REQUEST => "invalid_request_error",
            StatusCode::FORBIDDEN => "permission_error",
            _ => "service_unavailable",
        }
    }
}

/// The routing table, built once from the config.
#[derive(Debug)]
pub struct Router {
    engines: Vec<Arc<EngineSpec>>,
    prefills: Vec<EngineSpec>,
    serve_without_hint: bool,
    pub allowlist: Arc<Allowlist>,
}

fn first_header<'a>(
    headers: &'a HeaderMap,
    names: &[&'static str],
) -> Option<(&'static str, &'a str, bool)> {
    names.iter().find_map(|&n| {
        headers.get(n).map(|v| match v.to_str() {
            Ok(s) => (n, s.trim(), true),
            Err(_) => (n, "", false),
        })
    })
}

fn parse_num<T: std::str::FromStr>(
    headers: &HeaderMap,
    names: &[&'static str],
) -> Result<Option<T>, RouteError>
where
    T::Err: std::fmt::Display,
{
    match first_header(headers, names) {
        None => Ok(None),
        Some((header, value, ascii)) => {
            if !ascii {
                return Err(RouteError::BadHeader {
                    header,
                    value: "<non-ASCII>".into(),
                    why: "not a decimal number".into(),
                });
            }
            value
                .parse::<T>()
                .map(Some)
                .map_err(|e| RouteError::BadHeader {
                    header,
                    value: value.to_string(),
                    why: e.to_string(),
                })
        }
    }
}

impl Router {
    pub fn new(cfg: &Config, allowlist: Arc<Allowlist>) -> Router {
        Router {
            engines: cfg.engines.iter().cloned().map(Arc::new).collect(),
            prefills: cfg.prefills.clone(),
            serve_without_hint: cfg.serve_without_hint,
            allowlist,
        }
    }

    pub fn engines(&self) -> &[Arc<EngineSpec>] {
        &self.engines
    }

    /// Resolves the hints of one request.
    pub fn route(&self, headers: &HeaderMap) -> Result<Route, RouteError> {
        let worker: Option<u64> = parse_num(headers, WORKER_ID_HEADERS)?;
        let dp_rank: Option<u32> = parse_num(headers, DP_RANK_HEADERS)?;
        let (engine, forward_rank) = match worker {
            None if self.serve_without_hint => match self.engines.first() {
                Some(e) => (e.clone(), dp_rank.filter(|_| e.dp_rank.is_none())),
                None => return Err(RouteError::MissingHint),
            },
            None => return Err(RouteError::MissingHint),
            Some(id) => self.local_engine(id, dp_rank)?,
        };
        let prefill = self.prefill_target(headers, dp_rank)?;
        if prefill.is_none()
            && first_header(headers, &[hints::ROUTING_MODE])
                .is_some_and(|(_, v, _)| v.eq_ignore_ascii_case("disaggregated"))
        {
            return Err(RouteError::DisaggWithoutPrefill);
        }
        Ok(Route {
            engine,
            dp_rank: forward_rank,
            prefill,
        })
    }

    /// The engine for `id` (+ rank): an entry with exactly that rank, else one that serves all
    /// ranks itself (the rank is then forwarded to it), else — with no rank asked — the first.
    fn local_engine(
        &self,
        id: u64,
        rank: Option<u32>,
    ) -> Result<(Arc<EngineSpec>, Option<u32>), RouteError> {
        let mut candidates = self
            .engines
            .iter()
            .filter(|e| e.instance_id == id)
            .peekable();
        if candidates.peek().is_none() {
            return Err(RouteError::UnknownInstance {
                id,
                known: self
                    .engines
                    .iter()
                    .map(|e| format!("{}={}", e.name, e.instance_id))
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        let candidates: Vec<&Arc<EngineSpec>> = candidates.collect();
        match rank {
            Some(r) => {
                if let Some(e) = candidates.iter().find(|e| e.dp_rank == Some(r)) {
                    return Ok(((*e).clone(), None));
                }
                match candidates.iter().find(|e| e.dp_rank.is_none()) {
                    Some(e) => Ok(((*e).clone(), Some(r))),
                    None => Err(RouteError::UnknownDpRank { id, rank: r }),
                }
            }
            None => Ok((candidates[0].clone(), None)),
        }
    }

    fn prefill_target(
        &self,
        headers: &HeaderMap,
        decode_rank: Option<u32>,
    ) -> Result<Option<PrefillTarget>, RouteError> {
        // Dynamo: prefill_dp_rank.or(dp_rank).
        let prefill_rank: Option<u32> =
            parse_num::<u32>(headers, &[hints::PREFILL_DP_RANK])?.or(decode_rank);
        if let Some((header, value, ascii)) = first_header(headers, &[hints::PREFILLER_HOST_PORT]) {
            // llm-d: a comma list, the first entry is used.
            let first = value.split(',').map(str::trim).find(|s| !s.is_empty());
            let Some((host, port)) = first.filter(|_| ascii).and_then(split_host_port) else {
                return Err(RouteError::BadHeader {
                    header,
                    value: value.to_string(),
                    why: "expected host:port".into(),
                });
            };
            if !self.allowlist.allows(host, port) {
                return Err(RouteError::Forbidden {
                    target: format!("{host}:{port}"),
                });
            }
            let bootstrap_port = self
                .prefills
                .iter()
                .find(|p| p.authority == crate::config::normalize_authority(host, port))
                .and_then(|p| p.bootstrap_port);
            return Ok(Some(PrefillTarget {
                base_url: format!("http://{host}:{port}"),
                host: host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string(),
                port,
                dp_rank: prefill_rank,
                bootstrap_port,
            }));
        }
        let Some(id) = parse_num::<u64>(headers, PREFILL_ID_HEADERS)? else {
            return Ok(None);
        };
        let spec = match prefill_rank {
            Some(r) => self
                .prefills
                .iter()
                .filter(|p| p.instance_id == id)
                .find(|p| p.dp_rank == Some(r) || p.dp_rank.is_none()),
            None => self.prefills.iter().find(|p| p.instance_id == id),
        }
        .ok_or(RouteError::UnknownPrefill { id })?;
        let port = split_host_port(&spec.authority).map_or(80, |(_, p)| p);
        if !self.allowlist.allows(&spec.host, port) {
            return Err(RouteError::Forbidden {
                target: spec.authority.clone(),
            });
        }
        Ok(Some(PrefillTarget {
            base_url: spec.base_url.clone(),
            host: spec
                .host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port,
            // A per-rank entry is its own engine; one that serves all ranks is told the rank.
            dp_rank: if spec.dp_rank.is_some() {
                None
            } else {
                prefill_rank
            },
            bootstrap_port: spec.bootstrap_port,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use http::HeaderValue;

    fn router(serve_without_hint: bool) -> Router {
        let mut cfg = Config::for_engines(&[
            "name=1,url=http://127.0.0.1:9001",
            "name=2,url=http://127.0.0.1:9002,dp_rank=0",
            "name=2,url=http://127.0.0.1:9003,dp_rank=1",
        ])
        .unwrap();
        cfg.serve_without_hint = serve_without_hint;
        cfg.prefills = vec![EngineSpec::parse(
            "--prefill",
            "name=7,url=http://10.0.0.7:8000,bootstrap_port=8998",
        )
        .unwrap()];
        let allow = Arc::new(
            Allowlist::new(vec!["10.0.0.7:8000".into(), "10.0.0.8".into()], None).unwrap(),
        );
        Router::new(&cfg, allow)
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn resolves_instance_and_rank() {
        let r = router(false);
        let route = r
            .route(&headers(&[
                (hints::WORKER_INSTANCE_ID, "2"),
                (hints::DP_RANK, "1"),
            ]))
            .unwrap();
        assert_eq!(route.engine.base_url, "http://127.0.0.1:9003");
        assert_eq!(route.dp_rank, None);
        let route = r
            .route(&headers(&[
                ("x-worker-instance-id", "1"),
                (hints::DP_RANK, "3"),
            ]))
            .unwrap();
        assert_eq!(route.engine.base_url, "http://127.0.0.1:9001");
        assert_eq!(route.dp_rank, Some(3));
        assert_eq!(
            r.route(&headers(&[
                (hints::WORKER_INSTANCE_ID, "2"),
                (hints::DP_RANK, "5")
            ]))
            .unwrap_err(),
            RouteError::UnknownDpRank { id: 2, rank: 5 }
        );
        let e = r
            .route(&headers(&[(hints::WORKER_INSTANCE_ID, "99")]))
            .unwrap_err();
        assert!(e.to_string().contains("instance_id=99 not found"), "{e}");
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn missing_and_bad_hints() {
        let e = router(false).route(&HeaderMap::new()).unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(e
            .to_string()
            .contains("requires x-dynamo-worker-instance-id (set by the EPP)"));
        let route = router(true).route(&HeaderMap::new()).unwrap();
        assert_eq!(route.engine.base_url, "http://127.0.0.1:9001");
        let e = router(false)
            .route(&headers(&[(hints::WORKER_INSTANCE_ID, "abc")]))
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn prefill_targets_and_ssrf() {
        let r = router(false);
        let route = r
            .route(&headers(&[
                (hints::WORKER_INSTANCE_ID, "1"),
                (hints::PREFILLER_HOST_PORT, "10.0.0.8:1234, 10.0.0.9:1"),
            ]))
            .unwrap();
        let p = route.prefill.unwrap();
        assert_eq!(p.base_url, "http://10.0.0.8:1234");
        let e = r
            .route(&headers(&[
                (hints::WORKER_INSTANCE_ID, "1"),
                (hints::PREFILLER_HOST_PORT, "169.254.169.254:80"),
            ]))
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::FORBIDDEN);
        let route = r
            .route(&headers(&[
                (hints::WORKER_INSTANCE_ID, "1"),
                (hints::PREFILL_INSTANCE_ID, "7"),
            ]))
            .unwrap();
        assert_eq!(route.prefill.unwrap().bootstrap_port, Some(8998));
        assert_eq!(
            r.route(&headers(&[
                (hints::WORKER_INSTANCE_ID, "1"),
                (hints::PREFILL_INSTANCE_ID, "8")
            ]))
            .unwrap_err(),
            RouteError::UnknownPrefill { id: 8 }
        );
        assert_eq!(
            r.route(&headers(&[
                (hints::WORKER_INSTANCE_ID, "1"),
                (hints::ROUTING_MODE, "disaggregated")
            ]))
            .unwrap_err(),
            RouteError::DisaggWithoutPrefill
        );
    }
}
