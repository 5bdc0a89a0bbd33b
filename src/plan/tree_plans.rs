//! The tree family of plans: all-reduce, broadcast and reduce over the double binary
//! tree across hosts ([`super::tree`]), a chain inside each host.

use super::*;

/// One chunk's way down a tree, for the rank with `parent` and `kids`: the root takes
/// it from `root_src` (copying it into `out` when that is elsewhere) and sends it to its
/// children; every other rank receives it into `out` from its parent and forwards it to
/// its first child, then sends it from `out` to the others.
fn tree_down(parent: Option<usize>, kids: &[usize], root_src: Region, out: Region) -> Vec<Step> {
    let Some((&first, rest)) = kids.split_first() else {
        return vec![match parent {
            Some(p) => Step::Recv { from: p, dst: out },
            None => Step::Copy {
                src: root_src,
                dst: out,
            },
        }];
    };
    let mut steps = vec![match parent {
        Some(p) => Step::RecvCopySend {
            from: p,
            to: first,
            dst: out,
        },
        None if root_src == out => Step::Send {
            to: first,
            src: out,
        },
        None => Step::CopySend {
            to: first,
            src: root_src,
            dst: out,
        },
    }];
    steps.extend(rest.iter().map(|&k| Step::Send { to: k, src: out }));
    steps
}

/// One chunk's way up a tree, for the rank with `parent` and `kids`: a leaf sends its
/// contribution `inp` to its parent; an inner rank adds each child's partial sum to its
/// contribution, accumulating in `acc`, and sends the last sum to its parent instead; the
/// root completes the sum in `acc` (with the post-operation).
fn tree_up(parent: Option<usize>, kids: &[usize], inp: Region, acc: Region) -> Vec<Step> {
    if kids.is_empty() {
        return match parent {
            Some(p) => vec![Step::Send { to: p, src: inp }],
            // A single rank: its contribution is the result.
            None => vec![Step::Copy { src: inp, dst: acc }],
        };
    }
    kids.iter()
        .enumerate()
        .map(|(k, &kid)| {
            // The first child's partial meets this rank's contribution; later ones meet
            // the partial sum accumulated so far.
            let src = if k == 0 { inp } else { acc };
            let last = k + 1 == kids.len();
            match parent {
                Some(p) if last => Step::RecvReduceSend {
                    from: kid,
                    to: p,
                    src,
                },
                _ => Step::RecvReduceCopy {
                    from: kid,
                    src,
                    dst: acc,
                    post: last,
                    local_first: false,
                },
            }
        })
        .collect()
}

impl Builder<'_> {
    /// Tree all-reduce: each channel takes a share of the buffer and one of the two
    /// trees (even channels the first, odd the second). Chunk by chunk, every rank adds
    /// its children's partial sums to its own contribution and passes the result up; the
    /// root completes it and the final chunk travels back down. Reducing up and
    /// forwarding down are separate lanes (they use opposite directions of each
    /// connection), so a chunk goes up while an earlier one comes down; on the root they
    /// share one lane, since what it sends down is what it just completed.
    pub(super) fn tree_all_reduce(&self) -> Vec<Lane> {
        let me = self.rank;
        let mut lanes = Vec::new();
        for c in 0..self.channels() {
            let (lo, len) = split_even(self.count, self.channels(), c);
            if self.nranks == 1 {
                lanes.push(lane(
                    c,
                    vec![Step::Copy {
                        src: Region::input(lo, len),
                        dst: Region::output(lo, len),
                    }],
                ));
                continue;
            }
            let t = tree::RankTree::new(self.hosts, c % 2);
            let (parent, kids) = (t.parent[me], &t.children[me]);
            let (mut up, mut down, mut root_lane) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..len.div_ceil(self.chunk) {
                let (off, l) = (lo + i * self.chunk, self.chunk.min(len - i * self.chunk));
                let (inp, out) = (Region::input(off, l), Region::output(off, l));
                let up_steps = tree_up(parent, kids, inp, out);
                // The root sends what it just completed in its output buffer.
                let down_steps = tree_down(parent, kids, out, out);
                if parent.is_none() {
                    root_lane.extend(up_steps);
                    root_lane.extend(down_steps);
                } else {
                    up.extend(up_steps);
                    down.extend(down_steps);
                }
            }
            for steps in [root_lane, up, down] {
                if !steps.is_empty() {
                    lanes.push(lane(c, steps));
                }
            }
        }
        lanes
    }

    /// Tree broadcast: the root's data flows down tree 0 re-rooted at the root, chunk by
    /// chunk, each rank forwarding to its children as it receives.
    pub(super) fn tree_broadcast(&self, root: usize) -> Vec<Lane> {
        let t = tree::RankTree::rooted_at(self.hosts, root);
        let (parent, kids) = (t.parent[self.rank], &t.children[self.rank]);
        self.lanes_by_chunk(|_, _, off, l, steps| {
            let (inp, out) = (Region::input(off, l), Region::output(off, l));
            steps.extend(tree_down(parent, kids, inp, out));
        })
    }

    /// Tree reduce: the contributions flow up tree 0 re-rooted at the root, chunk by
    /// chunk, each rank adding its children's partial sums to its own contribution. A
    /// rank with several children accumulates in the call's scratch memory (only the
    /// root has a receive buffer).
    pub(super) fn tree_reduce(&self, root: usize) -> Vec<Lane> {
        let t = tree::RankTree::rooted_at(self.hosts, root);
        let (parent, kids) = (t.parent[self.rank], &t.children[self.rank]);
        self.lanes_by_chunk(|_, _, off, l, steps| {
            let acc = if parent.is_none() {
                Region::output(off, l)
            } else {
                Region::scratch(off, l)
            };
            steps.extend(tree_up(parent, kids, Region::input(off, l), acc));
        })
    }
}
