//! The bookkeeping of a paged KV cache: which fixed-size blocks of token slots each sequence
//! owns, and which full blocks other sequences may share because their prompts begin with the
//! same tokens (shared-prefix reuse, as vLLM's automatic prefix caching).
//!
//! Pure bookkeeping, no tensors: a block id indexes the `[num_blocks, kv_heads, block_size,
//! head_dim]` buffers of every layer, and slot `block * block_size + offset` is one token's
//! keys and values there ([`crate::ops::paged_kv_write`] writes them).
//!
//! Exactness: only full blocks are shared, and a block is found again only by the exact tokens
//! of the whole prefix before and in it — a block's key is (its parent block, that parent's
//! generation, its own tokens), and a block's generation changes whenever it is reused for
//! other tokens, so a key can never match a block whose prefix changed. No hash collisions: the
//! tokens themselves are the key. A sequence never writes into a shared block: its last,
//! partial block is its own, and at least one prompt token is always computed (the logits of
//! the last prompt token are needed), so a prompt that is entirely cached recomputes its last
//! block.

use std::collections::{BTreeMap, HashMap};

/// A block id in the pool.
pub type BlockId = u32;

/// The identity of a full block's contents: the block before it (and that block's
/// generation), and its own tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct BlockKey {
    parent: Option<(BlockId, u64)>,
    tokens: Vec<u32>,
}

/// Fixed-size blocks of KV slots with reference counts and a cache of full blocks by prefix.
///
/// A block is in one of three states: owned (reference count ≥ 1), cached (count 0, its
/// contents still findable by prefix, evicted least recently freed first), or empty (count 0,
/// no contents). Free blocks are the cached and the empty ones.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    ref_counts: Vec<u32>,
    /// Bumped each time a block is given other contents: keys naming an old generation of a
    /// parent are dead.
    generations: Vec<u64>,
    /// The key a full block is registered under, if any.
    keys: Vec<Option<BlockKey>>,
    cached: HashMap<BlockKey, BlockId>,
    /// Free blocks by the tick they were freed at: the first is evicted first.
    free: BTreeMap<u64, BlockId>,
    /// The tick of each free block in `free`.
    free_tick: Vec<Option<u64>>,
    tick: u64,
    /// Prompt tokens found in the cache, and prompt tokens asked for, since the pool was made.
    hits: u64,
    queried: u64,
}

/// One sequence's blocks: its tokens so far (prompt and generated) and the block of each
/// `block_size` of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceBlocks {
    /// Every token of the sequence whose slot has been given out.
    pub tokens: Vec<u32>,
    /// The sequence's blocks in order (the last may be partial).
    pub blocks: Vec<BlockId>,
    /// Leading tokens whose keys and values were found in the cache (a multiple of the block
    /// size): the prefill starts after them.
    pub cached: usize,
    /// Leading blocks registered in the cache (shared ones included).
    registered: usize,
    /// Leading tokens whose ids say what their keys and values are (all of a text prompt's;
    /// a vision-language prompt's up to its first image token, since every image's tokens
    /// carry the same id): only blocks within them are shared or registered.
    shareable: usize,
}

impl SequenceBlocks {
    /// Tokens in the sequence.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the sequence holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Tokens after the cached prefix: what a prefill of the sequence computes.
    pub fn uncached(&self) -> usize {
        self.len() - self.cached
    }

    /// The slot of token `i`.
    pub fn slot(&self, i: usize, block_size: usize) -> u32 {
        self.blocks[i / block_size] * block_size as u32 + (i % block_size) as u32
    }
}

impl BlockPool {
    /// `num_blocks` blocks of `block_size` slots, all empty.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "a block holds at least one token");
        let mut pool = BlockPool {
            block_size,
            ref_counts: vec![0; num_blocks],
            generations: vec![0; num_blocks],
            keys: vec![None; num_blocks],
            cached: HashMap::new(),
            free: BTreeMap::new(),
            free_tick: vec![None; num_blocks],
            tick: 0,
            hits: 0,
            queried: 0,
        };
        for b in 0..num_blocks as BlockId {
            pool.push_free(b);
        }
        pool
    }

    /// Slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks that can be given out (empty or cached).
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Prompt tokens found in the cache and prompt tokens asked for, over the pool's life.
    pub fn hit_counts(&self) -> (u64, u64) {
        (self.hits, self.queried)
    }

    /// A block's reference count (for tests and assertions).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Blocks needed for `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Leading tokens of `prompt` whose blocks the cache holds now (whole blocks, as
    /// [`BlockPool::admit`] would share them; nothing is taken).
    pub fn cached_prefix_len(&self, prompt: &[u32]) -> usize {
        let bs = self.block_size;
        let mut parent = None;
        let mut found = 0;
        for chunk in prompt.chunks(bs).take(prompt.len().saturating_sub(1) / bs) {
            let key = BlockKey {
                parent,
                tokens: chunk.to_vec(),
            };
            match self.cached.get(&key) {
                Some(&b) => {
                    found += bs;
                    parent = Some((b, self.generations[b as usize]));
                }
                None => break,
            }
        }
        found
    }

    /// Takes blocks for a new sequence whose first tokens are `prompt`, with room for
    /// `reserve` more tokens: the longest cached prefix of whole blocks is shared (leaving at
    /// least one prompt token to compute), fresh blocks cover the rest. `None`, with nothing
    /// taken, when the free blocks do not suffice.
    pub fn admit(&mut self, prompt: &[u32], reserve: usize) -> Option<SequenceBlocks> {
        self.admit_sharing(prompt, reserve, usize::MAX)
    }

    /// [`BlockPool::admit`] where only the first `shareable` tokens of `prompt` identify their
    /// keys and values (a vision-language prompt's, up to its first image token): blocks past
    /// them are neither shared nor, later, registered.
    pub fn admit_sharing(
        &mut self,
        prompt: &[u32],
        reserve: usize,
        shareable: usize,
    ) -> Option<SequenceBlocks> {
        let bs = self.block_size;
        // Whole blocks that may be shared: not the one holding the last prompt token, none
        // past the shareable tokens.
        let shareable_tokens = shareable.min(prompt.len());
        let shareable = (prompt.len().saturating_sub(1) / bs).min(shareable_tokens / bs);
        let mut shared: Vec<BlockId> = Vec::new();
        let mut parent = None;
        for chunk in prompt.chunks(bs).take(shareable) {
            let key = BlockKey {
                parent,
                tokens: chunk.to_vec(),
            };
            match self.cached.get(&key) {
                Some(&b) => {
                    shared.push(b);
                    parent = Some((b, self.generations[b as usize]));
                }
                None => break,
            }
        }
        let total = self.blocks_for(prompt.len() + reserve).max(shared.len());
        let fresh = total - shared.len();
        // Shared blocks that are free now count against the free blocks too.
        let shared_free = shared
            .iter()
            .filter(|&&b| self.ref_counts[b as usize] == 0)
            .count();
        if fresh + shared_free > self.free_blocks() {
            return None;
        }
        for &b in &shared {
            self.take(b);
        }
        let mut blocks = shared.clone();
        for _ in 0..fresh {
            blocks.push(self.take_fresh().expect("counted above"));
        }
        self.queried += prompt.len() as u64;
        self.hits += (shared.len() * bs) as u64;
        Some(SequenceBlocks {
            tokens: prompt.to_vec(),
            blocks,
            cached: shared.len() * bs,
            registered: shared.len(),
            shareable: shareable_tokens,
        })
    }

    /// A second sequence with `seq`'s tokens, all of them already computed (the first
    /// sequence's prefill serves both: GSPO's completions of one prompt), with room for
    /// `reserve` more tokens: `seq`'s full blocks are shared, its partial last block is given a
    /// fresh copy — returned as `(from, to)` for the caller to copy on the device — since each
    /// sequence writes its own continuation there. `None`, with nothing taken, when the free
    /// blocks do not suffice.
    pub fn fork(
        &mut self,
        seq: &SequenceBlocks,
        reserve: usize,
    ) -> Option<(SequenceBlocks, Option<(BlockId, BlockId)>)> {
        let bs = self.block_size;
        let full = seq.len() / bs;
        let total = self.blocks_for(seq.len() + reserve).max(full);
        if total - full > self.free_blocks() {
            return None;
        }
        let mut blocks: Vec<BlockId> = seq.blocks[..full].to_vec();
        for &b in &blocks {
            self.take(b);
        }
        let mut copy = None;
        for i in full..total {
            let b = self.take_fresh().expect("counted above");
            if i == full && !seq.len().is_multiple_of(bs) {
                copy = Some((seq.blocks[full], b));
            }
            blocks.push(b);
        }
        self.queried += seq.len() as u64;
        self.hits += seq.len() as u64;
        Some((
            SequenceBlocks {
                tokens: seq.tokens.clone(),
                blocks,
                cached: seq.len(),
                registered: seq.registered.min(full),
                shareable: seq.shareable,
            },
            copy,
        ))
    }

    /// Gives `seq` the slot of one more token, `token` (a fresh block when its blocks are
    /// full); `None`, with nothing changed, when no block is free.
    pub fn append(&mut self, seq: &mut SequenceBlocks, token: u32) -> Option<u32> {
        if seq.tokens.len() == seq.blocks.len() * self.block_size {
            let b = self.take_fresh()?;
            seq.blocks.push(b);
        }
        if seq.shareable == seq.tokens.len() {
            seq.shareable += 1;
        }
        seq.tokens.push(token);
        Some(seq.slot(seq.tokens.len() - 1, self.block_size))
    }

    /// Registers `seq`'s full blocks whose keys and values are now written (the first
    /// `written` tokens), so that later sequences with the same prefix share them. A block
    /// already registered under the same key by another sequence stays the one found.
    pub fn register(&mut self, seq: &mut SequenceBlocks, written: usize) {
        let bs = self.block_size;
        let full = written.min(seq.tokens.len()).min(seq.shareable) / bs;
        for i in seq.registered..full {
            let b = seq.blocks[i];
            let parent = (i > 0).then(|| {
                let p = seq.blocks[i - 1];
                (p, self.generations[p as usize])
            });
            let key = BlockKey {
                parent,
                tokens: seq.tokens[i * bs..(i + 1) * bs].to_vec(),
            };
            if self.keys[b as usize].is_none() && !self.cached.contains_key(&key) {
                self.cached.insert(key.clone(), b);
                self.keys[b as usize] = Some(key);
            }
        }
        seq.registered = seq.registered.max(full);
    }

    /// Returns `seq`'s blocks: each loses one reference; a block nobody holds becomes free,
    /// its contents kept findable until the block is needed again. The tail goes first, so
    /// the most shared blocks (a common prefix) are evicted last.
    pub fn release(&mut self, seq: SequenceBlocks) {
        for &b in seq.blocks.iter().rev() {
            let count = &mut self.ref_counts[b as usize];
            assert!(*count > 0, "block {b} released more often than taken");
            *count -= 1;
            if *count == 0 {
                self.push_free(b);
            }
        }
    }

    fn push_free(&mut self, b: BlockId) {
        self.tick += 1;
        self.free.insert(self.tick, b);
        self.free_tick[b as usize] = Some(self.tick);
    }

    /// Takes one more reference to `b` (off the free list if it was free).
    fn take(&mut self, b: BlockId) {
        if self.ref_counts[b as usize] == 0 {
            let tick = self.free_tick[b as usize].take().expect("a free block");
            self.free.remove(&tick);
        }
        self.ref_counts[b as usize] += 1;
    }

    /// The least recently freed block, its cached contents (if any) forgotten.
    fn take_fresh(&mut self) -> Option<BlockId> {
        let (&tick, &b) = self.free.iter().next()?;
        self.free.remove(&tick);
        self.free_tick[b as usize] = None;
        if let Some(key) = self.keys[b as usize].take() {
            self.cached.remove(&key);
        }
        self.generations[b as usize] += 1;
        self.ref_counts[b as usize] = 1;
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(n: usize, start: u32) -> Vec<u32> {
        (start..start + n as u32).collect()
    }

    #[test]
    fn a_sequence_gets_slots_in_its_blocks_and_returns_them() {
        let mut pool = BlockPool::new(8, 4);
        let mut s = pool.admit(&prompt(6, 0), 0).unwrap();
        assert_eq!((s.blocks.len(), s.cached), (2, 0));
        let slots: Vec<u32> = (0..6).map(|i| s.slot(i, 4)).collect();
        assert_eq!(slots[4], s.blocks[1] * 4);
        assert_eq!(pool.append(&mut s, 100), Some(s.blocks[1] * 4 + 2));
        pool.append(&mut s, 101).unwrap();
        // The ninth token needs a third block.
        let slot = pool.append(&mut s, 102).unwrap();
        assert_eq!((s.blocks.len(), slot), (3, s.blocks[2] * 4));
        assert_eq!(pool.free_blocks(), 5);
        pool.release(s);
        assert_eq!(pool.free_blocks(), 8);
    }

    #[test]
    fn a_shared_prompt_prefix_is_found_by_its_tokens_only() {
        let mut pool = BlockPool::new(16, 4);
        let p: Vec<u32> = prompt(10, 0);
        let mut a = pool.admit(&p, 4).unwrap();
        pool.register(&mut a, 10);
        // Same prompt: the two full blocks before the last token's block are shared (and
        // the lookup that routes a prompt says so, taking nothing).
        assert_eq!(pool.cached_prefix_len(&p), 8);
        assert_eq!(pool.hit_counts(), (0, 10));
        let b = pool.admit(&p, 4).unwrap();
        assert_eq!(b.cached, 8);
        assert_eq!(&b.blocks[..2], &a.blocks[..2]);
        assert_ne!(b.blocks[2], a.blocks[2]);
        assert_eq!(pool.ref_count(a.blocks[0]), 2);
        // A prompt differing in its second block shares the first only.
        let mut q = p.clone();
        q[5] = 999;
        assert_eq!(pool.cached_prefix_len(&q), 4);
        let c = pool.admit(&q, 0).unwrap();
        assert_eq!(c.cached, 4);
        // A prompt differing in its first token shares nothing, though its later blocks are
        // the same tokens.
        let mut r = p.clone();
        r[0] = 999;
        let d = pool.admit(&r, 0).unwrap();
        assert_eq!(d.cached, 0);
        assert_eq!(pool.hit_counts(), (12, 40));
        for s in [a, b, c, d] {
            pool.release(s);
        }
        assert_eq!(pool.free_blocks(), 16);
    }

    #[test]
    fn an_entirely_cached_prompt_still_computes_its_last_block() {
        let mut pool = BlockPool::new(8, 4);
        let p = prompt(8, 0);
        let mut a = pool.admit(&p, 0).unwrap();
        pool.register(&mut a, 8);
        let b = pool.admit(&p, 0).unwrap();
        assert_eq!(
            b.cached, 4,
            "the block of the last prompt token is computed again"
        );
        assert_ne!(b.blocks[1], a.blocks[1]);
    }

    #[test]
    fn released_blocks_stay_findable_until_evicted_and_never_match_after() {
        let mut pool = BlockPool::new(4, 2);
        let p = prompt(5, 0);
        let mut a = pool.admit(&p, 0).unwrap();
        pool.register(&mut a, 5);
        let first = a.blocks[0];
        pool.release(a);
        // Freed but cached: found again.
        let b = pool.admit(&p, 0).unwrap();
        assert_eq!((b.cached, b.blocks[0]), (4, first));
        pool.release(b);
        // Other prompts take every block: the cached contents are evicted.
        let c = pool.admit(&prompt(8, 50), 0).unwrap();
        assert_eq!(pool.free_blocks(), 0);
        pool.release(c);
        let d = pool.admit(&p, 0).unwrap();
        assert_eq!(d.cached, 0);
    }

    #[test]
    fn a_prefix_registered_again_after_eviction_is_found_only_as_far_as_registered() {
        // After eviction only what is registered again is found: here the first block.
        let mut pool = BlockPool::new(6, 2);
        let p = prompt(7, 0); // blocks [0,1] [2,3] [4,5] [6]
        let mut a = pool.admit(&p, 0).unwrap();
        pool.register(&mut a, 7);
        pool.release(a);
        // Evict everything, then register the first block's tokens alone again.
        let c = pool.admit(&prompt(12, 100), 0).unwrap();
        pool.release(c);
        let mut e = pool.admit(&p[..3], 0).unwrap();
        pool.register(&mut e, 3);
        let f = pool.admit(&p, 0).unwrap();
        assert_eq!(f.cached, 2, "only the re-registered first block is found");
        pool.release(e);
        pool.release(f);
    }

    #[test]
    fn a_fork_shares_full_blocks_and_copies_the_partial_one() {
        let mut pool = BlockPool::new(12, 4);
        let p = prompt(10, 0);
        let mut a = pool.admit(&p, 3).unwrap();
        pool.register(&mut a, 10);
        let (b, copy) = pool.fork(&a, 3).unwrap();
        assert_eq!(b.cached, 10);
        assert_eq!(&b.blocks[..2], &a.blocks[..2]);
        assert_eq!(copy, Some((a.blocks[2], b.blocks[2])));
        assert_ne!(b.blocks[2], a.blocks[2]);
        assert_eq!(b.blocks.len(), 4, "10 + 3 tokens");
        assert_eq!(pool.ref_count(a.blocks[0]), 2);
        // A prompt of whole blocks copies nothing.
        let q = prompt(8, 50);
        let c = pool.admit(&q, 0).unwrap();
        let (d, copy) = pool.fork(&c, 0).unwrap();
        assert_eq!((copy, d.blocks.clone()), (None, c.blocks.clone()));
        // Not enough blocks: nothing taken.
        let free = pool.free_blocks();
        assert!(pool.fork(&a, 100).is_none());
        assert_eq!(pool.free_blocks(), free);
        for s in [a, b, c, d] {
            pool.release(s);
        }
        assert_eq!(pool.free_blocks(), 12);
    }

    #[test]
    fn admission_takes_nothing_when_blocks_do_not_suffice() {
        let mut pool = BlockPool::new(3, 4);
        let a = pool.admit(&prompt(8, 0), 0).unwrap();
        assert!(pool.admit(&prompt(5, 0), 0).is_none());
        assert_eq!(pool.free_blocks(), 1);
        let mut b = pool.admit(&prompt(3, 0), 1).unwrap();
        assert_eq!(pool.free_blocks(), 0);
        assert!(
            pool.append(&mut b, 7).is_some(),
            "room reserved in its block"
        );
        assert!(pool.append(&mut b, 8).is_none());
        pool.release(a);
        pool.release(b);
        assert_eq!(pool.free_blocks(), 3);
    }
}
