//! msgpack building helpers shared by the decoder tests (`decode_vllm`, `decode_sglang`).
#![allow(dead_code)]

use rmpv::Value;

pub fn s(x: &str) -> Value {
    Value::from(x)
}

pub fn u(x: u64) -> Value {
    Value::from(x)
}

pub fn i(x: i64) -> Value {
    Value::from(x)
}

pub fn arr(items: Vec<Value>) -> Value {
    Value::Array(items)
}

pub fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}

pub fn tokens(range: std::ops::RangeInclusive<u64>) -> Value {
    arr(range.map(u).collect())
}

pub fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("encoding to a Vec cannot fail");
    out
}

/// `[ts, events, dp_rank]` (dp_rank omitted when `None`).
pub fn batch(ts: f64, events: Vec<Value>, dp_rank: Option<Value>) -> Vec<u8> {
    let mut b = vec![Value::F64(ts), arr(events)];
    if let Some(r) = dp_rank {
        b.push(r);
    }
    encode(&arr(b))
}

pub fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("valid hex"))
        .collect()
}
