//! The whole local gateway stack: N simulated workers, the EPP (discovering them from a worker
//! file, so tests can drop one), and Envoy in front. `./dev up` and the end-to-end tests both
//! start it through here.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvroute_proto::worker_id::instance_id_for_pod;

use super::envoy::{self, BodyMode, EnvoyConfig};
use super::process::ChildProcess;
use super::{client, envoy_bin, free_port, model_dir, workspace_bin};

#[derive(Debug, Clone)]
pub struct StackOptions {
    /// Aggregated workers.
    pub workers: usize,
    /// Disaggregated serving: prefill workers, and decode workers each behind a sidecar.
    pub prefill_workers: usize,
    pub decode_workers: usize,
    /// Topology zones, assigned round-robin within each role (empty: no topology).
    pub zones: Vec<String>,
    /// KV transfer policy of every worker when zones are set: `required` or `preferred`, and the
    /// preferred weight.
    pub kv_transfer: (String, f32),
    /// Gateway port; a free one when `None`.
    pub gateway_port: Option<u16>,
    pub policy: String,
    pub body_mode: BodyMode,
    pub fail_open: bool,
    pub speedup: f64,
    pub kv_blocks: u64,
    pub block_size: u32,
    pub model: String,
    pub extra_epp_args: Vec<String>,
    pub extra_worker_args: Vec<String>,
    pub log_dir: PathBuf,
    /// Fixed ports for the EPP (ext_proc, health, metrics) instead of free ones.
    pub epp_ports: Option<(u16, u16, u16)>,
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            workers: 4,
            prefill_workers: 0,
            decode_workers: 0,
            zones: Vec::new(),
            kv_transfer: ("required".into(), 0.0),
            gateway_port: None,
            policy: "kv".into(),
            body_mode: BodyMode::FullDuplexStreamed,
            fail_open: false,
            speedup: 50.0,
            kv_blocks: 4096,
            block_size: 16,
            model: "Qwen/Qwen3-0.6B".into(),
            extra_epp_args: Vec::new(),
            extra_worker_args: Vec::new(),
            log_dir: std::env::temp_dir().join(format!(
                "kvroute-stack-{}-{}",
                std::process::id(),
                unique()
            )),
            epp_ports: None,
        }
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

pub struct WorkerHandle {
    pub name: String,
    pub http: String,
    pub grpc: String,
    pub instance_id: u64,
    pub role: String,
    pub zone: Option<String>,
    /// The sidecar in front of a decode worker: its address is the gateway's destination.
    pub sidecar: Option<(String, ChildProcess)>,
    pub process: ChildProcess,
}

impl WorkerHandle {
    /// Where the gateway sends this worker's requests.
    pub fn destination(&self) -> &str {
        self.sidecar
            .as_ref()
            .map(|(a, _)| a.as_str())
            .unwrap_or(&self.http)
    }
}

pub struct Stack {
    pub opts: StackOptions,
    pub gateway_url: String,
    pub epp_grpc_port: u16,
    pub epp_health_port: u16,
    pub epp_metrics_port: u16,
    pub workers_file: PathBuf,
    pub workers: Vec<WorkerHandle>,
    pub epp: Option<ChildProcess>,
    pub envoy: Option<ChildProcess>,
}

pub async fn start_worker(
    name: &str,
    opts: &StackOptions,
    extra: &[String],
) -> anyhow::Result<WorkerHandle> {
    let http = format!("127.0.0.1:{}", free_port()?);
    let grpc = format!("127.0.0.1:{}", free_port()?);
    let mut args: Vec<String> = [
        "--engine",
        "sim",
        "--listen",
        &http,
        "--grpc-listen",
        &grpc,
        "--model",
        &opts.model,
        "--name",
        name,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend([
        "--model-dir".into(),
        model_dir()?.display().to_string(),
        "--block-size".into(),
        opts.block_size.to_string(),
        "--kv-blocks".into(),
        opts.kv_blocks.to_string(),
        "--speedup".into(),
        opts.speedup.to_string(),
    ]);
    args.extend(opts.extra_worker_args.iter().cloned());
    args.extend(extra.iter().cloned());
    let mut process = ChildProcess::spawn(
        name,
        &workspace_bin("kvroute-worker")?,
        &args,
        &opts.log_dir,
    )?;
    let url = format!("http://{http}/health");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, _, _)) = client::get(&url).await {
            break;
        }
        if process.exited() {
            anyhow::bail!(
                "worker {name} exited during start-up:\n{}",
                process.log_tail(30)
            );
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "worker {name} not healthy after 30 s:\n{}",
                process.log_tail(30)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let flag = |k: &str| {
        extra
            .iter()
            .position(|a| a == k)
            .and_then(|i| extra.get(i + 1))
            .cloned()
    };
    Ok(WorkerHandle {
        name: name.to_string(),
        instance_id: instance_id_for_pod(name),
        http,
        grpc,
        role: flag("--role").unwrap_or_else(|| "aggregated".into()),
        zone: flag("--topology-domain").and_then(|d| d.strip_prefix("zone=").map(str::to_string)),
        sidecar: None,
        process,
    })
}

/// Starts a sidecar fronting `worker`, allowed to call `prefill_endpoints`.
pub async fn start_sidecar(
    worker: &mut WorkerHandle,
    prefill_endpoints: &[String],
    opts: &StackOptions,
) -> anyhow::Result<()> {
    let addr = format!("127.0.0.1:{}", free_port()?);
    let mut args = vec![
        "--listen".to_string(),
        addr.clone(),
        "--engine".into(),
        format!("name={},url=http://{}", worker.instance_id, worker.http),
    ];
    if !prefill_endpoints.is_empty() {
        args.push("--pool-endpoints".into());
        args.push(prefill_endpoints.join(","));
    }
    let name = format!("{}-sidecar", worker.name);
    let mut process = ChildProcess::spawn(
        &name,
        &workspace_bin("kvroute-sidecar")?,
        &args,
        &opts.log_dir,
    )?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, _, _)) = client::get(&format!("http://{addr}/health")).await {
            break;
        }
        if process.exited() {
            anyhow::bail!(
                "sidecar {name} exited during start-up:\n{}",
                process.log_tail(30)
            );
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "sidecar {name} not healthy after 30 s:\n{}",
            process.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.sidecar = Some((addr, process));
    Ok(())
}

/// Worker flags for role and topology.
fn role_args(role: &str, zone: Option<&String>, opts: &StackOptions) -> Vec<String> {
    let mut a = vec!["--role".to_string(), role.to_string()];
    if let Some(z) = zone {
        a.extend([
            "--topology-domain".to_string(),
            format!("zone={z}"),
            "--kv-transfer-domain".into(),
            "zone".into(),
            "--kv-transfer-enforcement".into(),
            opts.kv_transfer.0.clone(),
            "--kv-transfer-preferred-weight".into(),
            opts.kv_transfer.1.to_string(),
        ]);
    }
    a
}

pub fn write_workers_file(path: &std::path::Path, workers: &[&WorkerHandle]) -> anyhow::Result<()> {
    let list: Vec<serde_json::Value> = workers
        .iter()
        .map(|w| serde_json::json!({"name": w.name, "grpc": w.grpc, "http": w.destination()}))
        .collect();
    let tmp = path.with_extension("tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(&serde_json::json!({ "workers": list }))?,
    )?;
    // Rename so the EPP never reads a half-written file.
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

impl Stack {
    pub async fn start(opts: StackOptions) -> anyhow::Result<Stack> {
        std::fs::create_dir_all(&opts.log_dir)?;
        let mut workers = Vec::new();
        for i in 0..opts.workers {
            workers.push(start_worker(&format!("sim-worker-{i}"), &opts, &[]).await?);
        }
        let zone =
            |i: usize| (!opts.zones.is_empty()).then(|| opts.zones[i % opts.zones.len()].clone());
        let mut prefill_endpoints = Vec::new();
        for i in 0..opts.prefill_workers {
            let args = role_args("prefill", zone(i).as_ref(), &opts);
            let w = start_worker(&format!("prefill-worker-{i}"), &opts, &args).await?;
            prefill_endpoints.push(w.http.clone());
            workers.push(w);
        }
        for i in 0..opts.decode_workers {
            let args = role_args("decode", zone(i).as_ref(), &opts);
            let mut w = start_worker(&format!("decode-worker-{i}"), &opts, &args).await?;
            start_sidecar(&mut w, &prefill_endpoints, &opts).await?;
            workers.push(w);
        }
        let workers_file = opts.log_dir.join("workers.json");
        write_workers_file(&workers_file, &workers.iter().collect::<Vec<_>>())?;
        let (epp_grpc_port, epp_health_port, epp_metrics_port) = match opts.epp_ports {
            Some(p) => p,
            None => (free_port()?, free_port()?, free_port()?),
        };
        let mut stack = Stack {
            gateway_url: String::new(),
            epp_grpc_port,
            epp_health_port,
            epp_metrics_port,
            workers_file,
            workers,
            epp: None,
            envoy: None,
            opts,
        };
        stack.start_epp().await?;
        let listen_port = match stack.opts.gateway_port {
            Some(p) => p,
            None => free_port()?,
        };
        let cfg = EnvoyConfig {
            listen_port,
            admin_port: free_port()?,
            epp_port: epp_grpc_port,
            body_mode: stack.opts.body_mode,
            fail_open: stack.opts.fail_open,
            pool_endpoints: stack
                .workers
                .iter()
                .filter(|w| w.role != "prefill")
                .map(|w| w.destination().to_string())
                .collect(),
            direct_to: None,
        };
        stack.envoy = Some(envoy::start(&envoy_bin()?, &cfg, &stack.opts.log_dir, "envoy").await?);
        stack.gateway_url = format!("http://127.0.0.1:{listen_port}");
        Ok(stack)
    }

    /// (Re)starts the EPP and waits until it routes to every listed worker.
    pub async fn start_epp(&mut self) -> anyhow::Result<()> {
        let mut args = vec![
            "--workers-file".to_string(),
            self.workers_file.display().to_string(),
            "--model".into(),
            self.opts.model.clone(),
            "--block-size".into(),
            self.opts.block_size.to_string(),
            "--policy".into(),
            self.opts.policy.clone(),
        ];
        args.extend(self.opts.extra_epp_args.iter().cloned());
        let ports = (
            self.epp_grpc_port,
            self.epp_health_port,
            self.epp_metrics_port,
        );
        let epp =
            EppProcess::start("epp", ports, &args, &self.opts.log_dir, self.workers.len()).await?;
        self.epp = Some(epp.process);
        Ok(())
    }

    pub fn stop_epp(&mut self) {
        if let Some(mut e) = self.epp.take() {
            e.stop();
        }
    }

    /// Removes workers from the EPP's worker file (discovery drops them) and waits until the EPP
    /// reports the smaller pool.
    pub async fn drop_from_discovery(&self, names: &[&str]) -> anyhow::Result<()> {
        let keep: Vec<&WorkerHandle> = self
            .workers
            .iter()
            .filter(|w| !names.contains(&w.name.as_str()))
            .collect();
        write_workers_file(&self.workers_file, &keep)?;
        let want = keep.len() as f64;
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(n)) = self.epp_metric("inference_pool_ready_pods").await {
                if n == want {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::bail!("EPP did not drop {names:?} within 15 s")
    }

    /// Reads one unlabelled sample (or the sum of a labelled family) from the EPP's /metrics.
    pub async fn epp_metric(&self, name: &str) -> anyhow::Result<Option<f64>> {
        let (_, _, body) = client::get(&format!(
            "http://127.0.0.1:{}/metrics",
            self.epp_metrics_port
        ))
        .await?;
        Ok(metric_value(&String::from_utf8_lossy(&body), name))
    }

    pub fn worker_by_id(&self, id: u64) -> Option<&WorkerHandle> {
        self.workers.iter().find(|w| w.instance_id == id)
    }
}

/// A running `kvroute-epp`.
pub struct EppProcess {
    pub process: ChildProcess,
    pub grpc_port: u16,
    pub health_port: u16,
    pub metrics_port: u16,
}

impl EppProcess {
    /// Starts the EPP on `ports` (ext_proc, health, metrics) with `args` (discovery, policy, ...)
    /// and waits until it reports `ready_workers` ready pods.
    pub async fn start(
        name: &str,
        ports: (u16, u16, u16),
        args: &[String],
        log_dir: &std::path::Path,
        ready_workers: usize,
    ) -> anyhow::Result<EppProcess> {
        let (grpc_port, health_port, metrics_port) = ports;
        let mut all = vec![
            "--grpc-addr".to_string(),
            format!("127.0.0.1:{grpc_port}"),
            "--health-addr".into(),
            format!("127.0.0.1:{health_port}"),
            "--metrics-addr".into(),
            format!("127.0.0.1:{metrics_port}"),
            "--model-dir".into(),
            model_dir()?.display().to_string(),
        ];
        all.extend(args.iter().cloned());
        let mut process = ChildProcess::spawn(name, &workspace_bin("kvroute-epp")?, &all, log_dir)?;
        let url = format!("http://127.0.0.1:{metrics_port}/metrics");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok((200, _, body)) = client::get(&url).await {
                let ready =
                    metric_value(&String::from_utf8_lossy(&body), "inference_pool_ready_pods");
                if ready.is_some_and(|n| n >= ready_workers as f64) {
                    break;
                }
            }
            if process.exited() {
                anyhow::bail!("EPP exited during start-up:\n{}", process.log_tail(40));
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "EPP not ready with {ready_workers} workers after 60 s:\n{}",
                    process.log_tail(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(EppProcess {
            process,
            grpc_port,
            health_port,
            metrics_port,
        })
    }

    /// Starts an EPP on free ports that discovers `workers` from flags.
    pub async fn for_workers(
        workers: &[&WorkerHandle],
        extra: &[String],
        log_dir: &std::path::Path,
    ) -> anyhow::Result<EppProcess> {
        let mut args = Vec::new();
        for w in workers {
            args.push("--worker".to_string());
            args.push(format!("name={},grpc={},http={}", w.name, w.grpc, w.http));
        }
        args.extend(extra.iter().cloned());
        let ports = (free_port()?, free_port()?, free_port()?);
        Self::start(
            &format!("epp-{}", ports.0),
            ports,
            &args,
            log_dir,
            workers.len(),
        )
        .await
    }

    pub async fn metric(&self, name: &str) -> anyhow::Result<Option<f64>> {
        let (_, _, body) =
            client::get(&format!("http://127.0.0.1:{}/metrics", self.metrics_port)).await?;
        Ok(metric_value(&String::from_utf8_lossy(&body), name))
    }
}

/// Sum of every sample of metric `name` in a Prometheus text exposition.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let base = series.split('{').next().unwrap_or(series);
        if base == name {
            if let Ok(v) = value.parse::<f64>() {
                *found.get_or_insert(0.0) += v;
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_metric_values() {
        let text = "# HELP x y\nfoo 3\nbar{a=\"1\"} 2\nbar{a=\"2\"} 5\nfoo_total 9\n";
        assert_eq!(super::metric_value(text, "foo"), Some(3.0));
        assert_eq!(super::metric_value(text, "bar"), Some(7.0));
        assert_eq!(super::metric_value(text, "baz"), None);
    }
}
