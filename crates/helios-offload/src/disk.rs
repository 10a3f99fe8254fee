//! The disk tier: checkpoint images in files under one directory, surviving restarts.
//!
//! One file per checkpoint, named by its prefix digest. A file holds a header, then the blocks
//! this file stores: the chain pages no earlier file held, the tail page and the row, each at a
//! [`UNIT_BYTES`]-aligned offset (so `O_DIRECT` reads and writes land in host extents in place).
//! The header lists the whole chain as page references (uid, file, block): pages shared with an
//! ancestor checkpoint's file are stored once.
//!
//! Crash safety: a file is written under a temporary name, synced, and renamed when complete,
//! after every file it references exists. At startup ([`DiskTier::open`]) temporary files are
//! removed, and files of another core or geometry, with a damaged header, or shorter than their
//! blocks are rejected (reported and removed). Block checksums are verified when a restore reads
//! them; a mismatch discards the file and every checkpoint that references it.
//!
//! Invariants (asserted by [`DiskTier::check_invariants`]):
//! - a file's `refs` counts the live (or being written) entries whose chain references one of
//!   its blocks, its own entry included; a file with no reference is deleted;
//! - `by_uid` names, per uid, a page block of a live file; `index` holds exactly the live
//!   checkpoints (not being written); `lru` holds exactly the live unpinned entries;
//! - `used` is the size of every file, written or being written.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use helios_cache::{Digest, ImageSpan, PrefixIndex, PrefixKey, PromptDigests};

use crate::StoreGeometry;
use crate::arena::{HostExtent, UNIT_BYTES};
use crate::host::PageUid;

/// First bytes of every file.
pub const FILE_MAGIC: [u8; 8] = *b"FLARECK1";
/// Version of the layout below.
pub const FORMAT_VERSION: u32 = 1;
const SUFFIX: &str = "ckpt";
const TMP_SUFFIX: &str = "tmp";

/// What makes files usable by this process: the core they were written for and its geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskIdentity {
    /// sha256 of the core's manifest (its weights' digests included).
    pub fingerprint: [u8; 32],
    pub geometry: StoreGeometry,
}

/// What a block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    Page,
    Tail,
    Row,
}

/// One block stored in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    pub kind: BlockKind,
    /// The page's uid (pages only).
    pub uid: PageUid,
    pub offset: u64,
    pub len: u64,
    pub checksum: u64,
}

/// Where a chain page is stored: a file (by its digest) and a block index in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRef {
    pub uid: PageUid,
    pub file: Digest,
    pub block: u32,
}

/// A file's header: the checkpoint, its chain, and the blocks the file stores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileHeader {
    pub key: PrefixKey,
    pub chain: Vec<PageRef>,
    pub blocks: Vec<BlockInfo>,
}

/// Why a file cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("not a checkpoint file")]
    Magic,
    #[error("format version {0}, this build reads {FORMAT_VERSION}")]
    Version(u32),
    #[error("written for another core")]
    OtherCore,
    #[error("written for another cache geometry")]
    Geometry,
    #[error("header checksum mismatch")]
    Checksum,
    #[error("truncated: {have} bytes, {need} needed")]
    Truncated { have: u64, need: u64 },
    #[error("malformed header: {0}")]
    Malformed(&'static str),
    #[error("references a block no usable file holds")]
    MissingReference,
}

/// A 64-bit checksum of `bytes` (word-wise multiply-rotate; detects corruption, not tampering).
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        h = (h ^ w).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(0xc4ce_b9fe_1a85_ec53).rotate_left(17);
    }
    h ^ (h >> 31)
}

const FIXED_HEADER: usize = 8 + 4 + 4 + 32 + 4 + 8 + 8 + 16 + 16 + 8 + 4 + 4;
const REF_BYTES: usize = 16 + 16 + 4;
const BLOCK_BYTES: usize = 1 + 16 + 8 + 8 + 8;

fn round_up(n: u64) -> u64 {
    n.div_ceil(UNIT_BYTES) * UNIT_BYTES
}

impl FileHeader {
    /// Header bytes, padded to whole units, for `chain` references and `blocks` blocks.
    pub fn encoded_len(chain: usize, blocks: usize) -> u64 {
        round_up((FIXED_HEADER + chain * REF_BYTES + blocks * BLOCK_BYTES + 8) as u64)
    }

    /// End of the last block: the file's length.
    pub fn data_end(&self) -> u64 {
        let header = Self::encoded_len(self.chain.len(), self.blocks.len());
        self.blocks.iter().map(|b| b.offset + round_up(b.len.max(1))).max().unwrap_or(header).max(header)
    }

    /// The header bytes (padded to whole units).
    pub fn encode(&self, id: &DiskIdentity) -> Vec<u8> {
        let len = Self::encoded_len(self.chain.len(), self.blocks.len()) as usize;
        let mut b = Vec::with_capacity(len);
        b.extend_from_slice(&FILE_MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&(len as u32).to_le_bytes());
        b.extend_from_slice(&id.fingerprint);
        b.extend_from_slice(&id.geometry.page_tokens.to_le_bytes());
        b.extend_from_slice(&id.geometry.bytes_per_page.to_le_bytes());
        b.extend_from_slice(&id.geometry.continuation_row_bytes.to_le_bytes());
        for d in [self.key.block_digest, self.key.digest] {
            b.extend_from_slice(&d.0.to_le_bytes());
            b.extend_from_slice(&d.1.to_le_bytes());
        }
        b.extend_from_slice(&self.key.tokens.to_le_bytes());
        b.extend_from_slice(&(self.chain.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.blocks.len() as u32).to_le_bytes());
        for r in &self.chain {
            b.extend_from_slice(&r.uid.0.to_le_bytes());
            b.extend_from_slice(&r.file.0.to_le_bytes());
            b.extend_from_slice(&r.file.1.to_le_bytes());
            b.extend_from_slice(&r.block.to_le_bytes());
        }
        for k in &self.blocks {
            b.push(match k.kind {
                BlockKind::Page => 0,
                BlockKind::Tail => 1,
                BlockKind::Row => 2,
            });
            b.extend_from_slice(&k.uid.0.to_le_bytes());
            b.extend_from_slice(&k.offset.to_le_bytes());
            b.extend_from_slice(&k.len.to_le_bytes());
            b.extend_from_slice(&k.checksum.to_le_bytes());
        }
        let sum = checksum(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b.resize(len, 0);
        b
    }

    /// The header's length, from its first unit (to read the rest before decoding).
    pub fn declared_len(first: &[u8]) -> Result<u64, FormatError> {
        let mut r = Reader(first);
        if r.take(8)? != FILE_MAGIC {
            return Err(FormatError::Magic);
        }
        let version = r.u32()?;
        if version != FORMAT_VERSION {
            return Err(FormatError::Version(version));
        }
        Ok(u64::from(r.u32()?))
    }

    /// Decodes and checks a header written for `id`.
    pub fn decode(bytes: &[u8], id: &DiskIdentity) -> Result<FileHeader, FormatError> {
        let len = Self::declared_len(bytes)? as usize;
        if bytes.len() < len || len < FIXED_HEADER + 8 {
            return Err(FormatError::Malformed("header length"));
        }
        let mut r = Reader(&bytes[16..len]);
        let fingerprint = r.take(32)?;
        let geometry =
            StoreGeometry { page_tokens: r.u32()?, bytes_per_page: r.u64()?, continuation_row_bytes: r.u64()? };
        let digest = |r: &mut Reader<'_>| -> Result<Digest, FormatError> { Ok(Digest(r.u64()?, r.u64()?)) };
        let block_digest = digest(&mut r)?;
        let key_digest = digest(&mut r)?;
        let tokens = r.u64()?;
        let (chain_len, block_count) = (r.u32()? as usize, r.u32()? as usize);
        if Self::encoded_len(chain_len, block_count) as usize != len {
            return Err(FormatError::Malformed("counts"));
        }
        let mut chain = Vec::with_capacity(chain_len);
        for _ in 0..chain_len {
            chain.push(PageRef { uid: PageUid(r.u128()?), file: digest(&mut r)?, block: r.u32()? });
        }
        let mut blocks = Vec::with_capacity(block_count);
        for _ in 0..block_count {
            let kind = match r.take(1)?[0] {
                0 => BlockKind::Page,
                1 => BlockKind::Tail,
                2 => BlockKind::Row,
                _ => return Err(FormatError::Malformed("block kind")),
            };
            blocks.push(BlockInfo {
                kind,
                uid: PageUid(r.u128()?),
                offset: r.u64()?,
                len: r.u64()?,
                checksum: r.u64()?,
            });
        }
        let body = len - r.0.len();
        let sum = r.u64()?;
        if checksum(&bytes[..body]) != sum {
            return Err(FormatError::Checksum);
        }
        if fingerprint != id.fingerprint {
            return Err(FormatError::OtherCore);
        }
        if geometry != id.geometry {
            return Err(FormatError::Geometry);
        }
        let header = FileHeader { key: PrefixKey { block_digest, digest: key_digest, tokens }, chain, blocks };
        header.validate(id)?;
        Ok(header)
    }

    /// Shape checks: the chain covers the key's complete pages, blocks are aligned, ordered,
    /// past the header and of the geometry's sizes, one row, a tail exactly when needed.
    fn validate(&self, id: &DiskIdentity) -> Result<(), FormatError> {
        let g = id.geometry;
        let pt = u64::from(g.page_tokens.max(1));
        if self.chain.len() as u64 != self.key.tokens / pt {
            return Err(FormatError::Malformed("chain length"));
        }
        let mut end = Self::encoded_len(self.chain.len(), self.blocks.len());
        let (mut tails, mut rows) = (0, 0);
        for b in &self.blocks {
            let expected = match b.kind {
                BlockKind::Page | BlockKind::Tail => g.bytes_per_page,
                BlockKind::Row => g.continuation_row_bytes,
            };
            if b.len != expected || b.offset < end || !b.offset.is_multiple_of(UNIT_BYTES) {
                return Err(FormatError::Malformed("block layout"));
            }
            end = b.offset + round_up(b.len.max(1));
            tails += usize::from(b.kind == BlockKind::Tail);
            rows += usize::from(b.kind == BlockKind::Row);
        }
        if rows != 1 || tails != usize::from(!self.key.tokens.is_multiple_of(pt)) {
            return Err(FormatError::Malformed("row or tail count"));
        }
        Ok(())
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        if self.0.len() < n {
            return Err(FormatError::Malformed("short header"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, FormatError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, FormatError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn u128(&mut self) -> Result<u128, FormatError> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.take(16)?);
        Ok(u128::from_le_bytes(a))
    }
}

/// Disk tier failures outside one file's format.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("disk cache directory {path}: {source}")]
    Directory { path: PathBuf, source: std::io::Error },
    #[error("{needed} bytes do not fit the disk tier's {capacity} bytes beside its pinned files")]
    NoRoom { needed: u64, capacity: u64 },
    #[error("a file for this checkpoint exists")]
    Present,
}

/// A file found unusable at startup (it was removed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub path: PathBuf,
    pub reason: FormatError,
}

#[derive(Clone, Debug)]
struct DiskFile {
    header: FileHeader,
    bytes: u64,
    /// Its own checkpoint is live (not evicted, not invalid).
    alive: bool,
    /// Being written: not yet readable.
    writing: bool,
    /// Being written while a file it references was discarded: fails when the write ends.
    doomed: bool,
    refs: u32,
    pins: u32,
    last_access: u64,
}

/// Counters and gauges of the disk tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskStats {
    pub entries: u64,
    pub files: u64,
    pub resident_bytes: u64,
    pub capacity_bytes: u64,
    pub writes: u64,
    pub written_bytes: u64,
    pub write_skips: u64,
    pub write_failures: u64,
    pub evictions: u64,
    pub rejected_at_start: u64,
    pub discarded: u64,
}

/// One block to read for a restore: from `path` at `offset`, `len` bytes whose checksum is
/// `checksum`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockRead {
    pub path: PathBuf,
    pub offset: u64,
    pub len: u64,
    pub checksum: u64,
}

/// Everything a restore of one checkpoint reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadPlan {
    pub key: PrefixKey,
    pub chain: Vec<PageUid>,
    pub pages: Vec<BlockRead>,
    pub tail: Option<BlockRead>,
    pub row: BlockRead,
}

/// Where a block written for a new file comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockSource {
    /// Chain page `i` of the checkpoint.
    Page(usize),
    Tail,
    Row,
}

/// A file to write: its header (checksums still zero: the writer fills them from the bytes it
/// writes), where each stored block comes from, and the paths.
#[derive(Clone, Debug)]
pub struct WritePlan {
    pub file: Digest,
    pub header: FileHeader,
    pub sources: Vec<BlockSource>,
    pub tmp_path: PathBuf,
    pub path: PathBuf,
}

/// The disk tier's index. Plans reads and writes; the I/O itself runs elsewhere
/// ([`crate::DiskIo`]), and deletions are handed out by [`DiskTier::take_deletions`].
#[derive(Debug)]
pub struct DiskTier {
    dir: PathBuf,
    identity: DiskIdentity,
    capacity: u64,
    used: u64,
    files: HashMap<Digest, DiskFile>,
    index: PrefixIndex<Digest>,
    by_uid: HashMap<PageUid, (Digest, u32)>,
    lru: BTreeSet<(u64, Digest)>,
    clock: u64,
    deletions: Vec<PathBuf>,
    stats: DiskStats,
}

fn file_name(d: Digest) -> String {
    format!("{:016x}{:016x}", d.0, d.1)
}

fn parse_file_name(s: &str) -> Option<Digest> {
    if s.len() != 32 {
        return None;
    }
    Some(Digest(u64::from_str_radix(&s[..16], 16).ok()?, u64::from_str_radix(&s[16..], 16).ok()?))
}

impl DiskTier {
    /// Opens (creating) `dir` and indexes the files of `identity` in it; everything else found
    /// there is reported and removed. Files beyond `capacity` are evicted, oldest first.
    pub fn open(dir: &Path, identity: DiskIdentity, capacity: u64) -> Result<(Self, Vec<Rejection>), DiskError> {
        let io = |source| DiskError::Directory { path: dir.to_path_buf(), source };
        std::fs::create_dir_all(dir).map_err(io)?;
        let mut tier = DiskTier {
            dir: dir.to_path_buf(),
            identity,
            capacity,
            used: 0,
            files: HashMap::new(),
            index: PrefixIndex::default(),
            by_uid: HashMap::new(),
            lru: BTreeSet::new(),
            clock: 0,
            deletions: Vec::new(),
            stats: DiskStats { capacity_bytes: capacity, ..DiskStats::default() },
        };
        let mut rejected = Vec::new();
        let mut found: Vec<(std::time::SystemTime, Digest, FileHeader, u64)> = Vec::new();
        for item in std::fs::read_dir(dir).map_err(io)? {
            let path = item.map_err(io)?.path();
            match path.extension().and_then(|e| e.to_str()) {
                Some(TMP_SUFFIX) => {
                    // An interrupted write.
                    let _ = std::fs::remove_file(&path);
                }
                Some(SUFFIX) => match read_header(&path, &identity) {
                    Ok((header, len, mtime))
                        if path.file_stem().and_then(|s| s.to_str()) == Some(&file_name(header.key.digest)) =>
                    {
                        found.push((mtime, header.key.digest, header, len));
                    }
                    Ok(_) => rejected.push(Rejection { path, reason: FormatError::Malformed("file name") }),
                    Err(reason) => rejected.push(Rejection { path, reason }),
                },
                _ => {}
            }
        }
        found.sort_by_key(|f| f.0);
        for (_, digest, header, len) in found {
            tier.clock += 1;
            tier.used += len;
            let file = DiskFile {
                header,
                bytes: len,
                alive: true,
                writing: false,
                doomed: false,
                refs: 0,
                pins: 0,
                last_access: tier.clock,
            };
            tier.files.insert(digest, file);
        }
        // A checkpoint is usable when every page it references is a page block of a file found.
        let digests: Vec<Digest> = tier.files.keys().copied().collect();
        for d in &digests {
            let ok = tier.files[d].header.chain.iter().all(|r| {
                tier.files
                    .get(&r.file)
                    .and_then(|f| f.header.blocks.get(r.block as usize))
                    .is_some_and(|b| b.kind == BlockKind::Page && b.uid == r.uid)
            });
            if ok {
                let chain = tier.files[d].header.chain.clone();
                tier.reference(*d, &chain);
            } else {
                if let Some(f) = tier.files.get_mut(d) {
                    f.alive = false;
                }
                rejected.push(Rejection { path: tier.path(*d), reason: FormatError::MissingReference });
            }
        }
        for d in digests {
            if tier.files.get(&d).is_some_and(|f| f.alive) {
                tier.index(d);
            } else {
                tier.maybe_delete(d);
            }
        }
        for r in &rejected {
            if r.reason != FormatError::MissingReference {
                let _ = std::fs::remove_file(&r.path);
            }
        }
        tier.stats.rejected_at_start = rejected.len() as u64;
        while tier.used > tier.capacity && tier.evict_one() {}
        // Startup may block: unused files go now.
        for path in tier.take_deletions() {
            let _ = std::fs::remove_file(path);
        }
        Ok((tier, rejected))
    }

    fn path(&self, d: Digest) -> PathBuf {
        self.dir.join(format!("{}.{SUFFIX}", file_name(d)))
    }

    fn tmp_path(&self, d: Digest) -> PathBuf {
        self.dir.join(format!("{}.{TMP_SUFFIX}", file_name(d)))
    }

    /// Counters and gauges.
    pub fn stats(&self) -> DiskStats {
        DiskStats {
            entries: self.files.values().filter(|f| f.alive && !f.writing).count() as u64,
            files: self.files.len() as u64,
            resident_bytes: self.used,
            ..self.stats
        }
    }

    /// Whether a live checkpoint with this key is on disk (or being written).
    pub fn contains(&self, key: &PrefixKey) -> bool {
        self.files.get(&key.digest).is_some_and(|f| f.alive)
    }

    /// Paths the tier stopped using, for the I/O thread to unlink.
    pub fn take_deletions(&mut self) -> Vec<PathBuf> {
        std::mem::take(&mut self.deletions)
    }

    fn reference(&mut self, owner: Digest, chain: &[PageRef]) {
        let mut files: Vec<Digest> = chain.iter().map(|r| r.file).collect();
        files.push(owner);
        files.sort();
        files.dedup();
        for f in files {
            if let Some(file) = self.files.get_mut(&f) {
                file.refs += 1;
            }
        }
    }

    fn unreference(&mut self, owner: Digest) {
        let Some(chain) = self.files.get(&owner).map(|f| f.header.chain.clone()) else { return };
        let mut files: Vec<Digest> = chain.iter().map(|r| r.file).collect();
        files.push(owner);
        files.sort();
        files.dedup();
        for f in files {
            if let Some(file) = self.files.get_mut(&f) {
                file.refs -= 1;
            }
            self.maybe_delete(f);
        }
    }

    fn index(&mut self, d: Digest) {
        let Some(f) = self.files.get(&d) else { return };
        let key = f.header.key;
        let pages: Vec<(u32, PageUid)> = f
            .header
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.kind == BlockKind::Page)
            .map(|(i, b)| (i as u32, b.uid))
            .collect();
        let last = f.last_access;
        self.index.insert(&key, d);
        for (i, uid) in pages {
            self.by_uid.entry(uid).or_insert((d, i));
        }
        if self.files[&d].pins == 0 {
            self.lru.insert((last, d));
        }
    }

    fn unindex(&mut self, d: Digest) {
        let Some(f) = self.files.get(&d) else { return };
        let key = f.header.key;
        self.lru.remove(&(f.last_access, d));
        self.index.remove(&key, d);
    }

    /// Deletes a file no live checkpoint needs any more and no read is using.
    fn maybe_delete(&mut self, d: Digest) {
        let Some(f) = self.files.get(&d) else { return };
        if f.refs > 0 || f.alive || f.pins > 0 {
            return;
        }
        self.used -= f.bytes;
        self.forget_pages(d);
        self.files.remove(&d);
        self.deletions.push(self.path(d));
    }

    /// Drops the uid index entries that point into file `d` (its page blocks only: no scan).
    fn forget_pages(&mut self, d: Digest) {
        let Some(f) = self.files.get(&d) else { return };
        for (i, b) in f.header.blocks.iter().enumerate().filter(|(_, b)| b.kind == BlockKind::Page) {
            if self.by_uid.get(&b.uid) == Some(&(d, i as u32)) {
                self.by_uid.remove(&b.uid);
            }
        }
    }

    /// Retires a live checkpoint's own entry (its file stays while others reference it).
    fn kill(&mut self, d: Digest) {
        let alive = self.files.get(&d).is_some_and(|f| f.alive && !f.writing);
        if !alive {
            return;
        }
        self.unindex(d);
        if let Some(f) = self.files.get_mut(&d) {
            f.alive = false;
        }
        self.unreference(d);
    }

    fn evict_one(&mut self) -> bool {
        let Some(&(_, d)) = self.lru.first() else { return false };
        self.kill(d);
        self.stats.evictions += 1;
        true
    }

    /// The deepest live checkpoint on disk that is a prefix of `tokens`, at most `max_tokens`
    /// long and longer than `min_tokens`. Cost as [`PromptDigests::deepest`].
    pub fn lookup(
        &mut self,
        digests: &PromptDigests,
        tokens: &[u32],
        images: &[ImageSpan],
        max_tokens: usize,
        min_tokens: u64,
    ) -> Option<PrefixKey> {
        let files = &self.files;
        let d = self.index.deepest(digests, tokens, images, max_tokens, |d| files[&d].header.key)?;
        let key = self.files[&d].header.key;
        (key.tokens > min_tokens).then_some(key)
    }

    /// Bytes a fetch of checkpoint `key` reads at most (its chain, tail and row).
    pub fn image_bytes(&self, key: &PrefixKey) -> Option<u64> {
        let f = self.files.get(&key.digest).filter(|f| f.alive && !f.writing)?;
        let g = self.identity.geometry;
        let tail = f.header.blocks.iter().filter(|b| b.kind == BlockKind::Tail).count() as u64;
        Some((f.header.chain.len() as u64 + tail) * g.bytes_per_page + g.continuation_row_bytes)
    }

    /// Plans the read of a live checkpoint and pins it (and so the files it references) until
    /// [`Self::finish_read`].
    pub fn begin_read(&mut self, key: &PrefixKey) -> Option<ReadPlan> {
        let f = self.files.get(&key.digest).filter(|f| f.alive && !f.writing)?;
        let block = |file: Digest, i: u32| -> Option<BlockRead> {
            let b = self.files.get(&file)?.header.blocks.get(i as usize)?;
            Some(BlockRead { path: self.path(file), offset: b.offset, len: b.len, checksum: b.checksum })
        };
        let own = |kind: BlockKind| {
            f.header.blocks.iter().position(|b| b.kind == kind).and_then(|i| block(key.digest, i as u32))
        };
        let pages: Option<Vec<BlockRead>> = f.header.chain.iter().map(|r| block(r.file, r.block)).collect();
        let plan = ReadPlan {
            key: f.header.key,
            chain: f.header.chain.iter().map(|r| r.uid).collect(),
            pages: pages?,
            tail: own(BlockKind::Tail),
            row: own(BlockKind::Row)?,
        };
        self.clock += 1;
        let clock = self.clock;
        if let Some(f) = self.files.get_mut(&key.digest) {
            if f.pins == 0 {
                self.lru.remove(&(f.last_access, key.digest));
            }
            f.pins += 1;
            f.last_access = clock;
        }
        Some(plan)
    }

    /// Ends a read. `ok == false` (an I/O error or a checksum mismatch): the checkpoint and
    /// every file that cannot be trusted with it are discarded.
    pub fn finish_read(&mut self, key: &PrefixKey, ok: bool) {
        self.end_read(key, if ok { None } else { Some(key.digest) });
    }

    /// Ends a read that failed in `path` (an I/O error or checksum mismatch there): the file
    /// holding the bad block is discarded with every checkpoint that references it, and the
    /// checkpoint read as well.
    pub fn fail_read(&mut self, key: &PrefixKey, path: &Path) {
        let bad = path.file_stem().and_then(|s| s.to_str()).and_then(parse_file_name);
        if let Some(bad) = bad {
            self.discard(bad);
        }
        self.end_read(key, Some(key.digest));
    }

    fn end_read(&mut self, key: &PrefixKey, discard: Option<Digest>) {
        let d = key.digest;
        if let Some(f) = self.files.get_mut(&d) {
            f.pins = f.pins.saturating_sub(1);
            if f.pins == 0 && f.alive && !f.writing {
                self.lru.insert((f.last_access, d));
            }
        }
        if let Some(bad) = discard {
            self.discard(bad);
        }
        self.maybe_delete(d);
    }

    /// Discards a file and every live checkpoint whose chain references it; files being
    /// written that reference it fail when their write ends.
    fn discard(&mut self, d: Digest) {
        let uses = |o: &Digest, f: &DiskFile| *o == d || f.header.chain.iter().any(|r| r.file == d);
        let dependents: Vec<Digest> =
            self.files.iter().filter(|(o, f)| f.alive && !f.writing && uses(o, f)).map(|(o, _)| *o).collect();
        for f in self.files.iter_mut().filter(|(o, f)| f.writing && uses(o, f)).map(|(_, f)| f) {
            f.doomed = true;
        }
        for o in dependents {
            self.kill(o);
            self.stats.discarded += 1;
        }
        self.forget_pages(d);
    }

    /// Bytes that evicting every evictable checkpoint would free, files in `held` kept: files
    /// no pinned or writing checkpoint needs.
    fn reclaimable(&self, held: &[Digest]) -> u64 {
        let mut needed: std::collections::HashSet<Digest> = held.iter().copied().collect();
        for (d, f) in &self.files {
            if f.writing || f.pins > 0 {
                needed.insert(*d);
                needed.extend(f.header.chain.iter().map(|r| r.file));
            }
        }
        self.files.iter().filter(|(d, _)| !needed.contains(d)).map(|(_, f)| f.bytes).sum()
    }

    /// Makes a file kept only for the pages others reference a live checkpoint again, when
    /// every file its chain references is still there. Returns whether it is live now.
    fn revive(&mut self, d: Digest) -> bool {
        let Some(f) = self.files.get(&d) else { return false };
        if f.alive {
            return true;
        }
        if f.writing || f.pins > 0 || !f.header.chain.iter().all(|r| self.files.contains_key(&r.file)) {
            return false;
        }
        let chain = f.header.chain.clone();
        self.clock += 1;
        if let Some(f) = self.files.get_mut(&d) {
            f.alive = true;
            f.last_access = self.clock;
        }
        self.reference(d, &chain);
        self.index(d);
        true
    }

    /// Plans a file for checkpoint `key` with chain page uids `chain` (and a tail page when
    /// `tail`): pages a live file already stores are referenced, the rest stored here. Evicts
    /// least recently used checkpoints for room. The plan holds its references until
    /// [`Self::finish_write`].
    pub fn begin_write(&mut self, key: PrefixKey, chain: &[PageUid], tail: bool) -> Result<WritePlan, DiskError> {
        if self.files.contains_key(&key.digest) {
            // On disk already, or kept for its pages: revived instead of written again.
            self.revive(key.digest);
            return Err(DiskError::Present);
        }
        let g = self.identity.geometry;
        let refs_for = |tier: &Self| -> Vec<Option<PageRef>> {
            chain
                .iter()
                .map(|uid| tier.by_uid.get(uid).map(|&(file, block)| PageRef { uid: *uid, file, block }))
                .collect()
        };
        let existing = refs_for(self);
        let stored = existing.iter().filter(|r| r.is_none()).count() + usize::from(tail) + 1;
        let header_len = FileHeader::encoded_len(chain.len(), stored);
        let needed = header_len
            + existing.iter().filter(|r| r.is_none()).count() as u64 * round_up(g.bytes_per_page.max(1))
            + u64::from(tail) * round_up(g.bytes_per_page.max(1))
            + round_up(g.continuation_row_bytes.max(1));
        // Hold the referenced files (once each, as `reference` counts) while evicting for room.
        let mut held: Vec<Digest> = existing.iter().flatten().map(|r| r.file).collect();
        held.sort();
        held.dedup();
        for f in &held {
            if let Some(file) = self.files.get_mut(f) {
                file.refs += 1;
            }
        }
        // Fail before evicting anything when even evicting everything evictable cannot make room.
        let short = self.used + needed > self.capacity && self.used - self.reclaimable(&held) + needed > self.capacity;
        while self.used + needed > self.capacity {
            if short || !self.evict_one() {
                for f in &held {
                    if let Some(file) = self.files.get_mut(f) {
                        file.refs -= 1;
                    }
                    self.maybe_delete(*f);
                }
                self.stats.write_skips += 1;
                return Err(DiskError::NoRoom { needed, capacity: self.capacity });
            }
        }
        let digest = key.digest;
        let mut offset = header_len;
        let mut blocks = Vec::with_capacity(stored);
        let mut sources = Vec::with_capacity(stored);
        let mut refs = Vec::with_capacity(chain.len());
        let mut push = |kind, uid, len: u64, source, blocks: &mut Vec<BlockInfo>| {
            blocks.push(BlockInfo { kind, uid, offset, len, checksum: 0 });
            sources.push(source);
            offset += round_up(len.max(1));
            blocks.len() as u32 - 1
        };
        for (i, (uid, r)) in chain.iter().zip(existing).enumerate() {
            refs.push(match r {
                Some(r) => r,
                None => {
                    let block = push(BlockKind::Page, *uid, g.bytes_per_page, BlockSource::Page(i), &mut blocks);
                    PageRef { uid: *uid, file: digest, block }
                }
            });
        }
        if tail {
            push(BlockKind::Tail, PageUid(0), g.bytes_per_page, BlockSource::Tail, &mut blocks);
        }
        push(BlockKind::Row, PageUid(0), g.continuation_row_bytes, BlockSource::Row, &mut blocks);
        let header = FileHeader { key, chain: refs, blocks };
        let bytes = header.data_end();
        // The referenced files were held above; the new file references itself.
        self.used += bytes;
        self.clock += 1;
        self.files.insert(
            digest,
            DiskFile {
                header: header.clone(),
                bytes,
                alive: true,
                writing: true,
                doomed: false,
                refs: 1,
                pins: 0,
                last_access: self.clock,
            },
        );
        Ok(WritePlan { file: digest, header, sources, tmp_path: self.tmp_path(digest), path: self.path(digest) })
    }

    /// Ends a write: with the blocks' checksums the file becomes a live checkpoint; on failure
    /// (`None`) its references and room are released.
    pub fn finish_write(&mut self, plan: &WritePlan, checksums: Option<&[u64]>) {
        let d = plan.file;
        let doomed = self.files.get(&d).is_some_and(|f| f.doomed);
        match checksums {
            Some(sums) if self.files.contains_key(&d) && !doomed => {
                if let Some(f) = self.files.get_mut(&d) {
                    for (b, &s) in f.header.blocks.iter_mut().zip(sums) {
                        b.checksum = s;
                    }
                    f.writing = false;
                }
                self.index(d);
                self.stats.writes += 1;
                self.stats.written_bytes += plan.header.data_end();
            }
            _ => {
                self.stats.write_failures += 1;
                if let Some(f) = self.files.get_mut(&d) {
                    f.writing = false;
                    f.alive = false;
                    f.doomed = false;
                }
                self.unreference(d);
            }
        }
    }

    /// Asserts the invariants in the module documentation.
    pub fn check_invariants(&self) {
        let mut refs: HashMap<Digest, u32> = HashMap::new();
        let mut used = 0;
        let mut lru = BTreeSet::new();
        for (d, f) in &self.files {
            used += f.bytes;
            if f.alive {
                let mut files: Vec<Digest> = f.header.chain.iter().map(|r| r.file).collect();
                files.push(*d);
                files.sort();
                files.dedup();
                for x in files {
                    *refs.entry(x).or_default() += 1;
                }
                if !f.writing && f.pins == 0 {
                    lru.insert((f.last_access, *d));
                }
            }
        }
        assert_eq!(used, self.used, "used bytes out of sync");
        assert_eq!(lru, self.lru, "eviction order out of sync");
        for (d, f) in &self.files {
            assert_eq!(f.refs, refs.get(d).copied().unwrap_or(0), "refs of file {}", file_name(*d));
            assert!(f.refs > 0 || f.pins > 0, "unreferenced file {} kept", file_name(*d));
        }
        for (uid, (d, i)) in &self.by_uid {
            let b = self.files.get(d).and_then(|f| f.header.blocks.get(*i as usize));
            assert!(b.is_some_and(|b| b.kind == BlockKind::Page && b.uid == *uid), "uid index out of sync");
        }
        let live = self.files.values().filter(|f| f.alive && !f.writing).count();
        assert_eq!(self.index.len(), live, "checkpoint index out of sync");
        self.index.check_invariants();
        for (d, f) in self.files.iter().filter(|(_, f)| f.alive && !f.writing) {
            assert!(self.index.holds(&f.header.key, *d), "file {} not indexed under its key", file_name(*d));
        }
    }
}

/// Reads and decodes a file's header; returns it with the file's length and modification time.
fn read_header(path: &Path, id: &DiskIdentity) -> Result<(FileHeader, u64, std::time::SystemTime), FormatError> {
    use std::io::Read;
    let malformed = |_| FormatError::Malformed("unreadable");
    let mut file = std::fs::File::open(path).map_err(malformed)?;
    let meta = file.metadata().map_err(malformed)?;
    let mut first = vec![0u8; UNIT_BYTES as usize];
    let n = file.read(&mut first).map_err(malformed)?;
    first.truncate(n);
    let len = FileHeader::declared_len(&first)?;
    if len > meta.len() || len > (64 << 20) {
        return Err(FormatError::Truncated { have: meta.len(), need: len });
    }
    let mut bytes = vec![0u8; len as usize];
    use std::io::Seek;
    file.seek(std::io::SeekFrom::Start(0)).map_err(malformed)?;
    file.read_exact(&mut bytes).map_err(malformed)?;
    let header = FileHeader::decode(&bytes, id)?;
    let need = header.data_end();
    if meta.len() < need {
        return Err(FormatError::Truncated { have: meta.len(), need });
    }
    Ok((header, meta.len(), meta.modified().unwrap_or(std::time::UNIX_EPOCH)))
}

/// Block bytes of a plan's source, as the host tier holds them.
pub fn source_extent(
    source: BlockSource,
    pages: &[HostExtent],
    tail: Option<HostExtent>,
    row: HostExtent,
) -> Option<HostExtent> {
    match source {
        BlockSource::Page(i) => pages.get(i).copied(),
        BlockSource::Tail => tail,
        BlockSource::Row => Some(row),
    }
}
