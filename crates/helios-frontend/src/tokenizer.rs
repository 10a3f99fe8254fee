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
    /// Exact fast pre-tokenizer for recognized byte-level BPE pipelines (needs `splitter`).
    fast: Option<crate::bytelevel::ByteLevelFast>,
    /// Most threads one long encode uses (default: available cores, at most `MAX_THREADS`).
    threads: usize,
    /// Longest `token_bytes` entry: no token of an exact (fast-path) encoding covers more.
    max_token_bytes: usize,
}

/// Segment cache bound; the cache is cleared when it fills.
const CACHE_ENTRIES: usize = 1 << 16;
/// Texts at least this long encode their segments on several threads.
const PARALLEL_BYTES: usize = 48 * 1024;
const MAX_THREADS: usize = 4;

/// A piece of text between added tokens, or an added token.
#[derive(Clone, Copy)]
enum Item<'t> {
    Segment(&'t str),
    Added(u32),
}

impl Item<'_> {
    fn len(&self) -> usize {
        match self {
            Item::Segment(s) => s.len(),
            Item::Added(_) => 0,
        }
    }
}

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
        let fast = if splitter.is_some() && added_list.iter().all(|t| !t.normalized) {
            crate::bytelevel::ByteLevelFast::new(&inner)
        } else {
            None
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS);
        let max_token_bytes = token_bytes.iter().map(Vec::len).max().unwrap_or(0);
        Ok(Tokenizer { inner, token_bytes, special, splitter, fast, threads, max_token_bytes })
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
    /// go through the cache when a splitter exists, and through the exact byte-level fast
    /// path when one was built. Identical to `encode_fast(text, false)`.
    fn ids_of(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let Some(sp) = &self.splitter else { return self.hf_ids(text) };
        let mut items = Vec::new();
        let mut pos = 0;
        for m in sp.matcher.find_iter(text) {
            items.push(Item::Segment(&text[pos..m.start()]));
            items.push(Item::Added(sp.ids[m.pattern().as_usize()]));
            pos = m.end();
        }
        items.push(Item::Segment(&text[pos..]));
        let threads = if text.len() >= PARALLEL_BYTES { self.threads } else { 1 };
        if threads <= 1 || items.len() < 2 * threads {
            return self.encode_items(sp, &items, text.len() / 3);
        }
        // Split the items into `threads` runs of about equal bytes; each run is encoded
        // independently (segments never interact), then concatenated in order.
        let per = text.len().div_ceil(threads);
        let mut runs: Vec<&[Item<'_>]> = Vec::with_capacity(threads);
        let (mut start, mut acc) = (0, 0);
        for (i, it) in items.iter().enumerate() {
            acc += it.len();
            if acc >= per && runs.len() + 1 < threads {
                runs.push(&items[start..=i]);
                start = i + 1;
                acc = 0;
            }
        }
        runs.push(&items[start..]);
        let parts: Vec<Result<Vec<u32>, TokenizerError>> = std::thread::scope(|s| {
            let handles: Vec<_> =
                runs.iter().skip(1).map(|r| s.spawn(move || self.encode_items(sp, r, per / 3))).collect();
            let mut parts = vec![runs.first().map_or(Ok(Vec::new()), |r| self.encode_items(sp, r, per / 3))];
            for h in handles {
                parts.push(h.join().unwrap_or_else(|_| Err(TokenizerError::Encode("encode thread panicked".into()))));
            }
            parts
        });
        let mut out = Vec::with_capacity(text.len() / 3);
        for p in parts {
            out.extend_from_slice(&p?);
        }
        Ok(out)
    }

    fn hf_ids(&self, s: &str) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode_fast(s, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    fn encode_items(&self, sp: &Splitter, items: &[Item<'_>], cap: usize) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(cap);
        let mut words = crate::bytelevel::WordCache::default();
        for it in items {
            let seg = match *it {
                Item::Added(id) => {
                    out.push(id);
                    continue;
                }
                Item::Segment("") => continue,
                Item::Segment(seg) => seg,
            };
            if let Some(hit) = sp.cache.lock().ok().and_then(|c| c.get(seg).cloned()) {
                out.extend_from_slice(&hit);
                continue;
            }
            let ids: std::sync::Arc<[u32]> = match &self.fast {
                Some(fast) => {
                    let mut ids = Vec::with_capacity(seg.len() / 3);
                    fast.encode_segment(self.inner.get_model(), seg, &mut words, &mut ids)
                        .map_err(|e| TokenizerError::Encode(e.to_string()))?;
                    ids.into()
                }
                None => self.hf_ids(seg)?.into(),
            };
            out.extend_from_slice(&ids);
            if let Ok(mut c) = sp.cache.lock() {
                if c.len() >= CACHE_ENTRIES {
                    c.clear();
                }
                c.insert(seg.into(), ids);
            }
        }
        Ok(out)
    }

    /// Caps the threads one long encode may use (1: always on the calling thread).
    /// Results never depend on it.
    pub fn set_encode_threads(&mut self, threads: usize) {
        self.threads = threads.clamp(1, MAX_THREADS);
    }

    /// Whether the exact byte-level fast path is in use (else HF `encode_fast` per segment).
    pub fn has_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// Token ids through HF `tokenizers` only (no cache, no fast path): the reference the
    /// fast path is tested against.
    pub fn encode_ids_reference(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.hf_ids(text)
    }

    /// Drops every cache an encode can hit: our segment cache and the HF model's word
    /// cache (results never depend on either). Use for cold, first-request measurements.
    pub fn clear_encode_cache(&self) {
        if let Some(c) = self.splitter.as_ref().and_then(|s| s.cache.lock().ok()).as_mut() {
            c.clear();
        }
        if let tokenizers::ModelWrapper::BPE(bpe) = self.inner.get_model() {
            bpe.clear_cache();
        }
    }

    /// The longest text of `max_tokens` tokens, without encoding anything: every token of
    /// an exact byte-level encoding covers at most the longest token's bytes, so a longer
    /// text has more tokens. `None` when encodings are not exact byte concatenations (a
    /// normalizer may fold many input bytes into one token), so no such bound holds.
    pub fn max_text_bytes(&self, max_tokens: usize) -> Option<usize> {
        (self.fast.is_some() && self.max_token_bytes > 0).then(|| max_tokens.saturating_mul(self.max_token_bytes))
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

    /// The byte bound never rejects a text that fits: texts of every token count up to the
    /// bound's own edge encode to at most that many tokens.
    #[test]
    fn max_text_bytes_is_a_sound_bound() {
        let t = smol();
        let per = t.max_text_bytes(1).expect("SmolLM2 encodes exactly");
        assert!(per >= 1);
        for text in ["<|im_start|>user\nHéllo 🌍 wörld  123\n<|im_end|>", "a", "                ", "🚀🚀🚀🚀"]
        {
            let text = text.repeat(40);
            let n = t.encode(&text, false).expect("encodes").ids.len();
            let bound = t.max_text_bytes(n).expect("bound");
            assert!(text.len() <= bound, "{} bytes in {n} tokens, bound {bound}", text.len());
        }
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

    static DEEPSEEK: std::sync::OnceLock<std::sync::Arc<Tokenizer>> = std::sync::OnceLock::new();

    fn deepseek() -> std::sync::Arc<Tokenizer> {
        DEEPSEEK
            .get_or_init(|| {
                std::sync::Arc::new(Tokenizer::from_file(fixture("deepseek/tokenizer.json")).expect("fixture loads"))
            })
            .clone()
    }

    /// Pieces that stress every branch of the GPT-2 regex and the Digits split: contractions
    /// (and near misses), space runs before letters / numbers / punctuation / end, other
    /// Unicode white space, non-ASCII numbers, combining marks, astral letters and emoji.
    const PIECES: &str = "(<\\|im_start\\|>|<\\|im_end\\|>|'s|'t|'re|'ve|'m|'ll|'d|'S|'x| |  |   |\t|\n|\r\n| \n |\u{a0}|\u{3000}|\u{85}|\u{2028}|\u{200b}|x|Ab|\u{e9}|e\u{301}|\u{6771}\u{4eac}|12|\u{663}|\u{bd}|\u{216b}|\u{1d49c}|\u{1f680}|\u{2705}|\u{1f469}\u{200d}\u{1f467}|!|\\.|,|-|\\(|\\$|\\{\\\"k\\\": 1\\}|\\PC{0,4})";

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// The byte-level fast path (plus segment cache) equals HF `encode_fast` exactly.
        #[test]
        fn fast_path_equals_hf(parts in proptest::collection::vec(PIECES, 0..24)) {
            let t = smol();
            proptest::prop_assert!(t.has_fast_path());
            let text: String = parts.concat();
            let reference = t.encode_ids_reference(&text).expect("encodes");
            t.clear_encode_cache();
            proptest::prop_assert_eq!(&t.encode(&text, false).expect("encodes").ids, &reference);
            proptest::prop_assert_eq!(&t.encode(&text, false).expect("encodes").ids, &reference);
        }
    }

    #[test]
    fn fast_path_only_for_recognized_pipelines() {
        assert!(smol().has_fast_path());
        // DeepSeek: custom Split regexes and normalized added tokens -> HF per segment.
        assert!(!deepseek().has_fast_path());
        let text = "Hello 123 東京 🚀 <｜end▁of▁sentence｜> it's";
        assert_eq!(
            deepseek().encode(text, false).expect("encodes").ids,
            deepseek().encode_ids_reference(text).expect("ok")
        );
    }

    /// Long texts take the multi-threaded path; ids stay identical.
    #[test]
    fn long_text_parallel_equals_hf() {
        let mut t = Tokenizer::from_file(fixture("smollm2/tokenizer.json")).expect("fixture loads");
        t.set_encode_threads(3); // Threads are exercised even on a one-core machine.
        let mut text = String::new();
        let mut i = 0u32;
        while text.len() < 3 * PARALLEL_BYTES {
            text.push_str(&format!(
                "<|im_start|>user\nStep {i}: it's   naïve café 東京 🚀✅ x{i}y  \n\n\t(ok) 'll\u{a0}end<|im_end|>\n"
            ));
            i += 1;
        }
        let reference = t.encode_ids_reference(&text).expect("encodes");
        t.clear_encode_cache();
        assert_eq!(t.encode(&text, false).expect("encodes").ids, reference);
        assert_eq!(t.encode(&text, false).expect("encodes").ids, reference);
    }

    /// Every differential fixture text (both tokenizers) through the fast path and caches.
    #[test]
    fn differential_texts_equal_hf() {
        let data: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("differential.json")).expect("fixture"))
                .expect("json");
        let mut n = 0;
        for case in data["cases"].as_array().expect("cases") {
            let text = case["text"].as_str().expect("text");
            let t = if case["tokenizer"] == "deepseek" { deepseek() } else { smol() };
            let want: Vec<u32> =
                case["ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
            t.clear_encode_cache();
            assert_eq!(t.encode(text, false).expect("encodes").ids, want);
            assert_eq!(t.encode_ids_reference(text).expect("encodes"), want);
            n += 1;
        }
        assert!(n >= 50);
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
