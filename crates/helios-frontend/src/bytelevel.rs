//! Exact fast path for GPT-2 style byte-level BPE tokenizers (SmolLM2, GPT-2, Llama 3 without
//! its custom split, ...): a hand-written equivalent of the HF `ByteLevel` pre-tokenizer regex
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` (optionally after
//! the `Digits` pre-tokenizer), with the word -> ids step delegated to the tokenizer's own model,
//! so merges are HF's by construction. Character classes come from `regex-syntax`, the same
//! Unicode tables `fancy-regex` uses inside HF `tokenizers`.
//!
//! Built only when the tokenizer has no normalizer, no truncation or padding, and exactly that
//! pre-tokenizer; everything else keeps the HF path. Equality with HF `encode_fast` is tested
//! (proptest over adversarial text, the differential fixtures and the bench conversation).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use serde_json::Value as Json;
use tokenizers::Model;

/// Character class for the GPT-2 regex: letter, number, white space, other.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Class {
    Other = 0,
    Letter = 1,
    Number = 2,
    Space = 3,
}

/// FxHash (rustc's hasher): fast for the short word keys of one encode call.
#[derive(Default)]
pub(crate) struct Fx(u64);

impl Hasher for Fx {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(K);
        }
    }
}

/// Per-call word cache: pre-token -> ids.
pub(crate) type WordCache<'t> = HashMap<&'t str, Box<[u32]>, BuildHasherDefault<Fx>>;

pub(crate) struct ByteLevelFast {
    /// `Some(individual_digits)` when a `Digits` pre-tokenizer runs first.
    digits: Option<bool>,
    /// Classes of the Basic Multilingual Plane; astral chars use `astral`.
    bmp: Box<[u8]>,
    /// Sorted, disjoint (start, end, class) ranges above U+FFFF.
    astral: Vec<(u32, u32, Class)>,
    byte_char: [char; 256],
}

impl std::fmt::Debug for ByteLevelFast {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteLevelFast").field("digits", &self.digits).finish_non_exhaustive()
    }
}

fn unicode_ranges(pattern: &str) -> Option<Vec<(u32, u32)>> {
    use regex_syntax::hir::{Class as HClass, HirKind};
    let hir = regex_syntax::Parser::new().parse(pattern).ok()?;
    match hir.kind() {
        HirKind::Class(HClass::Unicode(c)) => {
            Some(c.ranges().iter().map(|r| (u32::from(r.start()), u32::from(r.end()))).collect())
        }
        _ => None,
    }
}

/// `Some(individual_digits)` / `None` for a recognized pre-tokenizer; `Err` otherwise.
fn recognize_pre_tokenizer(pt: &Json) -> Result<Option<bool>, ()> {
    let byte_level_ok = |v: &Json| {
        v.get("type").and_then(Json::as_str) == Some("ByteLevel")
            && v.get("add_prefix_space").and_then(Json::as_bool) == Some(false)
            && v.get("use_regex").and_then(Json::as_bool).unwrap_or(true)
    };
    if byte_level_ok(pt) {
        return Ok(None);
    }
    if pt.get("type").and_then(Json::as_str) == Some("Sequence")
        && let Some([d, b]) = pt.get("pretokenizers").and_then(Json::as_array).map(Vec::as_slice)
        && d.get("type").and_then(Json::as_str) == Some("Digits")
        && byte_level_ok(b)
    {
        return Ok(Some(d.get("individual_digits").and_then(Json::as_bool).unwrap_or(false)));
    }
    Err(())
}

impl ByteLevelFast {
    /// The fast path for `inner`, or `None` when its pipeline is not the recognized one.
    pub(crate) fn new(inner: &tokenizers::Tokenizer) -> Option<Self> {
        if inner.get_truncation().is_some() || inner.get_padding().is_some() {
            return None;
        }
        if let Some(n) = inner.get_normalizer() {
            let j = serde_json::to_value(n).ok()?;
            let empty_seq = j.get("type").and_then(Json::as_str) == Some("Sequence")
                && j.get("normalizers").and_then(Json::as_array).is_some_and(Vec::is_empty);
            if !empty_seq {
                return None;
            }
        }
        let pt = serde_json::to_value(inner.get_pre_tokenizer()?).ok()?;
        let digits = recognize_pre_tokenizer(&pt).ok()?;
        let mut bmp = vec![Class::Other as u8; 0x1_0000].into_boxed_slice();
        let mut astral = Vec::new();
        for (pat, class) in [(r"\p{L}", Class::Letter), (r"\p{N}", Class::Number), (r"\s", Class::Space)] {
            for (a, b) in unicode_ranges(pat)? {
                for c in a..=b.min(0xFFFF) {
                    bmp[c as usize] = class as u8;
                }
                if b > 0xFFFF {
                    astral.push((a.max(0x1_0000), b, class));
                }
            }
        }
        astral.sort_unstable_by_key(|r| r.0);
        let mut byte_char = ['\0'; 256];
        for (b, c) in byte_to_char().into_iter().enumerate() {
            byte_char[b] = c;
        }
        Some(ByteLevelFast { digits, bmp, astral, byte_char })
    }

    #[inline]
    fn class(&self, c: char) -> Class {
        let u = u32::from(c);
        if u < 0x1_0000 {
            return match self.bmp[u as usize] {
                1 => Class::Letter,
                2 => Class::Number,
                3 => Class::Space,
                _ => Class::Other,
            };
        }
        let i = self.astral.partition_point(|r| r.0 <= u);
        match i.checked_sub(1).map(|i| self.astral[i]) {
            Some((_, end, class)) if u <= end => class,
            _ => Class::Other,
        }
    }

    /// Appends the ids of `seg` (text between added tokens) to `out`.
    pub(crate) fn encode_segment<'t>(
        &self,
        model: &tokenizers::ModelWrapper,
        seg: &'t str,
        cache: &mut WordCache<'t>,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let mut buf = String::new();
        let mut word = |w: &'t str, out: &mut Vec<u32>| -> tokenizers::Result<()> {
            if let Some(ids) = cache.get(w) {
                out.extend_from_slice(ids);
                return Ok(());
            }
            buf.clear();
            for &b in w.as_bytes() {
                buf.push(self.byte_char[b as usize]);
            }
            let ids: Box<[u32]> = model.tokenize(&buf)?.into_iter().map(|t| t.id).collect();
            out.extend_from_slice(&ids);
            cache.insert(w, ids);
            Ok(())
        };
        match self.digits {
            None => self.split(seg, &mut |w| word(w, out)),
            Some(individual) => {
                // Digits: numeric chars isolated (each, or as contiguous runs).
                let mut rest = 0;
                let mut iter = seg.char_indices().peekable();
                while let Some((i, c)) = iter.next() {
                    if !c.is_numeric() {
                        continue;
                    }
                    let mut end = i + c.len_utf8();
                    if !individual {
                        while let Some(&(j, d)) = iter.peek() {
                            if !d.is_numeric() {
                                break;
                            }
                            end = j + d.len_utf8();
                            iter.next();
                        }
                    }
                    self.split(&seg[rest..i], &mut |w| word(w, out))?;
                    self.split(&seg[i..end], &mut |w| word(w, out))?;
                    rest = end;
                }
                self.split(&seg[rest..], &mut |w| word(w, out))
            }
        }
    }

    /// The GPT-2 regex split of `p` (leftmost-first, as fancy-regex finds it).
    fn split<'t>(&self, p: &'t str, emit: &mut dyn FnMut(&'t str) -> tokenizers::Result<()>) -> tokenizers::Result<()> {
        const CONTRACTIONS: [&str; 7] = ["s", "t", "re", "ve", "m", "ll", "d"];
        let b = p.as_bytes();
        let len = b.len();
        let char_at = |i: usize| p[i..].chars().next();
        let run = |mut j: usize, class: Class| {
            while let Some(c) = char_at(j) {
                if self.class(c) != class {
                    break;
                }
                j += c.len_utf8();
            }
            j
        };
        let mut i = 0;
        while let Some(c) = char_at(i) {
            if c == '\''
                && let Some(k) = CONTRACTIONS.iter().find(|k| b[i + 1..].starts_with(k.as_bytes()))
            {
                let end = i + 1 + k.len();
                emit(&p[i..end])?;
                i = end;
                continue;
            }
            // ` ?` then a letter / number / other run.
            let (j, class) = if c == ' ' {
                match char_at(i + 1) {
                    Some(d) => (i + 1, self.class(d)),
                    None => (i, Class::Space),
                }
            } else {
                (i, self.class(c))
            };
            let end = match class {
                Class::Letter | Class::Number | Class::Other => run(j, class),
                Class::Space => {
                    // `\s+(?!\S)` backs off one char before a non-space; else `\s+`.
                    let j = run(i, Class::Space);
                    if j == len {
                        j
                    } else {
                        let last = p[i..j].char_indices().next_back().map_or(i, |(k, _)| i + k);
                        if last > i { last } else { j }
                    }
                }
            };
            emit(&p[i..end])?;
            i = end;
        }
        Ok(())
    }
}

/// GPT-2 byte-level alphabet: byte -> char.
fn byte_to_char() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (u32::from(b'!')..=u32::from(b'~')).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        out[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    out
}
