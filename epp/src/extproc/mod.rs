//! The GAIE endpoint-picker protocol over Envoy's `ext_proc` (gaie-epp-protocol.md §5).
//!
//! One gRPC stream per HTTP request. FULL_DUPLEX_STREAMED: the headers reply is held until the
//! body ends, then the routing header mutation + `envoy.lb` metadata, then the unchanged body in
//! `streamed_response` chunks. BUFFERED: an empty headers reply, then the mutation on the body
//! reply. Body-less requests are routed at once. On the response path the served-endpoint report
//! moves the load booking to the endpoint that really served, the first body byte ends the
//! prefill, and the end of the response — or the stream's end for any reason (client abort,
//! reset) — releases the booking.

pub mod responses;

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HeaderMutation, ProcessingRequest, ProcessingResponse,
};
use kvroute_proto::hints;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::picker::{prefill_booking, Decision, Picker, Rejection, RequestMeta};
use responses::*;

/// `ProcessingMode.BodySendMode` values (envoy-ext-proc.md §4).
const BODY_NONE: i32 = 0;
const BODY_BUFFERED: i32 = 2;
const BODY_FULL_DUPLEX: i32 = 4;

/// Numbers ext_proc streams, to key their bookings uniquely.
static NEXT_STREAM: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bodies above this are scored on the blocking pool: tokenizing them takes milliseconds.
const INLINE_PICK_MAX_BYTES: usize = 8 * 1024;

#[derive(Debug, Clone)]
pub struct ExtProcConfig {
    /// Put the whole fallback list in the header too (for gateways whose header parser takes a
    /// list; Envoy's ORIGINAL_DST takes exactly one `ip:port`, so off by default). The
    /// `envoy.lb` metadata always carries the list.
    pub header_fallbacks: bool,
    /// Honour the conformance header `test-epp-endpoint-selection`.
    pub test_epp_header: bool,
}

pub struct ExtProcService {
    picker: Arc<Picker>,
    cfg: ExtProcConfig,
}

impl ExtProcService {
    pub fn new(picker: Arc<Picker>, cfg: ExtProcConfig) -> Self {
        ExtProcService { picker, cfg }
    }

    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        ExternalProcessorServer::new(self)
            .max_decoding_message_size(64 * 1024 * 1024)
            .max_encoding_message_size(64 * 1024 * 1024)
    }
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(32);
        let handler = StreamHandler::new(self.picker.clone(), self.cfg.clone(), tx);
        tokio::spawn(handler.run(inbound));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Per-request state of one ext_proc stream.
struct StreamHandler {
    picker: Arc<Picker>,
    cfg: ExtProcConfig,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    meta: RequestMeta,
    request_id_generated: bool,
    request_body_mode: i32,
    response_body_mode: i32,
    body: Vec<u8>,
    decided: bool,
    /// Set once a booking exists; released exactly once.
    booked_model: Option<String>,
    saw_response_body: bool,
    hint_headers_sent: Vec<String>,
}

impl StreamHandler {
    fn new(
        picker: Arc<Picker>,
        cfg: ExtProcConfig,
        tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) -> Self {
        StreamHandler {
            picker,
            cfg,
            tx,
            meta: RequestMeta::default(),
            request_id_generated: false,
            request_body_mode: BODY_FULL_DUPLEX,
            response_body_mode: BODY_NONE,
            body: Vec::new(),
            decided: false,
            booked_model: None,
            saw_response_body: false,
            hint_headers_sent: Vec::new(),
        }
    }

    async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        loop {
            match inbound.message().await {
                Ok(Some(msg)) => {
                    if let Err(e) = self.handle(msg).await {
                        tracing::debug!(request_id = %self.meta.request_id, "ext_proc stream ended: {e}");
                        break;
                    }
                }
                Ok(None) => break,
                Err(status) => {
                    tracing::debug!(request_id = %self.meta.request_id, "ext_proc stream reset: {}", status.message());
                    break;
                }
            }
        }
        self.release();
    }

    async fn send(&self, msg: ProcessingResponse) -> Result<(), &'static str> {
        self.tx
            .send(Ok(msg))
            .await
            .map_err(|_| "gateway closed the stream")
    }

    async fn handle(&mut self, msg: ProcessingRequest) -> Result<(), &'static str> {
        if let Some(pc) = &msg.protocol_config {
            self.request_body_mode = pc.request_body_mode;
            self.response_body_mode = pc.response_body_mode;
        }
        let metadata = msg.metadata_context.as_ref();
        match msg.request {
            Some(processing_request::Request::RequestHeaders(h)) => {
                self.read_request_headers(h.headers.as_ref());
                self.meta.subset = metadata_strings(metadata, SUBSET_NAMESPACE, SUBSET_KEY);
                if h.end_of_stream || !self.body_aware_mode() {
                    // No body to read (or a mode in which we never see it before forwarding).
                    return self.decide_and_reply(false).await;
                }
                if self.request_body_mode == BODY_BUFFERED {
                    return self.send(headers_response(None, false, None)).await;
                }
                Ok(())
            }
            Some(processing_request::Request::RequestBody(b)) => {
                if self.decided {
                    // Body after a decision (a mode we route at headers time): pass it on.
                    return self.pass_request_body(b.body, b.end_of_stream).await;
                }
                self.body.extend_from_slice(&b.body);
                if self.body.len() > self.picker.cfg.max_body_bytes {
                    let r = self.picker.too_large(self.body.len());
                    return self.reject(r).await;
                }
                if b.end_of_stream {
                    return self.decide_and_reply(true).await;
                }
                if self.request_body_mode == BODY_BUFFERED {
                    // BUFFERED sends one message; without eos the proxy is misbehaving. Be lenient:
                    // wait for more (the buffer limit above still bounds us).
                    tracing::debug!("BUFFERED body without end_of_stream");
                }
                Ok(())
            }
            Some(processing_request::Request::RequestTrailers(_)) => {
                if !self.decided {
                    // A body that ended with trailers: route now. FULL_DUPLEX_STREAMED: the
                    // headers reply, then the body chunks without eos. BUFFERED: the body reply
                    // (our headers reply went out already) carries the mutation.
                    let buffered = self.request_body_mode == BODY_BUFFERED;
                    self.decide_and_reply(buffered).await?;
                }
                self.send(trailers_response(false)).await
            }
            Some(processing_request::Request::ResponseHeaders(h)) => {
                if let Some(served) = metadata_strings(metadata, LB_NAMESPACE, SERVED_KEY)
                    .and_then(|v| v.into_iter().next())
                {
                    self.credit_served(&served);
                }
                // Release before replying: once Envoy has our reply the client can see the end of
                // the response and send its next turn, which must not find this request booked.
                if h.end_of_stream {
                    self.release();
                }
                self.send(continue_response_headers()).await
            }
            Some(processing_request::Request::ResponseBody(b)) => {
                if !self.saw_response_body {
                    self.saw_response_body = true;
                    self.picker
                        .ledger
                        .mark_prefill_done(self.meta.booking_key());
                    // The prefill leg is over once the decode side answers.
                    self.picker
                        .ledger
                        .release(&prefill_booking(self.meta.booking_key()));
                }
                let eos = b.end_of_stream;
                let reply = if self.response_body_mode == BODY_FULL_DUPLEX {
                    streamed_chunk(b.body, eos, true)
                } else {
                    continue_body(true)
                };
                if eos {
                    self.release();
                }
                self.send(reply).await
            }
            Some(processing_request::Request::ResponseTrailers(_)) => {
                self.release();
                self.send(trailers_response(true)).await
            }
            None => Ok(()),
        }
    }

    fn body_aware_mode(&self) -> bool {
        matches!(self.request_body_mode, BODY_BUFFERED | BODY_FULL_DUPLEX)
    }

    fn read_request_headers(&mut self, headers: Option<&HeaderMap>) {
        let mut request_id = None;
        for h in headers.map(|m| m.headers.as_slice()).unwrap_or_default() {
            let value = if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8_lossy(&h.raw_value).into_owned()
            };
            let key = h.key.to_ascii_lowercase();
            match key.as_str() {
                ":path" => self.meta.path = value,
                "x-request-id" if !value.trim().is_empty() => {
                    request_id = Some(value.trim().to_string())
                }
                "test-epp-endpoint-selection" if self.cfg.test_epp_header => {
                    self.meta.test_selection = Some(
                        value
                            .split(',')
                            .map(str::trim)
                            .filter(|s| !s.is_empty())
                            .map(String::from)
                            .collect(),
                    )
                }
                k if hints::is_hint_header(k) => self.hint_headers_sent.push(key.clone()),
                _ => {}
            }
        }
        self.meta.request_id = request_id.unwrap_or_else(|| {
            self.request_id_generated = true;
            uuid::Uuid::new_v4().to_string()
        });
        self.meta.booking_id = format!(
            "{}/{}",
            self.meta.request_id,
            NEXT_STREAM.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
    }

    async fn decide_and_reply(&mut self, body_complete: bool) -> Result<(), &'static str> {
        self.decided = true;
        let body = std::mem::take(&mut self.body);
        let picker = self.picker.clone();
        let meta = self.meta.clone();
        let (outcome, body) = if body.len() > INLINE_PICK_MAX_BYTES {
            tokio::task::spawn_blocking(move || {
                let r = picker.pick(&meta, &body);
                (r, body)
            })
            .await
            .map_err(|_| "picker task panicked")?
        } else {
            (picker.pick(&meta, &body), body)
        };
        let decision = match outcome {
            Ok(d) => d,
            Err(r) => return self.reject(r).await,
        };
        self.booked_model = Some(decision.model.clone());
        self.picker
            .metrics
            .running_requests
            .with_label_values(&[&decision.model])
            .inc();
        tracing::debug!(
            request_id = %self.meta.request_id,
            worker = decision.worker_id,
            dp_rank = decision.dp_rank,
            overlap_blocks = decision.overlap_blocks,
            prompt_tokens = decision.prompt_tokens,
            destination = %decision.destinations[0],
            "picked"
        );
        let stream_body =
            self.request_body_mode == BODY_FULL_DUPLEX && (body_complete || !body.is_empty());
        let mutation = self.mutation(&decision, stream_body.then_some(body.len()));
        let list = decision.destinations.join(",");
        if self.request_body_mode == BODY_BUFFERED && body_complete {
            return self
                .send(buffered_body_response(
                    mutation,
                    destination_metadata(&list),
                ))
                .await;
        }
        self.send(headers_response(
            Some(mutation),
            true,
            Some(destination_metadata(&list)),
        ))
        .await?;
        if stream_body {
            for chunk in streamed_body_chunks(&body, body_complete, false) {
                self.send(chunk).await?;
            }
        }
        Ok(())
    }

    fn mutation(&self, d: &Decision, content_length: Option<usize>) -> HeaderMutation {
        let destination = if self.cfg.header_fallbacks {
            d.destinations.join(",")
        } else {
            d.destinations[0].clone()
        };
        let mut set = vec![
            set_header(DESTINATION_HEADER, &destination),
            set_header(hints::WORKER_INSTANCE_ID, &d.worker_id.to_string()),
            set_header(hints::DP_RANK, &d.dp_rank.to_string()),
            set_header(
                hints::ROUTING_MODE,
                if d.prefill.is_some() {
                    "disaggregated"
                } else {
                    "aggregated"
                },
            ),
        ];
        if let Some(p) = &d.prefill {
            set.push(set_header(
                hints::PREFILL_INSTANCE_ID,
                &p.worker_id.to_string(),
            ));
            set.push(set_header(hints::PREFILL_DP_RANK, &p.dp_rank.to_string()));
            set.push(set_header(hints::PREFILLER_HOST_PORT, &p.host_port));
        }
        if let Some(len) = content_length {
            set.push(set_header("content-length", &len.to_string()));
        }
        if self.request_id_generated {
            set.push(set_header("x-request-id", &self.meta.request_id));
        }
        let ours: Vec<String> = set
            .iter()
            .filter_map(|h| h.header.as_ref().map(|h| h.key.clone()))
            .collect();
        let remove = self
            .hint_headers_sent
            .iter()
            .filter(|h| !ours.contains(h))
            .cloned()
            .collect();
        HeaderMutation {
            set_headers: set,
            remove_headers: remove,
        }
    }

    async fn pass_request_body(&self, body: Vec<u8>, eos: bool) -> Result<(), &'static str> {
        if self.request_body_mode == BODY_FULL_DUPLEX {
            self.send(streamed_chunk(body, eos, false)).await
        } else {
            self.send(continue_body(false)).await
        }
    }

    async fn reject(&mut self, r: Rejection) -> Result<(), &'static str> {
        tracing::debug!(request_id = %self.meta.request_id, status = r.status, "rejected: {}", r.message);
        self.decided = true;
        self.send(immediate(r.status, r.body(), &self.meta.request_id))
            .await?;
        Err("answered with an immediate response")
    }

    fn credit_served(&self, served: &str) {
        let Some(booked) = self.picker.ledger.booked_worker(self.meta.booking_key()) else {
            return;
        };
        if let Some(w) = self.picker.pool.by_destination(served) {
            if w.id() != booked.0 {
                let rank = if w.metadata.dp_size > booked.1 {
                    booked.1
                } else {
                    0
                };
                self.picker
                    .ledger
                    .move_booking(self.meta.booking_key(), (w.id(), rank));
                tracing::debug!(request_id = %self.meta.request_id, served, "gateway served another endpoint; booking moved");
            }
        }
    }

    fn release(&mut self) {
        if let Some(model) = self.booked_model.take() {
            self.picker.ledger.release(self.meta.booking_key());
            self.picker
                .ledger
                .release(&prefill_booking(self.meta.booking_key()));
            self.picker
                .metrics
                .running_requests
                .with_label_values(&[&model])
                .dec();
        }
    }
}
