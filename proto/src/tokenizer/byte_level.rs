//! GPT-2 byte-level alphabet: the reversible map between the 256 byte values and the printable
//! characters that byte-level BPE vocabularies are written in (`Ġ` for a space, `Ċ` for `\n`).
//!
//! The fast encoder works on raw bytes end to end; this map is only needed at load time, to turn
//! vocabulary and merge strings back into byte strings.

/// The character that stands for byte `b` in a byte-level vocabulary.
///
/// Printable Latin-1 bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves; the other
/// 68 bytes are assigned, in increasing byte order, the code points 256, 257, ... This is the
/// published GPT-2 `bytes_to_unicode` table that HF's `ByteLevel` pre-tokenizer also uses.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next_extra = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        let cp = if printable {
            b as u32
        } else {
            let cp = next_extra;
            next_extra += 1;
            cp
        };
        // Every value here is below 256 + 68, a valid scalar value.
        *slot = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

/// Inverse of [`byte_to_char_table`]: maps a byte-level vocabulary string back to its bytes.
/// `None` when the string contains a character outside the 256-character alphabet (such a
/// token can never be produced from byte-level pieces).
pub(crate) struct ByteDecoder {
    /// Indexed by code point (all alphabet characters are below 512).
    map: Vec<Option<u8>>,
}

impl ByteDecoder {
    pub(crate) fn new() -> Self {
        let mut map = vec![None; 512];
        for (b, c) in byte_to_char_table().iter().enumerate() {
            map[*c as usize] = Some(b as u8);
        }
        ByteDecoder { map }
    }

    pub(crate) fn decode(&self, s: &str) -> Option<Vec<u8>> {
        s.chars()
            .map(|c| self.map.get(c as usize).copied().flatten())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_a_bijection_with_known_points() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        let mut seen = std::collections::HashSet::new();
        assert!(t.iter().all(|c| seen.insert(*c)));
        let d = ByteDecoder::new();
        assert_eq!(d.decode("Ġhello").as_deref(), Some(&b" hello"[..]));
        assert_eq!(d.decode("€"), None);
    }
}
