//! The block pool: a flat arena of fixed-size blocks addressed by id, with a free list and
//! reference counts. Allocation and release are O(1) (a stack pop and push), as in vLLM's and
//! mistral.rs's block pools; the arena is allocated once, at its full capacity.

use crate::error::{CacheError, Result};

/// Index of a block in the pool.
pub type BlockId = u32;

/// The most blocks a pool can hold: every id fits a [`BlockId`].
pub const MAX_BLOCKS: usize = BlockId::MAX as usize;

/// A fixed-capacity arena of equally sized blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockPool {
    block_bytes: usize,
    arena: Vec<u8>,
    refcount: Vec<u32>,
    /// Free ids, the next to hand out last.
    free: Vec<BlockId>,
}

impl BlockPool {
    /// A pool of `capacity` blocks of `block_bytes` bytes each, all free.
    ///
    /// # Errors
    /// [`CacheError::Config`] when `capacity` exceeds [`MAX_BLOCKS`] or the arena's size
    /// overflows; [`CacheError::Alloc`] when the memory cannot be had (nothing is allocated
    /// then).
    pub fn new(capacity: usize, block_bytes: usize) -> Result<Self> {
        let arena = arena_bytes(capacity, block_bytes)?;
        let arena = zeroed(arena, "the block pool's arena")?;
        let refcount = zeroed(capacity, "the block pool's reference counts")?;
        let mut free = Vec::new();
        free.try_reserve_exact(capacity)
            .map_err(|_| CacheError::Alloc { what: "the block pool's free list", bytes: capacity * 4 })?;
        free.extend((0..capacity as BlockId).rev());
        Ok(Self { block_bytes, arena, refcount, free })
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.refcount.len()
    }

    /// Free blocks.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// References held on `id`.
    pub fn refcount(&self, id: BlockId) -> u32 {
        self.refcount[id as usize]
    }

    /// Takes a free block (zeroed, refcount 1), or `None` when the pool is exhausted.
    pub(crate) fn alloc(&mut self) -> Option<BlockId> {
        let id = self.free.pop()?;
        self.refcount[id as usize] = 1;
        Some(id)
    }

    /// Adds a reference (a fork shares the block). The caller has checked with
    /// [`BlockPool::can_retain`] that the count does not overflow.
    pub(crate) fn retain(&mut self, id: BlockId) {
        self.refcount[id as usize] += 1;
    }

    /// Whether one more reference to `id` can be counted.
    pub(crate) fn can_retain(&self, id: BlockId) -> bool {
        self.refcount[id as usize] < u32::MAX
    }

    /// Drops a reference; the block returns to the free list when none are left.
    pub(crate) fn release(&mut self, id: BlockId) {
        let rc = &mut self.refcount[id as usize];
        debug_assert!(*rc > 0, "release of a free block");
        *rc -= 1;
        if *rc == 0 {
            // Free blocks are kept zeroed, so that a pool's state is its live data alone
            // (an offloaded and reloaded cache compares equal to the original).
            self.block_mut(id).fill(0);
            self.free.push(id);
        }
    }

    /// The whole arena, every block back to back (block `id` at `id × block_bytes`): for
    /// memory advice such as huge pages (`kvq_kernels_simd::advise_huge_pages`), which is best
    /// given right after [`BlockPool::new`], before any block is written.
    pub fn arena(&self) -> &[u8] {
        &self.arena
    }

    /// The bytes of block `id`.
    pub fn block(&self, id: BlockId) -> &[u8] {
        let s = id as usize * self.block_bytes;
        &self.arena[s..s + self.block_bytes]
    }

    pub(crate) fn block_mut(&mut self, id: BlockId) -> &mut [u8] {
        let s = id as usize * self.block_bytes;
        &mut self.arena[s..s + self.block_bytes]
    }

    /// Copies block `from` into a fresh block (copy-on-write), releasing one reference to
    /// `from`. The caller has checked that a block is free.
    pub(crate) fn copy_on_write(&mut self, from: BlockId) -> BlockId {
        let to = self.alloc().expect("caller reserved a free block");
        let (b, f, t) = (self.block_bytes, from as usize, to as usize);
        self.arena.copy_within(f * b..(f + 1) * b, t * b);
        self.release(from);
        to
    }

    pub(crate) fn free_list(&self) -> &[BlockId] {
        &self.free
    }

    pub(crate) fn from_parts(
        block_bytes: usize,
        arena: Vec<u8>,
        refcount: Vec<u32>,
        free: Vec<BlockId>,
    ) -> Self {
        Self { block_bytes, arena, refcount, free }
    }
}

/// Bytes of a pool's arena, checked: at most [`MAX_BLOCKS`] blocks, and a size that an
/// allocation can have (`isize::MAX`).
pub(crate) fn arena_bytes(capacity: usize, block_bytes: usize) -> Result<usize> {
    if capacity > MAX_BLOCKS {
        return Err(CacheError::Config(format!(
            "capacity_blocks {capacity} is over the {MAX_BLOCKS} blocks a pool can address"
        )));
    }
    capacity.checked_mul(block_bytes).filter(|&n| n <= isize::MAX as usize).ok_or_else(|| {
        CacheError::Config(format!(
            "capacity_blocks {capacity} × {block_bytes} bytes per block overflows the address space"
        ))
    })
}

/// `n` zeroed elements, or [`CacheError::Alloc`]. Zeroed allocation keeps the pages of a large
/// arena untouched until they are written (and so open to huge-page advice).
pub(crate) fn zeroed<T: bytemuck::Zeroable>(n: usize, what: &'static str) -> Result<Vec<T>> {
    bytemuck::allocation::try_zeroed_slice_box::<T>(n)
        .map(|b| b.into_vec())
        .map_err(|()| CacheError::Alloc { what, bytes: n.saturating_mul(size_of::<T>()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked_before_allocating() {
        assert!(matches!(BlockPool::new(MAX_BLOCKS + 1, 1), Err(CacheError::Config(_))));
        assert!(matches!(BlockPool::new(1 << 20, usize::MAX / 1024), Err(CacheError::Config(_))));
        // Within the address space but not to be had: a typed error, not an abort.
        assert!(matches!(BlockPool::new(1 << 31, 1 << 31), Err(CacheError::Alloc { .. })));
    }

    #[test]
    fn alloc_release_and_exhaustion() {
        let mut p = BlockPool::new(3, 8).unwrap();
        let a = p.alloc().unwrap();
        let b = p.alloc().unwrap();
        assert_eq!((a, b), (0, 1));
        p.retain(a);
        p.release(a);
        assert_eq!(p.refcount(a), 1);
        let c = p.alloc().unwrap();
        assert!(p.alloc().is_none());
        p.release(b);
        assert_eq!(p.alloc(), Some(b));
        p.block_mut(c).copy_from_slice(&[7; 8]);
        p.release(a);
        p.retain(c);
        let d = p.copy_on_write(c);
        assert_eq!(p.block(d), &[7; 8]);
        assert_eq!(p.refcount(c), 1);
    }
}
