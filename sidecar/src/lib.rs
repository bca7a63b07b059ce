//! `kvroute-sidecar`: the direct-mode OpenAI frontend that runs in each worker pod behind the
//! gateway. It reads the EPP's routing hints, forwards to the chosen local engine (streaming
//! both ways), and runs the disaggregated prefill/decode flow.
//!
//! - [`config`]: flags and the validated configuration;
//! - [`routing`]: hint headers → local engine and prefill target (trust model documented there);
//! - [`allowlist`]: the SSRF allowlist for prefill targets;
//! - [`upstream`]: the pooled client, header rules, upstream errors, disconnect tracking;
//! - [`server`]: the HTTP server, routes and the aggregated proxy;
//! - [`disagg`]: nixlv2 and SGLang bootstrap prefill/decode legs;
//! - [`usage`]: truthful `cached_tokens` in disaggregated responses;
//! - [`metrics`], [`respond`]: Prometheus metrics and response helpers.

pub mod allowlist;
pub mod config;
pub mod disagg;
pub mod metrics;
pub mod respond;
pub mod routing;
pub mod server;
pub mod upstream;
pub mod usage;
