//! Synthetic multi-turn chat conversations: each turn re-sends the whole history plus a new user
//! message, as chat clients do, so every turn's prompt extends the previous one.

use serde_json::{json, Value};

const WORDS: &[&str] = &[
    "router", "cache", "kernel", "tensor", "gateway", "prefill", "decode", "latency", "block",
    "shard", "replica", "token", "schedule", "vector", "matrix", "stream", "budget", "window",
    "pool", "queue", "batch", "lattice",
];

/// Deterministic pseudo-random text of about `words` words, distinct per `seed`.
pub fn text(seed: u64, words: usize) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::with_capacity(words * 8);
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        if x.is_multiple_of(11) {
            out.push_str(&format!(" {}", x % 1000));
        }
    }
    out
}

pub struct Conversation {
    pub id: u64,
    pub messages: Vec<Value>,
}

impl Conversation {
    /// A conversation whose first message is unique to `id` and about `words` words long.
    pub fn new(id: u64, words: usize) -> Self {
        Conversation {
            id,
            messages: vec![
                json!({"role": "user", "content": format!("Conversation {id}. {}", text(id, words))}),
            ],
        }
    }

    pub fn request(&self, model: &str, max_tokens: u32, stream: bool) -> Value {
        json!({"model": model, "messages": self.messages, "max_tokens": max_tokens, "stream": stream})
    }

    /// Appends the assistant's answer and the next user message.
    pub fn advance(&mut self, assistant_reply: &str, words: usize) {
        let turn = self.messages.len() as u64;
        self.messages
            .push(json!({"role": "assistant", "content": assistant_reply}));
        self.messages
            .push(json!({"role": "user", "content": text(self.id * 1000 + turn, words)}));
    }
}

/// The assistant text of a non-streaming chat completion.
pub fn reply_text(body: &Value) -> String {
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}
