//! One routing decision: understand the request (parse, chat template, tokenize, block hashes),
//! gather eligible candidates (model, readiness, subset hint, test-EPP header, busy thresholds),
//! score them with the configured policy, and book the chosen worker's load. Errors come back as
//! an HTTP status plus an OpenAI-shaped message for the gateway to return.

use std::sync::Arc;
use std::time::Instant;

use kvroute_proto::hashing::{local_block_hashes, namespace_seed, sequence_hashes};
use kvroute_proto::metadata::{Enforcement, WorkerRole};
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
    /// Conditional disaggregation: prefill on the decode worker when it would compute fewer
    /// uncached tokens than this (0 = always use a prefill worker when there is one).
    pub disagg_min_uncached_tokens: u64,
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
    /// Disaggregated serving: the worker that runs the prefill leg.
    pub prefill: Option<PrefillTarget>,
    /// Prefill workers exist but this request prefills on its decode worker (conditional
    /// disaggregation: too little of it is uncached to pay for a transfer).
    pub prefill_bypassed: bool,
}

/// Where the prefill leg of a disaggregated request goes.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillTarget {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// host:port of the prefill worker's OpenAI API (llm-d's `x-prefiller-host-port`).
    pub host_port: String,
}

/// The booking id of a request's prefill leg.
pub fn prefill_booking(request_id: &str) -> String {
    format!("{request_id}#prefill")
}

/// Candidates and the worker each belongs to (same order).
struct Scored {
    cands: Vec<Candidate>,
    owners: Vec<Arc<WorkerEntry>>,
}

/// What scoring needs from the index lookups, computed once per request.
struct ScoreContext<'a> {
    overlaps: Option<&'a crate::index::OverlapScores>,
    /// Sequence hashes of the request (empty when speculation is off).
    positions: &'a [u64],
}

/// `preferred` KV transfer topology: decode workers in the prefill worker's domain get its
/// weight, which scales their cost by `exp(-tanh(w))`.
fn preferred_weight_fn(prefill: &WorkerEntry) -> impl Fn(&WorkerEntry) -> f64 {
    let md = &prefill.metadata;
    let pref = match (md.transfer_domain_value(), md.kv_transfer_enforcement) {
        (Some((d, v)), Enforcement::Preferred) => Some((
            d.to_string(),
            v.to_string(),
            f64::from(md.kv_transfer_preferred_weight),
        )),
        _ => None,
    };
    move |w: &WorkerEntry| match &pref {
        Some((d, v, weight)) if w.metadata.topology_domains.get(d) == Some(v) => *weight,
        _ => 0.0,
    }
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
    /// `x-request-id` (generated when missing): the request's identity in logs and headers.
    pub request_id: String,
    /// The load-ledger key: unique per ext_proc stream, so two requests reusing one client-sent
    /// `x-request-id` cannot overwrite each other's booking. Defaults to `request_id` if empty.
    pub booking_id: String,
    pub path: String,
    /// `envoy.lb.subset_hint` endpoints; `Some(empty)` means "nothing is allowed".
    pub subset: Option<Vec<String>>,
    /// The conformance test-EPP header `test-epp-endpoint-selection`, when enabled.
    pub test_selection: Option<Vec<String>>,
}

impl RequestMeta {
    pub fn booking_key(&self) -> &str {
        if self.booking_id.is_empty() {
            &self.request_id
        } else {
            &self.booking_id
        }
    }
}

pub struct Picker {
    pub cfg: PickerConfig,
    renderer: Arc<PromptRenderer>,
    pub pool: Arc<WorkerPool>,
    pub index: Arc<KvIndex>,
    pub ledger: Arc<LoadLedger>,
    pub metrics: Arc<EppMetrics>,
    selector: Selector,
    /// Decode side of disaggregated requests: no overlap credit (the KV arrives by transfer).
    decode_selector: Selector,
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
        let decode_selector = Selector::new(
            cfg.policy,
            CostParams {
                overlap_score_credit: 0.0,
                ..cfg.cost
            },
        );
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
            decode_selector,
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
        let decode_side = self.eligible(meta, u.map(|u| u.model.as_str()))?;
        let hashes: &[u64] = u.map(|u| u.hashes.as_slice()).unwrap_or(&[]);
        let tokens = u.map(|u| u.tokens as u64).unwrap_or(0);
        let shape = RequestShape {
            isl_tokens: tokens,
            block_size: self.cfg.block_size,
        };
        let kv = !hashes.is_empty() && self.cfg.policy == PolicyKind::Kv;
        let overlaps = kv.then(|| self.index.find_matches(hashes));
        let positions = if kv && self.speculative.enabled() {
            sequence_hashes(hashes)
        } else {
            Vec::new()
        };
        let ctx = ScoreContext {
            overlaps: overlaps.as_ref(),
            positions: &positions,
        };
        // A prompt shorter than one block has no KV to transfer: its decode worker prefills it.
        let prefill_side = if hashes.is_empty() {
            Vec::new()
        } else {
            self.prefill_workers()
        };
        if prefill_side.is_empty() {
            return self.aggregated(meta, u, &decode_side, &ctx, &shape, false);
        }

        // Disaggregated: the prefill worker by KV overlap and prefill load (it holds no decode
        // load), the decode worker by decode load alone (overlap credit 0), as Dynamo does.
        // Unlike Dynamo, a prefill worker whose required transfer domain has no decode worker
        // is not a candidate, so one zone losing its decode workers does not fail requests that
        // the other zone can serve; only when no prefill worker is viable is it a 503.
        let mut viable = Vec::new();
        let mut first_refusal = None;
        for p in prefill_side {
            match self.apply_topology(&p, decode_side.clone()) {
                Ok(_) => viable.push(p),
                Err(r) => {
                    first_refusal.get_or_insert(r);
                }
            }
        }
        if viable.is_empty() {
            return Err(first_refusal.unwrap_or_else(|| {
                Rejection::new(503, "ServiceUnavailable", "no prefill worker")
            }));
        }
        let prefill_side = viable;
        let prefill = self.score(&prefill_side, &ctx, &|_| 0.0, true)?;
        let p_idx = self.selector.rank(&prefill.cands, &shape, &[])[0];
        let p_worker = prefill.owners[p_idx].clone();
        let p_key = prefill.cands[p_idx].key;
        let decode_side = self.apply_topology(&p_worker, decode_side)?;
        let preferred = preferred_weight_fn(&p_worker);
        let decode = self.score(&decode_side, &ctx, &preferred, false)?;
        // Conditional disaggregation: when some decode worker already holds nearly all of the
        // prompt, the remote prefill (and its KV transfer) costs more than prefilling locally.
        let best_local_uncached = decode
            .cands
            .iter()
            .map(|c| {
                tokens.saturating_sub(u64::from(c.overlap_blocks) * u64::from(self.cfg.block_size))
            })
            .min()
            .unwrap_or(tokens);
        if best_local_uncached < self.cfg.disagg_min_uncached_tokens {
            return self.aggregated(meta, u, &decode_side, &ctx, &shape, true);
        }
        let order = self.decode_selector.rank(&decode.cands, &shape, &[]);
        let d_idx = order[0];
        let chosen = &decode.cands[d_idx];
        let destinations = self.destinations(&order, &decode.owners);
        let p_overlap = prefill.cands[p_idx].overlap_blocks;
        let cached = (u64::from(p_overlap) * u64::from(self.cfg.block_size)).min(tokens);
        self.ledger.book(
            &prefill_booking(meta.booking_key()),
            p_key,
            tokens - cached,
            0,
        );
        self.ledger
            .book(meta.booking_key(), chosen.key, 0, shape.request_blocks());
        if !positions.is_empty() {
            // Both hold the prompt's KV once the transfer is done.
            self.speculative.record(&positions, p_key);
            self.speculative.record(&positions, chosen.key);
        }
        Ok(Decision {
            destinations,
            worker_id: chosen.key.0,
            dp_rank: chosen.key.1,
            model: u.map(|u| u.model.clone()).unwrap_or_default(),
            prompt_tokens: tokens as usize,
            overlap_blocks: p_overlap,
            prefill: Some(PrefillTarget {
                worker_id: p_key.0,
                dp_rank: p_key.1,
                host_port: p_worker.destination.clone(),
            }),
            prefill_bypassed: false,
        })
    }

    /// One worker serves the whole request.
    fn aggregated(
        &self,
        meta: &RequestMeta,
        u: Option<&Understood>,
        workers: &[Arc<WorkerEntry>],
        ctx: &ScoreContext<'_>,
        shape: &RequestShape,
        prefill_bypassed: bool,
    ) -> Result<Decision, Rejection> {
        let scored = self.score(workers, ctx, &|_| 0.0, false)?;
        let approx_hashes = u
            .and_then(|u| u.approx_text.as_deref())
            .map(|t| self.approx.block_hashes(t))
            .unwrap_or_default();
        let approx_scores = if approx_hashes.is_empty() {
            Vec::new()
        } else {
            let keys: Vec<WorkerKey> = scored.cands.iter().map(|c| c.key).collect();
            self.approx.scores(&approx_hashes, &keys)
        };
        let order = self.selector.rank(&scored.cands, shape, &approx_scores);
        let chosen = &scored.cands[order[0]];
        let destinations = self.destinations(&order, &scored.owners);
        let bs = u64::from(self.cfg.block_size);
        let cached = (u64::from(chosen.overlap_blocks) * bs).min(shape.isl_tokens);
        self.ledger.book(
            meta.booking_key(),
            chosen.key,
            shape.isl_tokens - cached,
            shape.request_blocks(),
        );
        if !approx_hashes.is_empty() {
            self.approx.record(&approx_hashes, chosen.key);
        }
        if !ctx.positions.is_empty() {
            self.speculative.record(ctx.positions, chosen.key);
        }
        Ok(Decision {
            destinations,
            worker_id: chosen.key.0,
            dp_rank: chosen.key.1,
            model: u.map(|u| u.model.clone()).unwrap_or_default(),
            prompt_tokens: shape.isl_tokens as usize,
            overlap_blocks: chosen.overlap_blocks,
            prefill: None,
            prefill_bypassed,
        })
    }

    /// Candidates (one per dp rank) of `workers` that are not busy, with overlaps and loads.
    fn score(
        &self,
        workers: &[Arc<WorkerEntry>],
        ctx: &ScoreContext<'_>,
        preferred: &dyn Fn(&WorkerEntry) -> f64,
        prefill_only: bool,
    ) -> Result<Scored, Rejection> {
        let mut cands = Vec::new();
        let mut owners = Vec::new();
        let mut busy = 0usize;
        for w in workers {
            for rank in 0..w.metadata.dp_size {
                let key: WorkerKey = (w.id(), rank);
                let mut load = self.ledger.view(key);
                if self.cfg.busy.is_busy(&load) {
                    busy += 1;
                    continue;
                }
                if prefill_only {
                    // A prefill worker's blocks leave with the transfer: only its prefill queue counts.
                    load.active_decode_blocks = 0;
                }
                let overlap_blocks = ctx
                    .overlaps
                    .map(|o| crate::index::overlap_of(o, key))
                    .unwrap_or(0);
                cands.push(Candidate {
                    key,
                    overlap_blocks,
                    load,
                    preferred_weight: preferred(w),
                });
                owners.push(w.clone());
            }
        }
        if !ctx.positions.is_empty() {
            let keys: Vec<WorkerKey> = cands.iter().map(|c| c.key).collect();
            for (c, spec) in cands
                .iter_mut()
                .zip(self.speculative.overlaps(ctx.positions, &keys))
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
        Ok(Scored { cands, owners })
    }

    /// Distinct endpoints in preference order: the pick, then up to `fallbacks` more.
    fn destinations(&self, order: &[usize], owners: &[Arc<WorkerEntry>]) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for &i in order {
            let d = &owners[i].destination;
            if !out.contains(d) {
                out.push(d.clone());
            }
            if out.len() > self.cfg.fallbacks {
                break;
            }
        }
        out
    }

    fn prefill_workers(&self) -> Vec<Arc<WorkerEntry>> {
        self.pool
            .snapshot()
            .iter()
            .filter(|w| w.ready() && w.role() == WorkerRole::Prefill && w.serves(&self.cfg.model))
            .cloned()
            .collect()
    }

    /// `required` KV transfer topology: only decode workers in the prefill worker's domain.
    fn apply_topology(
        &self,
        prefill: &WorkerEntry,
        decode: Vec<Arc<WorkerEntry>>,
    ) -> Result<Vec<Arc<WorkerEntry>>, Rejection> {
        let Some((domain, value)) = prefill.metadata.transfer_domain_value() else {
            return Ok(decode);
        };
        if prefill.metadata.kv_transfer_enforcement != Enforcement::Required {
            return Ok(decode);
        }
        let kept: Vec<Arc<WorkerEntry>> = decode
            .into_iter()
            .filter(|w| w.metadata.topology_domains.get(domain).map(String::as_str) == Some(value))
            .collect();
        if kept.is_empty() {
            return Err(Rejection::new(
                503,
                "ServiceUnavailable",
                format!(
                    "no ready decode worker in KV transfer domain {domain}={value} (required by prefill worker {})",
                    prefill.name
                ),
            ));
        }
        Ok(kept)
    }

    /// Forgets a departed worker in the policies' own state.
    pub fn forget_worker(&self, worker_id: u64) {
        self.approx.forget_worker(worker_id);
        self.speculative.forget_worker(worker_id);
    }
}
