//! A small HTTP/1.1 client for tests and benchmarks (hyper), with streaming access to the body.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn new_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub type Headers = Vec<(String, String)>;

pub fn header_list(h: &hyper::HeaderMap) -> Headers {
    h.iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

pub async fn get(url: &str) -> anyhow::Result<(u16, Headers, Bytes)> {
    let resp = new_client().get(url.parse()?).await?;
    let status = resp.status().as_u16();
    let headers = header_list(resp.headers());
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, headers, body))
}

/// Sends a request and returns the response with its body unread (for streaming and aborts).
pub async fn send(
    client: &HttpClient,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<hyper::Response<Incoming>> {
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.into()))?;
    Ok(client.request(req).await?)
}

/// Sends a request and reads the whole response.
pub async fn request(
    client: &HttpClient,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<(u16, Headers, Bytes)> {
    let resp = send(client, method, url, headers, body).await?;
    let status = resp.status().as_u16();
    let h = header_list(resp.headers());
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, h, body))
}

pub fn response_headers(resp: &hyper::Response<Incoming>) -> Headers {
    header_list(resp.headers())
}
