//! End-to-end: the EPP's operator-facing surface — gRPC health that turns SERVING only once
//! discovery has synced, Prometheus metrics with GAIE's names, and the conformance test header.

use std::time::{Duration, Instant};

use kvroute_tests::harness::client;
use kvroute_tests::harness::process::ChildProcess;
use kvroute_tests::harness::stack::{metric_value, start_worker, write_workers_file, StackOptions};
use kvroute_tests::harness::{free_port, model_dir, workspace_bin};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

async fn status(
    client: &mut HealthClient<tonic::transport::Channel>,
    service: &str,
) -> Result<ServingStatus, tonic::Code> {
    client
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map(|r| ServingStatus::try_from(r.into_inner().status).unwrap_or(ServingStatus::Unknown))
        .map_err(|s| s.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_serving_after_discovery_sync_and_metrics_use_gaie_names() -> anyhow::Result<()>
{
    let opts = StackOptions::default();
    let worker = start_worker("ctl-worker-0", &opts, &[]).await?;
    let workers_file = opts.log_dir.join("late-workers.json");
    let (grpc, health, metrics) = (free_port()?, free_port()?, free_port()?);
    let args: Vec<String> = vec![
        "--grpc-addr".into(),
        format!("127.0.0.1:{grpc}"),
        "--health-addr".into(),
        format!("127.0.0.1:{health}"),
        "--metrics-addr".into(),
        format!("127.0.0.1:{metrics}"),
        "--model-dir".into(),
        model_dir()?.display().to_string(),
        "--workers-file".into(),
        workers_file.display().to_string(),
        "--test-epp-header".into(),
    ];
    let _epp = ChildProcess::spawn(
        "epp-ctl",
        &workspace_bin("kvroute-epp")?,
        &args,
        &opts.log_dir,
    )?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut hc = loop {
        match tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{health}"))?
            .connect()
            .await
        {
            Ok(ch) => break HealthClient::new(ch),
            Err(e) => {
                anyhow::ensure!(Instant::now() < deadline, "health port never opened: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    // Wait until the reporter has published its first statuses.
    while status(&mut hc, "liveness").await != Ok(ServingStatus::Serving) {
        anyhow::ensure!(Instant::now() < deadline, "liveness never SERVING");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // No worker file yet: discovery has not synced, so readiness names are NOT_SERVING.
    for s in [
        "",
        "readiness",
        "inference-extension",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        assert_eq!(
            status(&mut hc, s).await,
            Ok(ServingStatus::NotServing),
            "service {s:?} before sync"
        );
    }
    assert_eq!(
        status(&mut hc, "no-such-service").await,
        Err(tonic::Code::NotFound)
    );

    write_workers_file(&workers_file, &[&worker])?;
    let deadline = Instant::now() + Duration::from_secs(15);
    while status(&mut hc, "inference-extension").await != Ok(ServingStatus::Serving) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "never SERVING after the worker file appeared"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for s in [
        "",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
        "liveness",
    ] {
        assert_eq!(
            status(&mut hc, s).await,
            Ok(ServingStatus::Serving),
            "service {s:?} after sync"
        );
    }

    let (code, _, body) = client::get(&format!("http://127.0.0.1:{metrics}/metrics")).await?;
    assert_eq!(code, 200);
    let text = String::from_utf8_lossy(&body);
    assert_eq!(metric_value(&text, "inference_pool_ready_pods"), Some(1.0));
    for name in [
        "inference_extension_scheduler_e2e_duration_seconds",
        "kvroute_epp_kv_hit_rate",
        "kvroute_epp_tokenize_duration_seconds",
        "kvroute_epp_kv_event_lag_seconds",
    ] {
        assert!(
            text.contains(&format!("# TYPE {name} histogram")),
            "missing histogram {name}"
        );
    }
    for name in [
        "kvroute_epp_index_blocks",
        "kvroute_epp_kv_events_applied_total",
        "inference_pool_ready_pods",
    ] {
        assert!(text.contains(name), "missing {name}");
    }
    let (code, _, _) = client::get(&format!("http://127.0.0.1:{metrics}/other")).await?;
    assert_eq!(code, 404);
    Ok(())
}
