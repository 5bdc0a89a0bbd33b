//! The ring family of plans: reduce-scatter then all-gather around each channel's ring
//! for all-reduce, and the other collectives pipelined along the same rings.

use super::*;

impl Builder<'_> {
    /// Ring all-reduce. Each channel takes a contiguous share of the buffer and walks it
    /// in iterations of `nranks × chunk` elements; an iteration is split into one piece per
    /// rank. At step `s` the rank at ring position `p` handles the piece owned by the rank
    /// `s` positions behind it: sends it (s = 0), adds its own contribution and forwards it
    /// (0 < s < n−1), completes it (s = n−1: the sum is final, stored and forwarded),
    /// then passes final pieces on (n−1 < s < 2n−2) and stores the last one (s = 2n−2).
    pub(super) fn ring_all_reduce(&self) -> Vec<Lane> {
        let n = self.nranks;
        (0..self.channels())
            .map(|c| {
                let (lo, len) = split_even(self.count, self.channels(), c);
                let mut steps = Vec::new();
                if n == 1 {
                    steps.push(Step::Copy {
                        src: Region::input(lo, len),
                        dst: Region::output(lo, len),
                    });
                    return lane(c, steps);
                }
                let v = self.view(c);
                let (prev, next) = (v.prev(), v.next());
                for it in self.iterations(lo, len) {
                    for s in 0..=2 * (n - 1) {
                        // The piece owned by the ring position s steps back.
                        let (off, l) = it.piece(v.position_of(v.before(s)));
                        let (src, dst) = (Region::input(off, l), Region::output(off, l));
                        steps.push(match s {
                            0 => Step::Send { to: next, src },
                            s if s < n - 1 => Step::RecvReduceSend {
                                from: prev,
                                to: next,
                                src,
                            },
                            s if s == n - 1 => Step::RecvReduceCopySend {
                                from: prev,
                                to: next,
                                src,
                                dst,
                            },
                            s if s < 2 * (n - 1) => Step::RecvCopySend {
                                from: prev,
                                to: next,
                                dst,
                            },
                            _ => Step::Recv { from: prev, dst },
                        });
                    }
                }
                lane(c, steps)
            })
            .collect()
    }

    /// Ring reduce-scatter: like the first half of all-reduce over blocks, arranged so
    /// that rank `r` completes block `r`.
    pub(super) fn ring_reduce_scatter(&self) -> Vec<Lane> {
        let (n, count) = (self.nranks, self.count);
        self.lanes_by_chunk(|_, v, off, l, steps| {
            for s in 0..n {
                // At step s handle the block of the rank s+1 positions back, so that the
                // last step (s = n−1) completes this rank's own block.
                let block = v.before(s + 1);
                let src = Region::input(block * count + off, l);
                steps.push(v.chain_reduce_step(s, src, Region::output(off, l)));
            }
        })
    }

    /// Ring all-gather: each rank copies its block into place and sends it; every
    /// block then travels n−1 hops.
    pub(super) fn ring_all_gather(&self) -> Vec<Lane> {
        let (n, count) = (self.nranks, self.count);
        self.lanes_by_chunk(|_, v, off, l, steps| {
            let own = Region::output(self.rank * count + off, l);
            if n == 1 {
                steps.push(Step::Copy {
                    src: Region::input(off, l),
                    dst: own,
                });
                return;
            }
            steps.push(Step::CopySend {
                to: v.next(),
                src: Region::input(off, l),
                dst: own,
            });
            for s in 1..n {
                let dst = Region::output(v.before(s) * count + off, l);
                steps.push(if s < n - 1 {
                    Step::RecvCopySend {
                        from: v.prev(),
                        to: v.next(),
                        dst,
                    }
                } else {
                    Step::Recv {
                        from: v.prev(),
                        dst,
                    }
                });
            }
        })
    }

    /// Broadcast pipelined along the ring, starting at the root.
    pub(super) fn ring_broadcast(&self, root: usize) -> Vec<Lane> {
        let n = self.nranks;
        self.lanes_by_chunk(|_, v, off, l, steps| {
            // Distance from the root along the ring.
            let q = (v.pos + n - v.position_of(root)) % n;
            let dst = Region::output(off, l);
            steps.push(match q {
                _ if n == 1 => Step::Copy {
                    src: Region::input(off, l),
                    dst,
                },
                0 => Step::CopySend {
                    to: v.next(),
                    src: Region::input(off, l),
                    dst,
                },
                q if q < n - 1 => Step::RecvCopySend {
                    from: v.prev(),
                    to: v.next(),
                    dst,
                },
                _ => Step::Recv {
                    from: v.prev(),
                    dst,
                },
            });
        })
    }

    /// Reduce pipelined along the ring, ending at the root.
    pub(super) fn ring_reduce(&self, root: usize) -> Vec<Lane> {
        let n = self.nranks;
        self.lanes_by_chunk(|_, v, off, l, steps| {
            // Position in the chain that starts right after the root and ends at it.
            let q = (v.pos + n - v.position_of(root) + n - 1) % n;
            steps.push(v.chain_reduce_step(q, Region::input(off, l), Region::output(off, l)));
        })
    }
}
