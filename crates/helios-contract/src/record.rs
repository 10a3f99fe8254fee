//! The completion record a sampling graph writes for each request row it served, and its
//! host-side reading. One record is `completion_record_header_words + completion_token_capacity`
//! little-endian `u32` words:
//!
//! | word | meaning | state-maintenance status record |
//! |---|---|---|
//! | 0 | [`RECORD_MAGIC`] — written last by the device; a record without it was not written | same |
//! | 1 | request slot the row served (echo of `RequestSlots`) | destination row (echo of `DestinationRows`) |
//! | 2 | flags: bit 0 [`FLAG_SAMPLED`], bit 1 [`FLAG_EOS`], bit 2 [`FLAG_GRAMMAR_EXHAUSTED`] | bit 3 [`FLAG_CHECKPOINT_REJECTED`]: the op's check failed and it wrote nothing |
//! | 3 | tokens written in the token slots (≤ token capacity) | 0 |
//! | 4 | consumed count after this step, low 32 bits | the source row's stamp: consumed (initialize: the cleared row's, 0) |
//! | 5 | sampling counter used (echo of `RngCounter`, low 32 bits) | the source row's stamp: epoch (initialize: 0) |
//! | 6.. header | reserved, zero | reserved, zero |
//! | header.. | sampled token ids | unused |
//!
//! Status records (ABI 3, optional) are what a state-maintenance graph binding
//! `CompletionRecords` writes, one per op; the stamp is the source row's as the op found it
//! (`model::RowRegionKind::PositionMetadata`), so a rejection says what the row held.
//!
//! Headers shorter than [`MIN_HEADER_WORDS`] cannot carry this layout; [`CompletionRecord::parse`]
//! rejects them, as it rejects a record that is not written, claims more tokens than it has
//! slots, or names a token outside the vocabulary.

/// "FLRC": a written record.
pub const RECORD_MAGIC: u32 = 0x464c_5243;
/// Header words this layout needs.
pub const MIN_HEADER_WORDS: u32 = 6;

pub const FLAG_SAMPLED: u32 = 1;
pub const FLAG_EOS: u32 = 1 << 1;
pub const FLAG_GRAMMAR_EXHAUSTED: u32 = 1 << 2;
/// Status records only: a restore or snapshot whose source stamp (or row kinds) did not match
/// wrote nothing.
pub const FLAG_CHECKPOINT_REJECTED: u32 = 1 << 3;

/// A parsed record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompletionRecord {
    pub slot: u32,
    pub flags: u32,
    pub consumed_low: u32,
    pub counter_low: u32,
    pub tokens: Vec<u32>,
}

/// Why a record cannot be trusted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("record header of {0} words is shorter than the {MIN_HEADER_WORDS} this layout needs")]
    HeaderTooShort(u32),
    #[error("record of {got} words, expected {expected}")]
    WrongLength { got: usize, expected: usize },
    #[error("record was not written (word 0 = {0:#x})")]
    NotWritten(u32),
    #[error("record claims {count} tokens but has {capacity} slots")]
    TooManyTokens { count: u32, capacity: u32 },
    #[error("record token {token} outside the vocabulary of {vocab}")]
    TokenOutOfVocabulary { token: u32, vocab: u32 },
}

impl CompletionRecord {
    /// Parses one record of `header_words + token_capacity` words.
    pub fn parse(words: &[u32], header_words: u32, token_capacity: u32, vocab: u32) -> Result<Self, RecordError> {
        if header_words < MIN_HEADER_WORDS {
            return Err(RecordError::HeaderTooShort(header_words));
        }
        let expected = (header_words + token_capacity) as usize;
        if words.len() != expected {
            return Err(RecordError::WrongLength { got: words.len(), expected });
        }
        if words[0] != RECORD_MAGIC {
            return Err(RecordError::NotWritten(words[0]));
        }
        let count = words[3];
        if count > token_capacity {
            return Err(RecordError::TooManyTokens { count, capacity: token_capacity });
        }
        let start = header_words as usize;
        let tokens = words[start..start + count as usize].to_vec();
        if let Some(&token) = tokens.iter().find(|&&t| t >= vocab) {
            return Err(RecordError::TokenOutOfVocabulary { token, vocab });
        }
        Ok(CompletionRecord { slot: words[1], flags: words[2], consumed_low: words[4], counter_low: words[5], tokens })
    }

    /// Writes this record in the layout above (device emulators and tests).
    pub fn encode(&self, header_words: u32, token_capacity: u32) -> Vec<u32> {
        let mut w = vec![0u32; (header_words + token_capacity) as usize];
        w[0] = RECORD_MAGIC;
        w[1] = self.slot;
        w[2] = self.flags;
        w[3] = self.tokens.len() as u32;
        w[4] = self.consumed_low;
        w[5] = self.counter_low;
        for (i, &t) in self.tokens.iter().enumerate() {
            if let Some(slot) = w.get_mut(header_words as usize + i) {
                *slot = t;
            }
        }
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> CompletionRecord {
        CompletionRecord { slot: 3, flags: FLAG_SAMPLED, consumed_low: 17, counter_low: 2, tokens: vec![42] }
    }

    #[test]
    fn round_trips() {
        let w = record().encode(8, 8);
        assert_eq!(w.len(), 16);
        assert_eq!(CompletionRecord::parse(&w, 8, 8, 64), Ok(record()));
    }

    #[test]
    fn rejects_untrusted_records() {
        let w = record().encode(8, 8);
        let mut unwritten = w.clone();
        unwritten[0] = 0;
        assert_eq!(CompletionRecord::parse(&unwritten, 8, 8, 64), Err(RecordError::NotWritten(0)));
        let mut many = w.clone();
        many[3] = 9;
        assert!(matches!(CompletionRecord::parse(&many, 8, 8, 64), Err(RecordError::TooManyTokens { .. })));
        assert!(matches!(CompletionRecord::parse(&w, 8, 8, 40), Err(RecordError::TokenOutOfVocabulary { .. })));
        assert!(matches!(CompletionRecord::parse(&w[..15], 8, 8, 64), Err(RecordError::WrongLength { .. })));
        assert_eq!(CompletionRecord::parse(&w, 4, 12, 64), Err(RecordError::HeaderTooShort(4)));
    }
}
