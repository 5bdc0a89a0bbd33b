//! Trees for tree algorithms: a double binary tree across hosts, with a chain inside each
//! host (the shape NCCL builds in `trees.cc`, constructed here from scratch).
//!
//! **Binary tree over `n` nodes.** Node 0 is the root. Every other node `r` with lowest
//! set bit `b` hangs from `(r − b) | 2b` — the node one level up whose lowest set bit is
//! `2b` — or, when that is not below `n`, from `r − b`. Walking up, the lowest set bit
//! doubles at every step, so every node reaches the root within ⌈log₂ n⌉ steps; children
//! are whoever names a node as parent (at most two). Odd nodes are leaves.
//!
//! **Double binary tree.** The second tree gives every node the place another node has
//! in the first: the mirror `n − 1 − r` when `n` is even, the shift `r + 1` when it is
//! odd. Either way odd nodes of the first tree (its leaves) become inner nodes of the
//! second, so each node does the inner work (receive from two children, reduce) in at
//! most one of the two trees, and the two trees together balance the load — each
//! channel runs on one of them.
//!
//! **Ranks.** Hosts are the tree's nodes, and a host's ranks form a chain below its first
//! rank: the first rank joins the host tree, each following local rank hangs from the
//! one before it.

/// The parent of node `r` in the first binary tree over `n` nodes (`None` for the root).
fn btree_parent(n: usize, r: usize) -> Option<usize> {
    if r == 0 {
        return None;
    }
    let b = r & r.wrapping_neg();
    let up = (r - b) | (b << 1);
    Some(if up < n { up } else { r - b })
}

/// The parent of node `r` in tree `which` (0 or 1) of the double binary tree over `n`.
pub fn node_parent(n: usize, which: usize, r: usize) -> Option<usize> {
    if which == 0 || n <= 1 {
        return btree_parent(n, r);
    }
    // Tree 1 gives node r the place node `map(r)` has in tree 0: the mirror for even n,
    // a shift by one for odd n.
    let even = n.is_multiple_of(2);
    let map = |x: usize| if even { n - 1 - x } else { (x + 1) % n };
    let unmap = |x: usize| if even { n - 1 - x } else { (x + n - 1) % n };
    btree_parent(n, map(r)).map(unmap)
}

/// A tree over ranks: each rank's parent and children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankTree {
    /// `parent[r]`, `None` for the root.
    pub parent: Vec<Option<usize>>,
    /// `children[r]`, in the order data is reduced: the local chain first, then hosts.
    pub children: Vec<Vec<usize>>,
}

impl RankTree {
    /// Tree `which` (0 or 1) over ranks whose hosts are `host_of[rank]` (any labels):
    /// hosts ordered by their first rank form the double binary tree, each host's ranks
    /// a chain below its first rank.
    pub fn new(host_of: &[usize], which: usize) -> Self {
        let n = host_of.len();
        // Hosts in order of first appearance, and each host's ranks.
        let mut hosts: Vec<usize> = Vec::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (r, h) in host_of.iter().enumerate() {
            match hosts.iter().position(|x| x == h) {
                Some(i) => members[i].push(r),
                None => {
                    hosts.push(*h);
                    members.push(vec![r]);
                }
            }
        }
        let mut parent = vec![None; n];
        for (hi, ranks) in members.iter().enumerate() {
            parent[ranks[0]] = node_parent(hosts.len(), which, hi).map(|ph| members[ph][0]);
            for w in ranks.windows(2) {
                parent[w[1]] = Some(w[0]);
            }
        }
        let mut children = vec![Vec::new(); n];
        for (r, p) in parent.iter().enumerate() {
            if let Some(p) = *p {
                children[p].push(r);
            }
        }
        // Local chain first: it shares memory, so its data arrives soonest.
        for (p, kids) in children.iter_mut().enumerate() {
            kids.sort_by_key(|&c| (host_of[c] != host_of[p], c));
        }
        RankTree { parent, children }
    }

    /// Tree 0 re-rooted at `root`: `root`'s host becomes the root host and `root` its
    /// head (for rooted collectives such as broadcast).
    pub fn rooted_at(host_of: &[usize], root: usize) -> Self {
        let n = host_of.len();
        // Virtual order: the root first, then the others; build, then map back.
        let order: Vec<usize> = std::iter::once(root)
            .chain((0..n).filter(|&r| r != root))
            .collect();
        let virt_hosts: Vec<usize> = order.iter().map(|&r| host_of[r]).collect();
        let t = RankTree::new(&virt_hosts, 0);
        let mut parent = vec![None; n];
        let mut children = vec![Vec::new(); n];
        for (v, &r) in order.iter().enumerate() {
            parent[r] = t.parent[v].map(|p| order[p]);
            children[r] = t.children[v].iter().map(|&c| order[c]).collect();
        }
        RankTree { parent, children }
    }

    /// The root.
    pub fn root(&self) -> usize {
        self.parent.iter().position(Option::is_none).unwrap_or(0)
    }

    /// Edges from `r` up to the root.
    pub fn depth(&self, mut r: usize) -> usize {
        let mut d = 0;
        while let Some(p) = self.parent[r] {
            r = p;
            d += 1;
            assert!(d <= self.parent.len(), "the parent links have a cycle");
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn double_binary_trees_are_sound_for_1_to_64_hosts() {
        for n in 1..=64usize {
            let log = (usize::BITS - (n - 1).leading_zeros()) as usize; // ceil(log2 n)
            let mut inner = [vec![false; n], vec![false; n]];
            for (which, inner) in inner.iter_mut().enumerate() {
                let t = RankTree::new(&(0..n).collect::<Vec<_>>(), which);
                // Exactly one root; every node once; binary; shallow.
                assert_eq!(t.parent.iter().filter(|p| p.is_none()).count(), 1, "n {n}");
                let mut seen = vec![0; n];
                for (p, kids) in t.children.iter().enumerate() {
                    assert!(kids.len() <= 2, "n {n} tree {which}: {p} has {kids:?}");
                    for &c in kids {
                        seen[c] += 1;
                        assert_eq!(t.parent[c], Some(p));
                    }
                    inner[p] = !kids.is_empty();
                }
                assert_eq!(seen[t.root()], 0);
                assert!(
                    (0..n).filter(|&r| r != t.root()).all(|r| seen[r] == 1),
                    "n {n}"
                );
                for r in 0..n {
                    assert!(t.depth(r) <= log.max(1), "n {n} tree {which}: depth of {r}");
                }
            }
            // Complementary: no node does inner work in both trees, but for at most one
            // (the shape cannot always avoid it for tiny or odd n).
            let both = (0..n).filter(|&r| inner[0][r] && inner[1][r]).count();
            assert!(both <= 1, "n {n}: {both} nodes are inner in both trees");
        }
    }

    #[test]
    fn a_tree_can_be_rooted_at_any_rank() {
        let hosts = [0, 0, 1, 1, 2, 2, 3];
        for root in 0..hosts.len() {
            let t = RankTree::rooted_at(&hosts, root);
            assert_eq!(t.root(), root);
            for r in 0..hosts.len() {
                assert!(t.depth(r) <= 2 + 1, "root {root}: depth of {r}");
            }
        }
    }

    #[test]
    fn ranks_chain_inside_hosts_below_the_host_tree() {
        // 3 hosts of 2 ranks: hosts a (ranks 0, 3), b (1, 4), c (2, 5).
        let hosts = [7, 8, 9, 7, 8, 9];
        let t = RankTree::new(&hosts, 0);
        // Host tree over (a, b, c) = nodes (0, 1, 2): 0 -> 2 -> 1.
        assert_eq!(
            t.parent,
            [None, Some(2), Some(0), Some(0), Some(1), Some(2)]
        );
        // Chain child first.
        assert_eq!(t.children[0], [3, 2]);
        assert_eq!(t.children[2], [5, 1]);
        assert_eq!(t.depth(4), 3); // 4 -> 1 -> 2 -> 0: ceil(log2 3) + chain
    }
}
