//! Routing hint headers from the EPP to the sidecar / frontend (DESIGN contract 2): Dynamo's
//! direct-mode names and llm-d's P/D sidecar name (routing-and-disagg.md §7.2, §7.3, §8).
//! Only the gateway path may set them: the EPP overwrites or strips whatever a client sent.

pub const WORKER_INSTANCE_ID: &str = "x-dynamo-worker-instance-id";
pub const DP_RANK: &str = "x-dynamo-dp-rank";
pub const PREFILL_INSTANCE_ID: &str = "x-dynamo-prefill-instance-id";
pub const PREFILL_DP_RANK: &str = "x-dynamo-prefill-dp-rank";
pub const ROUTING_MODE: &str = "x-dynamo-routing-mode";
pub const PREFILLER_HOST_PORT: &str = "x-prefiller-host-port";

/// Every header a client must not be able to inject: ours plus the legacy aliases a
/// direct-mode frontend also honours.
pub const ALL: &[&str] = &[
    WORKER_INSTANCE_ID,
    DP_RANK,
    PREFILL_INSTANCE_ID,
    PREFILL_DP_RANK,
    ROUTING_MODE,
    PREFILLER_HOST_PORT,
    "x-worker-instance-id",
    "x-prefill-instance-id",
    "x-dp-rank",
    "x-data-parallel-rank",
    "x-dynamo-prefill-worker-id",
    "x-dynamo-decode-worker-id",
    "x-dynamo-epp-booking-id",
    "x-data-parallel-host-port",
];

/// The header every kvroute worker puts on its responses.
pub const SERVED_BY_WORKER: &str = "x-kvroute-worker-id";

/// Is `name` (any case) a routing hint header?
pub fn is_hint_header(name: &str) -> bool {
    ALL.iter().any(|h| h.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    #[test]
    fn recognizes_hints_case_insensitively() {
        assert!(super::is_hint_header("X-Dynamo-Worker-Instance-Id"));
        assert!(super::is_hint_header("x-prefiller-host-port"));
        assert!(!super::is_hint_header("x-request-id"));
    }
}
