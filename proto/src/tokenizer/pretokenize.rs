//! Hand-written matcher for the Llama-3 / Qwen2 / Qwen3 pre-tokenizer split regex:
//!
//! ```text
//! (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,K}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//! ```
//!
//! with `K = 1` for Qwen2/Qwen3 (`\p{N}`) and `K = 3` for Llama-3 (`\p{N}{1,3}`). HF applies it
//! with Oniguruma as `Split(behavior = Isolated)`: a left-to-right scan where, at each position,
//! the alternatives are tried in order (leftmost-first, not longest) with backtracking. Every
//! character starts some alternative (a letter, a number, whitespace, or anything else matches
//! alternative 2, 3, 7 or 4), so the matches tile the text and `Isolated` never sees a gap.
//!
//! [`piece_end`] resolves each alternative in closed form instead of backtracking; the comments
//! there derive each rule from the regex. Character classes come from tables generated from
//! Oniguruma itself ([`super::unicode_tables`]).

use super::unicode_tables::{
    FOLD_D, FOLD_E, FOLD_L, FOLD_M, FOLD_R, FOLD_S, FOLD_T, FOLD_V, LETTER, NUMBER, WHITESPACE,
};

/// `\p{L}`
pub(crate) const CLASS_L: u8 = 1;
/// `\p{N}`
pub(crate) const CLASS_N: u8 = 2;
/// `\s`
pub(crate) const CLASS_WS: u8 = 4;

/// Class lookup for every code point: a flat table for the BMP (where nearly all text lives),
/// binary search over ranges above it.
pub(crate) struct CharClasses {
    bmp: Box<[u8]>,
    astral: Vec<(u32, u32, u8)>,
}

impl CharClasses {
    pub(crate) fn new() -> Self {
        let mut bmp = vec![0u8; 0x1_0000].into_boxed_slice();
        let mut astral: Vec<(u32, u32, u8)> = Vec::new();
        for (table, bit) in [(LETTER, CLASS_L), (NUMBER, CLASS_N), (WHITESPACE, CLASS_WS)] {
            for &(lo, hi) in table {
                for cp in lo..=hi.min(0xFFFF) {
                    bmp[cp as usize] |= bit;
                }
                if hi > 0xFFFF {
                    astral.push((lo.max(0x1_0000), hi, bit));
                }
            }
        }
        // The three classes are disjoint in Unicode, so ranges never overlap; sort for search.
        astral.sort_unstable();
        CharClasses { bmp, astral }
    }

    #[inline]
    pub(crate) fn class(&self, cp: u32) -> u8 {
        if cp < 0x1_0000 {
            self.bmp[cp as usize]
        } else {
            let i = self.astral.partition_point(|&(lo, _, _)| lo <= cp);
            if i > 0 {
                let (_, hi, bit) = self.astral[i - 1];
                if cp <= hi {
                    return bit;
                }
            }
            0
        }
    }
}

/// Which digit rule the pattern uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Variant {
    /// `\p{N}`: Qwen2 / Qwen2.5 / Qwen3.
    SingleDigit,
    /// `\p{N}{1,3}`: Llama-3.
    DigitTriples,
}

/// The Qwen2/3 split pattern exactly as it appears in `tokenizer.json`.
pub(crate) const QWEN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The Llama-3 split pattern.
pub(crate) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl Variant {
    pub(crate) fn from_pattern(pattern: &str) -> Option<Variant> {
        match pattern {
            QWEN_PATTERN => Some(Variant::SingleDigit),
            LLAMA3_PATTERN => Some(Variant::DigitTriples),
            _ => None,
        }
    }

    fn max_digits(self) -> usize {
        match self {
            Variant::SingleDigit => 1,
            Variant::DigitTriples => 3,
        }
    }
}

/// Decodes the UTF-8 character at `i` of a valid UTF-8 buffer: (code point, byte length).
#[inline(always)]
fn decode(s: &[u8], i: usize) -> (u32, usize) {
    let b0 = s[i] as u32;
    if b0 < 0x80 {
        (b0, 1)
    } else if b0 < 0xE0 {
        (((b0 & 0x1F) << 6) | (s[i + 1] as u32 & 0x3F), 2)
    } else if b0 < 0xF0 {
        (
            ((b0 & 0x0F) << 12) | ((s[i + 1] as u32 & 0x3F) << 6) | (s[i + 2] as u32 & 0x3F),
            3,
        )
    } else {
        (
            ((b0 & 0x07) << 18)
                | ((s[i + 1] as u32 & 0x3F) << 12)
                | ((s[i + 2] as u32 & 0x3F) << 6)
                | (s[i + 3] as u32 & 0x3F),
            4,
        )
    }
}

/// The matcher over one pre-tokenizer input (one normalized segment between added tokens).
pub(crate) struct Splitter<'a> {
    s: &'a [u8],
    classes: &'a CharClasses,
    max_digits: usize,
}

impl<'a> Splitter<'a> {
    pub(crate) fn new(text: &'a str, classes: &'a CharClasses, variant: Variant) -> Self {
        Splitter {
            s: text.as_bytes(),
            classes,
            max_digits: variant.max_digits(),
        }
    }

    /// (code point, byte length, class bits) of the character at `i`.
    #[inline(always)]
    fn at(&self, i: usize) -> (u32, usize, u8) {
        let (cp, len) = decode(self.s, i);
        (cp, len, self.classes.class(cp))
    }

    /// End of the maximal run of characters with any of the `want` class bits, from `j`.
    #[inline(always)]
    fn run_end(&self, mut j: usize, want: u8) -> usize {
        while j < self.s.len() {
            let (_, len, cls) = self.at(j);
            if cls & want == 0 {
                break;
            }
            j += len;
        }
        j
    }

    /// End of the maximal run of characters outside `\s`, `\p{L}`, `\p{N}` from `j`, followed by
    /// `[\r\n]*` (the tail of alternative 4).
    #[inline(always)]
    fn punct_tail(&self, mut j: usize) -> usize {
        while j < self.s.len() {
            let (_, len, cls) = self.at(j);
            if cls != 0 {
                break;
            }
            j += len;
        }
        while j < self.s.len() && (self.s[j] == b'\r' || self.s[j] == b'\n') {
            j += 1;
        }
        j
    }

    /// Alternative 1 at `i` (where `s[i] == '\''`): the byte length of the contraction, if any.
    fn contraction(&self, i: usize) -> Option<usize> {
        let n = self.s.len();
        let j = i + 1;
        if j >= n {
            return None;
        }
        let (c1, l1) = decode(self.s, j);
        let c1 = char::from_u32(c1)?;
        if FOLD_S.contains(&c1)
            || FOLD_T.contains(&c1)
            || FOLD_M.contains(&c1)
            || FOLD_D.contains(&c1)
        {
            return Some(1 + l1);
        }
        let k = j + l1;
        if k >= n {
            return None;
        }
        let (c2, l2) = decode(self.s, k);
        let c2 = char::from_u32(c2)?;
        let three = ((FOLD_R.contains(&c1) || FOLD_V.contains(&c1)) && FOLD_E.contains(&c2))
            || (FOLD_L.contains(&c1) && FOLD_L.contains(&c2));
        three.then_some(1 + l1 + l2)
    }

    /// End (exclusive byte offset) of the regex match that starts at `i` (`i < len`).
    pub(crate) fn piece_end(&self, i: usize) -> usize {
        let n = self.s.len();
        let (cp, len, cls) = self.at(i);
        // Alt 1: `(?i:'s|'t|'re|'ve|'m|'ll|'d)` wins over everything else when it matches.
        if cp == u32::from(b'\'') {
            if let Some(l) = self.contraction(i) {
                return i + l;
            }
        }
        // Alt 2 with the optional leading character empty: a letter starts a letter run.
        if cls & CLASS_L != 0 {
            return self.run_end(i + len, CLASS_L);
        }
        // Alt 3: one number character, or up to `max_digits` of them (`{1,3}` is greedy).
        if cls & CLASS_N != 0 {
            let mut j = i + len;
            let mut count = 1;
            while count < self.max_digits && j < n {
                let (_, l, c) = self.at(j);
                if c & CLASS_N == 0 {
                    break;
                }
                j += l;
                count += 1;
            }
            return j;
        }
        // Alt 2 with the optional character taken: anything but \r, \n, a letter or a number
        // (whitespace included), immediately followed by a letter.
        if cp != u32::from(b'\r') && cp != u32::from(b'\n') && i + len < n {
            let (_, _, next) = self.at(i + len);
            if next & CLASS_L != 0 {
                return self.run_end(i + len, CLASS_L);
            }
        }
        if cls & CLASS_WS == 0 {
            // Alt 4 without the optional space: `c` itself starts the symbol run.
            return self.punct_tail(i + len);
        }
        // `c` is whitespace from here on.
        // Alt 4 with the optional space: only U+0020, then at least one symbol.
        if cp == u32::from(b' ') && i + 1 < n {
            let (_, _, next) = self.at(i + 1);
            if next == 0 {
                return self.punct_tail(i + 1);
            }
        }
        // Alt 5 `\s*[\r\n]+`: `\s*` takes the whole whitespace run, then backtracks until
        // `[\r\n]+` can match; the match therefore ends just after the run's last \r or \n.
        let mut j = i;
        let mut last_newline = None;
        let mut last_start = i;
        while j < n {
            let (c, l, k) = self.at(j);
            if k & CLASS_WS == 0 {
                break;
            }
            if c == u32::from(b'\r') || c == u32::from(b'\n') {
                last_newline = Some(j + 1);
            }
            last_start = j;
            j += l;
        }
        if let Some(end) = last_newline {
            return end;
        }
        // Alt 6 `\s+(?!\S)`: the whole run if it reaches the end of the input; otherwise it
        // backtracks one character so the next character is whitespace, which needs a run of
        // at least two.
        if j == n {
            return j;
        }
        if last_start > i {
            return last_start;
        }
        // Alt 7 `\s+`: a single whitespace character before a non-space.
        j
    }

    /// Calls `f(start, end)` for every piece, in order.
    #[inline]
    pub(crate) fn for_each_piece(&self, mut f: impl FnMut(usize, usize)) {
        let mut i = 0;
        while i < self.s.len() {
            let e = self.piece_end(i);
            f(i, e);
            i = e;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str, v: Variant) -> Vec<&str> {
        let classes = CharClasses::new();
        let sp = Splitter::new(text, &classes, v);
        let mut out = Vec::new();
        sp.for_each_piece(|a, b| out.push(&text[a..b]));
        out
    }

    #[test]
    fn ascii_examples_follow_the_regex() {
        let v = Variant::SingleDigit;
        assert_eq!(pieces("Hello world", v), ["Hello", " world"]);
        assert_eq!(pieces("don't", v), ["don", "'t"]);
        assert_eq!(pieces("a  b", v), ["a", " ", " b"]);
        assert_eq!(pieces("a  \t1", v), ["a", "  ", "\t", "1"]);
        assert_eq!(pieces("x  ", v), ["x", "  "]);
        assert_eq!(pieces("x \n\n y", v), ["x", " \n\n", " y"]);
        assert_eq!(
            pieces("fn(a, b) {}\n", v),
            ["fn", "(a", ",", " b", ")", " {}\n"]
        );
        assert_eq!(pieces("12345", v), ["1", "2", "3", "4", "5"]);
        assert_eq!(pieces("12345", Variant::DigitTriples), ["123", "45"]);
        assert_eq!(pieces("'sfoo 'RE", v), ["'s", "foo", " '", "RE"]);
    }
}
