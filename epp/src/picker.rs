//! One routing decision: understand the request (parse, chat template, tokenize, block hashes),
//! gather eligible candidates (model, readiness, subset hint, test-EPP header, busy thresholds),
//! score them with the configured policy, and book the chosen worker's load. Errors come back as
//! an HTTP status plus an OpenAI-shaped message for the gateway to return.

use std::sync::Arc;
use std::time::Instant;

use kvroute_proto::hashing::{local_block_hashes, namespace_seed, sequence_hashes};
use kvroute_proto::metadata::WorkerRole;
use kvroute_proto::openai::{self, ApiKind};
use kvroute_proto::prompt::PromptRenderer;

use crate::index::KvIndex;
use crate::load::{LoadLedger, WorkerKey};
use crate::metrics::EppMetrics;
use crate::policy::{
    ApproxPrefixIndex, BusyThresholds, Candidate, CostParams, PolicyKind, RequestShape, Selector,
    SpeculativeIndex,
};
use crate::pool::{endpoint_matches, WorkerEntry, WorkerPool};

#[derive(Debug, Clone)]
pub struct PickerConfig {
    /// The base model this pool serves.
    pub model: String,
    /// LoRA adapter names also served (requests naming one hash in its namespace).
    pub lora_adapters: Vec<String>,
    pub block_size: u32,
    pub max_body_bytes: usize,
    pub policy: PolicyKind,
    pub cost: CostParams,
    pub busy: BusyThresholds,
    /// How many next-best endpoints follow the pick in the `envoy.lb` fallback list.
    pub fallbacks: usize,
    /// How long a pick's blocks count as held by the chosen worker before its KV events arrive
    /// (zero disables speculation).
    pub speculative_ttl: std::time::Duration,
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Best first, then fallbacks; distinct endpoints.
    pub destinations: Vec<String>,
    pub worker_id: u64,
    pub dp_rank: u32,
    /// The model named by the request ("" for non-inference requests).
    pub model: String,
    pub prompt_tokens: usize,
    pub overlap_blocks: u32,
}

/// A request the EPP answers itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    pub status: u16,
    pub message: String,
    pub err_type: &'static str,
    pub param: Option<String>,
}

impl Rejection {
    fn new(status: u16, err_type: &'static str, message: impl Into<String>) -> Self {
        Rejection {
            status,
            message: message.into(),
            err_type,
            param: None,
        }
    }

    pub fn body(&self) -> String {
        openai::openai_error_body(
            self.status,
            &self.message,
            self.err_type,
            self.param.as_deref(),
        )
    }
}

/// What the gateway told us about the request, besides its body.
#[derive(Debug, Clone, Default)]
pub struct RequestMeta {
    pub request_id: String,
    pub path: String,
    /// `envoy.lb.subset_hint` endpoints; `Some(empty)` means "nothing is allowed".
    pub subset: Option<Vec<String>>,
    /// The conformance test-EPP header `test-epp-endpoint-selection`, when enabled.
    pub test_selection: Option<Vec<String>>,
}

pub struct Picker {
    pub cfg: PickerConfig,
    renderer: Arc<PromptRenderer>,
    pub pool: Arc<WorkerPool>,
    pub index: Arc<KvIndex>,
    pub ledger: Arc<LoadLedger>,
    pub metrics: Arc<EppMetrics>,
    selector: Selector,
    approx: ApproxPrefixIndex,
    speculative: SpeculativeIndex,
}

/// The request understood: enough to score it.
struct Understood {
    model: String,
    tokens: usize,
    hashes: Vec<u64>,
    approx_text: Option<String>,
}

impl Picker {
    pub fn new(
        cfg: PickerConfig,
        renderer: Arc<PromptRenderer>,
        pool: Arc<WorkerPool>,
        index: Arc<KvIndex>,
        ledger: Arc<LoadLedger>,
        metrics: Arc<EppMetrics>,
    ) -> Self {
        let selector = Selector::new(cfg.policy, cfg.cost);
        let approx = ApproxPrefixIndex::new(cfg.block_size, 1 << 20);
        let speculative = SpeculativeIndex::new(cfg.speculative_ttl, 1 << 20);
        Picker {
            cfg,
            renderer,
            pool,
            index,
            ledger,
            metrics,
            selector,
            approx,
            speculative,
        }
    }

    /// Routes one request. `body` is empty for body-less requests.
    pub fn pick(&self, meta: &RequestMeta, body: &[u8]) -> Result<Decision, Rejection> {
        let started = Instant::now();
        let kind = ApiKind::from_path(&meta.path).filter(|_| !body.is_empty());
        let understood = match kind {
            Some(kind) => Some(self.understand(kind, body)?),
            None => None,
        };
        let model = understood
            .as_ref()
            .map(|u| u.model.clone())
            .unwrap_or_default();
        let result = self.choose(meta, understood.as_ref());
        match &result {
            Ok(d) => {
                self.metrics
                    .scheduler_e2e
                    .observe(started.elapsed().as_secs_f64());
                self.metrics
                    .request_total
                    .with_label_values(&[&model, &model])
                    .inc();
                self.metrics
                    .picks
                    .with_label_values(&[&d.worker_id.to_string()])
                    .inc();
                if let Some(u) = &understood {
                    self.metrics
                        .input_tokens
                        .with_label_values(&[&model, &model])
                        .observe(u.tokens as f64);
                    if !u.hashes.is_empty() {
                        self.metrics
                            .kv_hit_rate
                            .observe(f64::from(d.overlap_blocks) / u.hashes.len() as f64);
                    }
                }
            }
            Err(r) => self.count_error(&model, r.status),
        }
        result
    }

    pub fn count_error(&self, model: &str, status: u16) {
        self.metrics
            .request_error_total
            .with_label_values(&[model, model, &status.to_string()])
            .inc();
    }

    fn understand(&self, kind: ApiKind, body: &[u8]) -> Result<Understood, Rejection> {
        if body.len() > self.cfg.max_body_bytes {
            return Err(self.too_large(body.len()));
        }
        let mut req = openai::parse_request(kind, body).map_err(|e| Rejection {
            status: e.http_status(),
            message: e.to_string(),
            err_type: "invalid_request_error",
            param: e.param().map(str::to_string),
        })?;
        let lora = if req.model == self.cfg.model {
            None
        } else if self.cfg.lora_adapters.contains(&req.model) {
            Some(req.model.clone())
        } else {
            return Err(Rejection {
                status: 404,
                message: format!(
                    "The model `{}` does not exist. This pool serves `{}`{}.",
                    req.model,
                    self.cfg.model,
                    if self.cfg.lora_adapters.is_empty() {
                        String::new()
                    } else {
                        format!(" and adapters {}", self.cfg.lora_adapters.join(", "))
                    }
                ),
                err_type: "NotFoundError",
                param: Some("model".into()),
            });
        };
        req.lora_name = lora.clone();
        let t0 = Instant::now();
        let tokens = self.renderer.token_ids(&req).map_err(|e| Rejection {
            status: e.http_status(),
            message: e.to_string(),
            err_type: if e.http_status() == 400 {
                "invalid_request_error"
            } else {
                "internal_error"
            },
            param: None,
        })?;
        self.metrics
            .tokenize_seconds
            .observe(t0.elapsed().as_secs_f64());
        let seed = namespace_seed(lora.as_deref(), req.cache_salt.as_deref());
        let hashes = local_block_hashes(&tokens, self.cfg.block_size as usize, seed);
        let approx_text = (self.cfg.policy == PolicyKind::ApproxPrefix)
            .then(|| self.renderer.render(&req).ok())
            .flatten();
        Ok(Understood {
            model: req.model,
            tokens: tokens.len(),
            hashes,
            approx_text,
        })
    }

    pub fn too_large(&self, size: usize) -> Rejection {
        Rejection::new(
            413,
            "invalid_request_error",
            format!(
                "request body of {size} bytes exceeds the limit of {} bytes",
                self.cfg.max_body_bytes
            ),
        )
    }

    fn eligible(
        &self,
        meta: &RequestMeta,
        model: Option<&str>,
    ) -> Result<Vec<Arc<WorkerEntry>>, Rejection> {
        if matches!(&meta.subset, Some(s) if s.is_empty()) {
            return Err(Rejection::new(
                503,
                "ServiceUnavailable",
                "the gateway's endpoint subset hint is empty: no endpoint may serve this request",
            ));
        }
        let workers = self.pool.snapshot();
        let mut out: Vec<Arc<WorkerEntry>> = workers
            .iter()
            .filter(|w| w.ready() && w.role() != WorkerRole::Prefill)
            .filter(|w| model.is_none_or(|_| w.serves(&self.cfg.model)))
            .filter(|w| {
                meta.subset
                    .as_ref()
                    .is_none_or(|s| s.iter().any(|t| endpoint_matches(t, &w.destination)))
            })
            .cloned()
            .collect();
        if let Some(sel) = &meta.test_selection {
            // Conformance contract: keep the header's order, de-duplicated.
            let mut ordered = Vec::new();
            for t in sel {
                for w in &out {
                    if endpoint_matches(t, &w.destination)
                        && !ordered.iter().any(|x: &Arc<WorkerEntry>| x.id() == w.id())
                    {
                        ordered.push(w.clone());
                    }
                }
            }
            if !ordered.is_empty() {
                out = ordered;
            }
        }
        if out.is_empty() {
            let why = if meta.subset.is_some() {
                "no ready worker matches the gateway's endpoint subset hint"
            } else if workers.is_empty() {
                "no workers discovered"
            } else {
                "no worker is ready"
            };
            return Err(Rejection::new(503, "ServiceUnavailable", why));
        }
        Ok(out)
    }

    fn choose(&self, meta: &RequestMeta, u: Option<&Understood>) -> Result<Decision, Rejection> {
        let workers = self.eligible(meta, u.map(|u| u.model.as_str()))?;
        let hashes: &[u64] = u.map(|u| u.hashes.as_slice()).unwrap_or(&[]);
        let kv = !hashes.is_empty() && self.cfg.policy == PolicyKind::Kv;
        let overlaps = kv.then(|| self.index.find_matches(hashes));
        let positions = if kv && self.speculative.enabled() {
            sequence_hashes(hashes)
        } else {
            Vec::new()
        };
        let mut cands = Vec::new();
        let mut owners = Vec::new();
        let mut busy = 0usize;
        for w in &workers {
            for rank in 0..w.metadata.dp_size {
                let key: WorkerKey = (w.id(), rank);
                let load = self.ledger.view(key);
                if self.cfg.busy.is_busy(&load) {
                    busy += 1;
                    continue;
                }
                let overlap_blocks = overlaps
                    .as_ref()
                    .map(|o| crate::index::overlap_of(o, key))
                    .unwrap_or(0);
                cands.push(Candidate {
                    key,
                    overlap_blocks,
                    load,
                    preferred_weight: 0.0,
                });
                owners.push(w.clone());
            }
        }
        if !positions.is_empty() {
            let keys: Vec<WorkerKey> = cands.iter().map(|c| c.key).collect();
            for (c, spec) in cands
                .iter_mut()
                .zip(self.speculative.overlaps(&positions, &keys))
            {
                c.overlap_blocks = c.overlap_blocks.max(spec);
            }
        }
        if cands.is_empty() {
            return Err(Rejection::new(
                429,
                "RateLimitError",
                format!(
                    "all {busy} eligible worker ranks are over their busy thresholds; retry later"
                ),
            ));
        }
        let tokens = u.map(|u| u.tokens as u64).unwrap_or(0);
        let shape = RequestShape {
            isl_tokens: tokens,
            block_size: self.cfg.block_size,
        };
        let approx_hashes = u
            .and_then(|u| u.approx_text.as_deref())
            .map(|t| self.approx.block_hashes(t))
            .unwrap_or_default();
        let approx_scores = if approx_hashes.is_empty() {
            Vec::new()
        } else {
            let keys: Vec<WorkerKey> = cands.iter().map(|c| c.key).collect();
            self.approx.scores(&approx_hashes, &keys)
        };
        let order = self.selector.rank(&cands, &shape, &approx_scores);
        let first = *order
            .first()
            .ok_or_else(|| Rejection::new(503, "ServiceUnavailable", "no candidate"))?;
        let chosen = &cands[first];
        let mut destinations: Vec<String> = Vec::new();
        for &i in &order {
            let d = &owners[i].destination;
            if !destinations.contains(d) {
                destinations.push(d.clone());
            }
            if destinations.len() > self.cfg.fallbacks {
                break;
            }
        }
        let bs = u64::from(self.cfg.block_size);
        let cached = (u64::from(chosen.overlap_blocks) * bs).min(tokens);
        self.ledger.book(
            &meta.request_id,
            chosen.key,
            tokens - cached,
            shape.request_blocks(),
        );
        if !approx_hashes.is_empty() {
            self.approx.record(&approx_hashes, chosen.key);
        }
        if !positions.is_empty() {
            self.speculative.record(&positions, chosen.key);
        }
        Ok(Decision {
            destinations,
            worker_id: chosen.key.0,
            dp_rank: chosen.key.1,
            model: u.map(|u| u.model.clone()).unwrap_or_default(),
            prompt_tokens: tokens as usize,
            overlap_blocks: chosen.overlap_blocks,
        })
    }

    /// Forgets a departed worker in the policies' own state.
    pub fn forget_worker(&self, worker_id: u64) {
        self.approx.forget_worker(worker_id);
        self.speculative.forget_worker(worker_id);
    }
}
