//! The msgpack `EventBatch` decoder shared by the vLLM and SGLang front ends.
//!
//! Both engines publish the same framing (a positional `[ts, events, dp_rank?]` batch of
//! msgspec-tagged events); they differ only in which fields a `BlockStored` carries and in
//! what order the tagged-array form lists them. A [`Layout`] captures that difference; the rest
//! (msgpack parsing, hash normalization, validation, router keys) lives here once.
//!
//! The payload is parsed into a borrowed [`ValueRef`] tree first. That keeps the code simple and
//! allocation-safe: rmpv grows arrays as elements are actually read (it never preallocates from
//! a declared length) and strings / binaries borrow from the payload, so memory stays
//! proportional to the input.

use std::io::{Cursor, ErrorKind};

use rmpv::decode::{read_value_ref_with_max_depth, Error as RmpError};
use rmpv::ValueRef;

use super::{DecodeError, DecodedBatch, TieredEvent, MAX_NESTING};
use crate::events::{EventError, KvCacheEvent, KvEventData, StorageTier, StoredBlock};
use crate::hashing::{local_block_hash, namespace_seed};

/// A field an event may carry, by meaning (map keys and array positions both resolve to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    Medium,
    LoraName,
    CacheSalt,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    /// A field we know exists but do not use (`lora_id`, `session_id`, `locality`, ..).
    Unused,
}

const FIELD_COUNT: usize = 11;

impl Field {
    fn slot(self) -> usize {
        self as usize
    }

    fn from_key(key: &str) -> Field {
        match key {
            "block_hashes" => Field::BlockHashes,
            "parent_block_hash" => Field::ParentBlockHash,
            "token_ids" => Field::TokenIds,
            "block_size" => Field::BlockSize,
            "medium" => Field::Medium,
            "lora_name" => Field::LoraName,
            "cache_salt" => Field::CacheSalt,
            "extra_keys" => Field::ExtraKeys,
            "group_idx" => Field::GroupIdx,
            "kv_cache_spec_kind" => Field::SpecKind,
            _ => Field::Unused,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Field::BlockHashes => "block_hashes",
            Field::ParentBlockHash => "parent_block_hash",
            Field::TokenIds => "token_ids",
            Field::BlockSize => "block_size",
            Field::Medium => "medium",
            Field::LoraName => "lora_name",
            Field::CacheSalt => "cache_salt",
            Field::ExtraKeys => "extra_keys",
            Field::GroupIdx => "group_idx",
            Field::SpecKind => "kv_cache_spec_kind",
            Field::Unused => "(unused)",
        }
    }
}

/// How one engine lays out its events.
pub(crate) struct Layout {
    /// Positional `BlockStored` fields after the tag, in declaration order.
    pub stored: &'static [Field],
    /// Positional `BlockRemoved` fields after the tag.
    pub removed: &'static [Field],
    /// Whether a root block's `extra_keys` may carry the cache salt (vLLM only).
    pub salt_in_extra_keys: bool,
}

/// An event's fields, gathered from either wire form. `nil` counts as absent.
struct Fields<'v, 'a> {
    slots: [Option<&'v ValueRef<'a>>; FIELD_COUNT],
}

impl<'v, 'a> Fields<'v, 'a> {
    fn new() -> Self {
        Fields {
            slots: [None; FIELD_COUNT],
        }
    }

    fn set(&mut self, field: Field, value: &'v ValueRef<'a>) {
        if field != Field::Unused && !matches!(value, ValueRef::Nil) {
            self.slots[field.slot()] = Some(value);
        }
    }

    fn get(&self, field: Field) -> Option<&'v ValueRef<'a>> {
        self.slots[field.slot()]
    }
}

/// The text of a valid UTF-8 string value.
fn str_of<'v>(v: &'v ValueRef<'_>) -> Option<&'v str> {
    match v {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

fn type_name(v: &ValueRef<'_>) -> &'static str {
    match v {
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "a boolean",
        ValueRef::Integer(_) => "an integer",
        ValueRef::F32(_) | ValueRef::F64(_) => "a float",
        ValueRef::String(_) => "a string",
        ValueRef::Binary(_) => "binary",
        ValueRef::Array(_) => "an array",
        ValueRef::Map(_) => "a map",
        ValueRef::Ext(..) => "an extension value",
    }
}

fn wrong_type(path: String, expected: &'static str, v: &ValueRef<'_>) -> DecodeError {
    DecodeError::WrongType {
        path,
        expected,
        found: type_name(v),
    }
}

fn field_path(ev: usize, field: Field) -> String {
    format!("events[{ev}].{}", field.name())
}

fn elem_path(ev: usize, field: Field, i: usize) -> String {
    format!("events[{ev}].{}[{i}]", field.name())
}

/// Reduces a `bin` hash to `u64` the way vLLM reduces its int form: the big-endian integer
/// modulo 2^64, i.e. the last 8 bytes. `None` for widths outside 8..=64 bytes.
pub fn normalize_hash_bytes(bytes: &[u8]) -> Option<u64> {
    if !(8..=64).contains(&bytes.len()) {
        return None;
    }
    let mut last = [0u8; 8];
    last.copy_from_slice(&bytes[bytes.len() - 8..]);
    Some(u64::from_be_bytes(last))
}

fn hash_value(v: &ValueRef<'_>, path: impl Fn() -> String) -> Result<u64, DecodeError> {
    match v {
        // Negative values (SGLang's i64, or an i64-typed publisher) keep their bit pattern.
        ValueRef::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or_else(|| wrong_type(path(), "an integer hash", v)),
        ValueRef::Binary(b) => normalize_hash_bytes(b).ok_or_else(|| DecodeError::HashWidth {
            path: path(),
            len: b.len(),
        }),
        _ => Err(wrong_type(path(), "an integer or binary hash", v)),
    }
}

fn array<'v, 'a>(
    v: &'v ValueRef<'a>,
    path: impl Fn() -> String,
) -> Result<&'v [ValueRef<'a>], DecodeError> {
    match v {
        ValueRef::Array(items) => Ok(items),
        _ => Err(wrong_type(path(), "an array", v)),
    }
}

fn string<'v>(v: &'v ValueRef<'_>, path: impl Fn() -> String) -> Result<&'v str, DecodeError> {
    match v {
        ValueRef::String(s) => s
            .as_str()
            .ok_or_else(|| wrong_type(path(), "a UTF-8 string", v)),
        _ => Err(wrong_type(path(), "a string", v)),
    }
}

fn unsigned(
    v: &ValueRef<'_>,
    max: u64,
    expected: &'static str,
    path: impl Fn() -> String,
) -> Result<u64, DecodeError> {
    match v {
        ValueRef::Integer(i) => match i.as_u64() {
            Some(x) if x <= max => Ok(x),
            _ => Err(DecodeError::OutOfRange {
                path: path(),
                value: i.to_string(),
                expected,
            }),
        },
        _ => Err(wrong_type(path(), "an integer", v)),
    }
}

fn opt_str<'v>(
    fields: &Fields<'v, '_>,
    ev: usize,
    f: Field,
) -> Result<Option<&'v str>, DecodeError> {
    fields
        .get(f)
        .map(|v| string(v, || field_path(ev, f)))
        .transpose()
}

fn require<'v, 'a>(
    fields: &Fields<'v, 'a>,
    ev: usize,
    f: Field,
) -> Result<&'v ValueRef<'a>, DecodeError> {
    fields.get(f).ok_or_else(|| DecodeError::MissingField {
        path: format!("events[{ev}]"),
        field: f.name(),
    })
}

fn hashes(v: &ValueRef<'_>, ev: usize, f: Field) -> Result<Vec<u64>, DecodeError> {
    array(v, || field_path(ev, f))?
        .iter()
        .enumerate()
        .map(|(i, h)| hash_value(h, || elem_path(ev, f, i)))
        .collect()
}

/// Dynamo's rule: only KV cache group 0 of a full / MLA attention spec is indexed. Returns
/// whether the event must be skipped (after checking the fields' types).
fn skip_group(fields: &Fields<'_, '_>, ev: usize) -> Result<bool, DecodeError> {
    let group = fields
        .get(Field::GroupIdx)
        .map(|v| {
            unsigned(v, u64::MAX, "a non-negative group index", || {
                field_path(ev, Field::GroupIdx)
            })
        })
        .transpose()?;
    let kind = opt_str(fields, ev, Field::SpecKind)?;
    let full_attention = kind.is_none_or(|k| {
        k.eq_ignore_ascii_case("full_attention") || k.eq_ignore_ascii_case("mla_attention")
    });
    Ok(group.unwrap_or(0) != 0 || !full_attention)
}

/// The cache salt vLLM mixes into a request's first block: `extra_keys[0]` of a root event is a
/// tuple of the LoRA name, multimodal `(id, offset)` tuples, the salt and prompt-embedding keys.
/// Top-level strings other than the LoRA name are salts; only an unambiguous single one is used.
fn salt_from_extra_keys<'v>(
    extra: &'v ValueRef<'_>,
    lora_name: Option<&str>,
    ev: usize,
) -> Result<Option<&'v str>, DecodeError> {
    let per_block = array(extra, || field_path(ev, Field::ExtraKeys))?;
    let Some(ValueRef::Array(first)) = per_block.first() else {
        return Ok(None);
    };
    let mut lora_seen = false;
    let mut salt = None;
    for item in first {
        let Some(s) = str_of(item) else { continue };
        if !lora_seen && Some(s) == lora_name {
            lora_seen = true;
        } else if salt.is_some() {
            return Ok(None); // two candidates: we cannot tell which is the salt
        } else {
            salt = Some(s);
        }
    }
    Ok(salt)
}

fn decode_stored(
    fields: &Fields<'_, '_>,
    ev: usize,
    layout: &Layout,
    block_size_hint: Option<u32>,
) -> Result<Option<(KvEventData, StorageTier)>, DecodeError> {
    if skip_group(fields, ev)? {
        return Ok(None);
    }
    let block_hashes = hashes(
        require(fields, ev, Field::BlockHashes)?,
        ev,
        Field::BlockHashes,
    )?;
    let parent_hash = fields
        .get(Field::ParentBlockHash)
        .map(|v| hash_value(v, || field_path(ev, Field::ParentBlockHash)))
        .transpose()?;
    let token_ids = array(require(fields, ev, Field::TokenIds)?, || {
        field_path(ev, Field::TokenIds)
    })?
    .iter()
    .enumerate()
    .map(|(i, t)| {
        unsigned(t, u64::from(u32::MAX), "a u32 token id", || {
            elem_path(ev, Field::TokenIds, i)
        })
        .map(|t| t as u32)
    })
    .collect::<Result<Vec<u32>, _>>()?;
    let block_size = match fields.get(Field::BlockSize) {
        Some(v) => unsigned(v, u64::from(u32::MAX), "a u32 block size", || {
            field_path(ev, Field::BlockSize)
        })? as u32,
        None => block_size_hint.ok_or_else(|| DecodeError::MissingField {
            path: format!("events[{ev}]"),
            field: Field::BlockSize.name(),
        })?,
    };
    let tier = StorageTier::from_medium(opt_str(fields, ev, Field::Medium)?);
    // Empty strings hash like absent ones (namespace_seed); normalize so the event says so too.
    let lora_name = opt_str(fields, ev, Field::LoraName)?.filter(|s| !s.is_empty());
    let mut cache_salt = opt_str(fields, ev, Field::CacheSalt)?;
    if cache_salt.is_none() && layout.salt_in_extra_keys && parent_hash.is_none() {
        if let Some(extra) = fields.get(Field::ExtraKeys) {
            cache_salt = salt_from_extra_keys(extra, lora_name, ev)?;
        }
    }
    let cache_salt = cache_salt.filter(|s| !s.is_empty());
    if token_ids.is_empty() && !block_hashes.is_empty() {
        return Err(DecodeError::MissingTokens {
            path: format!("events[{ev}]"),
            blocks: block_hashes.len(),
        });
    }
    let invalid = |source: EventError| DecodeError::InvalidEvent {
        path: format!("events[{ev}]"),
        source,
    };
    // `validate` multiplies blocks by block_size; rule out an overflow first (it would need a
    // payload of more than 4 GiB, but the decoder must not be the one to panic).
    if block_hashes
        .len()
        .checked_mul(block_size as usize)
        .is_none()
    {
        return Err(invalid(EventError::TokenCountMismatch {
            tokens: token_ids.len(),
            blocks: block_hashes.len(),
            block_size,
        }));
    }
    let mut data = KvEventData::Stored {
        parent_hash,
        blocks: block_hashes
            .iter()
            .map(|&block_hash| StoredBlock {
                block_hash,
                tokens_hash: 0, // filled below, once the sizes are known to agree
            })
            .collect(),
        token_ids,
        block_size,
        lora_name: lora_name.map(str::to_owned),
        cache_salt: cache_salt.map(str::to_owned),
    };
    // The invariant every decoder must guarantee (DESIGN contract 4): block_size > 0 and
    // token_ids.len() == blocks × block_size.
    data.validate().map_err(invalid)?;
    if let KvEventData::Stored {
        blocks,
        token_ids,
        block_size,
        ..
    } = &mut data
    {
        let seed = namespace_seed(lora_name, cache_salt);
        for (block, toks) in blocks
            .iter_mut()
            .zip(token_ids.chunks_exact(*block_size as usize))
        {
            block.tokens_hash = local_block_hash(toks, seed);
        }
    }
    Ok(Some((data, tier)))
}

fn decode_removed(
    fields: &Fields<'_, '_>,
    ev: usize,
) -> Result<Option<(KvEventData, StorageTier)>, DecodeError> {
    if skip_group(fields, ev)? {
        return Ok(None);
    }
    let block_hashes = hashes(
        require(fields, ev, Field::BlockHashes)?,
        ev,
        Field::BlockHashes,
    )?;
    let tier = StorageTier::from_medium(opt_str(fields, ev, Field::Medium)?);
    Ok(Some((KvEventData::Removed { block_hashes }, tier)))
}

fn decode_event(
    v: &ValueRef<'_>,
    ev: usize,
    layout: &Layout,
    block_size_hint: Option<u32>,
) -> Result<Option<(KvEventData, StorageTier)>, DecodeError> {
    let mut fields = Fields::new();
    let tag = match v {
        ValueRef::Map(entries) => {
            let mut tag = None;
            for (k, val) in entries {
                // Non-string keys cannot be msgspec fields; ignore them like unknown fields.
                let Some(key) = str_of(k) else { continue };
                if key == "type" {
                    tag = Some(val);
                } else {
                    fields.set(Field::from_key(key), val);
                }
            }
            tag.ok_or_else(|| DecodeError::MissingField {
                path: format!("events[{ev}]"),
                field: "type",
            })?
        }
        ValueRef::Array(items) => {
            let Some((tag, rest)) = items.split_first() else {
                return Err(DecodeError::BadLength {
                    path: format!("events[{ev}]"),
                    len: 0,
                    expected: "a type tag followed by fields",
                });
            };
            let order = match str_of(tag) {
                Some("BlockStored") => layout.stored,
                Some("BlockRemoved") => layout.removed,
                _ => &[],
            };
            // Fields past the known layout are newer additions: ignored.
            for (f, val) in order.iter().zip(rest) {
                fields.set(*f, val);
            }
            tag
        }
        _ => {
            return Err(wrong_type(
                format!("events[{ev}]"),
                "a tagged map or array",
                v,
            ))
        }
    };
    let tag = string(tag, || format!("events[{ev}].type"))?;
    match tag {
        "BlockStored" => decode_stored(&fields, ev, layout, block_size_hint),
        "BlockRemoved" => decode_removed(&fields, ev),
        "AllBlocksCleared" => Ok(Some((
            KvEventData::Cleared,
            StorageTier::from_medium(opt_str(&fields, ev, Field::Medium)?),
        ))),
        other => Err(DecodeError::UnknownEventType {
            path: format!("events[{ev}]"),
            tag: other.to_owned(),
        }),
    }
}

fn msgpack_reason(e: &RmpError) -> String {
    match e {
        RmpError::InvalidMarkerRead(io) | RmpError::InvalidDataRead(io)
            if io.kind() == ErrorKind::UnexpectedEof =>
        {
            "truncated (unexpected end of input)".to_owned()
        }
        RmpError::DepthLimitExceeded => format!("nested deeper than {MAX_NESTING} levels"),
        other => other.to_string(),
    }
}

/// Decodes one `EventBatch` payload under `layout`.
pub(crate) fn decode_batch(
    payload: &[u8],
    layout: &Layout,
    block_size_hint: Option<u32>,
) -> Result<DecodedBatch, DecodeError> {
    let mut cursor = Cursor::new(payload);
    let root = match read_value_ref_with_max_depth(&mut cursor, MAX_NESTING) {
        Ok(v) => v,
        Err(e) => {
            return Err(DecodeError::Msgpack {
                offset: cursor.position() as usize,
                reason: msgpack_reason(&e),
            })
        }
    };
    let end = cursor.position() as usize;
    if end < payload.len() {
        return Err(DecodeError::TrailingBytes {
            end,
            trailing: payload.len() - end,
        });
    }
    let batch = array(&root, || "EventBatch".to_owned())?;
    if batch.len() < 2 {
        return Err(DecodeError::BadLength {
            path: "EventBatch".to_owned(),
            len: batch.len(),
            expected: "[ts, events] or [ts, events, dp_rank]",
        });
    }
    let timestamp = match &batch[0] {
        ValueRef::F64(x) => *x,
        ValueRef::F32(x) => f64::from(*x),
        ValueRef::Integer(i) => i.as_f64().unwrap_or(0.0),
        other => {
            return Err(wrong_type(
                "EventBatch[0] (ts)".to_owned(),
                "a float",
                other,
            ))
        }
    };
    let dp_rank = match batch.get(2) {
        None | Some(ValueRef::Nil) => None,
        Some(v) => Some(
            unsigned(v, u64::from(u32::MAX), "a u32 data-parallel rank", || {
                "EventBatch[2] (dp_rank)".to_owned()
            })? as u32,
        ),
    };
    let raw_events = array(&batch[1], || "EventBatch[1] (events)".to_owned())?;
    let mut events = Vec::with_capacity(raw_events.len());
    let mut skipped = 0;
    for (ev, raw) in raw_events.iter().enumerate() {
        match decode_event(raw, ev, layout, block_size_hint)? {
            Some((data, tier)) => {
                let event_id = events.len() as u64;
                events.push(TieredEvent {
                    tier,
                    event: KvCacheEvent {
                        event_id,
                        data,
                        dp_rank: dp_rank.unwrap_or(0),
                    },
                });
            }
            None => skipped += 1,
        }
    }
    Ok(DecodedBatch {
        timestamp,
        dp_rank,
        events,
        skipped,
    })
}
