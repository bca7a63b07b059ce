//! Envoy 1.40 as the Inference Gateway: the GAIE ext_proc filter in front of an ORIGINAL_DST
//! cluster keyed on `x-gateway-destination-endpoint` (gaie-epp-protocol.md §11.1), with the
//! response path enabled (served-endpoint report, end-of-response) and `envoy.lb` metadata allowed
//! both ways (§11.3). Fail-open is modelled as Istio does it: without a routing header the
//! request goes to a plain round-robin cluster over the pool's endpoints.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::process::ChildProcess;

/// Test-only: a request header Envoy turns into the `envoy.lb.subset_hint` metadata (the
/// HeaderToMetadata form GAIE accepts: one comma-separated string), then removes.
pub const SUBSET_TEST_HEADER: &str = "x-test-subset-hint";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    FullDuplexStreamed,
    Buffered,
}

#[derive(Debug, Clone)]
pub struct EnvoyConfig {
    pub listen_port: u16,
    pub admin_port: u16,
    pub epp_port: u16,
    pub body_mode: BodyMode,
    /// GAIE FailOpen (`failure_mode_allow: true`) vs FailClose.
    pub fail_open: bool,
    /// host:port of every pool endpoint (the fail-open cluster).
    pub pool_endpoints: Vec<String>,
    /// Route straight to this endpoint, with no ext_proc at all (the baseline for overhead).
    pub direct_to: Option<String>,
}

fn socket(addr: &str) -> anyhow::Result<(String, u16)> {
    let (h, p) = addr
        .rsplit_once(':')
        .with_context(|| format!("{addr:?} is not host:port"))?;
    Ok((
        h.to_string(),
        p.parse().with_context(|| format!("bad port in {addr:?}"))?,
    ))
}

fn lb_endpoints(addrs: &[String]) -> anyhow::Result<String> {
    let mut out = String::new();
    for a in addrs {
        let (h, p) = socket(a)?;
        out.push_str(&format!(
            "        - endpoint:\n            address:\n              socket_address: {{ address: {h}, port_value: {p} }}\n"
        ));
    }
    Ok(out)
}

pub fn render(cfg: &EnvoyConfig) -> anyhow::Result<String> {
    let body_mode = match cfg.body_mode {
        BodyMode::FullDuplexStreamed => "FULL_DUPLEX_STREAMED",
        BodyMode::Buffered => "BUFFERED",
    };
    let routes = if let Some(direct) = &cfg.direct_to {
        let _ = socket(direct)?;
        "              - match: { prefix: \"/\" }\n                route: { cluster: direct_cluster, timeout: 0s }\n".to_string()
    } else {
        "              - match:\n                  prefix: \"/\"\n                  headers:\n                  - name: x-gateway-destination-endpoint\n                    present_match: true\n                route: { cluster: original_destination_cluster, timeout: 0s }\n              - match: { prefix: \"/\" }\n                route: { cluster: pool_fallback_cluster, timeout: 0s }\n".to_string()
    };
    let ext_proc = if cfg.direct_to.is_some() {
        String::new()
    } else {
        format!(
            r#"          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: {subset_header}
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
                remove: true
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{ cluster_name: ext_proc_picker }}
                timeout: 10s
              failure_mode_allow: {fail_open}
              message_timeout: 1000s
              processing_mode:
                request_header_mode: SEND
                request_body_mode: {body_mode}
                request_trailer_mode: SEND
                response_header_mode: SEND
                response_body_mode: FULL_DUPLEX_STREAMED
                response_trailer_mode: SEND
              metadata_options:
                receiving_namespaces: {{ untyped: [envoy.lb] }}
                forwarding_namespaces: {{ untyped: [envoy.lb, envoy.lb.subset_hint] }}
"#,
            fail_open = cfg.fail_open,
            subset_header = SUBSET_TEST_HEADER,
        )
    };
    let direct_cluster = match &cfg.direct_to {
        Some(d) => format!(
            "  - name: direct_cluster\n    type: STATIC\n    connect_timeout: 5s\n    lb_policy: ROUND_ROBIN\n    load_assignment:\n      cluster_name: direct_cluster\n      endpoints:\n      - lb_endpoints:\n{}",
            lb_endpoints(std::slice::from_ref(d))?
        ),
        None => String::new(),
    };
    let pool = if cfg.pool_endpoints.is_empty() {
        String::new()
    } else {
        lb_endpoints(&cfg.pool_endpoints)?
    };
    let pool_cluster = if pool.is_empty() {
        String::new()
    } else {
        format!(
            "  - name: pool_fallback_cluster\n    type: STATIC\n    connect_timeout: 5s\n    lb_policy: ROUND_ROBIN\n    load_assignment:\n      cluster_name: pool_fallback_cluster\n      endpoints:\n      - lb_endpoints:\n{pool}"
        )
    };
    Ok(format!(
        r#"admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin} }}
static_resources:
  listeners:
  - name: gateway
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {listen} }}
    # BUFFERED mode holds whole bodies: allow the 1 MB+ prompts the tests send.
    per_connection_buffer_limit_bytes: 33554432
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          codec_type: AUTO
          stream_idle_timeout: 300s
          route_config:
            name: local
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{routes}          http_filters:
{ext_proc}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: ext_proc_picker
    type: STATIC
    connect_timeout: 1s
    lb_policy: ROUND_ROBIN
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: ext_proc_picker
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: 127.0.0.1, port_value: {epp} }}
  - name: original_destination_cluster
    type: ORIGINAL_DST
    connect_timeout: 5s
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
{pool_cluster}{direct_cluster}"#,
        admin = cfg.admin_port,
        listen = cfg.listen_port,
        epp = cfg.epp_port,
    ))
}

/// Starts Envoy and waits until its admin endpoint reports LIVE.
pub async fn start(
    bin: &Path,
    cfg: &EnvoyConfig,
    dir: &Path,
    name: &str,
) -> anyhow::Result<ChildProcess> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, render(cfg)?).with_context(|| format!("writing {}", path.display()))?;
    let args = vec![
        "-c".to_string(),
        path.display().to_string(),
        // Several Envoys run side by side in tests: each needs its own shared-memory base id.
        "--use-dynamic-base-id".to_string(),
        "--log-level".to_string(),
        "warn".to_string(),
        "--concurrency".to_string(),
        "2".to_string(),
    ];
    let mut child = ChildProcess::spawn(name, bin, &args, dir)?;
    let ready_url = format!("http://127.0.0.1:{}/ready", cfg.admin_port);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, _, _)) = super::client::get(&ready_url).await {
            return Ok(child);
        }
        if child.exited() {
            anyhow::bail!("envoy exited during start-up:\n{}", child.log_tail(30));
        }
        if Instant::now() > deadline {
            anyhow::bail!("envoy not ready after 30 s:\n{}", child.log_tail(30));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validate(cfg: &EnvoyConfig) -> (bool, String) {
        let dir =
            std::env::temp_dir().join(format!("kvroute-envoy-validate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join(format!("{}.yaml", cfg.listen_port));
        std::fs::write(&path, render(cfg).expect("renders")).expect("write");
        let out = std::process::Command::new(
            crate::harness::envoy_bin().expect("envoy installed: run ./dev setup"),
        )
        .args(["--mode", "validate", "-c"])
        .arg(&path)
        .output()
        .expect("run envoy");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    }

    #[test]
    fn generated_configs_validate_with_envoy() {
        let base = EnvoyConfig {
            listen_port: 10000,
            admin_port: 9901,
            epp_port: 9002,
            body_mode: BodyMode::FullDuplexStreamed,
            fail_open: false,
            pool_endpoints: vec!["127.0.0.1:8000".into(), "127.0.0.1:8001".into()],
            direct_to: None,
        };
        for cfg in [
            base.clone(),
            EnvoyConfig {
                body_mode: BodyMode::Buffered,
                fail_open: true,
                listen_port: 10001,
                ..base.clone()
            },
            EnvoyConfig {
                direct_to: Some("127.0.0.1:8000".into()),
                listen_port: 10002,
                ..base.clone()
            },
        ] {
            let (ok, out) = validate(&cfg);
            assert!(ok, "envoy rejected the config: {out}");
            assert!(out.contains("OK"), "{out}");
        }
        let bad = EnvoyConfig {
            pool_endpoints: vec!["nohost".into()],
            ..base
        };
        assert!(render(&bad).is_err());
    }
}
