//! Buddy allocator with Linux `gpu_buddy` semantics, stored in a fixed array of `u64` words.
//!
//! This module owns the bookkeeping of one device's quota space: which byte ranges are handed
//! out, to which owner slot, and which are free. It does *not* own the file format, slots,
//! locking or accounting rules (see the crate docs): it is a data structure over a word region.
//!
//! # Semantics
//! A space of `size` bytes (rounded down to a multiple of `chunk`; `chunk` ≥ 4 KiB, a power of
//! two) is split into roots: the power-of-two pieces of `size`, largest first, at ascending
//! offsets. Roots never merge. `max_order = log2(size) − log2(chunk)`. Blocks are split into
//! two buddies and merged back when both are free. [`Buddy::alloc_blocks`] mirrors
//! `gpu_buddy_alloc_blocks(start, end, size, min_block_size, flags)`:
//! * `start + size == end`: exact range; every maximal free block inside is taken, or
//!   [`BuddyError::NoSpace`] if any part is taken (nothing is left allocated on failure).
//! * otherwise blocks of decreasing order (each ≥ `min_block_size`) are taken until the size
//!   is covered; an order that fails is retried one order lower, down to the minimum order.
//!   Default placement takes the highest-offset free block of the smallest sufficient order and
//!   keeps the right child when splitting; [`AllocFlags::TOPDOWN`] takes the highest-offset free
//!   block of any sufficient order; [`AllocFlags::RANGE`] (implied when `[start, end)` is not
//!   the whole space) takes the lowest-address aligned position inside the range.
//! * [`AllocFlags::CONTIGUOUS`] rounds the size up to a power of two (and `min` to it); when
//!   that order does not exist or no such block is free (and RANGE is not set) it tries the
//!   "harder" path: from the highest-offset free block of order `log2(rounddown_pow2(size))`,
//!   take `[off, off + size)` and, if short, the part just below `off`.
//! * Unless [`AllocFlags::TRIM_DISABLE`], a rounded-up result is trimmed back to the request
//!   (the last block, when there are several); the freed tail returns to the free lists.
//!
//! # Layout (no pointers)
//! Everything lives in a caller-provided word region ([`Words`]), whose length is
//! [`layout_len`]`(size, chunk)`:
//! * a header (magic, version, size, chunk, avail, layout length);
//! * for every order `o` in `0..=max_order`, three hierarchical bitmaps indexed by
//!   `offset >> (log2(chunk) + o)`: FREE, SPLIT and ALLOCATED. A tree node (order, index) is in
//!   exactly one of them when it exists (its parent is split, or it is a root) and in none
//!   otherwise. Each bitmap has summary levels (bit *i* of level *l + 1* set iff word *i* of
//!   level *l* is non-zero), so "highest / lowest set bit at or after / before *i*" is
//!   O(log64 n) instead of a scan;
//! * one `u32` per chunk (two per word): `owner + 1` at the first chunk of every allocated
//!   block, `0` elsewhere.
//!
//! Alloc and free of one block are O(max_order · log64 n). [`Buddy::free_owner`] walks the
//! ALLOCATED bitmaps through their summaries (O(allocated blocks · log n)). [`Buddy::check`]
//! is O(existing tree nodes + non-zero words).
//!
//! # The `U64_MAX` space (kernel case alloc_limit)
//! A dense region for 2^52 chunks would need ~2^54 bytes. The algorithm is generic over
//! [`Words`], so the same code runs over [`SparseWords`], an ordered map that stores only the
//! non-zero words of the same layout (all-zero words are implicit). The alloc_limit test uses it
//! with the real layout of a `U64_MAX` space; nothing else is special-cased. A file-backed
//! ledger uses the dense slice form (`&mut [u64]`).

use std::collections::BTreeMap;
use thiserror::Error;

/// Smallest chunk size accepted.
pub const CHUNK_MIN: u64 = 4096;
/// First header word of an initialised region ("VGBUDDY1", little-endian).
pub const MAGIC: u64 = u64::from_le_bytes(*b"VGBUDDY1");
/// Layout version written in the header.
pub const LAYOUT_VERSION: u64 = 1;
/// Number of header words at the start of the region.
pub const HEADER_WORDS: usize = 8;
/// Owner slots are `u32` values below this (the stored form is `owner + 1`).
pub const OWNER_MAX: u32 = u32::MAX - 1;

const H_MAGIC: usize = 0;
const H_VERSION: usize = 1;
const H_SIZE: usize = 2;
const H_CHUNK: usize = 3;
const H_AVAIL: usize = 4;
const H_LEN: usize = 5;
const MAX_LEVELS: usize = 10;

/// Errors of the buddy allocator.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum BuddyError {
    /// The request itself is malformed (the kernel's `-EINVAL`).
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The request is well-formed but cannot be satisfied now (the kernel's `-ENOSPC`).
    #[error("no space")]
    NoSpace,
    /// The caller's region is shorter than the layout needs.
    #[error("region too small: need {need} words, have {have}")]
    RegionTooSmall { need: usize, have: usize },
    /// The region's contents violate an invariant.
    #[error("corrupt buddy state: {0}")]
    Corrupt(String),
}

/// Allocation flags, as in `gpu_buddy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocFlags(u32);

impl AllocFlags {
    pub const NONE: Self = Self(0);
    pub const RANGE: Self = Self(1 << 0);
    pub const TOPDOWN: Self = Self(1 << 1);
    pub const CONTIGUOUS: Self = Self(1 << 2);
    pub const TRIM_DISABLE: Self = Self(1 << 5);

    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for AllocFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

/// One allocated block: `size = chunk << order` bytes at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Block {
    pub offset: u64,
    pub order: u32,
    pub size: u64,
}

/// The blocks of one allocation, in the order they were taken. A single block (the usual
/// case) is held inline, without a heap allocation; more spill to a `Vec`. Derefs to
/// `[Block]`.
#[derive(Clone, Debug, Default)]
pub struct Blocks(BlocksRepr);

#[derive(Clone, Debug, Default)]
enum BlocksRepr {
    #[default]
    Empty,
    One(Block),
    Many(Vec<Block>),
}

impl Blocks {
    /// No blocks.
    #[inline]
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a block.
    #[inline(always)]
    pub fn push(&mut self, b: Block) {
        match &mut self.0 {
            BlocksRepr::Empty => self.0 = BlocksRepr::One(b),
            BlocksRepr::One(a) => self.0 = BlocksRepr::Many(vec![*a, b]),
            BlocksRepr::Many(v) => v.push(b),
        }
    }

    /// Removes and returns the last block.
    #[inline]
    pub fn pop(&mut self) -> Option<Block> {
        match &mut self.0 {
            BlocksRepr::Empty => None,
            BlocksRepr::One(a) => {
                let a = *a;
                self.0 = BlocksRepr::Empty;
                Some(a)
            }
            BlocksRepr::Many(v) => v.pop(),
        }
    }

    /// The blocks as a `Vec`.
    #[inline]
    pub fn into_vec(self) -> Vec<Block> {
        match self.0 {
            BlocksRepr::Empty => Vec::new(),
            BlocksRepr::One(a) => vec![a],
            BlocksRepr::Many(v) => v,
        }
    }
}

impl std::ops::Deref for Blocks {
    type Target = [Block];
    #[inline]
    fn deref(&self) -> &[Block] {
        match &self.0 {
            BlocksRepr::Empty => &[],
            BlocksRepr::One(a) => std::slice::from_ref(a),
            BlocksRepr::Many(v) => v,
        }
    }
}

impl PartialEq for Blocks {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Blocks {}

impl Extend<Block> for Blocks {
    #[inline]
    fn extend<I: IntoIterator<Item = Block>>(&mut self, iter: I) {
        iter.into_iter().for_each(|b| self.push(b));
    }
}

impl From<Blocks> for Vec<Block> {
    #[inline]
    fn from(blocks: Blocks) -> Self {
        blocks.into_vec()
    }
}

/// The owning iterator of [`Blocks`].
pub struct BlocksIntoIter(Result<std::option::IntoIter<Block>, std::vec::IntoIter<Block>>);

impl Iterator for BlocksIntoIter {
    type Item = Block;
    #[inline]
    fn next(&mut self) -> Option<Block> {
        match &mut self.0 {
            Ok(one) => one.next(),
            Err(many) => many.next(),
        }
    }
}

impl IntoIterator for Blocks {
    type Item = Block;
    type IntoIter = BlocksIntoIter;
    #[inline]
    fn into_iter(self) -> BlocksIntoIter {
        BlocksIntoIter(match self.0 {
            BlocksRepr::Empty => Ok(None.into_iter()),
            BlocksRepr::One(a) => Ok(Some(a).into_iter()),
            BlocksRepr::Many(v) => Err(v.into_iter()),
        })
    }
}

impl<'a> IntoIterator for &'a Blocks {
    type Item = &'a Block;
    type IntoIter = std::slice::Iter<'a, Block>;
    #[inline]
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// A word-addressable region holding the allocator state.
pub trait Words {
    /// Number of words.
    fn len(&self) -> usize;
    /// Whether the region has no words.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Word `i` (`i < len()`).
    fn get(&self, i: usize) -> u64;
    /// Set word `i` (`i < len()`).
    fn set(&mut self, i: usize, v: u64);
    /// Index of the first non-zero word in `[from, to)`.
    fn next_nonzero(&self, from: usize, to: usize) -> Option<usize>;
    /// Zero every word.
    fn zero_all(&mut self);
}

fn slice_next_nonzero(s: &[u64], from: usize, to: usize) -> Option<usize> {
    let to = to.min(s.len());
    if from >= to {
        return None;
    }
    s[from..to].iter().position(|&w| w != 0).map(|p| p + from)
}

impl Words for [u64] {
    fn len(&self) -> usize {
        <[u64]>::len(self)
    }
    fn get(&self, i: usize) -> u64 {
        self[i]
    }
    fn set(&mut self, i: usize, v: u64) {
        self[i] = v;
    }
    fn next_nonzero(&self, from: usize, to: usize) -> Option<usize> {
        slice_next_nonzero(self, from, to)
    }
    fn zero_all(&mut self) {
        self.fill(0);
    }
}

impl Words for Vec<u64> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn get(&self, i: usize) -> u64 {
        self[i]
    }
    fn set(&mut self, i: usize, v: u64) {
        self[i] = v;
    }
    fn next_nonzero(&self, from: usize, to: usize) -> Option<usize> {
        slice_next_nonzero(self, from, to)
    }
    fn zero_all(&mut self) {
        self.fill(0);
    }
}

impl<T: Words + ?Sized> Words for &mut T {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn get(&self, i: usize) -> u64 {
        (**self).get(i)
    }
    fn set(&mut self, i: usize, v: u64) {
        (**self).set(i, v)
    }
    fn next_nonzero(&self, from: usize, to: usize) -> Option<usize> {
        (**self).next_nonzero(from, to)
    }
    fn zero_all(&mut self) {
        (**self).zero_all()
    }
}

/// A region of `len` words of which only the non-zero ones are stored. Same layout as the
/// dense form; used where a dense region cannot exist (a `U64_MAX` space).
#[derive(Clone, Debug, Default)]
pub struct SparseWords {
    len: usize,
    map: BTreeMap<usize, u64>,
}

impl SparseWords {
    /// An all-zero region of `len` words.
    pub fn new(len: usize) -> Self {
        Self {
            len,
            map: BTreeMap::new(),
        }
    }
    /// Number of words actually stored.
    pub fn stored_words(&self) -> usize {
        self.map.len()
    }
}

impl Words for SparseWords {
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self, i: usize) -> u64 {
        assert!(i < self.len, "word index out of range");
        self.map.get(&i).copied().unwrap_or(0)
    }
    fn set(&mut self, i: usize, v: u64) {
        assert!(i < self.len, "word index out of range");
        if v == 0 {
            self.map.remove(&i);
        } else {
            self.map.insert(i, v);
        }
    }
    fn next_nonzero(&self, from: usize, to: usize) -> Option<usize> {
        if from >= to {
            return None;
        }
        self.map.range(from..to).next().map(|(&k, _)| k)
    }
    fn zero_all(&mut self) {
        self.map.clear();
    }
}

/// A hierarchical bitmap's place in the region.
#[derive(Clone, Copy, Debug)]
struct Bitmap {
    nbits: u64,
    nlevels: usize,
    off: [usize; MAX_LEVELS],
    words: [usize; MAX_LEVELS],
}

#[derive(Clone, Copy, Debug)]
struct OrderMaps {
    free: Bitmap,
    split: Bitmap,
    alloc: Bitmap,
}

/// Derived geometry: a pure function of (size, chunk); lives in the process, not the region.
/// A process that works on one space often computes it once ([`Geometry::for_space`]) and
/// attaches views with [`Buddy::attach_with`].
#[derive(Clone, Debug)]
pub struct Geometry {
    size: u64,
    chunk: u64,
    cs: u32,
    nchunks: u64,
    max_order: u32,
    orders: Vec<OrderMaps>,
    owner_off: usize,
    owner_words: usize,
    len: usize,
}

fn to_usize(v: u64) -> Result<usize, BuddyError> {
    usize::try_from(v).map_err(|_| BuddyError::InvalidArgument("layout does not fit in usize"))
}

impl AsRef<Geometry> for Geometry {
    fn as_ref(&self) -> &Geometry {
        self
    }
}

impl Geometry {
    /// The geometry of a space of `size` bytes in chunks of `chunk`.
    pub fn for_space(size: u64, chunk: u64) -> Result<Self, BuddyError> {
        Self::new(size, chunk)
    }

    fn new(size: u64, chunk: u64) -> Result<Self, BuddyError> {
        if chunk < CHUNK_MIN || !chunk.is_power_of_two() {
            return Err(BuddyError::InvalidArgument(
                "chunk must be a power of two >= 4 KiB",
            ));
        }
        if size < chunk {
            return Err(BuddyError::InvalidArgument("size smaller than chunk"));
        }
        let size = size & !(chunk - 1);
        let cs = chunk.trailing_zeros();
        let nchunks = size >> cs;
        let max_order = (63 - size.leading_zeros()) - cs;
        let mut pos: u64 = HEADER_WORDS as u64;
        let bitmap = |nbits: u64, pos: &mut u64| -> Result<Bitmap, BuddyError> {
            let mut b = Bitmap {
                nbits,
                nlevels: 0,
                off: [0; MAX_LEVELS],
                words: [0; MAX_LEVELS],
            };
            let mut bits = nbits;
            loop {
                let words = bits.div_ceil(64);
                if b.nlevels == MAX_LEVELS {
                    return Err(BuddyError::InvalidArgument("bitmap too deep"));
                }
                b.off[b.nlevels] = to_usize(*pos)?;
                b.words[b.nlevels] = to_usize(words)?;
                b.nlevels += 1;
                *pos = pos
                    .checked_add(words)
                    .ok_or(BuddyError::InvalidArgument("layout overflows"))?;
                if words <= 1 {
                    break;
                }
                bits = words;
            }
            Ok(b)
        };
        let mut orders = Vec::with_capacity(max_order as usize + 1);
        for o in 0..=max_order {
            let nbits = ((nchunks - 1) >> o) + 1;
            let free = bitmap(nbits, &mut pos)?;
            let split = bitmap(nbits, &mut pos)?;
            let alloc = bitmap(nbits, &mut pos)?;
            orders.push(OrderMaps { free, split, alloc });
        }
        let owner_off = to_usize(pos)?;
        let owner_words = nchunks.div_ceil(2);
        let len = pos
            .checked_add(owner_words)
            .ok_or(BuddyError::InvalidArgument("layout overflows"))?;
        Ok(Self {
            size,
            chunk,
            cs,
            nchunks,
            max_order,
            orders,
            owner_off,
            owner_words: to_usize(owner_words)?,
            len: to_usize(len)?,
        })
    }

    fn is_root(&self, o: u32, idx: u64) -> bool {
        (self.nchunks >> o) & 1 == 1 && idx == ((self.nchunks >> (o + 1)) << 1)
    }
}

/// Number of `u64` words a region for a space of `size` bytes in `chunk`-byte chunks needs.
pub fn layout_len(size: u64, chunk: u64) -> Result<usize, BuddyError> {
    Ok(Geometry::new(size, chunk)?.len)
}

// ---- hierarchical bitmap primitives ----
// The single-bit ones are forced inline: an alloc/free pair of one chunk runs dozens of them,
// and inlined (each call site with its own branches) the pair took 12 % less time.

#[inline(always)]
fn bm_get<S: Words + ?Sized>(s: &S, b: &Bitmap, bit: u64) -> bool {
    debug_assert!(bit < b.nbits);
    (s.get(b.off[0] + (bit >> 6) as usize) >> (bit & 63)) & 1 == 1
}

#[inline(always)]
fn bm_set<S: Words + ?Sized>(s: &mut S, b: &Bitmap, bit: u64) {
    debug_assert!(bit < b.nbits);
    let mut bit = bit;
    for l in 0..b.nlevels {
        let wi = b.off[l] + (bit >> 6) as usize;
        let old = s.get(wi);
        s.set(wi, old | (1u64 << (bit & 63)));
        if old != 0 {
            break;
        }
        bit >>= 6;
    }
}

#[inline(always)]
fn bm_clear<S: Words + ?Sized>(s: &mut S, b: &Bitmap, bit: u64) {
    debug_assert!(bit < b.nbits);
    let mut bit = bit;
    for l in 0..b.nlevels {
        let wi = b.off[l] + (bit >> 6) as usize;
        let new = s.get(wi) & !(1u64 << (bit & 63));
        s.set(wi, new);
        if new != 0 {
            break;
        }
        bit >>= 6;
    }
}

/// From the set summary bit `bit` at `level`, descend to level 0 along the lowest (or,
/// `highest`, the highest) set bit of each word below; returns the bit found at level 0.
/// A damaged region (a summary bit past the level's end or over an empty word, a stray bit
/// past the last one) yields nothing rather than an index out of bounds; check() reports it.
#[inline]
fn bm_descend<S: Words + ?Sized>(
    s: &S,
    b: &Bitmap,
    mut level: usize,
    mut bit: u64,
    highest: bool,
) -> Option<u64> {
    let pick = |w: u64| if highest { 63 - w.leading_zeros() } else { w.trailing_zeros() } as u64;
    while level > 0 {
        level -= 1;
        if bit >= b.words[level] as u64 {
            return None;
        }
        let w = s.get(b.off[level] + bit as usize);
        if w == 0 {
            return None;
        }
        bit = (bit << 6) | pick(w);
    }
    (bit < b.nbits).then_some(bit)
}

/// Lowest set bit `>= from`.
fn bm_next<S: Words + ?Sized>(s: &S, b: &Bitmap, from: u64) -> Option<u64> {
    if from >= b.nbits {
        return None;
    }
    let mut level = 0;
    let mut pos = from;
    loop {
        let w_idx = pos >> 6;
        if w_idx >= b.words[level] as u64 {
            return None;
        }
        let w = s.get(b.off[level] + w_idx as usize) & (!0u64 << (pos & 63));
        if w != 0 {
            return bm_descend(s, b, level, (w_idx << 6) | w.trailing_zeros() as u64, false);
        }
        if level + 1 >= b.nlevels {
            return None;
        }
        level += 1;
        pos = w_idx + 1;
    }
}

/// Highest set bit `<= from`.
fn bm_prev<S: Words + ?Sized>(s: &S, b: &Bitmap, from: u64) -> Option<u64> {
    let mut level = 0;
    let mut pos = from.min(b.nbits.checked_sub(1)?);
    loop {
        let w_idx = pos >> 6;
        let sh = pos & 63;
        let mask = if sh == 63 {
            !0u64
        } else {
            (1u64 << (sh + 1)) - 1
        };
        let w = s.get(b.off[level] + w_idx as usize) & mask;
        if w != 0 {
            return bm_descend(s, b, level, (w_idx << 6) | (63 - w.leading_zeros()) as u64, true);
        }
        if level + 1 >= b.nlevels || w_idx == 0 {
            return None;
        }
        level += 1;
        pos = w_idx - 1;
    }
}

/// Highest set bit: straight down from the single top-level word (one read when empty).
#[inline(always)]
fn bm_last<S: Words + ?Sized>(s: &S, b: &Bitmap) -> Option<u64> {
    let top = b.nlevels.checked_sub(1)?;
    let w = s.get(b.off[top]);
    if w == 0 {
        return None;
    }
    bm_descend(s, b, top, (63 - w.leading_zeros()) as u64, true)
}

/// Verify summary consistency and stray bits; return the number of set bits.
fn bm_check<S: Words + ?Sized>(s: &S, b: &Bitmap, what: &str) -> Result<u64, BuddyError> {
    let mut count = 0u64;
    for l in 0..b.nlevels {
        let (off, words) = (b.off[l], b.words[l]);
        let bits_here = if l == 0 {
            b.nbits
        } else {
            b.words[l - 1] as u64
        };
        let mut from = off;
        while let Some(wi) = s.next_nonzero(from, off + words) {
            let w = s.get(wi);
            let i = (wi - off) as u64;
            let valid = bits_here - i * 64;
            if valid < 64 && (w >> valid) != 0 {
                return Err(BuddyError::Corrupt(format!(
                    "{what}: stray bits past the end at level {l}"
                )));
            }
            if l == 0 {
                count += w.count_ones() as u64;
            } else {
                let mut bits = w;
                while bits != 0 {
                    let c = i * 64 + bits.trailing_zeros() as u64;
                    if s.get(b.off[l - 1] + c as usize) == 0 {
                        return Err(BuddyError::Corrupt(format!(
                            "{what}: summary bit set over an empty word at level {l}"
                        )));
                    }
                    bits &= bits - 1;
                }
            }
            if l + 1 < b.nlevels && !(s.get(b.off[l + 1] + (i >> 6) as usize) >> (i & 63)) & 1 == 1
            {
                return Err(BuddyError::Corrupt(format!(
                    "{what}: non-empty word without summary bit at level {l}"
                )));
            }
            from = wi + 1;
        }
    }
    Ok(count)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Alloc,
}

/// A buddy space over a word region `S` (`Vec<u64>`, `&mut [u64]`, [`SparseWords`]).
#[derive(Debug)]
pub struct Buddy<S, G: AsRef<Geometry> = Geometry> {
    s: S,
    g: G,
}

/// The owned, heap-backed form (tests, tools).
pub type BuddySpace = Buddy<Vec<u64>>;

impl BuddySpace {
    /// A fresh space over its own `Vec<u64>`.
    pub fn new(size: u64, chunk: u64) -> Result<Self, BuddyError> {
        let len = layout_len(size, chunk)?;
        Buddy::init(vec![0u64; len], size, chunk)
    }
}

impl Buddy<SparseWords> {
    /// A fresh space over a [`SparseWords`] region (only non-zero words stored).
    pub fn new_sparse(size: u64, chunk: u64) -> Result<Self, BuddyError> {
        let len = layout_len(size, chunk)?;
        Buddy::init(SparseWords::new(len), size, chunk)
    }
}

impl<S: Words> Buddy<S, Geometry> {
    /// Initialise `region` as an empty space (all roots free). The region must hold at least
    /// [`layout_len`] words; its previous contents are discarded.
    pub fn init(mut region: S, size: u64, chunk: u64) -> Result<Self, BuddyError> {
        let g = Geometry::new(size, chunk)?;
        if region.len() < g.len {
            return Err(BuddyError::RegionTooSmall {
                need: g.len,
                have: region.len(),
            });
        }
        region.zero_all();
        region.set(H_MAGIC, MAGIC);
        region.set(H_VERSION, LAYOUT_VERSION);
        region.set(H_SIZE, g.size);
        region.set(H_CHUNK, g.chunk);
        region.set(H_AVAIL, g.size);
        region.set(H_LEN, g.len as u64);
        let mut b = Self { s: region, g };
        for (o, idx) in b.root_nodes() {
            let bm = &b.g.as_ref().orders[o as usize].free;
            bm_set(&mut b.s, bm, idx);
        }
        Ok(b)
    }

    /// Attach to a region initialised earlier (possibly by another process). The header is
    /// validated; run [`Buddy::check`] to validate the rest.
    pub fn attach(region: S) -> Result<Self, BuddyError> {
        if region.len() < HEADER_WORDS {
            return Err(BuddyError::RegionTooSmall {
                need: HEADER_WORDS,
                have: region.len(),
            });
        }
        if region.get(H_MAGIC) != MAGIC {
            return Err(BuddyError::Corrupt("bad magic".into()));
        }
        if region.get(H_VERSION) != LAYOUT_VERSION {
            return Err(BuddyError::Corrupt("unknown layout version".into()));
        }
        let (size, chunk) = (region.get(H_SIZE), region.get(H_CHUNK));
        let g = Geometry::new(size, chunk)
            .map_err(|e| BuddyError::Corrupt(format!("header geometry: {e}")))?;
        if g.size != size {
            return Err(BuddyError::Corrupt("size not a multiple of chunk".into()));
        }
        if region.get(H_LEN) != g.len as u64 {
            return Err(BuddyError::Corrupt("layout length mismatch".into()));
        }
        if region.len() < g.len {
            return Err(BuddyError::RegionTooSmall {
                need: g.len,
                have: region.len(),
            });
        }
        if region.get(H_AVAIL) > g.size {
            return Err(BuddyError::Corrupt("avail exceeds size".into()));
        }
        Ok(Self { s: region, g })
    }
}

impl<S: Words, G: AsRef<Geometry>> Buddy<S, G> {
    /// Attach to a region initialised earlier with a geometry computed beforehand (cheaper
    /// than [`Buddy::attach`] when the same space is attached often). The header must match
    /// the geometry.
    // Inlined: small and on every ledger operation; returned through memory, its result
    // stalled the caller (a store-forwarding stall showed in profiles).
    #[inline(always)]
    pub fn attach_with(region: S, geometry: G) -> Result<Self, BuddyError> {
        let g = geometry.as_ref();
        if region.len() < g.len.max(HEADER_WORDS) {
            return Err(BuddyError::RegionTooSmall { need: g.len.max(HEADER_WORDS), have: region.len() });
        }
        if region.get(H_MAGIC) != MAGIC || region.get(H_VERSION) != LAYOUT_VERSION {
            return Err(BuddyError::Corrupt("bad magic or layout version".into()));
        }
        if region.get(H_SIZE) != g.size || region.get(H_CHUNK) != g.chunk || region.get(H_LEN) != g.len as u64 {
            return Err(BuddyError::Corrupt("header does not match the expected geometry".into()));
        }
        if region.get(H_AVAIL) > g.size {
            return Err(BuddyError::Corrupt("avail exceeds size".into()));
        }
        Ok(Self { s: region, g: geometry })
    }

    /// Give the region back.
    pub fn into_inner(self) -> S {
        self.s
    }

    /// Managed size in bytes (rounded down to the chunk).
    pub fn size(&self) -> u64 {
        self.g.as_ref().size
    }
    /// Chunk size in bytes.
    pub fn chunk(&self) -> u64 {
        self.g.as_ref().chunk
    }
    /// Largest order.
    pub fn max_order(&self) -> u32 {
        self.g.as_ref().max_order
    }
    /// Free bytes.
    pub fn avail(&self) -> u64 {
        self.s.get(H_AVAIL)
    }

    fn set_avail(&mut self, v: u64) {
        self.s.set(H_AVAIL, v);
    }

    fn root_nodes(&self) -> Vec<(u32, u64)> {
        (0..=self.g.as_ref().max_order)
            .rev()
            .filter(|&o| (self.g.as_ref().nchunks >> o) & 1 == 1)
            .map(|o| (o, (self.g.as_ref().nchunks >> (o + 1)) << 1))
            .collect()
    }

    /// The roots, largest first at ascending offsets.
    pub fn roots(&self) -> Vec<Block> {
        self.root_nodes()
            .into_iter()
            .map(|(o, i)| self.block(o, i))
            .collect()
    }

    fn block(&self, o: u32, idx: u64) -> Block {
        Block {
            offset: idx << (self.g.as_ref().cs + o),
            order: o,
            size: self.g.as_ref().chunk << o,
        }
    }

    fn owner_get(&self, c: u64) -> u32 {
        let w = self.s.get(self.g.as_ref().owner_off + (c >> 1) as usize);
        (w >> ((c & 1) * 32)) as u32
    }

    fn owner_set(&mut self, c: u64, stored: u32) {
        let wi = self.g.as_ref().owner_off + (c >> 1) as usize;
        let sh = (c & 1) * 32;
        let w = self.s.get(wi) & !(0xffff_ffffu64 << sh);
        self.s.set(wi, w | ((stored as u64) << sh));
    }

    /// The owner slot of an allocated block, if `b` is one.
    pub fn owner_of(&self, b: &Block) -> Option<u32> {
        let (o, idx) = self.node_of(b).ok()?;
        if !bm_get(&self.s, &self.g.as_ref().orders[o as usize].alloc, idx) {
            return None;
        }
        self.owner_get(idx << o).checked_sub(1)
    }

    fn node_of(&self, b: &Block) -> Result<(u32, u64), BuddyError> {
        if b.order > self.g.as_ref().max_order || b.size != self.g.as_ref().chunk << b.order {
            return Err(BuddyError::InvalidArgument("bad block order or size"));
        }
        if b.offset >= self.g.as_ref().size || b.offset & (b.size - 1) != 0 {
            return Err(BuddyError::InvalidArgument("bad block offset"));
        }
        Ok((b.order, b.offset >> (self.g.as_ref().cs + b.order)))
    }

    /// The free or allocated tree leaf containing chunk `c`.
    fn leaf(&self, c: u64) -> Result<(u32, u64, State), BuddyError> {
        debug_assert!(c < self.g.as_ref().nchunks);
        let d = c ^ self.g.as_ref().nchunks;
        let mut o = 63 - d.leading_zeros();
        loop {
            let idx = c >> o;
            let m = &self.g.as_ref().orders[o as usize];
            // Most nodes on the way down are split: test that first.
            if o > 0 && bm_get(&self.s, &m.split, idx) {
                o -= 1;
                continue;
            }
            if bm_get(&self.s, &m.free, idx) {
                return Ok((o, idx, State::Free));
            }
            if bm_get(&self.s, &m.alloc, idx) {
                return Ok((o, idx, State::Alloc));
            }
            return Err(BuddyError::Corrupt(format!(
                "no tree leaf covers chunk {c}"
            )));
        }
    }

    /// Carve the order-`o` block at chunk `pos` out of the free block (`k`, `idx`) that
    /// contains it, and mark it allocated to `stored` (owner + 1).
    #[inline(always)] // its Block, returned through memory, stalled the callers' copies
    fn take(&mut self, mut k: u32, mut idx: u64, o: u32, pos: u64, stored: u32) -> Block {
        let g = self.g.as_ref();
        bm_clear(&mut self.s, &g.orders[k as usize].free, idx);
        // Split down to order `o` along `pos`: each split node's child off the path is free.
        while k > o {
            bm_set(&mut self.s, &g.orders[k as usize].split, idx);
            k -= 1;
            idx = pos >> k;
            bm_set(&mut self.s, &g.orders[k as usize].free, idx ^ 1);
        }
        bm_set(&mut self.s, &g.orders[o as usize].alloc, idx);
        self.owner_set(pos, stored);
        let b = self.block(o, idx);
        // Saturating: `avail` lives in the shared region, where damage can leave it too low
        // (check() reports the mismatch).
        let a = self.avail().saturating_sub(b.size);
        self.set_avail(a);
        b
    }

    /// Free an allocated node and merge upwards.
    fn release(&mut self, mut o: u32, mut idx: u64) {
        let m = &self.g.as_ref().orders[o as usize];
        bm_clear(&mut self.s, &m.alloc, idx);
        self.owner_set(idx << o, 0);
        let a = self.avail().saturating_add(self.g.as_ref().chunk << o);
        self.set_avail(a);
        while !self.g.as_ref().is_root(o, idx) {
            let m = &self.g.as_ref().orders[o as usize];
            if !bm_get(&self.s, &m.free, idx ^ 1) {
                break;
            }
            bm_clear(&mut self.s, &m.free, idx ^ 1);
            idx >>= 1;
            o += 1;
            let sp = &&self.g.as_ref().orders[o as usize].split;
            bm_clear(&mut self.s, sp, idx);
        }
        let m = &self.g.as_ref().orders[o as usize];
        bm_set(&mut self.s, &m.free, idx);
    }

    /// Free one allocated block (merging with free buddies).
    pub fn free_block(&mut self, b: &Block) -> Result<(), BuddyError> {
        let (o, idx) = self.node_of(b)?;
        if !bm_get(&self.s, &self.g.as_ref().orders[o as usize].alloc, idx) {
            return Err(BuddyError::InvalidArgument("block is not allocated"));
        }
        self.release(o, idx);
        Ok(())
    }

    /// Free a list of allocated blocks; stops at the first that is not allocated.
    pub fn free_blocks(&mut self, blocks: &[Block]) -> Result<(), BuddyError> {
        blocks.iter().try_for_each(|b| self.free_block(b))
    }

    /// Every allocated block with its owner, in (order, offset) order.
    pub fn allocated_blocks(&self) -> Vec<(Block, u32)> {
        let mut out = Vec::new();
        for o in 0..=self.g.as_ref().max_order {
            let bm = &&self.g.as_ref().orders[o as usize].alloc;
            let mut from = 0;
            while let Some(i) = bm_next(&self.s, bm, from) {
                let owner = self.owner_get(i << o).wrapping_sub(1);
                out.push((self.block(o, i), owner));
                from = i + 1;
            }
        }
        out
    }

    /// Every free block, in (order, offset) order.
    pub fn free_list(&self) -> Vec<Block> {
        let mut out = Vec::new();
        for o in 0..=self.g.as_ref().max_order {
            let bm = &&self.g.as_ref().orders[o as usize].free;
            let mut from = 0;
            while let Some(i) = bm_next(&self.s, bm, from) {
                out.push(self.block(o, i));
                from = i + 1;
            }
        }
        out
    }

    /// The blocks allocated to `owner`.
    pub fn blocks_of(&self, owner: u32) -> Vec<Block> {
        self.allocated_blocks()
            .into_iter()
            .filter(|&(_, w)| w == owner)
            .map(|(b, _)| b)
            .collect()
    }

    /// Free exactly the blocks of `owner`; returns the bytes freed.
    pub fn free_owner(&mut self, owner: u32) -> u64 {
        let mine = self.blocks_of(owner);
        let mut bytes = 0;
        for b in &mine {
            if let Ok((o, idx)) = self.node_of(b) {
                self.release(o, idx);
                bytes += b.size;
            }
        }
        bytes
    }

    /// The first piece of the decomposition of `[p, end)` (chunks) into maximal free blocks:
    /// the free leaf (order, index) holding chunk `p` and the piece's order; `None` when chunk
    /// `p` is taken or beyond the space.
    fn range_piece(&self, p: u64, end: u64) -> Result<Option<(u32, u64, u32)>, BuddyError> {
        if p >= self.g.as_ref().nchunks {
            return Ok(None);
        }
        let (k, idx, st) = self.leaf(p)?;
        if st == State::Alloc {
            return Ok(None);
        }
        let be = ((idx + 1) << k).min(end);
        let mut j = k.min(p.trailing_zeros());
        while p + (1u64 << j) > be {
            j -= 1;
        }
        Ok(Some((k, idx, j)))
    }

    /// How much of `[start, start + n)` (chunks) is free: the chunks before the first taken
    /// one (or the end of the space), and whether that is the whole range.
    fn range_free(&self, start: u64, n: u64) -> Result<(u64, bool), BuddyError> {
        let end = start.saturating_add(n);
        let mut p = start;
        while p < end {
            match self.range_piece(p, end)? {
                Some((_, _, j)) => p += 1u64 << j,
                None => return Ok((p - start, false)),
            }
        }
        Ok((n, true))
    }

    /// Exact range `[start, start + n)` in chunks, all or nothing: its maximal free blocks go
    /// to `out`. Taking a piece only splits the leaf that held it, and the next piece lies in a
    /// free node of at least its order, so the pieces are the ones the range had before the
    /// first was taken (no plan needs to be kept).
    fn alloc_exact(
        &mut self,
        start: u64,
        n: u64,
        stored: u32,
        out: &mut Blocks,
    ) -> Result<(), BuddyError> {
        if !self.range_free(start, n)?.1 {
            return Err(BuddyError::NoSpace);
        }
        let end = start.saturating_add(n);
        let mut p = start;
        while p < end {
            let Some((k, idx, j)) = self.range_piece(p, end)? else {
                return Err(BuddyError::Corrupt("planned range no longer free".into()));
            };
            out.push(self.take(k, idx, j, p, stored));
            p += 1u64 << j;
        }
        Ok(())
    }

    /// Highest-offset free block of the smallest order >= `order` (or, `topdown`, of any such
    /// order); split keeping the right child.
    fn alloc_freetree(&mut self, order: u32, topdown: bool, stored: u32) -> Option<Block> {
        let mut best: Option<(u32, u64)> = None;
        for k in order..=self.g.as_ref().max_order {
            if let Some(i) = bm_last(&self.s, &self.g.as_ref().orders[k as usize].free) {
                match best {
                    Some((bk, bi)) if (bi << bk) >= (i << k) => {}
                    _ => best = Some((k, i)),
                }
                if !topdown {
                    break;
                }
            }
        }
        let (k, i) = best?;
        let pos = ((i + 1) << k) - (1u64 << order);
        Some(self.take(k, i, order, pos, stored))
    }

    /// Lowest-address order-`order` position inside `[start, end)` (chunks) that is free.
    fn alloc_range_bias(&mut self, order: u32, start: u64, end: u64, stored: u32) -> Option<Block> {
        let end = end.min(self.g.as_ref().nchunks);
        if start >= end {
            return None;
        }
        let sz = 1u64 << order;
        let first_pos = start.checked_next_multiple_of(sz)?;
        let mut best: Option<(u64, u32, u64)> = None;
        for k in order..=self.g.as_ref().max_order {
            let bm = &&self.g.as_ref().orders[k as usize].free;
            let last_idx = (end - 1) >> k;
            let mut from = start >> k;
            while let Some(i) = bm_next(&self.s, bm, from) {
                if i > last_idx {
                    break;
                }
                let b = i << k;
                let p = b.max(first_pos);
                if p + sz <= ((i + 1) << k).min(end) {
                    if best.is_none_or(|(bp, _, _)| p < bp) {
                        best = Some((p, k, i));
                    }
                    break;
                }
                from = i + 1;
            }
        }
        let (p, k, i) = best?;
        Some(self.take(k, i, order, p, stored))
    }

    /// Shrink the allocated block `b` to its first `new` chunks; the tail becomes free.
    fn trim(
        &mut self,
        b: &Block,
        new: u64,
        stored: u32,
        out: &mut Blocks,
    ) -> Result<(), BuddyError> {
        let (o, idx) = self.node_of(b)?;
        bm_clear(&mut self.s, &self.g.as_ref().orders[o as usize].alloc, idx);
        self.owner_set(idx << o, 0);
        bm_set(&mut self.s, &self.g.as_ref().orders[o as usize].free, idx);
        let a = self.avail().saturating_add(b.size);
        self.set_avail(a);
        self.alloc_exact(idx << o, new, stored, out)
    }

    fn release_all(&mut self, blocks: &[Block]) {
        for b in blocks {
            if let Ok((o, idx)) = self.node_of(b) {
                if bm_get(&self.s, &self.g.as_ref().orders[o as usize].alloc, idx) {
                    self.release(o, idx);
                }
            }
        }
    }

    /// The "harder" contiguous path: `size` and `min` in chunks.
    fn contig_try_harder(
        &mut self,
        size: u64,
        min: u64,
        stored: u32,
    ) -> Result<Blocks, BuddyError> {
        let order = 63 - size.leading_zeros();
        if order > self.g.as_ref().max_order {
            return Err(BuddyError::NoSpace);
        }
        let bm = self.g.as_ref().orders[order as usize].free; // a copy: self is borrowed mutably below
        let mut cursor = bm_last(&self.s, &bm);
        while let Some(i) = cursor {
            let start = i << order;
            let (filled, complete) = self.range_free(start, size)?;
            let mut rhs = Blocks::new();
            self.alloc_exact(start, filled, stored, &mut rhs)?; // free: range_free said so
            if complete {
                return Ok(rhs);
            }
            let lhs = (size - filled).max(min).next_multiple_of(min);
            if let Some(lstart) = start.checked_sub(lhs) {
                let mut l = Blocks::new();
                if self.alloc_exact(lstart, lhs, stored, &mut l).is_ok() {
                    l.extend(rhs);
                    return Ok(l);
                }
            }
            self.release_all(&rhs);
            cursor = if i == 0 {
                None
            } else {
                bm_prev(&self.s, &bm, i - 1)
            };
        }
        Err(BuddyError::NoSpace)
    }

    /// Allocate `size` bytes within `[start, end)` in blocks of at least `min_block_size`,
    /// owned by slot `owner`, as `gpu_buddy_alloc_blocks` does (see the module docs). The
    /// blocks come in the order they were taken ([`Blocks`]: a single block, the usual result,
    /// needs no heap allocation).
    pub fn alloc_blocks(
        &mut self,
        start: u64,
        end: u64,
        size: u64,
        min_block_size: u64,
        flags: AllocFlags,
        owner: u32,
    ) -> Result<Blocks, BuddyError> {
        use BuddyError::InvalidArgument as Inv;
        let g = self.g.as_ref();
        if owner > OWNER_MAX {
            return Err(Inv("owner slot out of range"));
        }
        if size < g.chunk {
            return Err(Inv("size smaller than chunk"));
        }
        if min_block_size < g.chunk || !min_block_size.is_power_of_two() {
            return Err(Inv("min_block_size must be a power of two >= chunk"));
        }
        if (start | end | size) & (g.chunk - 1) != 0 {
            return Err(Inv("start, end and size must be chunk-aligned"));
        }
        if end > g.size {
            return Err(Inv("end beyond the space"));
        }
        if start >= g.size || size > g.size - start {
            return Err(Inv("range overflows the space"));
        }
        let (cs, space, max_order) = (g.cs, g.size, g.max_order);
        let stored = owner + 1;
        if start + size == end {
            if (start | end) & (min_block_size - 1) != 0 {
                return Err(Inv("exact range not aligned to min_block_size"));
            }
            let mut got = Blocks::new();
            self.alloc_exact(start >> cs, size >> cs, stored, &mut got)?;
            return Ok(got);
        }
        let mut flags = flags;
        if start != 0 || end != space {
            flags = flags | AllocFlags::RANGE;
        }
        let contiguous = flags.contains(AllocFlags::CONTIGUOUS);
        let range = flags.contains(AllocFlags::RANGE);
        let (orig_size, orig_min) = (size, min_block_size);
        let (size, min) = if contiguous {
            match size.checked_next_power_of_two() {
                Some(p) => (Some(p), p),
                None => (None, min_block_size),
            }
        } else {
            // Rounded up to a multiple of the power of two `min_block_size` with a mask (a
            // 64-bit division showed in profiles); `None` exactly when that overflows.
            let mask = min_block_size - 1;
            (size.checked_add(mask).map(|s| s & !mask), min_block_size)
        };
        let too_big = match size {
            Some(s) => s > space || (63 - (s >> cs).leading_zeros()) > max_order,
            None => true,
        };
        if too_big {
            if contiguous && !range {
                return self.contig_try_harder(orig_size >> cs, orig_min >> cs, stored);
            }
            return Err(Inv("request exceeds the largest order"));
        }
        let size = size.unwrap_or(0);
        let mut pages = size >> cs;
        let min_order = min.trailing_zeros() - cs;
        let mut order = 63 - pages.leading_zeros();
        let mut got = Blocks::new();
        loop {
            order = order.min(63 - pages.leading_zeros());
            let block = loop {
                let b = if range {
                    self.alloc_range_bias(order, start >> cs, end >> cs, stored)
                } else {
                    self.alloc_freetree(order, flags.contains(AllocFlags::TOPDOWN), stored)
                };
                if let Some(b) = b {
                    break b;
                }
                if order == min_order {
                    self.release_all(&got);
                    if contiguous && !range {
                        return self.contig_try_harder(orig_size >> cs, orig_min >> cs, stored);
                    }
                    return Err(BuddyError::NoSpace);
                }
                order -= 1;
            };
            pages -= 1u64 << order;
            got.push(block);
            if pages == 0 {
                break;
            }
        }
        if !flags.contains(AllocFlags::TRIM_DISABLE) && orig_size != size {
            if let Some(last) = got.pop() {
                let excess = size - orig_size;
                let keep = (last.size - excess) >> cs;
                self.trim(&last, keep, stored, &mut got)?;
            }
        }
        Ok(got)
    }

    /// Verify every invariant of the region: header, summaries, one state per existing node,
    /// no stray node bits, no two free buddies, owners exactly on allocated blocks, avail.
    pub fn check(&self) -> Result<(), BuddyError> {
        let corrupt = |m: String| Err(BuddyError::Corrupt(m));
        let g = self.g.as_ref();
        if self.s.get(H_MAGIC) != MAGIC || self.s.get(H_VERSION) != LAYOUT_VERSION {
            return corrupt("header magic/version".into());
        }
        if self.s.get(H_SIZE) != g.size || self.s.get(H_CHUNK) != g.chunk {
            return corrupt("header geometry changed".into());
        }
        let n = g.max_order as usize + 1;
        let (mut nfree, mut nsplit, mut nalloc) = (vec![0u64; n], vec![0u64; n], vec![0u64; n]);
        let (mut free_bytes, mut alloc_bytes) = (0u64, 0u64);
        let mut stack = self.root_nodes();
        stack.reverse();
        while let Some((o, idx)) = stack.pop() {
            let m = &self.g.as_ref().orders[o as usize];
            let f = bm_get(&self.s, &m.free, idx);
            let s = bm_get(&self.s, &m.split, idx);
            let a = bm_get(&self.s, &m.alloc, idx);
            if (f as u8 + s as u8 + a as u8) != 1 {
                return corrupt(format!(
                    "node order {o} index {idx}: {f}/{s}/{a} free/split/alloc"
                ));
            }
            let bytes = g.chunk << o;
            if f {
                nfree[o as usize] += 1;
                free_bytes += bytes;
                if !g.is_root(o, idx) && bm_get(&self.s, &m.free, idx ^ 1) {
                    return corrupt(format!("free buddies not merged at order {o} index {idx}"));
                }
            } else if a {
                nalloc[o as usize] += 1;
                alloc_bytes += bytes;
                if self.owner_get(idx << o) == 0 {
                    return corrupt(format!(
                        "allocated block order {o} index {idx} has no owner"
                    ));
                }
            } else {
                if o == 0 {
                    return corrupt(format!("order-0 node {idx} is split"));
                }
                nsplit[o as usize] += 1;
                stack.push(((o - 1), (idx << 1) | 1));
                stack.push(((o - 1), idx << 1));
            }
        }
        for o in 0..=g.max_order {
            let m = &self.g.as_ref().orders[o as usize];
            let i = o as usize;
            for (bm, want, what) in [
                (m.free, nfree[i], "free"),
                (m.split, nsplit[i], "split"),
                (m.alloc, nalloc[i], "alloc"),
            ] {
                let have = bm_check(&self.s, &bm, what)?;
                if have != want {
                    return corrupt(format!(
                        "order {o} {what} bitmap holds {have} bits, tree has {want} such nodes"
                    ));
                }
            }
        }
        // owners: exactly one non-zero entry per allocated block
        let mut owners = 0u64;
        let mut from = g.owner_off;
        while let Some(wi) = self.s.next_nonzero(from, g.owner_off + g.owner_words) {
            let w = self.s.get(wi);
            owners += (w as u32 != 0) as u64 + ((w >> 32) as u32 != 0) as u64;
            from = wi + 1;
        }
        if owners != nalloc.iter().sum::<u64>() {
            return corrupt("owner entries outside allocated blocks".into());
        }
        if free_bytes + alloc_bytes != g.size {
            return corrupt("tree leaves do not cover the space".into());
        }
        if free_bytes != self.avail() {
            return corrupt(format!(
                "avail {} but free blocks sum to {free_bytes}",
                self.avail()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Block, Blocks};

    #[test]
    fn blocks_hold_one_inline_and_more_on_the_heap() {
        let b = |i: u64| Block { offset: i << 12, order: 0, size: 4096 };
        let mut blocks = Blocks::new();
        assert!(blocks.is_empty());
        blocks.push(b(1));
        assert_eq!(&*blocks, &[b(1)]);
        blocks.extend([b(2), b(3)]);
        assert_eq!(&*blocks, &[b(1), b(2), b(3)]);
        assert_eq!(blocks.pop(), Some(b(3)));
        assert_eq!(blocks.iter().copied().collect::<Vec<_>>(), vec![b(1), b(2)]);
        assert_eq!(blocks.clone().into_iter().collect::<Vec<_>>(), vec![b(1), b(2)]);
        let mut one = Blocks::new();
        one.push(b(1));
        let mut spilled = Blocks::new();
        spilled.extend([b(1), b(2)]);
        spilled.pop();
        assert_eq!(one, spilled, "equal contents compare equal whatever the representation");
        assert_eq!(one.pop(), Some(b(1)));
        assert_eq!(one.pop(), None);
        assert_eq!(Vec::from(spilled), vec![b(1)]);
    }
}
