//! Fast, exact tokenization for the EPP and the simulated worker (issue 5).
//!
//! [`FastTokenizer`] reproduces HF `tokenizers`' `Tokenizer::encode(text, add_special_tokens)`
//! ids for byte-level BPE tokenizers of the Qwen2/Qwen3 and Llama-3 family, reading the same
//! `tokenizer.json`, several times faster:
//!
//! 1. added/special tokens are split out of the raw text ([`added_tokens`]);
//! 2. each remaining segment is NFC-normalized when the file says so — skipped when the
//!    Unicode quick check proves the text already is NFC (all ASCII text, most other text);
//! 3. the split regex is matched by hand ([`pretokenize`]) instead of by Oniguruma;
//! 4. each piece's bytes go through BPE merges by rank ([`bpe`]); byte-level mapping is folded
//!    into the vocabulary at load ([`byte_level`]), so no per-character remapping at run time;
//! 5. the post-processor's special tokens (Llama-3's BOS) are added when asked.
//!
//! Anything else in the file (another normalizer, pre-tokenizer, model, added-token flags,
//! truncation, padding) makes [`FastTokenizer::from_file`] return `Ok(None)` with the reason
//! logged once; [`TokenEncoder::from_file`] then uses HF `tokenizers` instead.
//!
//! [`PrefixReuseEncoder`] adds reuse across requests: a follow-up turn repeats the previous
//! prompt, so only the text after the longest remembered *safe boundary* is tokenized (see
//! [`prefix_cache`] for why those boundaries are safe).
//!
//! Differential tests against HF live in `proto/tests/tokenizer_diff.rs`, the fuzz target in
//! `fuzz/`, the benchmark in `src/bin/tokenizer-bench.rs`.

mod added_tokens;
mod bpe;
mod byte_level;
mod prefix_cache;
mod pretokenize;
mod unicode_tables;

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use unicode_normalization_alignments::{is_nfc_quick, IsNormalized, UnicodeNormalization};

use added_tokens::AddedTokens;
use bpe::{Bpe, FxBuild};
use byte_level::{byte_to_char_table, ByteDecoder};
use pretokenize::{CharClasses, Splitter, Variant};

pub use prefix_cache::{PrefixReuseEncoder, ReuseStats};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read tokenizer file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("tokenizer file {path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("invalid tokenizer.json: {0}")]
    Invalid(String),
    #[error("HF tokenizers: {0}")]
    Hf(String),
}

/// Class bits of one code point as the split regex sees them (`\p{L}` = 1, `\p{N}` = 2,
/// `\s` = 4). Exposed for the test that checks the generated tables against Oniguruma.
#[doc(hidden)]
pub fn regex_char_class(c: char) -> u8 {
    use std::sync::OnceLock;
    static CLASSES: OnceLock<CharClasses> = OnceLock::new();
    CLASSES.get_or_init(CharClasses::new).class(c as u32)
}

/// A safe boundary recorded during an encode: byte offset in the text and the number of
/// (raw, no post-processor) ids before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Checkpoint {
    pub(crate) byte: usize,
    pub(crate) ids: usize,
}

/// Collects safe boundaries, at most one per `min_gap` bytes (enough for the reuse cache's
/// grid, and cheap).
pub(crate) struct CheckpointRecorder {
    pub(crate) points: Vec<Checkpoint>,
    min_gap: usize,
    next_at: usize,
}

impl CheckpointRecorder {
    pub(crate) fn new(min_gap: usize) -> Self {
        CheckpointRecorder {
            points: Vec::new(),
            min_gap,
            next_at: 0,
        }
    }

    /// Records nothing before `byte` (the caller seeded `points` up to there).
    pub(crate) fn skip_until(&mut self, byte: usize) {
        self.next_at = byte;
    }

    #[inline]
    fn record(&mut self, byte: usize, ids: usize) {
        if byte >= self.next_at {
            self.points.push(Checkpoint { byte, ids });
            self.next_at = byte + self.min_gap;
        }
    }
}

/// Exact fast encoder for supported byte-level BPE tokenizers. `Send + Sync`.
pub struct FastTokenizer {
    added: AddedTokens,
    nfc: bool,
    variant: Variant,
    classes: CharClasses,
    bpe: Bpe,
    /// Ids the post-processor puts before / after the sequence when `add_special_tokens`.
    prefix_special: Vec<u32>,
    suffix_special: Vec<u32>,
    vocab_size: usize,
}

impl std::fmt::Debug for FastTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastTokenizer")
            .field("variant", &self.variant)
            .field("nfc", &self.nfc)
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

/// Why the fast path cannot take a tokenizer.json (the caller falls back to HF).
struct Unsupported(String);

fn unsupported<T>(why: impl Into<String>) -> Result<Result<T, Unsupported>, TokenizerError> {
    Ok(Err(Unsupported(why.into())))
}

fn invalid(why: impl Into<String>) -> TokenizerError {
    TokenizerError::Invalid(why.into())
}

fn is_null_or(v: Option<&Value>, ok: impl Fn(&Value) -> bool) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(v) => ok(v),
    }
}

fn flag(v: &Value, name: &str) -> bool {
    v.get(name).and_then(Value::as_bool).unwrap_or(false)
}

impl FastTokenizer {
    /// Loads `tokenizer.json`. `Ok(None)` when the file uses something the fast path does not
    /// implement (logged once here); `Err` when the file cannot be read or is malformed.
    pub fn from_file(path: &Path) -> Result<Option<FastTokenizer>, TokenizerError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let loaded = Self::from_value(&json)?;
        if loaded.is_none() {
            // from_value already logged the reason; add which file.
            tracing::info!(path = %path.display(), "fast tokenizer not used for this file");
        }
        Ok(loaded)
    }

    /// Same as [`FastTokenizer::from_file`] from the file's contents.
    pub fn from_json_str(json: &str) -> Result<Option<FastTokenizer>, TokenizerError> {
        let json: Value = serde_json::from_str(json)
            .map_err(|e| invalid(format!("tokenizer.json is not valid JSON: {e}")))?;
        Self::from_value(&json)
    }

    fn from_value(json: &Value) -> Result<Option<FastTokenizer>, TokenizerError> {
        match Self::build(json)? {
            Ok(t) => Ok(Some(t)),
            Err(Unsupported(why)) => {
                tracing::warn!(
                    reason = %why,
                    "tokenizer not supported by the fast encoder; falling back to HF tokenizers"
                );
                Ok(None)
            }
        }
    }

    fn build(json: &Value) -> Result<Result<FastTokenizer, Unsupported>, TokenizerError> {
        if !json.is_object() {
            return Err(invalid("top level is not an object"));
        }
        for field in ["truncation", "padding"] {
            if !is_null_or(json.get(field), |_| false) {
                return unsupported(format!("{field} is set"));
            }
        }

        // Normalizer: none, or NFC (possibly alone in a Sequence).
        let nfc = match json.get("normalizer") {
            None | Some(Value::Null) => false,
            Some(n) => match n.get("type").and_then(Value::as_str) {
                Some("NFC") => true,
                Some("Sequence") => {
                    let list = n.get("normalizers").and_then(Value::as_array);
                    match list.map(|l| l.as_slice()) {
                        Some([]) => false,
                        Some([one]) if one.get("type").and_then(Value::as_str) == Some("NFC") => {
                            true
                        }
                        _ => return unsupported("normalizer sequence other than [NFC]"),
                    }
                }
                other => return unsupported(format!("normalizer {other:?}")),
            },
        };

        // Pre-tokenizer: Sequence[Split(known regex, Isolated), ByteLevel(no prefix, no regex)].
        let variant = {
            let pt = json.get("pre_tokenizer");
            let list = pt
                .filter(|p| p.get("type").and_then(Value::as_str) == Some("Sequence"))
                .and_then(|p| p.get("pretokenizers"))
                .and_then(Value::as_array);
            let Some([split, byte_level]) = list.map(|l| l.as_slice()) else {
                return unsupported("pre_tokenizer is not Sequence[Split, ByteLevel]");
            };
            let pattern = split
                .get("pattern")
                .and_then(|p| p.get("Regex"))
                .and_then(Value::as_str);
            let variant = match (
                split.get("type").and_then(Value::as_str),
                pattern.and_then(Variant::from_pattern),
            ) {
                (Some("Split"), Some(v)) => v,
                _ => return unsupported(format!("split pattern {pattern:?} is not a known one")),
            };
            if split.get("behavior").and_then(Value::as_str) != Some("Isolated")
                || flag(split, "invert")
            {
                return unsupported("split behavior other than Isolated, or inverted");
            }
            if byte_level.get("type").and_then(Value::as_str) != Some("ByteLevel")
                || flag(byte_level, "add_prefix_space")
                || byte_level.get("use_regex").and_then(Value::as_bool) != Some(false)
            {
                return unsupported("second pre-tokenizer is not ByteLevel(add_prefix_space=false, use_regex=false)");
            }
            variant
        };

        // Model: byte-level BPE without dropout, byte fallback, prefixes or suffixes.
        let model = json
            .get("model")
            .ok_or_else(|| invalid("no model section"))?;
        if model.get("type").and_then(Value::as_str) != Some("BPE") {
            return unsupported("model is not BPE");
        }
        if !is_null_or(model.get("dropout"), |d| d.as_f64() == Some(0.0))
            || flag(model, "byte_fallback")
            || !is_null_or(model.get("continuing_subword_prefix"), |p| {
                p.as_str() == Some("")
            })
            || !is_null_or(model.get("end_of_word_suffix"), |p| p.as_str() == Some(""))
        {
            return unsupported("BPE with dropout, byte_fallback, or subword prefix/suffix");
        }
        let ignore_merges = flag(model, "ignore_merges");
        let vocab_json = model
            .get("vocab")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid("model.vocab is not an object"))?;
        let mut vocab_str: HashMap<&str, u32> = HashMap::with_capacity(vocab_json.len());
        let mut vocab_size = 0usize;
        for (tok, id) in vocab_json {
            let id = id
                .as_u64()
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| invalid(format!("vocab id of {tok:?} is not a u32")))?;
            vocab_str.insert(tok.as_str(), id);
            vocab_size = vocab_size.max(id as usize + 1);
        }
        let byte_chars = byte_to_char_table();
        let mut byte_ids = [0u32; 256];
        for (b, c) in byte_chars.iter().enumerate() {
            let mut buf = [0u8; 4];
            match vocab_str.get(&*c.encode_utf8(&mut buf)) {
                Some(&id) => byte_ids[b] = id,
                None => return unsupported(format!("byte {b:#04x} has no token (not byte-level)")),
            }
        }
        let decoder = ByteDecoder::new();
        let mut vocab: HashMap<Box<[u8]>, u32, FxBuild> =
            HashMap::with_capacity_and_hasher(vocab_str.len(), FxBuild::default());
        for (tok, &id) in &vocab_str {
            // Tokens outside the byte alphabet can never be produced from byte-level pieces.
            if let Some(bytes) = decoder.decode(tok) {
                vocab.insert(bytes.into_boxed_slice(), id);
            }
        }
        let merges_json = model
            .get("merges")
            .and_then(Value::as_array)
            .ok_or_else(|| invalid("model.merges is not an array"))?;
        let mut merges = Vec::with_capacity(merges_json.len());
        for (rank, m) in merges_json.iter().enumerate() {
            let (a, b) = match m {
                Value::String(s) => s
                    .split_once(' ')
                    .ok_or_else(|| invalid(format!("merge {s:?} is not 'a b'")))?,
                Value::Array(p) => match p.as_slice() {
                    [Value::String(a), Value::String(b)] => (a.as_str(), b.as_str()),
                    _ => return Err(invalid(format!("merge {rank} is not a pair of strings"))),
                },
                _ => return Err(invalid(format!("merge {rank} has an unknown form"))),
            };
            let id_of = |t: &str| {
                vocab_str
                    .get(t)
                    .copied()
                    .ok_or_else(|| invalid(format!("merge {rank}: token {t:?} not in vocab")))
            };
            let merged = format!("{a}{b}");
            merges.push(((id_of(a)?, id_of(b)?), (rank as u32, id_of(&merged)?)));
        }

        // Added tokens: plain ones only.
        let mut added = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for t in json
            .get("added_tokens")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let content = t
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid("added token without content"))?;
            let id = t
                .get("id")
                .and_then(Value::as_u64)
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| invalid(format!("added token {content:?} has no u32 id")))?;
            if flag(t, "lstrip") || flag(t, "rstrip") || flag(t, "single_word") {
                return unsupported(format!(
                    "added token {content:?} uses lstrip/rstrip/single_word"
                ));
            }
            if flag(t, "normalized") {
                return unsupported(format!(
                    "added token {content:?} is matched after normalization"
                ));
            }
            if !seen.insert(content) {
                return unsupported(format!("added token {content:?} listed twice"));
            }
            if let Some(&vid) = vocab_str.get(content) {
                if vid != id {
                    return unsupported(format!("added token {content:?} id differs from vocab"));
                }
            }
            vocab_size = vocab_size.max(id as usize + 1);
            added.push((content.to_string(), id));
        }

        // Post-processor: none, ByteLevel (offsets only), TemplateProcessing, or a Sequence.
        let (prefix_special, suffix_special) = match json.get("post_processor") {
            None | Some(Value::Null) => (Vec::new(), Vec::new()),
            Some(pp) => match post_processor_specials(pp)? {
                Ok(v) => v,
                Err(u) => return Ok(Err(u)),
            },
        };

        let bpe = Bpe::new(
            byte_ids,
            &merges,
            vocab,
            vocab_str.len().max(vocab_size),
            ignore_merges,
        );
        Ok(Ok(FastTokenizer {
            added: AddedTokens::new(&added),
            nfc,
            variant,
            classes: CharClasses::new(),
            bpe,
            prefix_special,
            suffix_special,
            vocab_size,
        }))
    }

    /// Number of ids (model vocabulary plus added tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Identical to HF `Tokenizer::encode(text, add_special_tokens).get_ids()`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        if add_special_tokens {
            out.extend_from_slice(&self.prefix_special);
        }
        self.encode_raw_into(text, &mut out, 0, None);
        if add_special_tokens {
            out.extend_from_slice(&self.suffix_special);
        }
        out
    }

    /// Special ids the post-processor adds (before, after) when `add_special_tokens`.
    pub(crate) fn specials(&self) -> (&[u32], &[u32]) {
        (&self.prefix_special, &self.suffix_special)
    }

    /// How far past a boundary the split decisions before it may look: the longest added
    /// token, plus a few characters of regex look-ahead (see `prefix_cache`).
    pub(crate) fn lookahead_margin(&self) -> usize {
        self.added.max_len() + 32
    }

    /// Appends the ids of `text` without post-processing to `out`. With a recorder, also
    /// records safe boundaries as (byte offset + `byte_base`, `out.len()` at that point).
    pub(crate) fn encode_raw_into(
        &self,
        text: &str,
        out: &mut Vec<u32>,
        byte_base: usize,
        mut rec: Option<&mut CheckpointRecorder>,
    ) {
        let bytes = text.as_bytes();
        let mut pos = 0;
        loop {
            let next = if self.added.is_empty() {
                None
            } else {
                self.added.find(bytes, pos)
            };
            let seg_end = next.map_or(bytes.len(), |(s, _, _)| s);
            if seg_end > pos {
                self.encode_segment(text, pos, seg_end, out, byte_base, rec.as_deref_mut());
            }
            let Some((start, end, id)) = next else { break };
            // Both sides of an added token are safe: segments are tokenized independently.
            if let Some(r) = rec.as_deref_mut() {
                r.record(byte_base + start, out.len());
            }
            out.push(id);
            if let Some(r) = rec.as_deref_mut() {
                r.record(byte_base + end, out.len());
            }
            pos = end;
        }
    }

    /// One segment between added tokens: normalize, split, BPE each piece.
    fn encode_segment(
        &self,
        text: &str,
        start: usize,
        end: usize,
        out: &mut Vec<u32>,
        byte_base: usize,
        mut rec: Option<&mut CheckpointRecorder>,
    ) {
        let raw = &text[start..end];
        let seg: Cow<'_, str> = if self.nfc && !raw.is_ascii() {
            match is_nfc_quick(raw.chars()) {
                IsNormalized::Yes => Cow::Borrowed(raw),
                _ => Cow::Owned(raw.nfc().map(|(c, _)| c).collect()),
            }
        } else {
            Cow::Borrowed(raw)
        };
        // Intra-segment boundaries are only recorded where the normalized text is the raw
        // text (so byte offsets agree).
        if matches!(seg, Cow::Owned(_)) {
            rec = None;
        }
        let sb = seg.as_bytes();
        let all = text.as_bytes();
        let splitter = Splitter::new(&seg, &self.classes, self.variant);
        splitter.for_each_piece(|a, b| {
            self.bpe.encode_piece(&sb[a..b], out);
            if let Some(r) = rec.as_deref_mut() {
                // Safe inside a segment (prefix_cache has the argument): the piece ends with
                // a non-whitespace character and the next three bytes are ASCII.
                let at = start + b;
                if b < sb.len()
                    && at + 3 <= all.len()
                    && all[at..at + 3].is_ascii()
                    && self.classes.class(last_char(&sb[..b])) & pretokenize::CLASS_WS == 0
                {
                    r.record(byte_base + at, out.len());
                }
            }
        });
    }
}

/// The last code point of a non-empty valid UTF-8 buffer.
#[inline]
fn last_char(s: &[u8]) -> u32 {
    let mut i = s.len() - 1;
    while i > 0 && s[i] & 0xC0 == 0x80 {
        i -= 1;
    }
    let lead = u32::from(s[i]);
    let (mut cp, n) = match lead {
        0..=0x7F => (lead, 1),
        0xC0..=0xDF => (lead & 0x1F, 2),
        0xE0..=0xEF => (lead & 0x0F, 3),
        _ => (lead & 0x07, 4),
    };
    for &b in &s[i + 1..(i + n).min(s.len())] {
        cp = (cp << 6) | (u32::from(b) & 0x3F);
    }
    cp
}

/// (before, after) ids of a supported post-processor.
#[allow(clippy::type_complexity)]
fn post_processor_specials(
    pp: &Value,
) -> Result<Result<(Vec<u32>, Vec<u32>), Unsupported>, TokenizerError> {
    match pp.get("type").and_then(Value::as_str) {
        Some("ByteLevel") => Ok(Ok((Vec::new(), Vec::new()))),
        Some("Sequence") => {
            let list = pp
                .get("processors")
                .and_then(Value::as_array)
                .ok_or_else(|| invalid("post_processor Sequence without processors"))?;
            let mut before = Vec::new();
            let mut after = Vec::new();
            for p in list {
                match post_processor_specials(p)? {
                    // Template processors wrap what the earlier ones produced.
                    Ok((b, a)) => {
                        let mut nb = b;
                        nb.extend(before);
                        before = nb;
                        after.extend(a);
                    }
                    Err(u) => return Ok(Err(u)),
                }
            }
            Ok(Ok((before, after)))
        }
        Some("TemplateProcessing") => {
            let single = pp
                .get("single")
                .and_then(Value::as_array)
                .ok_or_else(|| invalid("TemplateProcessing without a single template"))?;
            let specials = pp.get("special_tokens").and_then(Value::as_object);
            let mut before = Vec::new();
            let mut after = Vec::new();
            let mut seen_seq = false;
            for piece in single {
                if let Some(seq) = piece.get("Sequence") {
                    if seq.get("id").and_then(Value::as_str) != Some("A") || seen_seq {
                        return unsupported("template single is not one sequence A");
                    }
                    seen_seq = true;
                } else if let Some(sp) = piece.get("SpecialToken") {
                    let name = sp
                        .get("id")
                        .and_then(Value::as_str)
                        .ok_or_else(|| invalid("template SpecialToken without id"))?;
                    let ids = specials
                        .and_then(|s| s.get(name))
                        .and_then(|s| s.get("ids"))
                        .and_then(Value::as_array)
                        .ok_or_else(|| invalid(format!("template special {name:?} has no ids")))?;
                    let target = if seen_seq { &mut after } else { &mut before };
                    for id in ids {
                        target.push(
                            id.as_u64()
                                .and_then(|i| u32::try_from(i).ok())
                                .ok_or_else(|| invalid(format!("template special {name:?} id")))?,
                        );
                    }
                } else {
                    return unsupported("unknown template piece");
                }
            }
            if !seen_seq {
                return unsupported("template without the sequence");
            }
            Ok(Ok((before, after)))
        }
        other => unsupported(format!("post_processor {other:?}")),
    }
}

/// The encoder the EPP uses: [`FastTokenizer`] when it supports the file, HF otherwise.
pub enum TokenEncoder {
    Fast(Box<FastTokenizer>),
    Hf(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for TokenEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenEncoder::Fast(t) => t.fmt(f),
            TokenEncoder::Hf(_) => f.write_str("TokenEncoder::Hf"),
        }
    }
}

impl TokenEncoder {
    /// Loads `tokenizer.json` with the fast path when supported, else with HF (logged once).
    pub fn from_file(path: &Path) -> Result<TokenEncoder, TokenizerError> {
        if let Some(fast) = FastTokenizer::from_file(path)? {
            tracing::info!(path = %path.display(), "using the fast exact tokenizer");
            return Ok(TokenEncoder::Fast(Box::new(fast)));
        }
        let hf = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| TokenizerError::Hf(format!("{}: {e}", path.display())))?;
        Ok(TokenEncoder::Hf(Box::new(hf)))
    }

    /// Ids identical to HF `Tokenizer::encode(text, add_special_tokens)`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        match self {
            TokenEncoder::Fast(t) => Ok(t.encode(text, add_special_tokens)),
            TokenEncoder::Hf(t) => t
                .encode(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError::Hf(e.to_string())),
        }
    }

    pub fn is_fast(&self) -> bool {
        matches!(self, TokenEncoder::Fast(_))
    }
}

impl From<FastTokenizer> for TokenEncoder {
    fn from(t: FastTokenizer) -> Self {
        TokenEncoder::Fast(Box::new(t))
    }
}

impl From<tokenizers::Tokenizer> for TokenEncoder {
    fn from(t: tokenizers::Tokenizer) -> Self {
        TokenEncoder::Hf(Box::new(t))
    }
}
