//! [`DistributedSampler`]: which examples each rank trains on, as PyTorch's sampler
//! does it: a permutation shared by all ranks (seeded, and reshuffled per epoch with
//! `set_epoch`), padded by wrapping around (or cut with `drop_last`) to a multiple of the
//! number of ranks, then dealt out rank by rank: disjoint shards of equal size.

use rand::SeedableRng;
use rand::seq::SliceRandom;

use crate::error::{Error, Result};

/// Splits `0..len` into one shard per rank.
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    len: usize,
    ranks: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler over `len` examples for `rank` of `ranks`.
    pub fn new(
        len: usize,
        ranks: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self> {
        if ranks == 0 || rank >= ranks {
            return Err(Error::invalid(format!("rank {rank} of {ranks} ranks")));
        }
        Ok(DistributedSampler {
            len,
            ranks,
            rank,
            shuffle,
            seed,
            drop_last,
            epoch: 0,
        })
    }

    /// Reshuffles for `epoch` (every rank must set the same epoch).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// Examples per rank.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.ranks
        } else {
            self.len.div_ceil(self.ranks)
        }
    }

    /// This rank's examples for the current epoch.
    pub fn indices(&self) -> Vec<usize> {
        let mut all: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed.wrapping_add(self.epoch));
            all.shuffle(&mut rng);
        }
        let total = self.num_samples() * self.ranks;
        if total > all.len() && !all.is_empty() {
            let pad: Vec<usize> = all
                .iter()
                .cycle()
                .take(total - all.len())
                .copied()
                .collect();
            all.extend(pad);
        }
        all.truncate(total);
        all.into_iter()
            .skip(self.rank)
            .step_by(self.ranks)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_cover_the_set_and_reshuffle_per_epoch() {
        for (len, ranks) in [(10, 3), (1797, 4), (8, 8), (5, 2)] {
            for drop_last in [false, true] {
                let shards: Vec<Vec<usize>> = (0..ranks)
                    .map(|r| {
                        DistributedSampler::new(len, ranks, r, true, 7, drop_last)
                            .unwrap()
                            .indices()
                    })
                    .collect();
                let per = shards[0].len();
                assert!(shards.iter().all(|s| s.len() == per));
                let mut seen: Vec<usize> = shards.concat();
                seen.sort();
                if drop_last {
                    seen.dedup();
                    assert_eq!(seen.len(), per * ranks, "len {len} ranks {ranks}");
                } else {
                    seen.dedup();
                    assert_eq!(seen, (0..len).collect::<Vec<_>>(), "every example is used");
                }
            }
        }
        let mut s = DistributedSampler::new(100, 2, 0, true, 1, false).unwrap();
        let e0 = s.indices();
        s.set_epoch(1);
        assert_ne!(e0, s.indices());
        assert!(DistributedSampler::new(10, 2, 2, true, 0, false).is_err());
    }
}
