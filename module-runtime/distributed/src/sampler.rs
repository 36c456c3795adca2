//! [`DistributedSampler`]: each rank's share of a dataset's indices, PyTorch's way.

use super::{Collective, DistributedError};
use crate::Result;

/// Splits the indices `0..len` of a dataset among the ranks, as PyTorch's
/// `torch.utils.data.DistributedSampler` does, with the same index lists:
///
/// * With `shuffle` (the default), the indices are permuted from the seed `seed + epoch`, by
///   PyTorch's own algorithm (`torch.randperm` on a CPU generator: a Fisher–Yates shuffle on
///   MT19937), so all ranks, which share the seed, agree on the permutation, and it changes
///   with [`set_epoch`](Self::set_epoch) — call it at the start of every epoch, as in PyTorch,
///   or every epoch sees the same order.
/// * Without `drop_last` (the default), the list is padded to a multiple of the world size by
///   repeating it from its start, so every rank gets `ceil(len / world)` indices and some
///   samples are seen twice per epoch (which biases evaluation metrics slightly). With
///   `drop_last`, the tail is dropped instead: `floor(len / world)` each.
/// * Rank `r` takes every `world`-th index starting at `r`, so the ranks' lists are disjoint
///   (apart from the padding) and cover the dataset.
///
/// ```
/// use module_runtime::distributed::DistributedSampler;
///
/// let r0 = DistributedSampler::new(5, 2, 0)?.shuffle(false);
/// let r1 = DistributedSampler::new(5, 2, 1)?.shuffle(false);
/// assert_eq!(r0.indices(), [0, 2, 4]);
/// assert_eq!(r1.indices(), [1, 3, 0]); // padded with index 0
/// assert_eq!(r1.clone().drop_last(true).indices(), [1, 3]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler over `len` samples for rank `rank` of `num_replicas`, shuffling with seed 0 and
    /// padding (PyTorch's defaults).
    pub fn new(len: usize, num_replicas: usize, rank: usize) -> Result<Self> {
        if num_replicas == 0 || rank >= num_replicas {
            return Err(DistributedError::InvalidRank {
                rank,
                world_size: num_replicas,
            }
            .into());
        }
        Ok(DistributedSampler {
            len,
            num_replicas,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
        })
    }

    /// A sampler for this process's rank in `comm`.
    pub fn for_collective(len: usize, comm: &dyn Collective) -> Result<Self> {
        Self::new(len, comm.world_size(), comm.rank())
    }

    /// Whether to permute the indices each epoch (default: yes).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The seed shared by all ranks (default 0); the permutation of an epoch uses `seed + epoch`.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drop the tail instead of padding (default: pad).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch, which reseeds the shuffle: call it at the start of every epoch on every
    /// rank.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many indices each rank gets (PyTorch's `len(sampler)`).
    pub fn num_samples(&self) -> usize {
        if self.drop_last && !self.len.is_multiple_of(self.num_replicas) {
            self.len / self.num_replicas
        } else {
            self.len.div_ceil(self.num_replicas)
        }
    }

    /// The length of the padded (or trimmed) list split among the ranks.
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.num_replicas
    }

    /// This rank's indices for the current epoch.
    pub fn indices(&self) -> Vec<usize> {
        let mut indices: Vec<usize> = if self.shuffle {
            randperm(self.len, self.seed.wrapping_add(self.epoch))
        } else {
            (0..self.len).collect()
        };
        let total = self.total_size();
        if indices.len() < total {
            let padding: Vec<usize> = indices
                .iter()
                .copied()
                .cycle()
                .take(total - indices.len())
                .collect();
            indices.extend(padding);
        } else {
            indices.truncate(total);
        }
        indices
            .into_iter()
            .skip(self.rank)
            .step_by(self.num_replicas)
            .collect()
    }
}

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` on the CPU: PyTorch's
/// Fisher–Yates (`r[i] <-> r[i + random() % (n - i)]`) on its MT19937, which takes the seed's low
/// 32 bits.
pub(crate) fn randperm(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = Mt19937::new(seed as u32);
    let mut r: Vec<usize> = (0..n).collect();
    for i in 0..n.saturating_sub(1) {
        let z = (u64::from(rng.next_u32()) % (n - i) as u64) as usize;
        r.swap(i, i + z);
    }
    r
}

/// The 32-bit Mersenne Twister (`std::mt19937`, and PyTorch's CPU generator).
pub(crate) struct Mt19937 {
    state: [u32; 624],
    index: usize,
}

impl Mt19937 {
    pub(crate) fn new(seed: u32) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed;
        for i in 1..624 {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { state, index: 624 }
    }

    pub(crate) fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            for i in 0..624 {
                let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % 624] & 0x7fff_ffff);
                let mut next = self.state[(i + 397) % 624] ^ (y >> 1);
                if y & 1 != 0 {
                    next ^= 0x9908_b0df;
                }
                self.state[i] = next;
            }
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_matches_the_standard() {
        // The C++ standard requires the 10000th output of a default-seeded (5489) mt19937.
        let mut rng = Mt19937::new(5489);
        assert_eq!(rng.next_u32(), 3_499_211_612);
        let mut rng = Mt19937::new(5489);
        let last = (0..10_000).map(|_| rng.next_u32()).last();
        assert_eq!(last, Some(4_123_659_995));
        let mut rng = Mt19937::new(0);
        assert_eq!(rng.next_u32(), 2_357_136_044);
    }

    #[test]
    fn randperm_is_fisher_yates_on_mt19937() {
        // Seed 0 draws 2357136044, 2546248239, 3071714933: z = 0 (mod 4), 0 (mod 3), 1 (mod 2).
        assert_eq!(randperm(4, 0), [0, 1, 3, 2]);
        assert_eq!(randperm(0, 0), Vec::<usize>::new());
        assert_eq!(randperm(1, 7), [0]);
        let mut p = randperm(1000, 42);
        p.sort_unstable();
        assert_eq!(p, (0..1000).collect::<Vec<_>>());
    }
}
