//! Response bodies and OpenAI-shaped error responses of the sidecar.
//!
//! Every body is a boxed [`http_body::Body`] so an upstream engine's streaming body can be
//! handed to hyper frame by frame (no buffering) and full bodies share the same type.

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};
use kvroute_proto::openai::openai_error_body;

/// Errors inside a body (an upstream connection that broke mid-stream).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Request and response body of the sidecar, both directions.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

pub fn full_body(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub fn empty_body() -> Body {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// A complete response with `content_type`.
pub fn full(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut resp = Response::new(full_body(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// `{"error":{"message","type","param","code"}}` with `status`.
pub fn error_response(status: StatusCode, message: &str, err_type: &str) -> Response<Body> {
    full(
        status,
        "application/json",
        openai_error_body(status.as_u16(), message, err_type, None),
    )
}

pub fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    full(status, "application/json", value.to_string())
}
