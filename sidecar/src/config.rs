//! Command-line flags (clap, each with a `KVROUTE_SIDECAR_*` environment fallback) and the
//! validated [`Config`] the server runs with.
//!
//! Engine and prefill specs are `key=value` lists (`name=<id or pod name>,url=http://h:p
//! [,dp_rank=N][,bootstrap_port=N]`). A numeric `name` is the instance id itself; any other
//! name is a pod name hashed to Dynamo's instance id, so the sidecar and the EPP agree on ids
//! without sharing configuration.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use kvroute_proto::worker_id::instance_id_for_pod;

/// Why a flag value was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid {flag} {value:?}: {why}")]
    BadSpec {
        flag: &'static str,
        value: String,
        why: String,
    },
    #[error("reading pool file {path}: {why}")]
    PoolFile { path: String, why: String },
}

/// How the disaggregated prefill leg hands KV to the decode leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvConnector {
    /// vLLM NixlConnector: prefill first (`max_tokens=1`, `do_remote_decode`), then decode
    /// with the returned `kv_transfer_params` (llm-d's default "nixlv2").
    Nixlv2,
    /// SGLang bootstrap: the same body plus `bootstrap_host/port/room` to both legs at once.
    Sglang,
}

#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvroute-sidecar",
    version,
    about = "kvroute direct-mode sidecar: OpenAI front that follows the EPP's routing hints"
)]
pub struct Args {
    /// Address the OpenAI front listens on.
    #[arg(long, env = "KVROUTE_SIDECAR_LISTEN", default_value = "127.0.0.1:8100")]
    pub listen: SocketAddr,
    /// A local engine: `name=<instance id or pod name>,url=http://127.0.0.1:8001[,dp_rank=N]`.
    /// Repeatable (one sidecar may front several local engines or dp ranks).
    #[arg(
        long = "engine",
        env = "KVROUTE_SIDECAR_ENGINES",
        value_delimiter = ';',
        default_value = "name=local,url=http://127.0.0.1:8000"
    )]
    pub engines: Vec<String>,
    /// A prefill worker reachable by `x-dynamo-prefill-instance-id`:
    /// `name=<instance id or pod name>,url=http://host:port[,dp_rank=N][,bootstrap_port=N]`.
    #[arg(
        long = "prefill",
        env = "KVROUTE_SIDECAR_PREFILLS",
        value_delimiter = ';'
    )]
    pub prefills: Vec<String>,
    /// The SSRF allowlist: `host:port` (or bare `host`, any port) of the pool's workers that
    /// prefill legs may be sent to, comma-separated.
    #[arg(long, env = "KVROUTE_SIDECAR_POOL_ENDPOINTS", value_delimiter = ',')]
    pub pool_endpoints: Vec<String>,
    /// A JSON list of allowed `host:port` strings, merged with --pool-endpoints and re-read
    /// when it changes (so it can follow the InferencePool).
    #[arg(long, env = "KVROUTE_SIDECAR_POOL_FILE")]
    pub pool_file: Option<PathBuf>,
    /// Serve requests without `x-dynamo-worker-instance-id` on the first local engine instead
    /// of answering 400.
    #[arg(long, env = "KVROUTE_SIDECAR_SERVE_WITHOUT_HINT")]
    pub serve_without_hint: bool,
    /// When the prefill worker answers 5xx or cannot be reached, prefill on the local decode
    /// engine instead of failing the request.
    #[arg(long, env = "KVROUTE_SIDECAR_FALLBACK_LOCAL_PREFILL")]
    pub fallback_local_prefill: bool,
    /// KV connector protocol of the disaggregated flow.
    #[arg(
        long,
        env = "KVROUTE_SIDECAR_KV_CONNECTOR",
        value_enum,
        default_value = "nixlv2"
    )]
    pub kv_connector: KvConnector,
    /// SGLang bootstrap port for prefill targets given by `x-prefiller-host-port` (llm-d's
    /// SGLANG_BOOTSTRAP_PORT default).
    #[arg(
        long,
        env = "KVROUTE_SIDECAR_SGLANG_BOOTSTRAP_PORT",
        default_value_t = 8998
    )]
    pub sglang_bootstrap_port: u16,
    /// Larger request bodies get 413 (only disaggregated requests are read whole).
    #[arg(long, env = "KVROUTE_SIDECAR_MAX_BODY_BYTES", default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// Timeout for connecting to an engine.
    #[arg(
        long,
        env = "KVROUTE_SIDECAR_CONNECT_TIMEOUT_MS",
        default_value_t = 2000
    )]
    pub connect_timeout_ms: u64,
    /// Timeout of the whole prefill leg.
    #[arg(
        long,
        env = "KVROUTE_SIDECAR_PREFILL_TIMEOUT_SECS",
        default_value_t = 300
    )]
    pub prefill_timeout_secs: u64,
    /// Seconds in-flight requests may run after SIGTERM.
    #[arg(
        long,
        env = "KVROUTE_SIDECAR_SHUTDOWN_GRACE_SECS",
        default_value_t = 30
    )]
    pub shutdown_grace_secs: u64,
}

/// One upstream engine (local decode/aggregated engine, or a remote prefill worker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSpec {
    pub name: String,
    pub instance_id: u64,
    pub dp_rank: Option<u32>,
    /// `http://host:port`, no trailing slash.
    pub base_url: String,
    /// `host:port` of `base_url` (what the allowlist compares).
    pub authority: String,
    pub host: String,
    pub bootstrap_port: Option<u16>,
}

impl EngineSpec {
    /// Parses `name=..,url=..[,dp_rank=N][,bootstrap_port=N]`.
    pub fn parse(flag: &'static str, s: &str) -> Result<EngineSpec, ConfigError> {
        let bad = |why: String| ConfigError::BadSpec {
            flag,
            value: s.to_string(),
            why,
        };
        let (mut name, mut url, mut dp_rank, mut bootstrap_port) = (None, None, None, None);
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("expected key=value, got {part:?}")))?;
            match k.trim() {
                "name" => name = Some(v.trim().to_string()),
                "url" => url = Some(v.trim().trim_end_matches('/').to_string()),
                "dp_rank" => {
                    dp_rank = Some(
                        v.trim()
                            .parse::<u32>()
                            .map_err(|e| bad(format!("dp_rank: {e}")))?,
                    )
                }
                "bootstrap_port" => {
                    bootstrap_port = Some(
                        v.trim()
                            .parse::<u16>()
                            .map_err(|e| bad(format!("bootstrap_port: {e}")))?,
                    )
                }
                other => return Err(bad(format!("unknown key {other:?}"))),
            }
        }
        let name = name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| bad("missing name=".into()))?;
        let base_url = url.ok_or_else(|| bad("missing url=".into()))?;
        let uri: http::Uri = base_url.parse().map_err(|e| bad(format!("url: {e}")))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad(
                "url must start with http:// (TLS upstreams are not supported)".into(),
            ));
        }
        let auth = uri
            .authority()
            .ok_or_else(|| bad("url has no host:port".into()))?;
        let host = auth.host().to_ascii_lowercase();
        let port = auth.port_u16().unwrap_or(80);
        let authority = normalize_authority(&host, port);
        let instance_id = name
            .parse::<u64>()
            .unwrap_or_else(|_| instance_id_for_pod(&name));
        Ok(EngineSpec {
            name,
            instance_id,
            dp_rank,
            base_url,
            authority,
            host,
            bootstrap_port,
        })
    }
}

/// `host:port` in one canonical spelling (lower case, IPv6 in brackets).
pub fn normalize_authority(host: &str, port: u16) -> String {
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub engines: Vec<EngineSpec>,
    pub prefills: Vec<EngineSpec>,
    pub pool_endpoints: Vec<String>,
    pub pool_file: Option<PathBuf>,
    pub serve_without_hint: bool,
    pub fallback_local_prefill: bool,
    pub kv_connector: KvConnector,
    pub sglang_bootstrap_port: u16,
    pub max_body_bytes: usize,
    pub connect_timeout: Duration,
    pub prefill_timeout: Duration,
    pub shutdown_grace: Duration,
}

impl Config {
    pub fn from_args(a: &Args) -> Result<Config, ConfigError> {
        let engines = a
            .engines
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| EngineSpec::parse("--engine", s))
            .collect::<Result<Vec<_>, _>>()?;
        if engines.is_empty() {
            return Err(ConfigError::BadSpec {
                flag: "--engine",
                value: String::new(),
                why: "at least one local engine is required".into(),
            });
        }
        let prefills = a
            .prefills
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| EngineSpec::parse("--prefill", s))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Config {
            listen: a.listen,
            engines,
            prefills,
            pool_endpoints: a
                .pool_endpoints
                .iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            pool_file: a.pool_file.clone(),
            serve_without_hint: a.serve_without_hint,
            fallback_local_prefill: a.fallback_local_prefill,
            kv_connector: a.kv_connector,
            sglang_bootstrap_port: a.sglang_bootstrap_port,
            max_body_bytes: a.max_body_bytes,
            connect_timeout: Duration::from_millis(a.connect_timeout_ms),
            prefill_timeout: Duration::from_secs(a.prefill_timeout_secs),
            shutdown_grace: Duration::from_secs(a.shutdown_grace_secs),
        })
    }

    /// A config for `engines` with every other setting at its default (tests, benches).
    pub fn for_engines(engines: &[&str]) -> Result<Config, ConfigError> {
        let mut argv = vec!["kvroute-sidecar".to_string()];
        for e in engines {
            argv.push("--engine".into());
            argv.push((*e).to_string());
        }
        let args = Args::try_parse_from(argv).map_err(|e| ConfigError::BadSpec {
            flag: "--engine",
            value: engines.join(" "),
            why: e.to_string(),
        })?;
        Config::from_args(&args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_engine_specs() {
        let e =
            EngineSpec::parse("--engine", "name=42,url=http://127.0.0.1:8001/,dp_rank=1").unwrap();
        assert_eq!(e.instance_id, 42);
        assert_eq!(e.dp_rank, Some(1));
        assert_eq!(e.base_url, "http://127.0.0.1:8001");
        assert_eq!(e.authority, "127.0.0.1:8001");
        let p = EngineSpec::parse("--engine", "name=pod-a,url=http://Host:9000").unwrap();
        assert_eq!(p.instance_id, instance_id_for_pod("pod-a"));
        assert_eq!(p.authority, "host:9000");
        assert!(EngineSpec::parse("--engine", "url=http://h:1").is_err());
        assert!(EngineSpec::parse("--engine", "name=a,url=https://h:1").is_err());
        assert!(EngineSpec::parse("--engine", "name=a,url=http://h:1,zz=1").is_err());
    }

    #[test]
    fn default_config_works_on_one_machine() {
        let c = Config::from_args(&Args::try_parse_from(["kvroute-sidecar"]).unwrap()).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:8100");
        assert_eq!(c.engines.len(), 1);
        assert_eq!(c.kv_connector, KvConnector::Nixlv2);
    }

    #[test]
    fn ipv6_authorities_are_bracketed() {
        assert_eq!(normalize_authority("[::1]", 80), "[::1]:80");
        assert_eq!(normalize_authority("::1", 80), "[::1]:80");
    }
}
