//! Prefix identity: a chained digest over fixed 64-token hash blocks plus conditioning.
//!
//! Blocks are fixed at [`HASH_BLOCK_TOKENS`] regardless of the physical page size, so the same
//! conversation has the same identity on every cache geometry. The chain starts from the
//! model and token-layout identities; an image identity enters at the position its span
//! starts, so appending an image never changes the digest of an earlier prefix.
//! (Two independent 64-bit lanes; not cryptographic, but collisions need ~2^64 work.)

/// Tokens per hash block.
pub const HASH_BLOCK_TOKENS: usize = 64;

/// A 128-bit digest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub u64, pub u64);

/// What, besides tokens, decides model state: the model and its token layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PrefixIdentity {
    pub model: u64,
    pub token_layout: u64,
}

/// An image (or other conditioning input) entering the token stream before `position`.
/// `identity` covers the decoded representation and the preprocessing profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageSpan {
    pub position: u32,
    pub identity: u64,
}

/// Content address of one consumed prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrefixKey {
    /// Chain digest after the prefix's complete hash blocks (lookup bucket).
    pub block_digest: Digest,
    /// Digest of the whole prefix (identity).
    pub digest: Digest,
    /// Prefix length in tokens.
    pub tokens: u64,
}

const TOKEN_TAG: u64 = 0x7f4a_7c15_9e37_79b9;
const IMAGE_TAG: u64 = 0x94d0_49bb_1331_11eb;
const BLOCK_TAG: u64 = 0xbf58_476d_1ce4_e5b9;

fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn mix(d: Digest, word: u64) -> Digest {
    Digest(splitmix(d.0 ^ word), splitmix(d.1.rotate_left(29) ^ word.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
}

/// Folds tokens `start..end` (and the images entering there) into `d`.
fn fold(mut d: Digest, tokens: &[u32], images: &[ImageSpan], start: usize, end: usize) -> Digest {
    let first_image = images.partition_point(|i| (i.position as usize) < start);
    let mut image = images[first_image..].iter().peekable();
    for (position, &token) in tokens.iter().enumerate().take(end).skip(start) {
        while let Some(img) = image.next_if(|i| i.position as usize == position) {
            d = mix(d, IMAGE_TAG ^ img.identity);
        }
        d = mix(d, TOKEN_TAG ^ u64::from(token));
    }
    d
}

/// Chain digests at every hash-block boundary of one prompt: `blocks[b]` covers `b` blocks.
#[derive(Clone, Debug)]
pub struct PromptDigests {
    blocks: Vec<Digest>,
}

impl PromptDigests {
    /// Digests `tokens`; `images` must be sorted by position.
    pub fn new(identity: PrefixIdentity, tokens: &[u32], images: &[ImageSpan]) -> Self {
        let mut d = mix(mix(Digest(1, 2), identity.model), identity.token_layout);
        let mut blocks = Vec::with_capacity(tokens.len() / HASH_BLOCK_TOKENS + 1);
        blocks.push(d);
        for b in 0..tokens.len() / HASH_BLOCK_TOKENS {
            let start = b * HASH_BLOCK_TOKENS;
            d = mix(fold(d, tokens, images, start, start + HASH_BLOCK_TOKENS), BLOCK_TAG);
            blocks.push(d);
        }
        Self { blocks }
    }

    /// Chain digest after `b` complete blocks.
    pub fn block(&self, b: usize) -> Option<Digest> {
        self.blocks.get(b).copied()
    }

    /// Key of the prefix `tokens[..len]` (the same `tokens`/`images` given to [`Self::new`]).
    pub fn key_at(&self, tokens: &[u32], images: &[ImageSpan], len: usize) -> PrefixKey {
        let b = len / HASH_BLOCK_TOKENS;
        let block_digest = self.blocks[b];
        let tail = fold(block_digest, tokens, images, b * HASH_BLOCK_TOKENS, len);
        PrefixKey { block_digest, digest: mix(tail, len as u64), tokens: len as u64 }
    }

    /// The deepest stored prefix of `tokens` no longer than `max_tokens`. Walks hash blocks from
    /// the deepest; `bucket` lists the entries stored under a block digest and `key` gives an
    /// entry's key. Cost: one fold of at most a block's tail per candidate examined.
    pub fn deepest<'a, I: Copy + 'a>(
        &self,
        tokens: &[u32],
        images: &[ImageSpan],
        max_tokens: usize,
        bucket: impl Fn(&Digest) -> Option<&'a [I]>,
        key: impl Fn(I) -> PrefixKey,
    ) -> Option<I> {
        let max_tokens = max_tokens.min(tokens.len());
        for b in (0..=max_tokens / HASH_BLOCK_TOKENS).rev() {
            let Some(ids) = self.block(b).and_then(|d| bucket(&d)) else { continue };
            let mut best: Option<(u64, I)> = None;
            for &id in ids {
                let k = key(id);
                if k.tokens as usize > max_tokens || best.is_some_and(|(l, _)| l >= k.tokens) {
                    continue;
                }
                if self.key_at(tokens, images, k.tokens as usize).digest == k.digest {
                    best = Some((k.tokens, id));
                }
            }
            if let Some((_, id)) = best {
                return Some(id);
            }
        }
        None
    }

    /// Key of `tokens[..len]` without precomputed digests.
    pub fn key_of(identity: PrefixIdentity, tokens: &[u32], images: &[ImageSpan], len: usize) -> PrefixKey {
        Self::new(identity, &tokens[..len], images).key_at(tokens, images, len)
    }
}

/// Entries of one tier addressed by prefix: each under its whole-prefix digest, and in a bucket
/// of its block digest for [`PrefixIndex::deepest`]. The GPU prefix cache and the host and disk
/// tiers index their checkpoints with it.
///
/// Invariant: `by_key` and `by_block` hold exactly the same entries, each once.
#[derive(Clone, Debug)]
pub struct PrefixIndex<I> {
    by_key: std::collections::HashMap<Digest, I>,
    by_block: std::collections::HashMap<Digest, Vec<I>>,
}

impl<I> Default for PrefixIndex<I> {
    fn default() -> Self {
        PrefixIndex { by_key: Default::default(), by_block: Default::default() }
    }
}

impl<I: Copy + PartialEq> PrefixIndex<I> {
    /// Indexes `id` under `key`; an entry already under the same digest is replaced.
    pub fn insert(&mut self, key: &PrefixKey, id: I) {
        if let Some(old) = self.by_key.insert(key.digest, id) {
            self.remove_block(key, old);
        }
        self.by_block.entry(key.block_digest).or_default().push(id);
    }

    fn remove_block(&mut self, key: &PrefixKey, id: I) {
        if let Some(ids) = self.by_block.get_mut(&key.block_digest) {
            ids.retain(|&i| i != id);
            if ids.is_empty() {
                self.by_block.remove(&key.block_digest);
            }
        }
    }

    /// Removes `id` from under `key` (no-op when another entry holds the digest).
    pub fn remove(&mut self, key: &PrefixKey, id: I) {
        if self.by_key.get(&key.digest) == Some(&id) {
            self.by_key.remove(&key.digest);
            self.remove_block(key, id);
        }
    }

    /// The entry under `key`'s digest.
    pub fn get(&self, key: &PrefixKey) -> Option<I> {
        self.by_key.get(&key.digest).copied()
    }

    /// Whether an entry is under `key`'s digest.
    pub fn contains(&self, key: &PrefixKey) -> bool {
        self.by_key.contains_key(&key.digest)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Every entry (any order).
    pub fn ids(&self) -> impl Iterator<Item = I> + '_ {
        self.by_key.values().copied()
    }

    /// Whether `id` is indexed under `key` in both maps (invariant checks).
    pub fn holds(&self, key: &PrefixKey, id: I) -> bool {
        self.by_key.get(&key.digest) == Some(&id)
            && self.by_block.get(&key.block_digest).is_some_and(|v| v.contains(&id))
    }

    /// Asserts the invariant in the type documentation.
    pub fn check_invariants(&self) {
        assert_eq!(self.by_block.values().map(Vec::len).sum::<usize>(), self.by_key.len(), "block index out of sync");
    }

    /// The deepest indexed prefix of `tokens` no longer than `max_tokens`, as
    /// [`PromptDigests::deepest`]; `key` gives an entry's key.
    pub fn deepest(
        &self,
        digests: &PromptDigests,
        tokens: &[u32],
        images: &[ImageSpan],
        max_tokens: usize,
        key: impl Fn(I) -> PrefixKey,
    ) -> Option<I> {
        digests.deepest(tokens, images, max_tokens, |block| self.by_block.get(block).map(Vec::as_slice), key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_keys_are_stable_under_appends_and_sensitive_to_content() {
        let id = PrefixIdentity { model: 7, token_layout: 1 };
        let a: Vec<u32> = (0..200).collect();
        let mut b = a.clone();
        b.extend([5, 6, 7]);
        let da = PromptDigests::new(id, &a, &[]);
        let db = PromptDigests::new(id, &b, &[]);
        for len in [1, 63, 64, 65, 128, 200] {
            assert_eq!(da.key_at(&a, &[], len), db.key_at(&b, &[], len));
            assert_eq!(da.key_at(&a, &[], len), PromptDigests::key_of(id, &a, &[], len));
        }
        assert_ne!(da.key_at(&a, &[], 64).digest, da.key_at(&a, &[], 65).digest);
        let other = PrefixIdentity { model: 8, token_layout: 1 };
        assert_ne!(da.key_at(&a, &[], 64).digest, PromptDigests::key_of(other, &a, &[], 64).digest);
        let image = [ImageSpan { position: 100, identity: 9 }];
        let with_image = PromptDigests::new(id, &a, &image);
        assert_eq!(with_image.key_at(&a, &image, 100), da.key_at(&a, &[], 100));
        assert_ne!(with_image.key_at(&a, &image, 101), da.key_at(&a, &[], 101));
    }
}
