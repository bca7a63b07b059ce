//! Worker metadata: who a worker is, what it serves, how big its KV cache is and where it sits in
//! the topology. Field names follow Dynamo's `ModelRuntimeConfig` topology fields
//! (routing-and-disagg.md §5). [`WorkerMetadata::validate`] gives errors a person can act on.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::pb;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    #[default]
    Aggregated,
    Prefill,
    Decode,
}

impl std::str::FromStr for WorkerRole {
    type Err = MetadataError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "aggregated" | "agg" | "both" => Ok(WorkerRole::Aggregated),
            "prefill" => Ok(WorkerRole::Prefill),
            "decode" => Ok(WorkerRole::Decode),
            other => Err(MetadataError::UnknownRole(other.to_string())),
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WorkerRole::Aggregated => "aggregated",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Enforcement {
    #[default]
    Required,
    Preferred,
}

impl std::str::FromStr for Enforcement {
    type Err = MetadataError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "required" => Ok(Enforcement::Required),
            "preferred" => Ok(Enforcement::Preferred),
            other => Err(MetadataError::UnknownEnforcement(other.to_string())),
        }
    }
}

/// Everything the EPP needs to know about a worker besides its live state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerMetadata {
    pub instance_id: u64,
    pub name: String,
    pub model: String,
    pub role: WorkerRole,
    pub block_size: u32,
    pub kv_capacity_blocks: u64,
    pub dp_size: u32,
    /// `{domain: value}`, e.g. `{"zone": "us-east-1a", "rack": "rack-22"}`.
    pub topology_domains: BTreeMap<String, String>,
    /// The domain that constrains which decode worker may pull this worker's KV blocks.
    pub kv_transfer_domain: Option<String>,
    pub kv_transfer_enforcement: Enforcement,
    /// In [0, 1]; only used with `Enforcement::Preferred`.
    pub kv_transfer_preferred_weight: f32,
    /// host:port of the worker's OpenAI HTTP API.
    pub http_endpoint: String,
    pub max_num_batched_tokens: u32,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MetadataError {
    #[error("unknown worker role {0:?}: expected aggregated, prefill or decode")]
    UnknownRole(String),
    #[error("unknown kv transfer enforcement {0:?}: expected required or preferred")]
    UnknownEnforcement(String),
    #[error("worker {name:?}: model name is empty")]
    EmptyModel { name: String },
    #[error("worker {name:?}: block_size must be between 1 and 4096 tokens, got {got}")]
    BadBlockSize { name: String, got: u32 },
    #[error("worker {name:?}: KV capacity must be at least one block")]
    NoCapacity { name: String },
    #[error("worker {name:?}: dp_size must be at least 1")]
    NoDpRanks { name: String },
    #[error("worker {name:?}: kv_transfer_preferred_weight must be in [0, 1], got {got}")]
    BadWeight { name: String, got: f32 },
    #[error(
        "worker {name:?}: kv_transfer_domain {domain:?} is not one of its topology domains ({known})"
    )]
    UnknownTransferDomain {
        name: String,
        domain: String,
        known: String,
    },
    #[error("worker {name:?}: topology domain names and values must be non-empty, without ',' or '=' (got {domain:?}={value:?})")]
    BadDomain {
        name: String,
        domain: String,
        value: String,
    },
    #[error("worker {name:?}: instance id 0 is reserved")]
    ZeroInstanceId { name: String },
}

impl WorkerMetadata {
    pub fn validate(&self) -> Result<(), MetadataError> {
        let name = self.name.clone();
        if self.instance_id == 0 {
            return Err(MetadataError::ZeroInstanceId { name });
        }
        if self.model.trim().is_empty() {
            return Err(MetadataError::EmptyModel { name });
        }
        if self.block_size == 0 || self.block_size > 4096 {
            return Err(MetadataError::BadBlockSize {
                name,
                got: self.block_size,
            });
        }
        if self.kv_capacity_blocks == 0 {
            return Err(MetadataError::NoCapacity { name });
        }
        if self.dp_size == 0 {
            return Err(MetadataError::NoDpRanks { name });
        }
        let w = self.kv_transfer_preferred_weight;
        if !(0.0..=1.0).contains(&w) || w.is_nan() {
            return Err(MetadataError::BadWeight { name, got: w });
        }
        for (domain, value) in &self.topology_domains {
            let bad = |s: &str| s.trim().is_empty() || s.contains(',') || s.contains('=');
            if bad(domain) || bad(value) {
                return Err(MetadataError::BadDomain {
                    name,
                    domain: domain.clone(),
                    value: value.clone(),
                });
            }
        }
        if let Some(domain) = &self.kv_transfer_domain {
            if !self.topology_domains.contains_key(domain) {
                let known = if self.topology_domains.is_empty() {
                    "it has none".to_string()
                } else {
                    self.topology_domains
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                return Err(MetadataError::UnknownTransferDomain {
                    name,
                    domain: domain.clone(),
                    known,
                });
            }
        }
        Ok(())
    }

    /// The value of this worker's KV transfer domain, if it has one.
    pub fn transfer_domain_value(&self) -> Option<(&str, &str)> {
        let d = self.kv_transfer_domain.as_deref()?;
        self.topology_domains.get(d).map(|v| (d, v.as_str()))
    }

    pub fn to_pb(&self) -> pb::WorkerMetadata {
        pb::WorkerMetadata {
            instance_id: self.instance_id,
            name: self.name.clone(),
            model: self.model.clone(),
            role: match self.role {
                WorkerRole::Aggregated => pb::WorkerRole::Aggregated,
                WorkerRole::Prefill => pb::WorkerRole::Prefill,
                WorkerRole::Decode => pb::WorkerRole::Decode,
            } as i32,
            block_size: self.block_size,
            kv_capacity_blocks: self.kv_capacity_blocks,
            dp_size: self.dp_size,
            topology_domains: self.topology_domains.clone().into_iter().collect(),
            kv_transfer_domain: self.kv_transfer_domain.clone(),
            kv_transfer_enforcement: match self.kv_transfer_enforcement {
                Enforcement::Required => pb::KvTransferEnforcement::Required,
                Enforcement::Preferred => pb::KvTransferEnforcement::Preferred,
            } as i32,
            kv_transfer_preferred_weight: self.kv_transfer_preferred_weight,
            http_endpoint: self.http_endpoint.clone(),
            max_num_batched_tokens: self.max_num_batched_tokens,
        }
    }

    /// Decodes and validates metadata received from a worker.
    pub fn from_pb(m: &pb::WorkerMetadata) -> Result<Self, MetadataError> {
        let role = match pb::WorkerRole::try_from(m.role) {
            Ok(pb::WorkerRole::Aggregated) => WorkerRole::Aggregated,
            Ok(pb::WorkerRole::Prefill) => WorkerRole::Prefill,
            Ok(pb::WorkerRole::Decode) => WorkerRole::Decode,
            Err(_) => return Err(MetadataError::UnknownRole(m.role.to_string())),
        };
        let kv_transfer_enforcement =
            match pb::KvTransferEnforcement::try_from(m.kv_transfer_enforcement) {
                Ok(pb::KvTransferEnforcement::Required) => Enforcement::Required,
                Ok(pb::KvTransferEnforcement::Preferred) => Enforcement::Preferred,
                Err(_) => {
                    return Err(MetadataError::UnknownEnforcement(
                        m.kv_transfer_enforcement.to_string(),
                    ))
                }
            };
        let md = WorkerMetadata {
            instance_id: m.instance_id,
            name: m.name.clone(),
            model: m.model.clone(),
            role,
            block_size: m.block_size,
            kv_capacity_blocks: m.kv_capacity_blocks,
            dp_size: m.dp_size,
            topology_domains: m.topology_domains.clone().into_iter().collect(),
            kv_transfer_domain: m.kv_transfer_domain.clone(),
            kv_transfer_enforcement,
            kv_transfer_preferred_weight: m.kv_transfer_preferred_weight,
            http_endpoint: m.http_endpoint.clone(),
            max_num_batched_tokens: m.max_num_batched_tokens,
        };
        md.validate()?;
        Ok(md)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> WorkerMetadata {
        WorkerMetadata {
            instance_id: 42,
            name: "w0".into(),
            model: "Qwen/Qwen3-0.6B".into(),
            role: WorkerRole::Prefill,
            block_size: 16,
            kv_capacity_blocks: 1024,
            dp_size: 1,
            topology_domains: [("zone".to_string(), "a".to_string())].into(),
            kv_transfer_domain: Some("zone".into()),
            kv_transfer_enforcement: Enforcement::Preferred,
            kv_transfer_preferred_weight: 0.5,
            http_endpoint: "127.0.0.1:8000".into(),
            max_num_batched_tokens: 8192,
        }
    }

    #[test]
    fn valid_round_trips() {
        let md = good();
        md.validate().expect("valid");
        assert_eq!(WorkerMetadata::from_pb(&md.to_pb()), Ok(md.clone()));
        assert_eq!(md.transfer_domain_value(), Some(("zone", "a")));
    }

    #[test]
    fn errors_name_the_problem() {
        let cases: Vec<(WorkerMetadata, &str)> = vec![
            (
                WorkerMetadata {
                    block_size: 0,
                    ..good()
                },
                "block_size must be between 1 and 4096",
            ),
            (
                WorkerMetadata {
                    kv_capacity_blocks: 0,
                    ..good()
                },
                "at least one block",
            ),
            (
                WorkerMetadata {
                    model: " ".into(),
                    ..good()
                },
                "model name is empty",
            ),
            (
                WorkerMetadata {
                    dp_size: 0,
                    ..good()
                },
                "dp_size",
            ),
            (
                WorkerMetadata {
                    kv_transfer_preferred_weight: 1.5,
                    ..good()
                },
                "[0, 1], got 1.5",
            ),
            (
                WorkerMetadata {
                    kv_transfer_preferred_weight: f32::NAN,
                    ..good()
                },
                "[0, 1]",
            ),
            (
                WorkerMetadata {
                    kv_transfer_domain: Some("rack".into()),
                    ..good()
                },
                "\"rack\" is not one of its topology domains (zone)",
            ),
            (
                WorkerMetadata {
                    instance_id: 0,
                    ..good()
                },
                "reserved",
            ),
            (
                WorkerMetadata {
                    topology_domains: [("zone".into(), "a,b".into())].into(),
                    ..good()
                },
                "without ','",
            ),
        ];
        for (md, want) in cases {
            let err = md.validate().expect_err("invalid").to_string();
            assert!(err.contains(want), "{err:?} should contain {want:?}");
            assert!(err.contains("w0"), "{err:?} names the worker");
        }
    }

    #[test]
    fn parses_enums() {
        assert_eq!("Prefill".parse::<WorkerRole>(), Ok(WorkerRole::Prefill));
        assert!("middle"
            .parse::<WorkerRole>()
            .unwrap_err()
            .to_string()
            .contains("middle"));
        assert_eq!(
            "preferred".parse::<Enforcement>(),
            Ok(Enforcement::Preferred)
        );
        assert!("soft".parse::<Enforcement>().is_err());
        let mut wire = good().to_pb();
        wire.role = 17;
        assert!(WorkerMetadata::from_pb(&wire).is_err());
    }
}
