//! The direct family of plans: one-shot (every rank sends straight to every rank that
//! needs its data, receivers fold in rank order), two-shot (a direct reduce-scatter then a
//! direct all-gather), and the direct all-to-all, gather and scatter.

use super::*;

/// Where one channel's fold keeps its partial results: a scratch slot of its own,
/// reused for every range the lane folds.
struct FoldSlots {
    base: usize,
}

impl FoldSlots {
    /// The slot of channel `channel`, for ranges of at most `longest` elements.
    fn new(channel: usize, longest: usize) -> Self {
        FoldSlots {
            base: channel * longest,
        }
    }

    /// The slot's first `len` elements.
    fn acc(&self, len: usize) -> Region {
        Region::scratch(self.base, len)
    }
}

impl Builder<'_> {
    /// Fold slots of channel `c` for its chunks (channel 0's first chunk is the longest
    /// of any channel, so the channels' slots never overlap).
    fn chunk_slots(&self, c: usize) -> FoldSlots {
        let longest = self.chunk.min(split_even(self.count, self.channels(), 0).1);
        FoldSlots::new(c, longest)
    }

    /// One-shot all-reduce: chunk by chunk, every rank sends its contribution to every
    /// peer, then receives theirs and folds all n in rank order into its output. The next
    /// chunk goes out before the previous one is received, so one chunk is in flight each
    /// way; a chunk is sent before the same chunk of the output is written (in place,
    /// that is the input).
    pub(super) fn one_shot_all_reduce(&self) -> Vec<Lane> {
        let me = self.rank;
        (0..self.channels())
            .map(|c| {
                let chunks = self.block_chunks(c);
                let slots = self.chunk_slots(c);
                let send = |(off, l): (usize, usize), steps: &mut Vec<Step>| {
                    steps.extend(self.peers().map(|to| Step::Send {
                        to,
                        src: Region::input(off, l),
                    }));
                };
                let mut steps = Vec::new();
                for (i, &(off, l)) in chunks.iter().enumerate() {
                    if i == 0 {
                        send((off, l), &mut steps);
                    }
                    if let Some(&next) = chunks.get(i + 1) {
                        send(next, &mut steps);
                    }
                    let own = Region::input(off, l);
                    self.fold(&slots, me, own, Region::output(off, l), &mut steps);
                }
                lane(c, steps)
            })
            .collect()
    }

    /// Two-shot all-reduce: like the ring, each channel walks its share in iterations of
    /// `nranks × chunk` elements split into one piece per rank; in each, every rank sends
    /// piece `p` to rank `p`, folds the n contributions to its own piece in rank order,
    /// sends the result to every peer and receives theirs.
    pub(super) fn two_shot_all_reduce(&self) -> Vec<Lane> {
        let (me, n) = (self.rank, self.nranks);
        (0..self.channels())
            .map(|c| {
                let (lo, len) = split_even(self.count, self.channels(), c);
                let per_iter = n * self.chunk;
                // Pieces are longest in channel 0's first iteration.
                let share = split_even(self.count, self.channels(), 0).1;
                let slots = FoldSlots::new(c, split_even(per_iter.min(share), n, 0).1);
                let mut steps = Vec::new();
                for it in self.iterations(lo, len) {
                    for to in self.peers() {
                        let (off, l) = it.piece(to);
                        steps.push(Step::Send {
                            to,
                            src: Region::input(off, l),
                        });
                    }
                    let (off, l) = it.piece(me);
                    let mine = Region::output(off, l);
                    self.fold(&slots, me, Region::input(off, l), mine, &mut steps);
                    steps.extend(self.peers().map(|to| Step::Send { to, src: mine }));
                    for from in self.peers() {
                        let (off, l) = it.piece(from);
                        steps.push(Step::Recv {
                            from,
                            dst: Region::output(off, l),
                        });
                    }
                }
                lane(c, steps)
            })
            .collect()
    }

    /// One-shot reduce-scatter: chunk by chunk of a block, every rank sends the chunk of
    /// block `p` to rank `p` and folds the n contributions to its own block in rank order.
    pub(super) fn one_shot_reduce_scatter(&self) -> Vec<Lane> {
        let (me, count) = (self.rank, self.count);
        self.lanes_by_chunk(|c, _, off, l, steps| {
            let slots = &self.chunk_slots(c);
            steps.extend(self.peers().map(|to| Step::Send {
                to,
                src: Region::input(to * count + off, l),
            }));
            let own = Region::input(me * count + off, l);
            self.fold(slots, me, own, Region::output(off, l), steps);
        })
    }

    /// One-shot reduce: every rank sends each chunk to the root, which folds the n
    /// contributions in rank order.
    pub(super) fn one_shot_reduce(&self, root: usize) -> Vec<Lane> {
        let me = self.rank;
        self.lanes_by_chunk(|c, _, off, l, steps| {
            let slots = &self.chunk_slots(c);
            let own = Region::input(off, l);
            if me == root {
                self.fold(slots, me, own, Region::output(off, l), steps);
            } else {
                steps.push(Step::Send { to: root, src: own });
            }
        })
    }

    /// One-shot broadcast: the root sends each chunk to every peer.
    pub(super) fn one_shot_broadcast(&self, root: usize) -> Vec<Lane> {
        self.lanes_by_chunk(|_, _, off, l, steps| {
            let dst = Region::output(off, l);
            if self.rank == root {
                let src = Region::input(off, l);
                steps.extend(self.peers().map(|to| Step::Send { to, src }));
                steps.push(Step::Copy { src, dst });
            } else {
                steps.push(Step::Recv { from: root, dst });
            }
        })
    }

    /// One-shot all-gather: every rank sends each chunk of its block to every peer and
    /// receives theirs into place.
    pub(super) fn one_shot_all_gather(&self) -> Vec<Lane> {
        let (me, count) = (self.rank, self.count);
        self.lanes_by_chunk(|_, _, off, l, steps| {
            let src = Region::input(off, l);
            steps.extend(self.peers().map(|to| Step::Send { to, src }));
            steps.push(Step::Copy {
                src,
                dst: Region::output(me * count + off, l),
            });
            steps.extend(self.peers().map(|from| Step::Recv {
                from,
                dst: Region::output(from * count + off, l),
            }));
        })
    }

    /// The other ranks, in rank order starting after this one (so that ranks do not all
    /// send to rank 0 first).
    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (1..self.nranks).map(move |k| (self.rank + k) % self.nranks)
    }

    /// The rank-order fold of one range: combines every rank's contribution to it,
    /// `x₀ ⊕ x₁ ⊕ … ⊕ xₙ₋₁` left to right, `own` standing for this rank's, and stores the
    /// result in `dst`. Each received contribution is folded straight from the FIFO into
    /// the partial result (kept in the lane's scratch slot, so that `dst` may be `own`,
    /// in place: it is written by the last step only); only x₀ is copied there first
    /// when it is neither this rank's nor followed by it.
    fn fold(&self, slots: &FoldSlots, me: usize, own: Region, dst: Region, steps: &mut Vec<Step>) {
        let n = self.nranks;
        if n == 1 {
            steps.push(Step::Copy { src: own, dst });
            return;
        }
        let acc = slots.acc(own.len);
        // The result of combining up to rank j: the destination at the end.
        let into = |j: usize| if j == n - 1 { dst } else { acc };
        let first = match me {
            0 => 1,
            // x₀ arrives first and this rank's own comes next: one step.
            1 => {
                steps.push(Step::RecvReduceCopy {
                    from: 0,
                    src: own,
                    dst: into(1),
                    post: n == 2,
                    local_first: false,
                });
                2
            }
            _ => {
                steps.push(Step::Recv { from: 0, dst: acc });
                1
            }
        };
        for j in first..n {
            // The partial so far: this rank's contribution alone when it is x₀.
            let partial = if j == 1 && me == 0 { own } else { acc };
            let (post, dst) = (j == n - 1, into(j));
            steps.push(if j == me {
                Step::Reduce {
                    a: partial,
                    b: own,
                    dst,
                    post,
                }
            } else {
                Step::RecvReduceCopy {
                    from: j,
                    src: partial,
                    dst,
                    post,
                    local_first: true,
                }
            });
        }
    }

    /// All-to-all as direct exchanges: one lane per peer and direction, all in flight
    /// together, so no ordering between peers can deadlock.
    pub(super) fn direct_all_to_all(&self) -> Vec<Lane> {
        let (me, n, count) = (self.rank, self.nranks, self.count);
        let mut lanes = vec![one(Step::Copy {
            src: Region::input(me * count, count),
            dst: Region::output(me * count, count),
        })];
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            lanes.push(one(Step::Send {
                to,
                src: Region::input(to * count, count),
            }));
            lanes.push(one(Step::Recv {
                from,
                dst: Region::output(from * count, count),
            }));
        }
        lanes
    }

    /// Gather (`to_root`: every rank's block goes to the root) or scatter (every block
    /// comes from the root), as direct exchanges with one lane per peer.
    pub(super) fn direct_rooted(&self, root: usize, to_root: bool) -> Vec<Lane> {
        let (me, count) = (self.rank, self.count);
        // On the root, block `r` of all blocks; on every rank, its own block.
        let block = |r: usize| {
            if to_root {
                Region::output(r * count, count)
            } else {
                Region::input(r * count, count)
            }
        };
        let own = if to_root {
            Region::input(0, count)
        } else {
            Region::output(0, count)
        };
        // Moves `region` between this rank and `peer`, in the collective's direction.
        let exchange = |peer: usize, region: Region, towards_peer: bool| {
            if towards_peer {
                Step::Send {
                    to: peer,
                    src: region,
                }
            } else {
                Step::Recv {
                    from: peer,
                    dst: region,
                }
            }
        };
        if me != root {
            return vec![one(exchange(root, own, to_root))];
        }
        let (src, dst) = if to_root {
            (own, block(me))
        } else {
            (block(me), own)
        };
        let mut lanes = vec![one(Step::Copy { src, dst })];
        lanes.extend(
            (0..self.nranks)
                .filter(|&r| r != me)
                .map(|peer| one(exchange(peer, block(peer), !to_root))),
        );
        lanes
    }
}
