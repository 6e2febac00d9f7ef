//! Ports of the Linux `gpu_buddy` KUnit cases (docs/design.md, "The ledger"), plus a
//! property test against a simple model. Behaviour is ported from the case descriptions;
//! no kernel code is copied.

use ledger::buddy::{AllocFlags, Block, Buddy, BuddyError, BuddySpace, Words};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const PS: u64 = 4 * KIB;
const NONE: AllocFlags = AllocFlags::NONE;

fn total(blocks: &[Block]) -> u64 {
    blocks.iter().map(|b| b.size).sum()
}

fn alloc<S: Words>(
    mm: &mut Buddy<S>,
    start: u64,
    end: u64,
    size: u64,
    min: u64,
    flags: AllocFlags,
) -> Result<Vec<Block>, BuddyError> {
    let r = mm.alloc_blocks(start, end, size, min, flags, 0);
    mm.check().unwrap();
    r.map(Vec::from)
}

fn fini<S: Words>(mm: &mut Buddy<S>, blocks: &[Block]) {
    mm.free_blocks(blocks).unwrap();
    mm.check().unwrap();
    assert_eq!(mm.avail(), mm.size(), "leak");
    assert!(
        mm.free_list().iter().all(|b| mm.roots().contains(b)),
        "roots not whole again"
    );
}

/// Tiny deterministic PRNG for the randomised cases.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

#[test]
fn roots_layout() {
    let mm = BuddySpace::new(7 * MIB, PS).unwrap();
    let r: Vec<(u64, u64)> = mm.roots().iter().map(|b| (b.offset, b.size)).collect();
    assert_eq!(r, vec![(0, 4 * MIB), (4 * MIB, 2 * MIB), (6 * MIB, MIB)]);
    assert_eq!(mm.max_order(), 10);
    mm.check().unwrap();
    assert!(matches!(
        BuddySpace::new(PS, 2048),
        Err(BuddyError::InvalidArgument(_))
    ));
    assert!(matches!(
        BuddySpace::new(PS, 3 * PS),
        Err(BuddyError::InvalidArgument(_))
    ));
    assert!(matches!(
        BuddySpace::new(PS - 1, PS),
        Err(BuddyError::InvalidArgument(_))
    ));
    // size rounded down to the chunk
    assert_eq!(BuddySpace::new(PS * 3 + 100, PS).unwrap().size(), 3 * PS);
}

#[test]
fn region_view_and_attach() {
    let size = 7 * MIB;
    let len = ledger::buddy::layout_len(size, PS).unwrap();
    let mut region = vec![0u64; len];
    let b = {
        let mut mm = Buddy::init(&mut region[..], size, PS).unwrap();
        mm.alloc_blocks(0, size, 3 * PS, PS, NONE, 5).unwrap()
    };
    // a second "process" attaches to the same words and sees the same state
    let mm = Buddy::attach(&mut region[..]).unwrap();
    mm.check().unwrap();
    assert_eq!(mm.avail(), size - 3 * PS);
    assert_eq!(mm.owner_of(&b[0]), Some(5));
    assert!(matches!(
        Buddy::init(&mut region[..len - 1], size, PS),
        Err(BuddyError::RegionTooSmall { .. })
    ));
    let mut bad = region.clone();
    bad[0] ^= 1;
    assert!(matches!(
        Buddy::attach(&mut bad[..]),
        Err(BuddyError::Corrupt(_))
    ));
    // a stray bit in a bitmap (a node in two states) is caught by check()
    let mut bad = region.clone();
    let i = (ledger::buddy::HEADER_WORDS..len)
        .find(|&i| bad[i] != 0)
        .unwrap();
    bad[i] |= 1;
    let r = Buddy::attach(&mut bad[..]).and_then(|m| m.check());
    assert!(matches!(r, Err(BuddyError::Corrupt(_))), "{r:?}");
    let mut bad = region.clone();
    bad[2] += PS; // size changed under the layout
    assert!(matches!(
        Buddy::attach(&mut bad[..]),
        Err(BuddyError::Corrupt(_))
    ));
    // corrupting a bitmap word is caught by check()
    let mut bad = region.clone();
    // the first non-zero word after the header is the order-0 FREE bitmap
    let i = (ledger::buddy::HEADER_WORDS..len)
        .find(|&i| bad[i] != 0)
        .unwrap();
    bad[i] = 0;
    let r = Buddy::attach(&mut bad[..]).and_then(|m| m.check());
    assert!(matches!(r, Err(BuddyError::Corrupt(_))), "{r:?}");
}

/// Case 1: alloc_limit. A dense layout for 2^52 chunks cannot exist; the same code runs over
/// `SparseWords` (only non-zero words stored) with the real layout of the U64_MAX space.
#[test]
fn alloc_limit() {
    let mut mm = Buddy::new_sparse(u64::MAX, PS).unwrap();
    assert_eq!(mm.max_order(), 51);
    assert_eq!(mm.size(), !(PS - 1));
    assert_eq!(mm.roots().len(), 52);
    mm.check().unwrap();
    let size = 1u64 << 63;
    let b = alloc(&mut mm, 0, size, size, PS, NONE).unwrap();
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].order, 51);
    assert_eq!(b[0].offset, 0);
    assert_eq!(b[0].size, size);
    assert_eq!(mm.avail(), mm.size() - size);
    fini(&mut mm, &b);
    assert!(mm.into_inner().stored_words() < 10_000);
}

/// Case 2: optimistic.
#[test]
fn optimistic() {
    let size = PS * ((1 << 17) - 1);
    let mut mm = BuddySpace::new(size, PS).unwrap();
    assert_eq!(mm.max_order(), 16);
    assert_eq!(mm.roots().len(), 17);
    let mut held = Vec::new();
    for o in 0..=16 {
        let s = PS << o;
        let b = alloc(&mut mm, 0, size, s, s, NONE).unwrap_or_else(|e| panic!("order {o}: {e}"));
        assert_eq!(total(&b), s);
        held.extend(b);
    }
    assert_eq!(
        alloc(&mut mm, 0, size, PS, PS, NONE),
        Err(BuddyError::NoSpace)
    );
    fini(&mut mm, &held);
}

/// Case 3: pessimistic.
#[test]
fn pessimistic() {
    let max_order = 16;
    let size = PS << max_order;
    let mut mm = BuddySpace::new(size, PS).unwrap();
    let mut blocks = Vec::new();
    for o in 0..max_order {
        let s = PS << o;
        let b = alloc(&mut mm, 0, size, s, s, NONE).unwrap();
        assert_eq!(b.len(), 1);
        blocks.push(b[0]);
    }
    let extra = alloc(&mut mm, 0, size, PS, PS, NONE).unwrap();
    for o in (0..max_order).rev() {
        let s = PS << o;
        assert_eq!(
            alloc(&mut mm, 0, size, s, s, NONE),
            Err(BuddyError::NoSpace),
            "order {o}"
        );
    }
    mm.free_blocks(&extra).unwrap();
    for (order, b) in (1..).zip(blocks.iter()) {
        mm.free_block(b).unwrap();
        let s = PS << order;
        let t =
            alloc(&mut mm, 0, size, s, s, NONE).unwrap_or_else(|e| panic!("order {order}: {e}"));
        mm.free_blocks(&t).unwrap();
    }
    let all = alloc(&mut mm, 0, size, size, size, NONE).unwrap();
    assert_eq!(all.len(), 1);
    fini(&mut mm, &all);
}

/// Case 4: pathological.
#[test]
fn pathological() {
    let max_order = 3;
    let size = PS << max_order;
    let mut mm = BuddySpace::new(size, PS).unwrap();
    let mut blocks: Vec<Block> = Vec::new();
    let mut holes = Vec::new();
    for top in (1..=max_order).rev() {
        if !blocks.is_empty() {
            let b = blocks.remove(0);
            mm.free_block(&b).unwrap();
        }
        for o in (0..top).rev() {
            let s = PS << o;
            let b = alloc(&mut mm, 0, size, s, s, NONE)
                .unwrap_or_else(|e| panic!("top {top} order {o}: {e}"));
            blocks.push(b[0]);
        }
        let hole = alloc(&mut mm, 0, size, PS, PS, NONE).unwrap();
        holes.extend(hole);
        let s = PS << top;
        assert_eq!(
            alloc(&mut mm, 0, size, s, s, NONE),
            Err(BuddyError::NoSpace),
            "top {top}"
        );
    }
    mm.free_blocks(&holes).unwrap();
    for o in 1..=max_order {
        let s = PS << o;
        assert_eq!(
            alloc(&mut mm, 0, size, s, s, NONE),
            Err(BuddyError::NoSpace),
            "order {o}"
        );
    }
    fini(&mut mm, &blocks);
}

/// Case 5: alloc_contiguous.
#[test]
fn alloc_contiguous() {
    let n = 48u64;
    let size = n * PS;
    let mut mm = BuddySpace::new(size, PS).unwrap();
    assert_eq!(mm.roots().len(), 2);
    let (mut l, mut m, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let b = alloc(&mut mm, 0, size, PS, PS, NONE).unwrap();
        match i % 3 {
            0 => l.extend(b),
            1 => m.extend(b),
            _ => r.extend(b),
        }
    }
    let c = AllocFlags::CONTIGUOUS;
    assert_eq!(
        alloc(&mut mm, 0, size, 3 * PS, PS, c),
        Err(BuddyError::NoSpace)
    );
    mm.free_blocks(&m).unwrap();
    assert_eq!(
        alloc(&mut mm, 0, size, 3 * PS, PS, c),
        Err(BuddyError::NoSpace)
    );
    assert_eq!(
        alloc(&mut mm, 0, size, 2 * PS, PS, c),
        Err(BuddyError::NoSpace)
    );
    mm.free_blocks(&r).unwrap();
    assert_eq!(
        alloc(&mut mm, 0, size, 3 * PS, PS, c),
        Err(BuddyError::NoSpace)
    );
    let mut held = alloc(&mut mm, 0, size, 2 * PS, PS, c).unwrap();
    mm.free_blocks(&l).unwrap();
    held.extend(alloc(&mut mm, 0, size, 3 * PS, PS, c).unwrap());
    assert_eq!(total(&held), 5 * PS, "trim must leave exactly 5 pages");
    assert_eq!(mm.avail(), size - 5 * PS);
    fini(&mut mm, &held);
}

fn assert_inside(blocks: &[Block], start: u64, end: u64) {
    for b in blocks {
        assert!(
            b.offset >= start && b.offset + b.size <= end,
            "{b:?} outside [{start:#x}, {end:#x})"
        );
    }
}

/// Case 7: alloc_range.
#[test]
fn alloc_range() {
    let size = 16 * MIB;
    let mut mm = BuddySpace::new(size, PS).unwrap();

    // the full space as one exact range
    let all = alloc(&mut mm, 0, size, size, PS, NONE).unwrap();
    assert_inside(&all, 0, size);
    assert_eq!(total(&all), size);
    assert_eq!(mm.avail(), 0);
    assert_eq!(
        alloc(&mut mm, 0, PS, PS, PS, NONE),
        Err(BuddyError::NoSpace)
    );
    mm.free_blocks(&all).unwrap();
    assert_eq!(mm.avail(), size);

    // four quarters
    let q = size / 4;
    let mut held = Vec::new();
    for i in 0..4 {
        let b = alloc(&mut mm, i * q, (i + 1) * q, q, PS, NONE).unwrap();
        assert_inside(&b, i * q, (i + 1) * q);
        assert_eq!(total(&b), q);
        held.extend(b);
    }
    assert_eq!(mm.avail(), 0);
    mm.free_blocks(&held).unwrap();

    // single pages at the start, middle and end
    for off in [0, size / 2, size - PS] {
        let b = alloc(&mut mm, off, off + PS, PS, PS, NONE).unwrap();
        assert_eq!(
            b,
            vec![Block {
                offset: off,
                order: 0,
                size: PS
            }]
        );
        mm.free_blocks(&b).unwrap();
    }
    assert_eq!(mm.avail(), size);

    // a non-power-of-two space: each root, then the whole space across the roots
    {
        let s7 = 7 * MIB;
        let mut m7 = BuddySpace::new(s7, PS).unwrap();
        let mut h = Vec::new();
        for (off, len) in [(0, 4 * MIB), (4 * MIB, 2 * MIB), (6 * MIB, MIB)] {
            let b = alloc(&mut m7, off, off + len, len, PS, NONE).unwrap();
            assert_eq!(b.len(), 1);
            assert_eq!((b[0].offset, b[0].size), (off, len));
            h.extend(b);
        }
        m7.free_blocks(&h).unwrap();
        let b = alloc(&mut m7, 0, s7, s7, PS, NONE).unwrap();
        assert_eq!(b.len(), 3);
        assert_eq!(total(&b), s7);
        assert_eq!(m7.avail(), 0);
        fini(&mut m7, &b);
    }

    // 16 random contiguous slices allocated in random order
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for _ in 0..4 {
        let mut cuts: Vec<u64> = (0..15).map(|_| rng.below(size / PS) * PS).collect();
        cuts.push(0);
        cuts.push(size);
        cuts.sort();
        cuts.dedup();
        let mut slices: Vec<(u64, u64)> = cuts.windows(2).map(|w| (w[0], w[1])).collect();
        rng.shuffle(&mut slices);
        let mut h = Vec::new();
        for (s, e) in slices {
            let b = alloc(&mut mm, s, e, e - s, PS, NONE).unwrap();
            assert_inside(&b, s, e);
            assert_eq!(total(&b), e - s);
            h.extend(b);
        }
        assert_eq!(mm.avail(), 0);
        mm.free_blocks(&h).unwrap();
    }

    // first half taken
    let half = alloc(&mut mm, 0, size / 2, size / 2, PS, NONE).unwrap();
    assert_eq!(
        alloc(&mut mm, 0, size, size, PS, NONE),
        Err(BuddyError::NoSpace)
    );
    assert_eq!(
        alloc(&mut mm, 0, size / 2, size / 2, PS, NONE),
        Err(BuddyError::NoSpace)
    );
    let second = alloc(&mut mm, size / 2, size, size / 2, PS, NONE).unwrap();
    mm.free_blocks(&half).unwrap();
    mm.free_blocks(&second).unwrap();
    assert_eq!(mm.avail(), size);

    // 64 KiB checkerboard: even pages taken
    {
        let s = 64 * KIB;
        let mut mc = BuddySpace::new(s, PS).unwrap();
        let mut h = Vec::new();
        for p in (0..s / PS).step_by(2) {
            h.extend(alloc(&mut mc, p * PS, p * PS + PS, PS, PS, NONE).unwrap());
        }
        assert_eq!(
            alloc(&mut mc, 0, 2 * PS, 2 * PS, PS, NONE),
            Err(BuddyError::NoSpace)
        );
        h.extend(alloc(&mut mc, PS, 2 * PS, PS, PS, NONE).unwrap());
        fini(&mut mc, &h);
    }

    // misaligned and out-of-range requests are invalid
    let inv = |r: Result<Vec<Block>, BuddyError>| matches!(r, Err(BuddyError::InvalidArgument(_)));
    assert!(inv(alloc(&mut mm, PS / 2, PS / 2 + PS, PS, PS, NONE)));
    assert!(inv(alloc(&mut mm, 0, PS + 1, PS + 1, PS, NONE)));
    assert!(inv(alloc(&mut mm, size, size + PS, PS, PS, NONE)));

    // [4 MiB, 6 MiB) five times
    for _ in 0..5 {
        let b = alloc(&mut mm, 4 * MIB, 6 * MIB, 2 * MIB, PS, NONE).unwrap();
        assert_eq!(total(&b), 2 * MIB);
        mm.free_blocks(&b).unwrap();
        assert_eq!(mm.avail(), size);
    }

    // mixed sizes at their natural alignment, held together
    let mut h = Vec::new();
    for (off, len) in [
        (0, 4 * KIB),
        (64 * KIB, 64 * KIB),
        (MIB, MIB),
        (4 * MIB, 4 * MIB),
    ] {
        let b = alloc(&mut mm, off, off + len, len, PS, NONE).unwrap();
        assert_eq!(
            b,
            vec![Block {
                offset: off,
                order: (len / PS).trailing_zeros(),
                size: len
            }]
        );
        h.extend(b);
    }
    fini(&mut mm, &h);
}

/// Case 8: alloc_range_bias, for every chunk size from 4 KiB to 512 KiB and a few seeds.
#[test]
fn alloc_range_bias() {
    let r = AllocFlags::RANGE;
    for shift in 12..=19u32 {
        let ps = 1u64 << shift;
        for seed in 1..=3u64 {
            let mut rng = Rng(seed.wrapping_mul(0x2545f4914f6cdd1d) ^ ps);
            let size = (8 * MIB - 1) & !(ps - 1);
            let mut mm = BuddySpace::new(size, ps).unwrap();
            let bias = MIB;
            let count = size / bias;
            let mut order: Vec<u64> = (0..count).collect();
            rng.shuffle(&mut order);
            let mut held = Vec::new();
            for &i in &order {
                let (bs, be) = (i * bias, i * bias + bias);
                let mut rem = bias;
                assert!(
                    alloc(&mut mm, bs, be, bias + ps, bias, r).is_err(),
                    "round-up too big"
                );
                assert!(
                    alloc(&mut mm, bs, be, bias + ps, ps, r).is_err(),
                    "size too big"
                );
                assert!(
                    alloc(&mut mm, bs + ps, be, bias, ps, r).is_err(),
                    "range too small"
                );
                assert!(
                    alloc(&mut mm, bs + ps, be - ps, bias / 2, bias / 2, r).is_err(),
                    "misaligned"
                );
                let b = alloc(&mut mm, bs, be, bias, bias, r).unwrap();
                assert_inside(&b, bs, be);
                mm.free_blocks(&b).unwrap();
                let b = alloc(&mut mm, bs, be, ps, bias, r).unwrap();
                assert_inside(&b, bs, be);
                assert_eq!(total(&b), ps);
                mm.free_blocks(&b).unwrap();
                let s = (rng.below(rem).next_multiple_of(ps)).max(ps);
                let b = alloc(&mut mm, bs, be, s, ps, r).unwrap();
                assert_inside(&b, bs, be);
                assert_eq!(total(&b), s);
                held.extend(b);
                rem -= s;
                assert!(
                    alloc(&mut mm, bs, be, rem + ps, ps, r).is_err(),
                    "too big for avail"
                );
                if rem > 0 {
                    let s = (rng.below(rem).next_multiple_of(ps)).max(ps);
                    let b = alloc(&mut mm, bs, be, s, ps, r).unwrap();
                    assert_inside(&b, bs, be);
                    held.extend(b);
                }
            }
            fini(&mut mm, &held);

            // free-form: a random window that grows until it covers the space
            let mut held = Vec::new();
            let mut bs = rng.below(size - ps).next_multiple_of(ps);
            let mut be = (bs + rng.below(size - bs))
                .next_multiple_of(ps)
                .max(bs + ps)
                .min(size);
            let mut rem = be - bs;
            loop {
                let s = (rng.below(rem).next_multiple_of(ps)).max(ps);
                let b = alloc(&mut mm, bs, be, s, ps, r)
                    .unwrap_or_else(|e| panic!("[{bs:#x},{be:#x}) size {s:#x}: {e}"));
                assert_inside(&b, bs, be);
                held.extend(b);
                rem -= s;
                loop {
                    let (ob, oe) = (bs, be);
                    if bs > 0 {
                        bs -= rng.below(bs).next_multiple_of(ps);
                    }
                    if be != size {
                        be += rng.below(size - be).next_multiple_of(ps);
                    }
                    rem += (ob - bs) + (be - oe);
                    if rem != 0 || (bs == 0 && be == size) {
                        break;
                    }
                }
                if rem == 0 {
                    break;
                }
            }
            assert_eq!((bs, be), (0, size));
            assert_eq!(mm.avail(), 0);
            assert!(alloc(&mut mm, bs, be, ps, ps, r).is_err());
            fini(&mut mm, &held);
        }
    }
}

/// Case 10: exceeds_max_order.
#[test]
fn exceeds_max_order() {
    let size = 10 * GIB;
    let mut mm = BuddySpace::new(size, PS).unwrap();
    let b = alloc(&mut mm, 0, size, 9 * GIB, PS, AllocFlags::CONTIGUOUS).unwrap();
    assert_eq!(total(&b), 9 * GIB);
    let mut sorted = b.clone();
    sorted.sort();
    assert!(
        sorted
            .windows(2)
            .all(|w| w[0].offset + w[0].size == w[1].offset),
        "contiguous"
    );
    let inv = |r: Result<Vec<Block>, BuddyError>| matches!(r, Err(BuddyError::InvalidArgument(_)));
    assert!(inv(alloc(&mut mm, 0, size, 9 * GIB, 8 * GIB, NONE)));
    assert!(inv(alloc(
        &mut mm,
        0,
        size,
        9 * GIB,
        8 * GIB,
        AllocFlags::RANGE
    )));
    assert!(inv(alloc(
        &mut mm,
        0,
        size,
        9 * GIB,
        PS,
        AllocFlags::CONTIGUOUS | AllocFlags::RANGE
    )));
    fini(&mut mm, &b);
}

/// Case 11: offset_aligned_allocation.
#[test]
fn offset_aligned_allocation() {
    let size = 4 * MIB;
    let align = 256 * KIB;
    let mut mm = BuddySpace::new(size, PS).unwrap();
    for want in [8 * KIB, 16 * KIB] {
        let mut h = Vec::new();
        for _ in 0..16 {
            let b = alloc(&mut mm, 0, size, want, align, NONE).unwrap();
            assert_eq!(b.len(), 1);
            assert_eq!(b[0].size, want);
            assert_eq!(b[0].offset % align, 0);
            h.push(b[0]);
        }
        mm.free_blocks(&h).unwrap();
        assert_eq!(mm.avail(), size);
    }
    let mut h = Vec::new();
    for _ in 0..16 {
        h.push(alloc(&mut mm, 0, size, 8 * KIB, align, NONE).unwrap()[0]);
    }
    let (even, keep): (Vec<_>, Vec<_>) = h.iter().enumerate().partition(|(i, _)| i % 2 == 0);
    let even: Vec<Block> = even.into_iter().map(|(_, b)| *b).collect();
    mm.free_blocks(&even).unwrap();
    let mut keep: Vec<Block> = keep.into_iter().map(|(_, b)| *b).collect();
    for _ in 0..8 {
        let b = alloc(&mut mm, 0, size, 8 * KIB, align, NONE).unwrap();
        assert_eq!((b[0].size, b[0].offset % align), (8 * KIB, 0));
        keep.extend(b);
    }
    assert_eq!(
        alloc(&mut mm, 0, size, 8 * KIB, align, NONE),
        Err(BuddyError::NoSpace)
    );
    fini(&mut mm, &keep);
}

/// Case 12: subtree alignment stress.
#[test]
fn subtree_alignment_stress() {
    let size = 2 * MIB;
    let max_align = |mm: &BuddySpace| {
        mm.free_list()
            .iter()
            .map(|b| b.offset.trailing_zeros())
            .max()
            .unwrap_or(0)
    };
    let mut align = MIB;
    while align >= 8 * KIB {
        let mut mm = BuddySpace::new(size, PS).unwrap();
        let mut h = Vec::new();
        while let Ok(b) = alloc(&mut mm, 0, size, PS, align, NONE) {
            assert_eq!(b.len(), 1);
            assert_eq!(b[0].offset % align, 0);
            h.push(b[0]);
        }
        assert_eq!(h.len() as u64, size / align);
        assert_eq!(max_align(&mm), align.trailing_zeros() - 1);
        h.reverse();
        fini(&mut mm, &h);
        assert!(max_align(&mm) >= align.trailing_zeros());
        align /= 2;
    }
}

#[test]
fn topdown_default_and_owner() {
    let size = 7 * MIB;
    let mut mm = BuddySpace::new(size, PS).unwrap();
    // default: smallest sufficient order, highest offset -> the last page of the 1 MiB root
    let b = mm.alloc_blocks(0, size, PS, PS, NONE, 1).unwrap();
    assert_eq!(b[0].offset, size - PS);
    // default for 2 MiB: the 2 MiB root (smallest order holding one), not the top of the space
    let b2 = mm.alloc_blocks(0, size, 2 * MIB, PS, NONE, 2).unwrap();
    assert_eq!(b2[0].offset, 4 * MIB);
    // topdown picks the highest offset across orders
    let b3 = mm
        .alloc_blocks(0, size, 64 * KIB, PS, AllocFlags::TOPDOWN, 2)
        .unwrap();
    assert_eq!(b3[0].offset, 7 * MIB - 128 * KIB);
    // range picks the lowest address
    let b4 = mm.alloc_blocks(0, 6 * MIB, PS, PS, NONE, 3).unwrap();
    assert_eq!(b4[0].offset, 0);
    // trim disabled keeps the rounded block
    let b5 = mm
        .alloc_blocks(
            0,
            size,
            3 * PS,
            PS,
            AllocFlags::CONTIGUOUS | AllocFlags::TRIM_DISABLE,
            3,
        )
        .unwrap();
    assert_eq!(total(&b5), 4 * PS);
    mm.check().unwrap();
    assert_eq!(mm.blocks_of(2).len(), 2);
    assert_eq!(mm.free_owner(2), 2 * MIB + 64 * KIB);
    assert!(mm.blocks_of(2).is_empty());
    assert_eq!(mm.owner_of(&b[0]), Some(1));
    assert_eq!(mm.owner_of(&b2[0]), None);
    assert!(matches!(
        mm.free_block(&b2[0]),
        Err(BuddyError::InvalidArgument(_))
    ));
    mm.check().unwrap();
    mm.free_owner(1);
    mm.free_owner(3);
    assert_eq!(mm.avail(), size);
    mm.check().unwrap();
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Alloc {
            pages: u64,
            min_shift: u32,
            flags: u8,
            owner: u32,
            range: Option<(u64, u64)>,
        },
        Free {
            pick: usize,
        },
        FreeOwner {
            owner: u32,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u64..40, 0u32..4, 0u8..16, 0u32..4, proptest::option::of((0u64..60, 1u64..60)))
                .prop_map(|(pages, min_shift, flags, owner, range)| Op::Alloc {
                    pages, min_shift, flags, owner, range
                }),
            2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
            1 => (0u32..4).prop_map(|owner| Op::FreeOwner { owner }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
        #[test]
        fn random_ops_match_model(npages in 1u64..70, ops in proptest::collection::vec(op(), 1..60)) {
            let size = npages * PS;
            let mut mm = BuddySpace::new(size, PS).unwrap();
            let mut model: Vec<(Block, u32)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc { pages, min_shift, flags, owner, range } => {
                        let mut f = AllocFlags::NONE;
                        if flags & 1 != 0 { f = f | AllocFlags::CONTIGUOUS; }
                        if flags & 2 != 0 { f = f | AllocFlags::TOPDOWN; }
                        if flags & 4 != 0 { f = f | AllocFlags::TRIM_DISABLE; }
                        if flags & 8 != 0 { f = f | AllocFlags::RANGE; }
                        let (start, end) = match range {
                            Some((a, l)) => (a * PS, (a + l) * PS),
                            None => (0, size),
                        };
                        let want = pages * PS;
                        let min = PS << min_shift;
                        let avail = mm.avail();
                        let r = mm.alloc_blocks(start, end, want, min, f, owner);
                        match r {
                            Ok(bs) => {
                                prop_assert!(total(&bs) >= want);
                                if !f.contains(AllocFlags::TRIM_DISABLE) && min == PS {
                                    prop_assert_eq!(total(&bs), want);
                                }
                                if start != 0 || end != size {
                                    for b in &bs {
                                        prop_assert!(b.offset >= start && b.offset + b.size <= end);
                                    }
                                }
                                for b in &bs {
                                    prop_assert_eq!(b.offset % b.size, 0);
                                    for (m, _) in &model {
                                        prop_assert!(b.offset + b.size <= m.offset || m.offset + m.size <= b.offset);
                                    }
                                }
                                model.extend(bs.iter().map(|b| (*b, owner)));
                            }
                            Err(BuddyError::NoSpace) => {
                                // plain whole-space, chunk-granular requests fail only when short
                                if f == AllocFlags::NONE && min == PS && start == 0 && end == size {
                                    prop_assert!(want > avail);
                                }
                                prop_assert_eq!(mm.avail(), avail);
                            }
                            Err(BuddyError::InvalidArgument(_)) => prop_assert_eq!(mm.avail(), avail),
                            Err(e) => prop_assert!(false, "unexpected {e}"),
                        }
                    }
                    Op::Free { pick } => {
                        if !model.is_empty() {
                            let (b, _) = model.remove(pick % model.len());
                            mm.free_block(&b).unwrap();
                            prop_assert!(mm.free_block(&b).is_err(), "double free accepted");
                        }
                    }
                    Op::FreeOwner { owner } => {
                        let want: u64 = model.iter().filter(|(_, o)| *o == owner).map(|(b, _)| b.size).sum();
                        prop_assert_eq!(mm.free_owner(owner), want);
                        model.retain(|(_, o)| *o != owner);
                    }
                }
                mm.check().map_err(|e| TestCaseError::fail(e.to_string()))?;
                let used: u64 = model.iter().map(|(b, _)| b.size).sum();
                prop_assert_eq!(mm.avail(), mm.size() - used);
                let mut got = mm.allocated_blocks();
                got.sort();
                let mut want = model.clone();
                want.sort();
                prop_assert_eq!(got, want);
            }
            let all: Vec<Block> = model.iter().map(|(b, _)| *b).collect();
            mm.free_blocks(&all).unwrap();
            mm.check().unwrap();
            prop_assert_eq!(mm.avail(), mm.size());
        }
    }
}
