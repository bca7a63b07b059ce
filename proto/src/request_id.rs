//! The `x-request-id` every HTTP hop (sidecar, worker) echoes: the client's when it is usable,
//! otherwise a fresh one, so that every response and log line of a request can be joined.

use http::{HeaderMap, HeaderValue};

pub const HEADER: &str = "x-request-id";
/// Longest client-supplied id that is kept (a longer one is replaced, not truncated).
const MAX_LEN: usize = 256;

/// The client's `x-request-id` when it is non-empty, at most 256 bytes and visible ASCII;
/// otherwise a fresh v4 uuid.
pub fn from_or_new(headers: &HeaderMap) -> HeaderValue {
    headers
        .get(HEADER)
        .filter(|v| !v.is_empty() && v.len() <= MAX_LEN && v.to_str().is_ok())
        .cloned()
        .unwrap_or_else(|| {
            HeaderValue::from_str(&uuid::Uuid::new_v4().to_string())
                .unwrap_or(HeaderValue::from_static("unknown"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(value: &[u8]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            HEADER,
            HeaderValue::from_bytes(value).expect("valid header bytes"),
        );
        headers
    }

    #[test]
    fn keeps_a_usable_client_id() {
        assert_eq!(from_or_new(&with(b"req-42")), "req-42");
    }

    #[test]
    fn replaces_missing_empty_oversized_and_non_ascii_ids() {
        let fresh = |headers: &HeaderMap| {
            let id = from_or_new(headers);
            let id = id.to_str().expect("uuid is ASCII");
            assert!(uuid::Uuid::parse_str(id).is_ok(), "{id:?} is not a uuid");
        };
        fresh(&HeaderMap::new());
        fresh(&with(b""));
        fresh(&with(&[b'a'; MAX_LEN + 1]));
        fresh(&with("é".as_bytes()));
        assert_eq!(from_or_new(&with(&[b'a'; MAX_LEN])).len(), MAX_LEN);
    }
}
