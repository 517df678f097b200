//! Reservations: blocks set aside for a sequence's next tokens, so that a scheduler that
//! admitted a sequence knows its next appends cannot fail for lack of blocks, whatever the
//! other sequences do meanwhile.
//!
//! A reservation of `n` tokens for `(seq, layer)` holds exactly the blocks that appending `n`
//! tokens needs at that moment ([`PagedCache::blocks_needed`]: new blocks, and copies of the
//! shared blocks it would write). Other sequences' appends, imports and reservations see only
//! the unreserved free blocks; the sequence's own appends draw on its reservation first, and
//! each appended token uses one token of it. Calls that would make the held blocks too few
//! keep the promise or fail: a fork of the sequence (its written blocks become shared, so the
//! reserved appends would copy them) reserves the copies too, and a truncation recomputes what
//! the remaining tokens need; either fails with [`CacheError::PoolExhausted`], changing
//! nothing, when the pool cannot cover it. Freeing the sequence, or reserving 0 tokens,
//! returns the blocks.
//!
//! Reservations are scheduling state, not data: [`PagedCache::to_bytes`] and sequence exports
//! do not carry them.
//!
//! ```
//! use kvq_cache_layout::{CacheConfig, CacheError, PagedCache};
//!
//! // One layer, one head of 8 channels, 6 blocks of 4 tokens.
//! let mut cache = PagedCache::new(CacheConfig::new(1, 1, 8, 6).with_block_size(4).with_sink_tokens(0))?;
//! let (a, b) = (cache.create(), cache.create());
//! cache.reserve(a, 0, 8)?; // two blocks for a's next 8 tokens
//! let row = [0.5f32; 8];
//! while cache.append(b, 0, &row, &row).is_ok() {} // b takes what is left...
//! assert_eq!(cache.len(b, 0)?, 16);
//! for _ in 0..8 {
//!     cache.append(a, 0, &row, &row)?; // ...and a still gets its 8 tokens
//! }
//! assert!(matches!(cache.append(a, 0, &row, &row), Err(CacheError::PoolExhausted { .. })));
//! # Ok::<(), CacheError>(())
//! ```

use crate::SeqId;
use crate::cache::{LayerSeq, PagedCache, Reservation, WritePlan};
use crate::error::{CacheError, Result};
use crate::pool::BlockId;

impl PagedCache {
    /// Blocks held by every reservation.
    pub fn reserved_blocks(&self) -> usize {
        self.reserved
    }

    /// Free blocks that no reservation holds: what a new sequence can take.
    pub fn unreserved_blocks(&self) -> usize {
        self.pool.free_blocks() - self.reserved
    }

    /// Blocks an append to `layer` of `seq` may take: the unreserved free blocks and its own
    /// reservation.
    ///
    /// # Errors
    /// [`CacheError::UnknownSequence`], [`CacheError::Layer`].
    pub fn available_blocks(&self, seq: SeqId, layer: usize) -> Result<usize> {
        Ok(self.unreserved_blocks() + self.layer_seq(seq, layer)?.reserved.blocks)
    }

    /// The reservation of `layer` of `seq` (zero when it has none).
    ///
    /// # Errors
    /// [`CacheError::UnknownSequence`], [`CacheError::Layer`].
    pub fn reservation(&self, seq: SeqId, layer: usize) -> Result<Reservation> {
        Ok(self.layer_seq(seq, layer)?.reserved)
    }

    /// Sets aside the blocks that the next `tokens` tokens appended to `layer` of `seq` need,
    /// replacing its reservation (0 releases it). See the [module docs](self).
    ///
    /// # Errors
    /// [`CacheError::UnknownSequence`], [`CacheError::Layer`], [`CacheError::PoolExhausted`]
    /// when the unreserved free blocks and the reservation it replaces are too few; nothing
    /// changes on error.
    pub fn reserve(&mut self, seq: SeqId, layer: usize, tokens: usize) -> Result<()> {
        let blocks = self.check_reserve(seq, layer, tokens)?;
        let ls = &mut self.seqs.get_mut(&seq).expect("checked").layers[layer];
        self.reserved = self.reserved - ls.reserved.blocks + blocks;
        ls.reserved = Reservation { tokens, blocks };
        Ok(())
    }

    /// Whether [`PagedCache::reserve`] would succeed, without changing anything; the blocks it
    /// would hold.
    ///
    /// # Errors
    /// As [`PagedCache::reserve`].
    pub fn check_reserve(&self, seq: SeqId, layer: usize, tokens: usize) -> Result<usize> {
        let blocks = if tokens == 0 { 0 } else { self.blocks_needed(seq, layer, tokens)? };
        self.check_available(seq, layer, blocks)?;
        Ok(blocks)
    }

    /// Refuses a call on `layer` of `seq` that needs more blocks than it may take
    /// ([`PagedCache::available_blocks`]).
    pub(crate) fn check_available(&self, seq: SeqId, layer: usize, needed: usize) -> Result<()> {
        let free = self.available_blocks(seq, layer)?;
        if needed > free {
            return Err(CacheError::PoolExhausted { needed, free });
        }
        Ok(())
    }

    /// Blocks a reserved layer needs beyond what it holds once `ls` is in this state (after
    /// a truncation, or with every block shared after a fork: `all_shared`).
    pub(crate) fn reservation_shortfall(&self, ls: &LayerSeq, all_shared: bool) -> (usize, usize) {
        let r = ls.reserved;
        if r.tokens == 0 {
            return (0, 0);
        }
        let need = self.needed_for(ls, r.tokens, all_shared);
        (need, need.saturating_sub(r.blocks))
    }

    /// Whether [`PagedCache::fork`] of `seq` would succeed, without changing anything.
    ///
    /// # Errors
    /// As [`PagedCache::fork`].
    pub fn check_fork(&self, seq: SeqId) -> Result<()> {
        self.plan_fork(seq).map(|_| ())
    }

    /// The checks of a fork of `seq`; the extra blocks each layer's reservation then needs
    /// (the reserved appends will copy the written blocks the fork shares), checked against
    /// the unreserved free blocks.
    pub(crate) fn plan_fork(&self, seq: SeqId) -> Result<Vec<usize>> {
        let s = self.seqs.get(&seq).ok_or(CacheError::UnknownSequence(seq))?;
        if s.layers.iter().flat_map(|ls| &ls.blocks).any(|&id| !self.pool.can_retain(id)) {
            return Err(CacheError::Config(format!("a block of {seq:?} is shared by too many sequences")));
        }
        let extra: Vec<usize> = s.layers.iter().map(|ls| self.reservation_shortfall(ls, true).1).collect();
        let needed: usize = extra.iter().sum();
        if needed > self.unreserved_blocks() {
            return Err(CacheError::PoolExhausted { needed, free: self.unreserved_blocks() });
        }
        Ok(extra)
    }

    /// After a truncation of `seq` that leaves `layers` (not yet applied) and frees `freed`
    /// blocks: the blocks each reserved layer must then hold, checked against the pool.
    pub(crate) fn check_truncate_reservations(
        &self,
        seq: SeqId,
        layers: &[LayerSeq],
        freed: usize,
    ) -> Result<Vec<usize>> {
        let s = self.seqs.get(&seq).ok_or(CacheError::UnknownSequence(seq))?;
        let held: usize = s.layers.iter().map(|ls| ls.reserved.blocks).sum();
        let want: Vec<usize> = layers.iter().map(|ls| self.reservation_shortfall(ls, false).0).collect();
        let total: usize = want.iter().sum();
        // The pool once the truncation is done: its freed blocks back, this sequence's
        // reservations replaced by what they will need.
        let free = self.unreserved_blocks() + freed + held;
        if total > free {
            return Err(CacheError::PoolExhausted { needed: total, free });
        }
        Ok(want)
    }

    /// Blocks of `ids` that a release would return to the pool (held by no one else).
    pub(crate) fn freed_by_release(&self, ids: &[BlockId]) -> usize {
        ids.iter().filter(|&&id| self.pool.refcount(id) == 1).count()
    }

    /// [`PagedCache::blocks_needed`] for a layer state; with `all_shared`, as if every block
    /// it writes were shared.
    pub(crate) fn needed_for(&self, ls: &LayerSeq, n: usize, all_shared: bool) -> usize {
        let plan = WritePlan::new(&self.config, &self.parts, ls, n);
        let heads = self.config.kv_heads;
        let shared = (plan.first_written * heads..plan.have * heads)
            .filter(|&i| all_shared || self.pool.refcount(ls.blocks[i]) > 1)
            .count();
        (plan.want - plan.have) * heads + shared
    }
}
