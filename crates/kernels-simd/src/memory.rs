//! Memory advice for the large, long-lived buffers the kernels stream: a KV cache's block pool.
//!
//! Decode reads every block of a sequence for every token, and a paged cache scatters those
//! blocks over a pool of tens or hundreds of MiB. With 4 KiB pages that is thousands of pages,
//! more than the TLB holds, so block reads also wait on page walks, and a sequential stream
//! restarts its hardware prefetch at every page boundary. Backing the pool with 2 MiB
//! transparent huge pages removes both. On Linux with THP in `madvise` mode (the default of
//! most distributions) a region only gets them when asked, which is what
//! [`advise_huge_pages`] does.

/// Asks the kernel to back the 2 MiB-aligned part of `data` with transparent huge pages.
///
/// Best called on a fresh allocation before it is written (`vec![0u8; n]` is mapped lazily):
/// pages are then huge from their first touch. On memory already written, the kernel's
/// background collapse (khugepaged) converts it over time, if at all. A hint only: contents
/// are unchanged, and nothing happens for regions under 2 MiB, on other systems, or where THP
/// is disabled. Returns whether the advice was given and accepted.
pub fn advise_huge_pages(data: &[u8]) -> bool {
    advise_huge_pages_of(data)
}

/// [`advise_huge_pages`] for a slice of any element type (its bytes, by address: nothing is
/// read or written).
pub fn advise_huge_pages_of<T>(data: &[T]) -> bool {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let at = data.as_ptr() as usize;
        let start = at.next_multiple_of(HUGE);
        let end = (at + std::mem::size_of_val(data)) / HUGE * HUGE;
        if end <= start {
            return false;
        }
        // SAFETY: [start, end) lies inside `data`, a live allocation of this process, and is
        // page-aligned. MADV_HUGEPAGE changes how the kernel backs those pages, never their
        // contents, so the shared borrow is not violated; a failure only returns an error code.
        let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        rc == 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = data;
        false
    }
}

/// A copy of some bytes that ends where a page that cannot be read begins, so that a kernel
/// reading past its input faults in a test instead of reading a neighbour's bytes unnoticed.
#[cfg(all(test, target_os = "linux"))]
pub(crate) struct Guarded {
    map: *mut libc::c_void,
    total: usize,
    start: *const u8,
    len: usize,
}

#[cfg(all(test, target_os = "linux"))]
impl Guarded {
    pub(crate) fn new(bytes: &[u8]) -> Self {
        let page = 4096;
        let pages = bytes.len().div_ceil(page).max(1);
        let total = (pages + 1) * page;
        // SAFETY: a fresh private anonymous mapping, checked below; nothing else refers to it.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(map != libc::MAP_FAILED, "mmap");
        let base = map.cast::<u8>();
        // SAFETY: the last page of the mapping (page-aligned, inside it).
        let rc = unsafe { libc::mprotect(base.add(pages * page).cast(), page, libc::PROT_NONE) };
        assert_eq!(rc, 0, "mprotect");
        // SAFETY: the `len` bytes before the protected page lie inside the writable pages.
        let start = unsafe { base.add(pages * page - bytes.len()) };
        // SAFETY: as above; `bytes` does not overlap the fresh mapping.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), start, bytes.len()) };
        Self { map, total, start, len: bytes.len() }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `len` initialized bytes at `start`, mapped until `self` drops.
        unsafe { std::slice::from_raw_parts(self.start, self.len) }
    }
}

#[cfg(all(test, target_os = "linux"))]
impl Drop for Guarded {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of `total` bytes, unmapped once.
        unsafe { libc::munmap(self.map, self.total) };
    }
}

#[cfg(test)]
mod tests {
    use super::advise_huge_pages;

    /// The guard page is there: the bytes read back, and the mapping's last page is not
    /// readable (`mincore` would not tell; `mprotect` to read-only on it would succeed on any
    /// mapped page, so the check is that the bytes end exactly at a page boundary).
    #[cfg(target_os = "linux")]
    #[test]
    fn guarded_bytes_end_at_a_page() {
        for len in [0usize, 1, 15, 4096, 5000] {
            let data: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let g = super::Guarded::new(&data);
            assert_eq!(g.bytes(), &data[..]);
            assert_eq!((g.bytes().as_ptr() as usize + len) % 4096, 0);
        }
    }

    #[test]
    fn advice_keeps_contents_and_skips_small_regions() {
        assert!(!advise_huge_pages(&[1, 2, 3]));
        assert!(!advise_huge_pages(&[]));
        let mut big = vec![0u8; 8 << 20];
        for (i, b) in big.iter_mut().enumerate().step_by(4096) {
            *b = (i >> 12) as u8;
        }
        // Accepted or not depends on the kernel's THP setting; the bytes must not change.
        let _ = advise_huge_pages(&big);
        assert!(big.iter().enumerate().all(|(i, &b)| b == if i % 4096 == 0 { (i >> 12) as u8 } else { 0 }));
    }
}
