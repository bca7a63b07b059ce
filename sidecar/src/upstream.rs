//! Calls to upstream engines: the pooled hyper client, the header rules for a forwarded
//! request (hint headers and hop-by-hop headers removed, `x-request-id` set), error
//! classification (engine down → 503), and the body wrapper that notices a client that went
//! away so the upstream request is dropped at once.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_LENGTH, HOST};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_proto::hints;

use crate::metrics::Metrics;
use crate::respond::{error_response, Body, BoxError};

pub use kvroute_proto::request_id::HEADER as REQUEST_ID;

/// The pooled HTTP/1.1 client every upstream call goes through.
pub type HttpClient = Client<HttpConnector, Body>;

pub fn new_client(connect_timeout: Duration) -> HttpClient {
    let mut conn = HttpConnector::new();
    // SSE tokens are small writes: Nagle would hold them back.
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(conn)
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) never forwarded in either direction.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect()
}

/// The headers of a request sent upstream: the client's, minus hop-by-hop headers, `host`,
/// `content-length` (hyper sets it from the body) and every routing hint; plus the request id.
pub fn upstream_headers(client: &HeaderMap, request_id: &HeaderValue) -> HeaderMap {
    let listed = connection_listed(client);
    let mut out = HeaderMap::with_capacity(client.len() + 1);
    for (name, value) in client {
        let n = name.as_str();
        if HOP_BY_HOP.contains(&n)
            || name == HOST
            || name == CONTENT_LENGTH
            || hints::is_hint_header(n)
            || listed.contains(name)
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out.insert(REQUEST_ID, request_id.clone());
    out
}

/// Response headers passed back to the client: the engine's minus hop-by-hop headers.
pub fn downstream_headers(upstream: &HeaderMap) -> HeaderMap {
    let listed = connection_listed(upstream);
    let mut out = HeaderMap::with_capacity(upstream.len());
    for (name, value) in upstream {
        if HOP_BY_HOP.contains(&name.as_str()) || listed.contains(name) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// Why an upstream call failed before a response arrived.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot connect to {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("request to {url} failed: {source}")]
    Io {
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("invalid upstream URL {url}: {why}")]
    BadUrl { url: String, why: String },
    #[error("{url} did not answer within {after:?}")]
    Timeout { url: String, after: Duration },
}

impl UpstreamError {
    /// Metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Connect { .. } => "connect",
            UpstreamError::Io { .. } => "io",
            UpstreamError::BadUrl { .. } => "protocol",
            UpstreamError::Timeout { .. } => "timeout",
        }
    }

    /// The status the client gets: an engine that cannot be reached is unavailable (503);
    /// one that broke the exchange is a bad gateway (502); a slow one a gateway timeout.
    pub fn status(&self) -> StatusCode {
        match self {
            UpstreamError::Connect { .. } => StatusCode::SERVICE_UNAVAILABLE,
            UpstreamError::Io { .. } | UpstreamError::BadUrl { .. } => StatusCode::BAD_GATEWAY,
            UpstreamError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    pub fn response(&self, what: &str) -> Response<Body> {
        let status = self.status();
        let ty = if status == StatusCode::SERVICE_UNAVAILABLE {
            "service_unavailable"
        } else {
            "upstream_error"
        };
        error_response(status, &format!("{what}: {self}"), ty)
    }
}

/// Sends one request upstream and returns the response with its body unread.
pub async fn send(
    client: &HttpClient,
    method: Method,
    url: String,
    headers: HeaderMap,
    body: Body,
) -> Result<Response<Incoming>, UpstreamError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| UpstreamError::BadUrl {
            url: url.clone(),
            why: e.to_string(),
        })?;
    let mut req = Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    client.request(req).await.map_err(|source| {
        if source.is_connect() {
            UpstreamError::Connect { url, source }
        } else {
            UpstreamError::Io { url, source }
        }
    })
}

/// Wraps a response body that streams to the client: it counts a client cancellation when
/// hyper drops it before its end (the client went away). Dropping it drops the upstream body,
/// which makes hyper close that upstream connection, which is what stops the engine.
pub struct TrackedBody {
    inner: Body,
    metrics: Arc<Metrics>,
    mode: &'static str,
    ended: bool,
}

impl TrackedBody {
    pub fn new(inner: Body, metrics: Arc<Metrics>, mode: &'static str) -> TrackedBody {
        metrics.inflight.inc();
        TrackedBody {
            inner,
            metrics,
            mode,
            ended: false,
        }
    }
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            self.ended = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        self.metrics.inflight.dec();
        if !self.ended && !self.inner.is_end_stream() {
            self.metrics
                .client_cancellations
                .with_label_values(&[self.mode])
                .inc();
            tracing::debug!(
                mode = self.mode,
                "client went away; upstream request dropped"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_hints_and_hop_by_hop() {
        let mut h = HeaderMap::new();
        h.insert("x-dynamo-worker-instance-id", HeaderValue::from_static("1"));
        h.insert("X-Prefiller-Host-Port", HeaderValue::from_static("a:1"));
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("s"));
        h.insert("authorization", HeaderValue::from_static("Bearer t"));
        h.insert("content-length", HeaderValue::from_static("10"));
        let out = upstream_headers(&h, &HeaderValue::from_static("rid"));
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(out["authorization"], "Bearer t");
        assert_eq!(out[REQUEST_ID], "rid");
    }
}
