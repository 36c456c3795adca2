//! In-place element-wise updates of a float32 CPU parameter from its gradient and state buffers:
//! the optimizers' fused step ([`update_in_place`] over a [`ChunkRule`], split into chunks over
//! the barrier pool by [`chunked_update`]), each chunk compiled for AVX2 where the CPU has it.

use std::cell::RefCell;

use candle_core::{CpuStorage, Layout, Tensor};

use crate::capability::CpuCapability;
use crate::error::Result;
use crate::pool::par_map;

/// Elements per parallel task: big enough that scheduling costs nothing next to the pass, small
/// enough that a large parameter keeps every thread busy.
const CHUNK: usize = 1 << 14;

/// An element-wise update over one chunk of a parameter, its gradient and its state buffers. The
/// implementing type carries the update's flags as const generics, so each combination compiles
/// to its own loop without branches, which the compiler vectorizes.
pub trait ChunkRule {
    /// The step's constants.
    type Consts: Sync;
    /// The state buffers the pass walks beside the parameter.
    type State<'a>: StateChunks;
    /// The update of one chunk (`p`, `g` and `state` of one length).
    fn chunk(k: &Self::Consts, p: &mut [f32], g: &[f32], state: Self::State<'_>);
}

/// State buffers the size of their parameter, split into chunks as the parameter is.
pub trait StateChunks: Send + Sized {
    /// The values before `mid` and those from `mid` on.
    fn split(self, mid: usize) -> (Self, Self);
}

impl StateChunks for &mut [f32] {
    fn split(self, mid: usize) -> (Self, Self) {
        self.split_at_mut(mid)
    }
}

/// A buffer the update may not keep (AMSGrad's maximum, SGD's momentum).
impl StateChunks for Option<&mut [f32]> {
    fn split(self, mid: usize) -> (Self, Self) {
        match self {
            Some(b) => {
                let (head, tail) = b.split_at_mut(mid);
                (Some(head), Some(tail))
            }
            None => (None, None),
        }
    }
}

/// [`ChunkRule::chunk`] compiled for AVX2 (8 lanes instead of SSE2's 4). The results are the
/// same bits: the compiler fuses no multiply-add without being told to, and AVX's division and
/// square root are IEEE's, as SSE's are.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn chunk_avx2<R: ChunkRule>(k: &R::Consts, p: &mut [f32], g: &[f32], state: R::State<'_>) {
    R::chunk(k, p, g, state);
}

/// [`ChunkRule::chunk`], through [`chunk_avx2`] where `level` (the optimizer's in
/// [`kernel_choice`](crate::kernel_choice), read on the calling thread) allows and the CPU has AVX2.
fn chunk_best<R: ChunkRule>(
    level: CpuCapability,
    k: &R::Consts,
    p: &mut [f32],
    g: &[f32],
    state: R::State<'_>,
) {
    #[cfg(target_arch = "x86_64")]
    if level >= CpuCapability::Avx2 && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, the one feature `chunk_avx2` is compiled for (checked just
        // above; the detection is cached, so this costs one load per chunk).
        unsafe { chunk_avx2::<R>(k, p, g, state) };
        return;
    }
    let _ = level;
    R::chunk(k, p, g, state);
}

/// The update `R` over a whole parameter, in chunks of 16,384 values split over candle's barrier
/// pool (a parameter of one chunk stays on the calling thread): the step runs one pass per
/// parameter, right after the backward's kernels ran on the same pool, whose threads spin between
/// calls (rayon's sleeping workers would be woken, and left spinning beside it, once per
/// parameter).
pub fn chunked_update<R: ChunkRule>(k: &R::Consts, p: &mut [f32], g: &[f32], state: R::State<'_>) {
    let level = crate::kernel_choice().optimizer;
    if p.len() <= CHUNK {
        return chunk_best::<R>(level, k, p, g, state);
    }
    let mut chunks = Vec::with_capacity(p.len().div_ceil(CHUNK));
    let (mut p, mut g, mut state) = (p, g, state);
    while p.len() > CHUNK {
        let (p_head, p_tail) = p.split_at_mut(CHUNK);
        let (g_head, g_tail) = g.split_at(CHUNK);
        let (s_head, s_tail) = state.split(CHUNK);
        chunks.push((p_head, g_head, s_head));
        (p, g, state) = (p_tail, g_tail, s_tail);
    }
    chunks.push((p, g, state));
    par_map(chunks, |(p, g, state)| {
        chunk_best::<R>(level, k, p, g, state)
    });
}

/// Runs `f(parameter values, gradient values)` with the values of the parameter tensor `p`
/// writable in place: both contiguous float32 CPU tensors of one element count (an error
/// otherwise).
pub fn update_in_place<F: FnOnce(&mut [f32], &[f32])>(p: &Tensor, g: &Tensor, f: F) -> Result<()> {
    Ok(p.inplace_op2(g, &InPlace(RefCell::new(Some(f))))?)
}

/// The in-place candle op of [`update_in_place`].
struct InPlace<F>(RefCell<Option<F>>);

impl<F: FnOnce(&mut [f32], &[f32])> candle_core::InplaceOp2 for InPlace<F> {
    fn name(&self) -> &'static str {
        "module-optim-fused-update"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let name = self.name();
        let (CpuStorage::F32(p), CpuStorage::F32(g)) = (s1, s2) else {
            candle_core::bail!("{name}: the parameter and its gradient must be float32")
        };
        let (Some((p0, p1)), Some((g0, g1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            return Err(candle_core::Error::RequiresContiguous { op: name });
        };
        if p1 - p0 != g1 - g0 {
            candle_core::bail!(
                "{name}: the parameter has {} values, its gradient {}",
                p1 - p0,
                g1 - g0
            )
        }
        let Some(f) = self.0.borrow_mut().take() else {
            candle_core::bail!("{name}: ran twice")
        };
        f(&mut p[p0..p1], &g[g0..g1]);
        Ok(())
    }
}
