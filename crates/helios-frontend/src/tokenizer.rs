//! HF `tokenizers` wrapper with untrimmed byte offsets and per-token byte strings.

use std::path::Path;

use crate::error::TokenizerError;

/// A loaded `tokenizer.json`.
///
/// Invariant: `token_bytes.len() == vocab_size()`; special added tokens are flagged in
/// `special` and their bytes are their literal content.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    token_bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    splitter: Option<Splitter>,
}

/// Segment cache bound; the cache is cleared when it fills.
const CACHE_ENTRIES: usize = 1 << 16;

/// Splits text at non-normalized added tokens exactly as the HF added vocabulary does
/// (leftmost-longest), so segments can be encoded independently and cached. Only built
/// when no added token uses `lstrip`, `rstrip` or `single_word`.
struct Splitter {
    matcher: aho_corasick::AhoCorasick,
    ids: Vec<u32>,
    cache: std::sync::Mutex<std::collections::HashMap<Box<str>, std::sync::Arc<[u32]>>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.token_bytes.len()).finish()
    }
}

/// An encoding of one text.
///
/// Invariant: `ids.len() == offsets.len()`; offsets are byte ranges into the encoded text,
/// untrimmed (leading spaces belong to their token).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub offsets: Vec<(usize, usize)>,
}

/// GPT-2 byte-level alphabet: char -> byte.
fn byte_level_decoder() -> std::collections::HashMap<char, u8> {
    let mut bs: Vec<u32> = (u32::from(b'!')..=u32::from(b'~')).collect();
    bs.extend(0xA1..=0xAC);
    bs.extend(0xAE..=0xFF);
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.iter().zip(cs.iter()).filter_map(|(&b, &c)| Some((char::from_u32(c)?, u8::try_from(b).ok()?))).collect()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum PieceStyle {
    ByteLevel,
    Metaspace,
    Plain,
}

fn piece_style(inner: &tokenizers::Tokenizer) -> PieceStyle {
    let Some(dec) = inner.get_decoder() else { return PieceStyle::Plain };
    let text = serde_json::to_string(dec).unwrap_or_default();
    if text.contains("\"ByteLevel\"") {
        PieceStyle::ByteLevel
    } else if text.contains("\"Metaspace\"") || text.contains("\"ByteFallback\"") {
        PieceStyle::Metaspace
    } else {
        PieceStyle::Plain
    }
}

fn piece_bytes(piece: &str, style: PieceStyle, map: &std::collections::HashMap<char, u8>) -> Vec<u8> {
    match style {
        PieceStyle::ByteLevel => {
            let mapped: Option<Vec<u8>> = piece.chars().map(|c| map.get(&c).copied()).collect();
            mapped.unwrap_or_else(|| piece.as_bytes().to_vec())
        }
        PieceStyle::Metaspace => {
            if piece.len() == 6
                && piece.starts_with("<0x")
                && piece.ends_with('>')
                && let Ok(b) = u8::from_str_radix(&piece[3..5], 16)
            {
                return vec![b];
            }
            piece.replace('\u{2581}', " ").into_bytes()
        }
        PieceStyle::Plain => piece.as_bytes().to_vec(),
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let bytes = std::fs::read(path)?;
        Self::from_bytes(&bytes)
    }

    /// Loads `tokenizer.json` contents.
    pub fn from_bytes(json: &[u8]) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(json).map_err(|e| TokenizerError::Load(e.to_string()))?;
        let vocab_size = inner.get_vocab_size(true);
        let style = piece_style(&inner);
        let map = byte_level_decoder();
        let added = inner.get_added_tokens_decoder();
        let mut token_bytes = vec![Vec::new(); vocab_size];
        let mut special = vec![false; vocab_size];
        for (piece, id) in inner.get_vocab(true) {
            let Some(slot) = usize::try_from(id).ok().filter(|&i| i < vocab_size) else { continue };
            if let Some(tok) = added.get(&id) {
                token_bytes[slot] = tok.content.as_bytes().to_vec();
                special[slot] = tok.special;
            } else {
                token_bytes[slot] = piece_bytes(&piece, style, &map);
            }
        }
        let added_list: Vec<tokenizers::AddedToken> = added.values().cloned().collect();
        let splitter = Self::splitter(&inner, &added_list);
        Ok(Tokenizer { inner, token_bytes, special, splitter })
    }

    fn splitter(inner: &tokenizers::Tokenizer, added: &[tokenizers::AddedToken]) -> Option<Splitter> {
        if added.iter().any(|t| t.lstrip || t.rstrip || t.single_word) {
            return None;
        }
        let (contents, ids): (Vec<String>, Vec<u32>) = added
            .iter()
            .filter(|t| !t.normalized)
            .filter_map(|t| Some((t.content.clone(), inner.token_to_id(&t.content)?)))
            .unzip();
        if contents.is_empty() {
            return None;
        }
        let matcher = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(&contents)
            .ok()?;
        Some(Splitter { matcher, ids, cache: std::sync::Mutex::new(std::collections::HashMap::new()) })
    }

    /// Token ids of `text` without special-token addition; segments between added tokens
    /// go through the cache when a splitter exists. Identical to `encode_fast(text, false)`.
    fn ids_of(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = |s: &str| {
            self.inner
                .encode_fast(s, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError::Encode(e.to_string()))
        };
        let Some(sp) = &self.splitter else { return enc(text) };
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut pos = 0;
        let segment = |seg: &str, out: &mut Vec<u32>| -> Result<(), TokenizerError> {
            if seg.is_empty() {
                return Ok(());
            }
            if let Some(hit) = sp.cache.lock().ok().and_then(|c| c.get(seg).cloned()) {
                out.extend_from_slice(&hit);
                return Ok(());
            }
            let ids: std::sync::Arc<[u32]> = enc(seg)?.into();
            out.extend_from_slice(&ids);
            if let Ok(mut c) = sp.cache.lock() {
                if c.len() >= CACHE_ENTRIES {
                    c.clear();
                }
                c.insert(seg.into(), ids);
            }
            Ok(())
        };
        for m in sp.matcher.find_iter(text) {
            segment(&text[pos..m.start()], &mut out)?;
            out.push(sp.ids[m.pattern().as_usize()]);
            pos = m.end();
        }
        segment(&text[pos..], &mut out)?;
        Ok(out)
    }

    /// Drops cached segment encodings (results never depend on the cache).
    pub fn clear_encode_cache(&self) {
        if let Some(c) = self.splitter.as_ref().and_then(|s| s.cache.lock().ok()).as_mut() {
            c.clear();
        }
    }

    /// Number of token ids, including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// The underlying HF tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The bytes a token contributes to decoded text (special tokens: their content).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }

    /// Whether `id` is a special added token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Id of an exact token string (added tokens included).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Encodes `text` (added tokens are recognized). Offsets are untrimmed byte ranges:
    /// prefix sums of token bytes when those reproduce `text` exactly, else the
    /// tokenizer's own offsets.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Encoded, TokenizerError> {
        let ids = if add_special_tokens {
            self.inner.encode_fast(text, true).map_err(|e| TokenizerError::Encode(e.to_string()))?.get_ids().to_vec()
        } else {
            self.ids_of(text)?
        };
        let mut offsets = Vec::with_capacity(ids.len());
        let mut pos = 0usize;
        let src = text.as_bytes();
        let mut exact = true;
        for &id in &ids {
            let b = self.token_bytes(id).unwrap_or(&[]);
            if src.get(pos..pos + b.len()) != Some(b) {
                exact = false;
                break;
            }
            offsets.push((pos, pos + b.len()));
            pos += b.len();
        }
        if !exact || pos != src.len() {
            let enc = self.inner.encode(text, add_special_tokens).map_err(|e| TokenizerError::Encode(e.to_string()))?;
            offsets = enc.get_offsets().to_vec();
        }
        Ok(Encoded { ids, offsets })
    }

    /// Decodes like Transformers' `tokenizer.decode`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab_size()) {
            return Err(TokenizerError::UnknownToken(bad));
        }
        self.inner.decode(ids, skip_special_tokens).map_err(|e| TokenizerError::Decode(e.to_string()))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/frontend").join(name)
    }

    static SMOL: std::sync::OnceLock<std::sync::Arc<Tokenizer>> = std::sync::OnceLock::new();

    /// Shared SmolLM2 fixture tokenizer (loaded once per test binary).
    pub(crate) fn smol_arc() -> std::sync::Arc<Tokenizer> {
        SMOL.get_or_init(|| {
            std::sync::Arc::new(Tokenizer::from_file(fixture("smollm2/tokenizer.json")).expect("fixture loads"))
        })
        .clone()
    }

    pub(crate) fn smol() -> std::sync::Arc<Tokenizer> {
        smol_arc()
    }

    #[test]
    fn offsets_cover_text_exactly() {
        let t = smol();
        let text = "<|im_start|>user\nHéllo 🌍 wörld  123\n<|im_end|>";
        let e = t.encode(text, false).expect("encodes");
        assert_eq!(e.ids.len(), e.offsets.len());
        assert_eq!(e.offsets.first().map(|o| o.0), Some(0));
        assert_eq!(e.offsets.last().map(|o| o.1), Some(text.len()));
        for w in e.offsets.windows(2) {
            assert_eq!(w[0].1, w[1].0);
        }
        assert_eq!(t.decode(&e.ids, false).expect("decodes"), text);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Segmented, cached encoding equals the plain HF encoding.
        #[test]
        fn segmented_equals_plain(parts in proptest::collection::vec("(<\\|im_start\\|>|<\\|im_end\\|>|<\\|endoftext\\|>| |\n|\\PC{0,6})", 0..12)) {
            let t = smol();
            let text: String = parts.concat();
            let plain = t.inner().encode_fast(text.as_str(), false).expect("encodes").get_ids().to_vec();
            proptest::prop_assert_eq!(&t.encode(&text, false).expect("encodes").ids, &plain);
            proptest::prop_assert_eq!(&t.encode(&text, false).expect("encodes").ids, &plain);
        }
    }

    #[test]
    fn special_tokens_flagged() {
        let t = smol();
        let id = t.token_id("<|im_start|>").expect("present");
        assert!(t.is_special(id));
        assert_eq!(t.token_bytes(id), Some(&b"<|im_start|>"[..]));
        assert!(t.decode(&[u32::MAX], false).is_err());
    }
}
