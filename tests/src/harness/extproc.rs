//! An ext_proc client that plays Envoy's side of the protocol against a running EPP, message by
//! message, for protocol tests and the pick-latency benchmark.

use anyhow::Context;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

pub const FULL_DUPLEX_STREAMED: i32 = 4;
pub const BUFFERED: i32 = 2;

pub async fn connect(port: u16) -> anyhow::Result<ExternalProcessorClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("connecting to the EPP on port {port}"))?;
    Ok(ExternalProcessorClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20))
}

pub fn header(k: &str, v: &str) -> HeaderValue {
    HeaderValue {
        key: k.into(),
        value: String::new(),
        raw_value: v.as_bytes().to_vec(),
    }
}

/// One ext_proc stream (one HTTP request).
pub struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    pub async fn open(client: &mut ExternalProcessorClient<Channel>) -> anyhow::Result<Stream> {
        let (tx, rx) = mpsc::channel(64);
        let rx = client.process(ReceiverStream::new(rx)).await?.into_inner();
        Ok(Stream { tx, rx })
    }

    pub async fn send(&self, msg: ProcessingRequest) -> anyhow::Result<()> {
        self.tx
            .send(msg)
            .await
            .map_err(|_| anyhow::anyhow!("EPP closed the stream"))
    }

    /// Request headers, with the protocol configuration Envoy sends on the first message.
    pub async fn request_headers(
        &self,
        headers: &[(&str, &str)],
        end_of_stream: bool,
        body_mode: i32,
        metadata: Option<Metadata>,
    ) -> anyhow::Result<()> {
        self.send(ProcessingRequest {
            request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: headers.iter().map(|(k, v)| header(k, v)).collect(),
                }),
                end_of_stream,
                ..Default::default()
            })),
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: body_mode,
                response_body_mode: FULL_DUPLEX_STREAMED,
                ..Default::default()
            }),
            metadata_context: metadata,
            ..Default::default()
        })
        .await
    }

    pub async fn request_body(&self, body: &[u8], end_of_stream: bool) -> anyhow::Result<()> {
        self.send(ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(HttpBody {
                body: body.to_vec(),
                end_of_stream,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await
    }

    pub async fn request_trailers(&self) -> anyhow::Result<()> {
        self.send(ProcessingRequest {
            request: Some(processing_request::Request::RequestTrailers(
                HttpTrailers::default(),
            )),
            ..Default::default()
        })
        .await
    }

    pub async fn response_headers(
        &self,
        metadata: Option<Metadata>,
        end_of_stream: bool,
    ) -> anyhow::Result<()> {
        self.send(ProcessingRequest {
            request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![header(":status", "200")],
                }),
                end_of_stream,
                ..Default::default()
            })),
            metadata_context: metadata,
            ..Default::default()
        })
        .await
    }

    pub async fn response_body(&self, body: &[u8], end_of_stream: bool) -> anyhow::Result<()> {
        self.send(ProcessingRequest {
            request: Some(processing_request::Request::ResponseBody(HttpBody {
                body: body.to_vec(),
                end_of_stream,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await
    }

    /// The next reply, or `None` when the EPP ended the stream.
    pub async fn recv(&mut self) -> anyhow::Result<Option<ProcessingResponse>> {
        Ok(self.rx.message().await?)
    }

    /// Half-closes our side (what Envoy does when the HTTP stream ends).
    pub fn close(self) -> tonic::Streaming<ProcessingResponse> {
        self.rx
    }
}
