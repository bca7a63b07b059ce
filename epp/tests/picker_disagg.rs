//! The picker's disaggregated path: prefill by KV overlap, decode by load, topology constraints
//! from the prefill worker's metadata, conditional disaggregation. Real tokenizer and index; the
//! pool is filled directly (no network).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvroute_epp::index::KvIndex;
use kvroute_epp::load::LoadLedger;
use kvroute_epp::metrics::EppMetrics;
use kvroute_epp::picker::{prefill_booking, Picker, PickerConfig, RequestMeta};
use kvroute_epp::policy::{BusyThresholds, CostParams, PolicyKind};
use kvroute_epp::pool::{WorkerEntry, WorkerPool};
use kvroute_proto::events::{KvEventData, StoredBlock};
use kvroute_proto::hashing::{local_block_hashes, XXH3_SEED};
use kvroute_proto::metadata::{Enforcement, WorkerMetadata, WorkerRole};
use kvroute_proto::openai::{parse_request, ApiKind};
use kvroute_proto::prompt::PromptRenderer;

const BS: u32 = 16;

fn model_dir() -> PathBuf {
    let dir = std::env::var("KVROUTE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/models/qwen3")
        });
    assert!(
        dir.join("tokenizer.json").exists(),
        "no tokenizer in {}: run ./dev setup",
        dir.display()
    );
    dir
}

struct Fixture {
    picker: Picker,
    renderer: Arc<PromptRenderer>,
    index: Arc<KvIndex>,
}

fn worker(
    id: u64,
    role: WorkerRole,
    zone: &str,
    enforcement: Enforcement,
    weight: f32,
) -> Arc<WorkerEntry> {
    let md = WorkerMetadata {
        instance_id: id,
        name: format!("w{id}"),
        model: "m".into(),
        role,
        block_size: BS,
        kv_capacity_blocks: 10_000,
        dp_size: 1,
        topology_domains: BTreeMap::from([("zone".to_string(), zone.to_string())]),
        kv_transfer_domain: Some("zone".into()),
        kv_transfer_enforcement: enforcement,
        kv_transfer_preferred_weight: weight,
        http_endpoint: format!("10.0.0.{id}:8000"),
        max_num_batched_tokens: 8192,
    };
    md.validate().expect("valid metadata");
    let e = Arc::new(WorkerEntry::new(
        md.name.clone(),
        md.clone(),
        md.http_endpoint.clone(),
    ));
    e.set_rank_synced(0, true);
    e
}

fn fixture(workers: Vec<Arc<WorkerEntry>>, disagg_min_uncached_tokens: u64) -> Fixture {
    fixture_with(
        workers,
        disagg_min_uncached_tokens,
        BusyThresholds::default(),
    )
}

fn fixture_with(
    workers: Vec<Arc<WorkerEntry>>,
    disagg_min_uncached_tokens: u64,
    busy: BusyThresholds,
) -> Fixture {
    let renderer = Arc::new(PromptRenderer::from_dir(&model_dir()).expect("tokenizer"));
    let pool = Arc::new(WorkerPool::new());
    for w in workers {
        pool.upsert(w);
    }
    pool.set_synced();
    let index = Arc::new(KvIndex::new());
    let picker = Picker::new(
        PickerConfig {
            model: "m".into(),
            lora_adapters: vec![],
            block_size: BS,
            max_body_bytes: 1 << 20,
            policy: PolicyKind::Kv,
            cost: CostParams::default(),
            busy,
            fallbacks: 1,
            speculative_ttl: Duration::ZERO,
            disagg_min_uncached_tokens,
        },
        renderer.clone(),
        pool,
        index.clone(),
        Arc::new(LoadLedger::new()),
        Arc::new(EppMetrics::new().expect("metrics")),
    );
    Fixture {
        picker,
        renderer,
        index,
    }
}

fn body(i: usize) -> Vec<u8> {
    let text: String = (0..200)
        .map(|k| format!("word{} ", (k * 7 + i) % 50))
        .collect();
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": format!("{i} {text}")}]}))
        .expect("json")
}

impl Fixture {
    /// Makes worker `id` hold the whole prompt of `body` in the index.
    fn hold(&self, id: u64, body: &[u8]) {
        let req = parse_request(ApiKind::ChatCompletions, body).expect("parse");
        let tokens = self.renderer.token_ids(&req).expect("tokens");
        let hashes = local_block_hashes(&tokens, BS as usize, XXH3_SEED);
        let blocks = hashes
            .iter()
            .map(|&h| StoredBlock {
                block_hash: h ^ id,
                tokens_hash: h,
            })
            .collect();
        self.index
            .apply(
                (id, 0),
                &KvEventData::Stored {
                    parent_hash: None,
                    blocks,
                    token_ids: Vec::new(),
                    block_size: BS,
                    lora_name: None,
                    cache_salt: None,
                },
            )
            .expect("apply");
    }

    fn pick(
        &self,
        id: &str,
        body: &[u8],
    ) -> Result<kvroute_epp::picker::Decision, kvroute_epp::picker::Rejection> {
        let meta = RequestMeta {
            request_id: id.into(),
            path: "/v1/chat/completions".into(),
            ..RequestMeta::default()
        };
        self.picker.pick(&meta, body)
    }
}

#[test]
fn prefill_by_overlap_decode_in_the_required_domain() {
    let f = fixture(
        vec![
            worker(1, WorkerRole::Prefill, "a", Enforcement::Required, 0.0),
            worker(2, WorkerRole::Prefill, "b", Enforcement::Required, 0.0),
            worker(3, WorkerRole::Decode, "a", Enforcement::Required, 0.0),
            worker(4, WorkerRole::Decode, "b", Enforcement::Required, 0.0),
        ],
        0,
    );
    let b = body(1);
    f.hold(2, &b);
    for i in 0..20 {
        let d = f.pick(&format!("r{i}"), &b).expect("routed");
        let p = d.prefill.expect("disaggregated");
        assert_eq!(p.worker_id, 2, "the prefill worker holding the prefix");
        assert_eq!(p.host_port, "10.0.0.2:8000");
        assert_eq!(d.worker_id, 4, "decode stays in the prefill worker's zone");
        assert_eq!(d.destinations[0], "10.0.0.4:8000");
    }
}

#[test]
fn prefill_avoids_a_domain_without_decode_workers() {
    let f = fixture(
        vec![
            worker(1, WorkerRole::Prefill, "a", Enforcement::Required, 0.0),
            worker(2, WorkerRole::Prefill, "b", Enforcement::Required, 0.0),
            worker(3, WorkerRole::Decode, "a", Enforcement::Required, 0.0),
        ],
        0,
    );
    let b = body(3);
    f.hold(2, &b); // zone b's prefill worker holds the prompt, but zone b has no decode worker
    for i in 0..10 {
        let d = f.pick(&format!("r{i}"), &b).expect("zone a serves it");
        assert_eq!(d.prefill.map(|p| p.worker_id), Some(1));
        assert_eq!(d.worker_id, 3);
    }
}

#[test]
fn required_domain_without_decode_workers_is_503_naming_it() {
    let f = fixture(
        vec![
            worker(1, WorkerRole::Prefill, "a", Enforcement::Required, 0.0),
            worker(4, WorkerRole::Decode, "b", Enforcement::Required, 0.0),
        ],
        0,
    );
    let err = f.pick("r", &body(2)).expect_err("no decode in zone a");
    assert_eq!(err.status, 503);
    assert!(err.message.contains("zone=a"), "{}", err.message);
}

/// Share of decode picks that stay in the prefill worker's zone, with bookings never released
/// so load builds up and competes with the preference.
fn same_zone_share(weight: f32) -> f64 {
    let f = fixture(
        vec![
            worker(1, WorkerRole::Prefill, "a", Enforcement::Preferred, weight),
            worker(3, WorkerRole::Decode, "a", Enforcement::Preferred, weight),
            worker(4, WorkerRole::Decode, "b", Enforcement::Preferred, weight),
        ],
        0,
    );
    let n = 200;
    let same = (0..n)
        .filter(|i| {
            f.pick(&format!("r{i}"), &body(100 + i))
                .expect("routed")
                .worker_id
                == 3
        })
        .count();
    same as f64 / n as f64
}

#[test]
fn preferred_domain_share_grows_with_weight() {
    let shares: Vec<f64> = [0.0, 0.3, 1.0]
        .iter()
        .map(|w| same_zone_share(*w))
        .collect();
    assert!(
        (shares[0] - 0.5).abs() < 0.1,
        "no preference: even split, got {shares:?}"
    );
    assert!(
        shares[1] > shares[0] + 0.05,
        "weight 0.3 shifts the share: {shares:?}"
    );
    assert!(
        shares[2] > shares[1] + 0.05,
        "weight 1.0 shifts it further: {shares:?}"
    );
    assert!(shares[2] < 1.0, "preferred never excludes: {shares:?}");
}

#[test]
fn conditional_disaggregation_prefills_locally_when_decode_holds_the_prompt() {
    let f = fixture(
        vec![
            worker(1, WorkerRole::Prefill, "a", Enforcement::Preferred, 0.0),
            worker(3, WorkerRole::Decode, "a", Enforcement::Preferred, 0.0),
            worker(4, WorkerRole::Decode, "a", Enforcement::Preferred, 0.0),
        ],
        64,
    );
    let b = body(7);
    let cold = f.pick("cold", &b).expect("routed");
    assert!(cold.prefill.is_some(), "nothing cached: remote prefill");
    // The first request finishes (its bookings are released) and worker 4 holds its prompt.
    f.picker.ledger.release("cold");
    f.picker.ledger.release(&prefill_booking("cold"));
    f.hold(4, &b);
    let warm = f.pick("warm", &b).expect("routed");
    assert!(warm.prefill.is_none() && warm.prefill_bypassed, "{warm:?}");
    assert_eq!(
        warm.worker_id, 4,
        "the decode worker holding the prompt prefills it"
    );
}

#[test]
fn all_workers_over_their_busy_threshold_is_429() {
    let busy = BusyThresholds {
        active_decode_blocks_frac: None,
        active_prefill_tokens: Some(100),
    };
    let f = fixture_with(
        vec![
            worker(3, WorkerRole::Aggregated, "a", Enforcement::Preferred, 0.0),
            worker(4, WorkerRole::Aggregated, "a", Enforcement::Preferred, 0.0),
        ],
        0,
        busy,
    );
    // Each pick books > 100 uncached prefill tokens on its worker; bookings are never released.
    let first = f.pick("r1", &body(1)).expect("worker 3 or 4").worker_id;
    let second = f.pick("r2", &body(2)).expect("the other worker").worker_id;
    assert_ne!(first, second, "the busy worker is skipped");
    let err = f.pick("r3", &body(3)).expect_err("both busy");
    assert_eq!(err.status, 429);
    assert!(err.message.contains("busy"), "{}", err.message);
}
