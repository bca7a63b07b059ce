//! `kv_transfer_params` as vLLM's NixlConnector names them (reference §6.2), plus the few
//! kvroute extras a decode worker needs to check what it pulled.
//!
//! Prefill leg request: `{"do_remote_decode": true, "do_remote_prefill": false, ...nulls}`.
//! Prefill response / decode leg request: `{"do_remote_prefill": true, "do_remote_decode":
//! false, "remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
//! "remote_request_id", "tp_size"}` and the extras `kv_block_size`, `kv_block_bytes`,
//! `kv_num_tokens`, `kv_checksum`. Unknown fields are ignored, so params produced by a newer
//! peer still parse.

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTransferParams {
    #[serde(default)]
    pub do_remote_decode: bool,
    #[serde(default)]
    pub do_remote_prefill: bool,
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    #[serde(default)]
    pub remote_block_ids: Option<Vec<u64>>,
    #[serde(default)]
    pub remote_host: Option<String>,
    #[serde(default)]
    pub remote_port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    /// Tokens per block on the prefill worker (must match the decode worker's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_block_size: Option<u32>,
    /// Bytes per block on the prefill worker (must match the decode worker's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_block_bytes: Option<u64>,
    /// Prompt tokens covered by `remote_block_ids` (full blocks only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_num_tokens: Option<u32>,
    /// xxh3-64 (hex) of the blocks' bytes in order, as the prefill worker holds them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_checksum: Option<String>,
}

impl KvTransferParams {
    /// `kv_transfer_params` of a request body: `Ok(None)` when absent or null, `Err` with a
    /// client-facing message when present but not an object of the right shape.
    pub fn from_body(body: &Value) -> Result<Option<KvTransferParams>, String> {
        match body.get("kv_transfer_params") {
            None | Some(Value::Null) => Ok(None),
            Some(v @ Value::Object(_)) => serde_json::from_value(v.clone())
                .map(Some)
                .map_err(|e| format!("invalid kv_transfer_params: {e}")),
            Some(_) => Err("kv_transfer_params must be an object".into()),
        }
    }

    /// The prefill agent's host:port.
    pub fn remote_addr(&self) -> Option<String> {
        let host = self.remote_host.as_deref().filter(|h| !h.is_empty())?;
        let port = self.remote_port?;
        Some(if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        })
    }
}

/// SGLang bootstrap fields (reference §6.3), sent to both legs concurrently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    pub host: String,
    pub port: u16,
    pub room: u64,
}

impl Bootstrap {
    /// `bootstrap_host` + `bootstrap_port` + `bootstrap_room` of a body, when all are present.
    pub fn from_body(body: &Value) -> Result<Option<Bootstrap>, String> {
        let host = body.get("bootstrap_host").and_then(Value::as_str);
        let port = body.get("bootstrap_port");
        let room = body.get("bootstrap_room");
        match (host, port, room) {
            (None, None, None) => Ok(None),
            (Some(h), Some(p), Some(r)) => {
                let port = p
                    .as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .ok_or("bootstrap_port must be a port number")?;
                let room = r
                    .as_u64()
                    .ok_or("bootstrap_room must be a non-negative integer")?;
                Ok(Some(Bootstrap {
                    host: h.to_string(),
                    port,
                    room,
                }))
            }
            _ => Err("bootstrap_host, bootstrap_port and bootstrap_room go together".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_vllm_prefill_and_decode_params() {
        let body = json!({"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}});
        let p = KvTransferParams::from_body(&body).unwrap().unwrap();
        assert!(p.do_remote_decode && !p.do_remote_prefill);
        assert_eq!(p.remote_addr(), None);
        let body = json!({"kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "e", "remote_block_ids": [1, 2], "remote_host": "10.0.0.1",
            "remote_port": 5600, "remote_request_id": "r", "tp_size": 1, "future_field": 3}});
        let p = KvTransferParams::from_body(&body).unwrap().unwrap();
        assert_eq!(p.remote_block_ids, Some(vec![1, 2]));
        assert_eq!(p.remote_addr().as_deref(), Some("10.0.0.1:5600"));
        assert_eq!(KvTransferParams::from_body(&json!({})), Ok(None));
        assert!(KvTransferParams::from_body(&json!({"kv_transfer_params": 3})).is_err());
        assert!(
            KvTransferParams::from_body(&json!({"kv_transfer_params": {"remote_port": "x"}}))
                .is_err()
        );
    }

    #[test]
    fn parses_bootstrap() {
        assert_eq!(Bootstrap::from_body(&json!({})), Ok(None));
        let b = json!({"bootstrap_host": "h", "bootstrap_port": 8998, "bootstrap_room": 7});
        assert_eq!(
            Bootstrap::from_body(&b),
            Ok(Some(Bootstrap {
                host: "h".into(),
                port: 8998,
                room: 7
            }))
        );
        assert!(Bootstrap::from_body(&json!({"bootstrap_host": "h"})).is_err());
    }
}
