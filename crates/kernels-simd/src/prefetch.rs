//! Memory that a fused kernel brings into cache while it computes: the blocks its caller reads
//! next (a decode's next unit), queued on the [`Scratch`](crate::Scratch) with
//! [`Scratch::prefetch_next`](crate::Scratch::prefetch_next) and asked for a few cache lines at
//! a time from the kernel's row loops.
//!
//! Prefetching a unit's ~17 KB (blocks of 128 tokens) in one burst before the kernel runs
//! stalls it: each software prefetch holds one of the core's few line-fill buffers until its
//! line arrives, so the burst waits on memory for most of the lines before the arithmetic can
//! go on. Spread over the kernel's loops, the lines arrive while the kernel computes (on a
//! 2-vCPU Intel Xeon, `int4-channel32/int4-token` in blocks of 128 went from 5.3 to 4.3 ms a
//! step at 32k, `docs/performance.md`).

/// At most this many ranges are queued; a further one is prefetched at once.
const RANGES: usize = 4;

/// Byte ranges to prefetch, kept as addresses only: a prefetch never dereferences its
/// address and never faults, so a range whose memory has gone since is harmless.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Ahead {
    /// `(next line, end)` of each range; `ranges[at..len]` are the ones with lines left.
    ranges: [(usize, usize); RANGES],
    at: usize,
    len: usize,
    /// Lines asked for at each [`Ahead::step`], set by [`Ahead::pace`].
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    per_step: usize,
    /// The lines asked for by [`Ahead::step`] so far (tests: that a kernel steps the queue).
    #[cfg(test)]
    pub(crate) stepped: usize,
}

impl Ahead {
    /// Queues the lines of `data` (prefetched now when the queue is full).
    pub(crate) fn push(&mut self, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if self.len == RANGES {
            crate::prefetch(data);
            return;
        }
        self.push_range(data.as_ptr() as usize, data.len());
    }

    /// Queues the lines of the `len` bytes at address `start` (not empty, not wrapping the
    /// address space: a slice's).
    fn push_range(&mut self, start: usize, len: usize) {
        self.ranges[self.len] = (start & !63, start.saturating_add(len));
        self.len += 1;
    }

    /// The lines still queued.
    #[cfg_attr(not(any(target_arch = "x86_64", test)), allow(dead_code))]
    pub(crate) fn lines(&self) -> usize {
        self.ranges[self.at..self.len].iter().map(|&(a, e)| e.saturating_sub(a).div_ceil(64)).sum()
    }

    /// Spreads the queued lines over `steps` calls of [`Ahead::step`].
    #[cfg_attr(not(any(target_arch = "x86_64", test)), allow(dead_code))]
    pub(crate) fn pace(&mut self, steps: usize) {
        self.per_step = self.lines().div_ceil(steps.max(1));
    }

    /// Asks for the next lines (as many as [`Ahead::pace`] set); nothing once the queue is
    /// empty. (The x86 fused kernels, AVX-512 and AVX2, step it; the others prefetch it
    /// whole.)
    #[cfg_attr(not(any(target_arch = "x86_64", test)), allow(dead_code))]
    #[inline(always)]
    pub(crate) fn step(&mut self) {
        if self.at < self.len {
            let mut lines = 0;
            self.issue_with(self.per_step, |line| {
                lines += 1;
                crate::prefetch_line(line)
            });
            #[cfg(test)]
            {
                self.stepped += lines;
            }
            let _ = lines;
        }
    }

    /// Asks for every line still queued, and empties the queue.
    pub(crate) fn finish(&mut self) {
        if self.at < self.len {
            self.issue_with(usize::MAX, crate::prefetch_line);
        }
    }

    /// Hands up to `n` queued lines to `hint`, in order, and drops them from the queue.
    #[inline]
    fn issue_with(&mut self, mut n: usize, mut hint: impl FnMut(*const u8)) {
        while n > 0 && self.at < self.len {
            let (a, e) = &mut self.ranges[self.at];
            while n > 0 && *a < *e {
                hint(*a as *const u8);
                *a = a.saturating_add(64);
                n -= 1;
            }
            if *a >= *e {
                self.at += 1;
            }
        }
        if self.at == self.len {
            (self.at, self.len) = (0, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Ahead, RANGES};

    /// The lines each range touches, in the order queued.
    fn lines_of(ranges: &[&[u8]]) -> Vec<usize> {
        ranges.iter().flat_map(|r| crate::cache_lines(r).map(|p| p as usize)).collect()
    }

    #[test]
    fn every_queued_line_is_asked_for_once_in_order() {
        let buf = vec![1u8; 4096];
        for (a, b, c) in [(0, 1, 64), (3, 700, 129), (64, 0, 1), (65, 130, 2000), (0, 4096, 0)] {
            let ranges: Vec<&[u8]> =
                [&buf[a..a + b], &buf[c..], &buf[..c]].into_iter().filter(|r| !r.is_empty()).collect();
            let want = lines_of(&ranges);
            for per in [1, 3, 64, 1000] {
                let mut ahead = Ahead::default();
                for r in &ranges {
                    ahead.push(r);
                }
                assert_eq!(ahead.lines(), want.len());
                ahead.pace(want.len().div_ceil(per));
                let mut got = Vec::new();
                let mut steps = 0;
                while ahead.lines() > 0 {
                    let before = got.len();
                    ahead.issue_with(ahead.per_step, |p| got.push(p as usize));
                    assert!(got.len() - before <= per.max(1), "{per}");
                    steps += 1;
                    assert!(steps <= want.len() + 1, "a step that asks for nothing");
                }
                assert_eq!(got, want, "{a} {b} {c} by {per}");
                // Emptied: nothing more, and the queue takes new ranges from the start.
                ahead.issue_with(usize::MAX, |_| panic!("an empty queue asked for a line"));
                assert_eq!((ahead.at, ahead.len), (0, 0));
            }
        }
    }

    #[test]
    fn finish_asks_for_what_is_left_and_empties_the_queue() {
        let buf = vec![1u8; 1000];
        let mut ahead = Ahead::default();
        ahead.push(&buf[10..600]);
        ahead.push(&buf[700..]);
        ahead.pace(4);
        let mut got = Vec::new();
        ahead.issue_with(ahead.per_step, |p| got.push(p as usize));
        ahead.issue_with(usize::MAX, |p| got.push(p as usize));
        assert_eq!(got, lines_of(&[&buf[10..600], &buf[700..]]));
        assert_eq!(ahead.lines(), 0);
        // The real hints, on an empty queue and on a range that is no longer there.
        ahead.finish();
        ahead.step();
        let gone = {
            let v = vec![0u8; 1 << 16];
            v.as_ptr() as usize
        };
        // Memory freed since it was queued, and addresses no process maps.
        ahead.push_range(gone, 1 << 16);
        ahead.push_range(usize::MAX - 100, 100);
        ahead.push_range(0, 4096);
        ahead.pace(3);
        ahead.step();
        ahead.finish();
        assert_eq!(ahead.lines(), 0);
    }

    #[test]
    fn a_full_queue_prefetches_at_once_and_empty_ranges_are_skipped() {
        let buf = vec![1u8; 64 * 12];
        // Whole lines.
        let at = buf.as_ptr().align_offset(64);
        let mut ahead = Ahead::default();
        ahead.push(&buf[..0]);
        assert_eq!((ahead.len, ahead.lines()), (0, 0));
        for k in 0..RANGES + 2 {
            ahead.push(&buf[at + 64 * k..at + 64 * k + 64]);
        }
        assert_eq!((ahead.len, ahead.lines()), (RANGES, RANGES));
        // Pacing over more steps than lines asks for one line a step.
        ahead.pace(100);
        assert_eq!(ahead.per_step, 1);
        ahead.pace(0);
        assert_eq!(ahead.per_step, RANGES);
    }
}
