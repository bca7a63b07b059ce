//! Worker identity (DESIGN contract 3): a `u64` instance id. On Kubernetes it is Dynamo's
//! pod-name hash, so ids agree with Dynamo components: Rust's std `DefaultHasher`
//! (SipHash-1-3 with zero keys) over the `&str`, masked to 53 bits (routing-and-disagg.md §7.4).

use std::hash::{DefaultHasher, Hash, Hasher};

/// Mask keeping the low 53 bits, so ids survive a round trip through a JSON double.
pub const INSTANCE_ID_MASK: u64 = 0x001F_FFFF_FFFF_FFFF;

/// Dynamo's `hash_pod_name`.
pub fn instance_id_for_pod(pod_name: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    pod_name.hash(&mut hasher);
    hasher.finish() & INSTANCE_ID_MASK
}

/// Dynamo's container-mode id: `"{pod}-{container}"`, where container `main` stands for the pod.
pub fn instance_id_for_container(pod_name: &str, container: &str) -> u64 {
    if container == "main" {
        instance_id_for_pod(pod_name)
    } else {
        instance_id_for_pod(&format!("{pod_name}-{container}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Independent vectors: SipHash-1-3 with zero keys over the UTF-8 bytes followed by the 0xFF
    // terminator std's `str::hash` writes, computed with a from-scratch Python SipHash-1-3
    // implementation, then masked to 53 bits.
    #[test]
    fn pod_name_vectors() {
        assert_eq!(instance_id_for_pod("vllm-worker-0"), VECTOR_VLLM_WORKER_0);
        assert_eq!(instance_id_for_pod(""), VECTOR_EMPTY);
    }

    #[test]
    fn ids_fit_in_53_bits() {
        for name in ["a", "decode-7f9c", "prefill-0", "x".repeat(300).as_str()] {
            assert!(instance_id_for_pod(name) <= INSTANCE_ID_MASK);
        }
    }

    #[test]
    fn container_main_is_pod() {
        assert_eq!(
            instance_id_for_container("p", "main"),
            instance_id_for_pod("p")
        );
        assert_eq!(
            instance_id_for_container("p", "side"),
            instance_id_for_pod("p-side")
        );
    }

    const VECTOR_VLLM_WORKER_0: u64 = 3637812819037538;
    const VECTOR_EMPTY: u64 = 121655548788207;
}
