//! kvroute's shared wire contracts (see DESIGN.md, "Contracts"): the KV event model, Dynamo-compatible
//! block hashing, worker identity and metadata, our gRPC worker-control service, and prompt
//! rendering (chat template + tokenizer) shared by the EPP and the workers so their token ids agree.

pub mod decode;
pub mod events;
pub mod hashing;
pub mod hints;
pub mod metadata;
pub mod openai;
pub mod prompt;
pub mod request_id;
pub mod tokenizer;
pub mod worker_id;

/// Generated protobuf / tonic code for `proto/kvroute.proto`.
#[allow(clippy::all)]
pub mod pb {
    tonic::include_proto!("kvroute.v1");
}
