//! Recursive doubling: the all-reduce of MPICH's and Intel MPI's small messages. In
//! round `k` every rank swaps its whole partial result with the rank whose number
//! differs from its own in bit `k` and combines the two, so after ⌈log₂ n⌉ rounds every
//! rank holds the sum. A rank waits on one peer per round, where the one-shot waits on
//! all of them at once: when ranks outnumber cores, a round needs only its pair to have
//! been scheduled.
//!
//! When `n` is not a power of two, the first `2·(n − p)` ranks (`p` the largest power of
//! two not above `n`) pair up first: each odd one hands its contribution to the even one
//! below it and, at the end, receives the result from it; the other `p` ranks double.
//!
//! Both ranks of a pair combine the lower rank's partial first, so every rank ends with
//! the same bits; the grouping is a butterfly's, not a rank-order fold.

use super::*;

/// The rank that is number `v` among the ranks that double, of `n` in all: the largest
/// power of two `p` not above `n` double, and of the first `2·(n − p)` ranks, which pair
/// up first, only the even ones.
pub fn doubling_rank(v: usize, n: usize) -> usize {
    let extra = n - (1 << n.ilog2());
    if v < extra { 2 * v } else { v + extra }
}

impl Builder<'_> {
    /// Recursive-doubling all-reduce, chunk by chunk of each channel's share: the whole
    /// exchange for one chunk before the next, the partial results kept in the output.
    pub(super) fn doubling_all_reduce(&self) -> Vec<Lane> {
        let (me, n) = (self.rank, self.nranks);
        // `p` ranks double; the `extra` odd ranks below `2·extra` sit it out.
        let p = 1usize << n.ilog2();
        let extra = n - p;
        // A doubling rank's place among the `p`.
        let virtual_of = |r: usize| if r < 2 * extra { r / 2 } else { r - extra };
        self.lanes_by_chunk(|_, _, off, l, steps| {
            let input = Region::input(off, l);
            let output = Region::output(off, l);
            if n == 1 {
                steps.push(Step::Copy {
                    src: input,
                    dst: output,
                });
                return;
            }
            if me < 2 * extra && me % 2 == 1 {
                steps.push(Step::Send {
                    to: me - 1,
                    src: input,
                });
                steps.push(Step::Recv {
                    from: me - 1,
                    dst: output,
                });
                return;
            }
            // The partial result so far: this rank's contribution until a step stores a
            // sum in the output.
            let mut partial = input;
            if me < 2 * extra {
                steps.push(Step::RecvReduceCopy {
                    from: me + 1,
                    src: partial,
                    dst: output,
                    post: false,
                    local_first: true,
                });
                partial = output;
            }
            let v = virtual_of(me);
            let rounds = p.ilog2();
            for k in 0..rounds {
                let peer = doubling_rank(v ^ (1 << k), n);
                steps.push(Step::Send {
                    to: peer,
                    src: partial,
                });
                steps.push(Step::RecvReduceCopy {
                    from: peer,
                    src: partial,
                    dst: output,
                    post: k + 1 == rounds,
                    local_first: me < peer,
                });
                partial = output;
            }
            if me < 2 * extra {
                steps.push(Step::Send {
                    to: me + 1,
                    src: output,
                });
            }
        })
    }
}
