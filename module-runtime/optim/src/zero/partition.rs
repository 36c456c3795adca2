//! Which rank owns which parameter, and the check that every rank sharded the same optimizer.

use module_core::Param;
use module_distributed::Collective;

use super::all_sum;
use crate::error::{Error, Result};

/// The owner of each of `sizes` (bytes, in the optimizer's order) among `world` ranks: largest
/// first (ties in order), each to the rank with the fewest bytes so far (ties to the lowest rank),
/// as PyTorch's `ZeroRedundancyOptimizer` partitions (it sorts each group by size, largest first,
/// and gives each parameter to the least loaded rank). The same on every rank for the same sizes.
///
/// ```
/// use module_runtime::optim::partition_sizes;
/// // 100 goes to rank 0, 60 and 50 to rank 1 (110), then 10 to rank 0 (110).
/// assert_eq!(partition_sizes(&[10, 100, 50, 60], 2), [0, 0, 1, 1]);
/// ```
pub fn partition_sizes(sizes: &[usize], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; world];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let rank = (0..world)
            .min_by_key(|&r| (load[r], r))
            .expect("a world has a rank");
        owner[i] = rank;
        load[rank] += sizes[i];
    }
    owner
}

/// FNV-1a, 64 bits: the same on every platform and build.
fn digest(params: &[(String, Param, usize)]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut write = |bytes: &[u8]| {
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    };
    for (path, p, group) in params {
        write(path.as_bytes());
        write(format!("{:?}", p.shape().dims()).as_bytes());
        write(p.dtype().as_str().as_bytes());
        write(&(*group as u64).to_le_bytes());
    }
    h
}

/// Every rank compares its parameters (paths, shapes, dtypes, groups) with rank 0's; a rank
/// that differs makes it an error on every rank, before any state is touched.
pub(super) fn verify_across_ranks(
    comm: &dyn Collective,
    params: &[(String, Param, usize)],
) -> Result<()> {
    let world = comm.world_size();
    let d = digest(params);
    // 16-bit pieces and counts below 2^53 are exact in f64: each rank fills its own row.
    let mine: Vec<f64> = (0..4)
        .map(|i| ((d >> (16 * i)) & 0xffff) as f64)
        .chain([params.len() as f64])
        .collect();
    let mut rows = vec![0.0; 5 * world];
    rows[5 * comm.rank()..5 * comm.rank() + 5].copy_from_slice(&mine);
    let rows = all_sum(comm, &rows)?;
    let mismatched: Vec<usize> = (1..world)
        .filter(|&r| rows[5 * r..5 * r + 5] != rows[..5])
        .collect();
    if mismatched.is_empty() {
        return Ok(());
    }
    Err(Error::ZeroMismatch {
        rank: comm.rank(),
        reason: format!(
            "the optimizers of rank(s) {mismatched:?} train other parameters than rank 0's \
             (paths, shapes, dtypes or groups; this rank: {}, rank 0: {}); make the optimizer \
             identically on every rank",
            params.len(),
            rows[4]
        ),
    })
}
