//! Added and special tokens (`added_tokens` in `tokenizer.json`), split out of the raw text
//! before normalization the way HF's `AddedVocabulary` does for tokens with `normalized: false`:
//! a left-to-right scan taking, at the leftmost position where any token occurs, the longest
//! token there (Aho-Corasick `LeftmostLongest`), then resuming after it.
//!
//! Only tokens with `lstrip`, `rstrip`, `single_word` and `normalized` all false are supported
//! (the Qwen and Llama-3 families); the loader falls back to HF for anything else.

/// The added tokens of one tokenizer, bucketed by first byte, longest first in each bucket.
pub(crate) struct AddedTokens {
    buckets: Vec<Vec<(Box<[u8]>, u32)>>,
    starts: [bool; 256],
    max_len: usize,
    count: usize,
}

impl AddedTokens {
    pub(crate) fn new(tokens: &[(String, u32)]) -> Self {
        let mut buckets: Vec<Vec<(Box<[u8]>, u32)>> = vec![Vec::new(); 256];
        let mut starts = [false; 256];
        let mut max_len = 0;
        for (content, id) in tokens {
            let bytes = content.as_bytes();
            let Some(&first) = bytes.first() else {
                // HF's Aho-Corasick builder never matches an empty pattern; nor do we.
                continue;
            };
            starts[first as usize] = true;
            max_len = max_len.max(bytes.len());
            let bucket = &mut buckets[first as usize];
            // Duplicate content: HF's trie keeps one value per pattern; the loader rejects
            // duplicates before we get here, so plain push is fine.
            bucket.push((bytes.into(), *id));
        }
        for b in &mut buckets {
            b.sort_by_key(|t| std::cmp::Reverse(t.0.len()));
        }
        AddedTokens {
            buckets,
            starts,
            max_len,
            count: tokens.len(),
        }
    }

    /// Longest added token, in bytes (bounds how far ahead the split decision looks).
    pub(crate) fn max_len(&self) -> usize {
        self.max_len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The next (start, end, id) at or after `from`.
    #[inline]
    pub(crate) fn find(&self, s: &[u8], from: usize) -> Option<(usize, usize, u32)> {
        let mut i = from;
        while i < s.len() {
            let rel = s[i..].iter().position(|&b| self.starts[b as usize])?;
            i += rel;
            for (tok, id) in &self.buckets[s[i] as usize] {
                if s[i..].starts_with(tok) {
                    return Some((i, i + tok.len(), *id));
                }
            }
            i += 1;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftmost_then_longest() {
        let t = AddedTokens::new(&[("<a>".into(), 1), ("<a>b".into(), 2), ("a>".into(), 3)]);
        let s = b"x<a>bc<a>";
        assert_eq!(t.find(s, 0), Some((1, 5, 2)));
        assert_eq!(t.find(s, 5), Some((6, 9, 1)));
        assert_eq!(t.find(b"xa><", 0), Some((1, 3, 3)));
        assert_eq!(t.find(b"<<", 0), None);
    }
}
