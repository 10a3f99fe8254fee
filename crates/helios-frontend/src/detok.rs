//! Incremental detokenization that never emits a broken UTF-8 sequence.

use crate::error::TokenizerError;
use crate::tokenizer::Tokenizer;

/// Streams text for a growing token sequence.
///
/// Invariant: the concatenation of everything returned by [`push`](Self::push) and
/// [`finish`](Self::finish) equals `tokenizer.decode(all_ids, skip_special_tokens)` for
/// decoders that are prefix-stable (byte-level BPE, byte fallback). Text is withheld
/// while the newest tokens end inside a UTF-8 sequence (decoded as U+FFFD).
#[derive(Debug)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    skip_special_tokens: bool,
    /// Start of the context window re-decoded each step.
    prefix: usize,
    /// Tokens whose text has been emitted.
    read: usize,
}

impl IncrementalDecoder {
    /// `prompt_tail` may hold the last few prompt tokens, giving decoders that strip a
    /// leading space the right context; their text is never emitted.
    pub fn new(prompt_tail: &[u32], skip_special_tokens: bool) -> Self {
        IncrementalDecoder { ids: prompt_tail.to_vec(), skip_special_tokens, prefix: 0, read: prompt_tail.len() }
    }

    /// All ids seen so far (prompt tail included).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Adds one token; returns newly complete text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let prev = tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let full = tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        if full.len() > prev.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prev.len())
            && full.starts_with(&prev)
        {
            let out = full[prev.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(out)
        } else {
            Ok(String::new())
        }
    }

    /// Flushes withheld text at the end of generation (may contain U+FFFD for truly
    /// invalid byte sequences, exactly as the reference decode does).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        let prev = tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let full = tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(full.get(prev.len()..).filter(|_| full.starts_with(&prev)).unwrap_or(&full).to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::smol;

    #[test]
    fn streams_emoji_without_broken_utf8() {
        let t = smol();
        let text = "Hi 🌍🎉 — naïve 日本語 text\n<|im_end|> ok";
        let ids = t.encode(text, false).expect("encodes").ids;
        for skip in [false, true] {
            let mut d = IncrementalDecoder::new(&[], skip);
            let mut out = String::new();
            for &id in &ids {
                let piece = d.push(&t, id).expect("decodes");
                assert!(!piece.contains('\u{FFFD}'));
                out.push_str(&piece);
            }
            out.push_str(&d.finish(&t).expect("decodes"));
            assert_eq!(out, t.decode(&ids, skip).expect("decodes"));
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        #[test]
        fn matches_reference_decode(s in "\\PC{0,40}") {
            let t = smol();
            let ids = t.encode(&s, false).expect("encodes").ids;
            let mut d = IncrementalDecoder::new(&[], false);
            let mut out = String::new();
            for &id in &ids { out.push_str(&d.push(&t, id).expect("decodes")); }
            out.push_str(&d.finish(&t).expect("decodes"));
            proptest::prop_assert_eq!(out, s);
        }
    }
}
