//! Wire format of the KV transfer agent protocol: length-prefixed control frames.
//!
//! Every control frame is `len: u32 LE` followed by `len` bytes of body; the body starts with a
//! one-byte kind and carries a little-endian, fixed-layout payload (metadata is JSON inside the
//! payload because it is exchanged once per peer, not per transfer). Bulk KV bytes are *not*
//! framed: a `ReadOk{total}` frame announces exactly `total` raw bytes that follow on the
//! stream, so the receiver can `read_exact` straight into its destination buffer with no
//! intermediate copy and no per-block header.
//!
//! Decoding never panics and never trusts a length: the frame length is checked against a
//! bound before anything is allocated, descriptor counts against the bytes actually present,
//! and every error is a [`FrameError`]. `tests::garbage_never_panics` feeds random bytes to
//! [`decode`] to keep it that way.

use bytes::{Buf, BufMut, BytesMut};

use super::agent::{AgentMetadata, Descriptor};

/// Control frames larger than this are rejected before their body is read. A descriptor is 24
/// bytes, so this admits ~700k descriptors; metadata is a few hundred bytes.
pub const MAX_FRAME_LEN: usize = 16 << 20;

/// Largest error message / notification payload we accept or send.
pub const MAX_MESSAGE_LEN: usize = 64 << 10;

const KIND_GET_METADATA: u8 = 1;
const KIND_METADATA: u8 = 2;
const KIND_READ: u8 = 3;
const KIND_READ_OK: u8 = 4;
const KIND_NOTIFY: u8 = 5;
const KIND_NOTIFY_ACK: u8 = 6;
const KIND_ERROR: u8 = 7;

/// One control message.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// Initiator → target: send me your [`AgentMetadata`] (the NIXL metadata exchange).
    GetMetadata,
    Metadata(AgentMetadata),
    /// Initiator → target: send the bytes of these descriptors, in order, as one stream.
    Read {
        xfer_id: u64,
        descriptors: Vec<Descriptor>,
    },
    /// Target → initiator: exactly `total` raw bytes follow.
    ReadOk {
        xfer_id: u64,
        total: u64,
    },
    /// Initiator → target: an application notification (e.g. "transfer done, release").
    Notify {
        message: Vec<u8>,
    },
    NotifyAck,
    /// Either direction: the request failed (`xfer_id` 0 when not about a read).
    Error {
        xfer_id: u64,
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("incomplete frame: need {needed} more bytes")]
    Incomplete { needed: usize },
    #[error("frame length {len} exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("empty frame (no kind byte)")]
    Empty,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("malformed {kind} frame: {reason}")]
    Malformed { kind: &'static str, reason: String },
}

fn malformed(kind: &'static str, reason: impl Into<String>) -> FrameError {
    FrameError::Malformed {
        kind,
        reason: reason.into(),
    }
}

impl Frame {
    fn kind_name(kind: u8) -> &'static str {
        match kind {
            KIND_GET_METADATA => "GetMetadata",
            KIND_METADATA => "Metadata",
            KIND_READ => "Read",
            KIND_READ_OK => "ReadOk",
            KIND_NOTIFY => "Notify",
            KIND_NOTIFY_ACK => "NotifyAck",
            KIND_ERROR => "Error",
            _ => "unknown",
        }
    }

    /// Appends the encoded frame (length prefix included) to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        let start = out.len();
        out.put_u32_le(0); // patched below
        match self {
            Frame::GetMetadata => out.put_u8(KIND_GET_METADATA),
            Frame::Metadata(md) => {
                out.put_u8(KIND_METADATA);
                // Serialising a plain struct of strings and integers cannot fail.
                let json = serde_json::to_vec(md).unwrap_or_default();
                out.put_slice(&json);
            }
            Frame::Read {
                xfer_id,
                descriptors,
            } => {
                out.put_u8(KIND_READ);
                out.put_u64_le(*xfer_id);
                out.put_u32_le(descriptors.len() as u32);
                for d in descriptors {
                    out.put_u64_le(d.region);
                    out.put_u64_le(d.offset);
                    out.put_u64_le(d.len);
                }
            }
            Frame::ReadOk { xfer_id, total } => {
                out.put_u8(KIND_READ_OK);
                out.put_u64_le(*xfer_id);
                out.put_u64_le(*total);
            }
            Frame::Notify { message } => {
                out.put_u8(KIND_NOTIFY);
                out.put_slice(&message[..message.len().min(MAX_MESSAGE_LEN)]);
            }
            Frame::NotifyAck => out.put_u8(KIND_NOTIFY_ACK),
            Frame::Error { xfer_id, message } => {
                out.put_u8(KIND_ERROR);
                out.put_u64_le(*xfer_id);
                let mut end = message.len().min(MAX_MESSAGE_LEN);
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                out.put_slice(&message.as_bytes()[..end]);
            }
        }
        let body_len = (out.len() - start - 4) as u32;
        out[start..start + 4].copy_from_slice(&body_len.to_le_bytes());
    }

    pub fn to_bytes(&self) -> BytesMut {
        let mut b = BytesMut::with_capacity(64);
        self.encode(&mut b);
        b
    }

    /// Decodes a frame body (kind byte + payload, without the length prefix).
    pub fn decode_body(body: &[u8]) -> Result<Frame, FrameError> {
        let (&kind, mut p) = body.split_first().ok_or(FrameError::Empty)?;
        let name = Frame::kind_name(kind);
        let need = |p: &[u8], n: usize| -> Result<(), FrameError> {
            if p.len() < n {
                Err(malformed(
                    name,
                    format!("payload has {} bytes, need {n}", p.len()),
                ))
            } else {
                Ok(())
            }
        };
        let exact = |p: &[u8]| -> Result<(), FrameError> {
            if p.is_empty() {
                Ok(())
            } else {
                Err(malformed(name, format!("{} trailing bytes", p.len())))
            }
        };
        match kind {
            KIND_GET_METADATA => {
                exact(p)?;
                Ok(Frame::GetMetadata)
            }
            KIND_METADATA => serde_json::from_slice(p)
                .map(Frame::Metadata)
                .map_err(|e| malformed(name, e.to_string())),
            KIND_READ => {
                need(p, 12)?;
                let xfer_id = p.get_u64_le();
                let n = p.get_u32_le() as usize;
                // Check the count against the bytes present before allocating anything.
                if p.len() != n.saturating_mul(24) {
                    return Err(malformed(
                        name,
                        format!("{n} descriptors need {} bytes, got {}", n * 24, p.len()),
                    ));
                }
                let mut descriptors = Vec::with_capacity(n);
                for _ in 0..n {
                    descriptors.push(Descriptor {
                        region: p.get_u64_le(),
                        offset: p.get_u64_le(),
                        len: p.get_u64_le(),
                    });
                }
                Ok(Frame::Read {
                    xfer_id,
                    descriptors,
                })
            }
            KIND_READ_OK => {
                need(p, 16)?;
                let xfer_id = p.get_u64_le();
                let total = p.get_u64_le();
                exact(p)?;
                Ok(Frame::ReadOk { xfer_id, total })
            }
            KIND_NOTIFY => {
                if p.len() > MAX_MESSAGE_LEN {
                    return Err(malformed(name, "notification too long"));
                }
                Ok(Frame::Notify {
                    message: p.to_vec(),
                })
            }
            KIND_NOTIFY_ACK => {
                exact(p)?;
                Ok(Frame::NotifyAck)
            }
            KIND_ERROR => {
                need(p, 8)?;
                let xfer_id = p.get_u64_le();
                if p.len() > MAX_MESSAGE_LEN {
                    return Err(malformed(name, "error message too long"));
                }
                Ok(Frame::Error {
                    xfer_id,
                    message: String::from_utf8_lossy(p).into_owned(),
                })
            }
            other => Err(FrameError::UnknownKind(other)),
        }
    }
}

/// Decodes one whole frame from the front of `buf`: the frame and the bytes it used.
pub fn decode(buf: &[u8], max_len: usize) -> Result<(Frame, usize), FrameError> {
    if buf.len() < 4 {
        return Err(FrameError::Incomplete {
            needed: 4 - buf.len(),
        });
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > max_len {
        return Err(FrameError::TooLarge { len, max: max_len });
    }
    let Some(body) = buf.get(4..4 + len) else {
        return Err(FrameError::Incomplete {
            needed: 4 + len - buf.len(),
        });
    };
    Ok((Frame::decode_body(body)?, 4 + len))
}

/// Reads one frame from an async stream. `Ok(None)` on a clean EOF before any byte.
pub async fn read_frame<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    max_len: usize,
) -> Result<Option<Frame>, super::TransferError> {
    use tokio::io::AsyncReadExt;
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max_len {
        return Err(FrameError::TooLarge { len, max: max_len }.into());
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(Some(Frame::decode_body(&body)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::agent::RegionInfo;
    use proptest::prelude::*;

    fn roundtrip(f: Frame) {
        let b = f.to_bytes();
        let (g, used) = decode(&b, MAX_FRAME_LEN).unwrap();
        assert_eq!(used, b.len());
        assert_eq!(g, f);
    }

    #[test]
    fn frames_roundtrip() {
        roundtrip(Frame::GetMetadata);
        roundtrip(Frame::Metadata(AgentMetadata {
            name: "p".into(),
            address: "127.0.0.1:1".into(),
            backend: "tcp".into(),
            regions: vec![RegionInfo {
                id: 3,
                len: 100,
                page_len: 10,
                device: false,
            }],
        }));
        roundtrip(Frame::Read {
            xfer_id: 9,
            descriptors: vec![
                Descriptor {
                    region: 1,
                    offset: 2,
                    len: 3,
                },
                Descriptor {
                    region: u64::MAX,
                    offset: 0,
                    len: 1 << 40,
                },
            ],
        });
        roundtrip(Frame::ReadOk {
            xfer_id: 1,
            total: 77,
        });
        roundtrip(Frame::Notify {
            message: b"release r1".to_vec(),
        });
        roundtrip(Frame::NotifyAck);
        roundtrip(Frame::Error {
            xfer_id: 4,
            message: "bad région".into(),
        });
    }

    #[test]
    fn malformed_frames_are_errors() {
        assert!(matches!(
            decode(&[1, 0], MAX_FRAME_LEN),
            Err(FrameError::Incomplete { .. })
        ));
        assert!(matches!(
            decode(&[0, 0, 0, 0], MAX_FRAME_LEN),
            Err(FrameError::Empty)
        ));
        assert!(matches!(
            decode(&[1, 0, 0, 0, 99], MAX_FRAME_LEN),
            Err(FrameError::UnknownKind(99))
        ));
        assert!(matches!(
            decode(&[0xff, 0xff, 0xff, 0xff], MAX_FRAME_LEN),
            Err(FrameError::TooLarge { .. })
        ));
        // A Read claiming 2^32-1 descriptors with none present must not allocate or panic.
        let mut b = BytesMut::new();
        b.put_u32_le(13);
        b.put_u8(KIND_READ);
        b.put_u64_le(1);
        b.put_u32_le(u32::MAX);
        assert!(matches!(
            decode(&b, MAX_FRAME_LEN),
            Err(FrameError::Malformed { .. })
        ));
        // Metadata that is not JSON.
        assert!(matches!(
            decode(&[3, 0, 0, 0, KIND_METADATA, b'{', b'x'], MAX_FRAME_LEN),
            Err(FrameError::Malformed { .. })
        ));
        // Trailing bytes on a fixed-size frame.
        assert!(matches!(
            decode(&[2, 0, 0, 0, KIND_NOTIFY_ACK, 0], MAX_FRAME_LEN),
            Err(FrameError::Malformed { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        /// Fuzz-style: arbitrary bytes (and arbitrary bodies behind a valid length prefix, so
        /// the payload decoders are reached) yield a frame or an error, never a panic.
        #[test]
        fn garbage_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..256),
                                kind in 0u8..10) {
            let _ = decode(&raw, MAX_FRAME_LEN);
            let mut framed = BytesMut::new();
            framed.put_u32_le(raw.len() as u32 + 1);
            framed.put_u8(kind);
            framed.put_slice(&raw);
            if let Ok((_, used)) = decode(&framed, MAX_FRAME_LEN) {
                prop_assert_eq!(used, framed.len());
            }
        }

        /// A valid frame cut anywhere is Incomplete, never a wrong frame.
        #[test]
        fn truncated_frames_are_incomplete(n in 0usize..20, cut in 0usize..1000) {
            let f = Frame::Read {
                xfer_id: 5,
                descriptors: (0..n as u64).map(|i| Descriptor { region: i, offset: i * 7, len: 3 }).collect(),
            };
            let b = f.to_bytes();
            let cut = cut % b.len();
            let is_incomplete = matches!(decode(&b[..cut], MAX_FRAME_LEN), Err(FrameError::Incomplete { .. }));
            prop_assert!(is_incomplete);
        }
    }
}
