//! The runtime's random generator, PyTorch's default generator: `manual_seed`, `initial_seed`,
//! `get_rng_state`/`set_rng_state`, and the draws every runtime initializer, dropout and random
//! activation make (`rand`, `randn`).
//!
//! # What it covers
//!
//! One generator for the whole process (ChaCha8, from `rand_chacha`), behind a lock, as PyTorch's
//! default CPU generator is one per process. Everything the runtime draws comes from it:
//!
//! * the layers' initializations ([`Init`](crate::Init)'s random recipes: `Linear`, the
//!   convolutions, `Embedding`, the recurrent layers, `MultiheadAttention`, `Transformer`'s
//!   Xavier reset, and a `Lazy` layer built later), drawn on the CPU and moved to the
//!   parameter's device, so a seed gives the same initial weights on every device;
//! * dropout's masks (`Dropout`, its 1-, 2- and 3-d and alpha variants, attention's dropout, the
//!   fused training kernels and the composed path alike) and `RReLU`'s slopes, drawn on the
//!   input's device: on the CPU from the generator itself; on a CUDA or Metal device by candle's
//!   generator of that device, which the runtime reseeds from this generator before each draw.
//!
//! So [`manual_seed`] makes all of these reproducible on every device, and [`get_rng_state`] is
//! the whole random state a training checkpoint needs. Where PyTorch keeps one generator per
//! device (`torch.cuda.manual_seed`), here the one generator drives every device; and the values
//! differ from PyTorch's for the same seed (another algorithm: what is reproduced is a run of
//! this runtime, not PyTorch's numbers).
//!
//! # What it does not cover
//!
//! * candle's own `Tensor::rand`/`Tensor::randn` in user code, and candle-nn's layers and ops
//!   (`candle_nn::ops::dropout`, a `candle_nn` layer wrapped in `nn::Native`), still draw from
//!   candle's generators (the CPU one is a thread's and cannot be seeded); draw with [`rand()`]
//!   and [`randn`] here to make them reproducible too.
//! * The cost on a GPU: reseeding a CUDA device makes candle create a new cuRAND generator, once
//!   per dropout mask drawn there (not measured here: no GPU was lent to this work). On the CPU
//!   the draws cost what candle's did.
//! * Threads: the generator is shared (thread-safe), so draws made concurrently from several
//!   threads take values in whatever order the threads reach it, as with PyTorch's. A run is
//!   reproducible when its draws come from one thread at a time.
//!
//! A fresh process starts seeded with PyTorch's default seed, `67280421310721`
//! ([`initial_seed`]), so CPU runs are reproducible even without a `manual_seed`, as PyTorch's.

use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};

use candle_core::{DType, Device, Shape, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

use crate::error::{Error, Result};

/// PyTorch's default seed (`c10::default_rng_seed_val`): what [`initial_seed`] returns before any
/// [`manual_seed`].
pub const DEFAULT_SEED: u64 = 67280421310721;

/// The length of [`get_rng_state`]'s tensor: the initial seed (8 bytes), ChaCha's key (32), its
/// stream (8) and its position in words (16), little-endian.
pub const RNG_STATE_LEN: usize = 64;

struct Generator {
    initial_seed: u64,
    rng: ChaCha8Rng,
}

impl Generator {
    fn seeded(seed: u64) -> Self {
        Self {
            initial_seed: seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }
}

static GENERATOR: LazyLock<Mutex<Generator>> =
    LazyLock::new(|| Mutex::new(Generator::seeded(DEFAULT_SEED)));

/// The generator, locked. A panic while it was held cannot leave it half-updated (every update
/// is a draw or a whole replacement), so a poisoned lock is taken as it is.
fn generator() -> MutexGuard<'static, Generator> {
    GENERATOR.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Seeds the runtime's generator, PyTorch's `torch.manual_seed`: every initialization, dropout
/// mask and random activation drawn after it (on any device) is the same from run to run. See the
/// [module](self) for what it covers.
///
/// ```
/// use module_runtime::prelude::*;
/// module_runtime::manual_seed(42);
/// let a = Linear::new(4, 3, &Device::Cpu)?;
/// module_runtime::manual_seed(42);
/// let b = Linear::new(4, 3, &Device::Cpu)?;
/// assert_eq!(a.weight.tensor()?.to_vec2::<f32>()?, b.weight.tensor()?.to_vec2::<f32>()?);
/// assert_eq!(module_runtime::initial_seed(), 42);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn manual_seed(seed: u64) {
    *generator() = Generator::seeded(seed);
}

/// The seed the generator was last seeded with ([`manual_seed`], or [`DEFAULT_SEED`] in a fresh
/// process): PyTorch's `torch.initial_seed`.
pub fn initial_seed() -> u64 {
    generator().initial_seed
}

/// The generator's whole state as a `U8` tensor of [`RNG_STATE_LEN`] bytes, PyTorch's
/// `torch.get_rng_state`: [`set_rng_state`] with it makes the draws that follow repeat those that
/// followed this call. What a training checkpoint saves.
///
/// ```
/// use module_runtime::{get_rng_state, rand, set_rng_state};
/// use module_runtime::prelude::*;
/// let state = get_rng_state()?;
/// let a = rand(0., 1., 5, DType::F32, &Device::Cpu)?;
/// set_rng_state(&state)?;
/// let b = rand(0., 1., 5, DType::F32, &Device::Cpu)?;
/// assert_eq!(a.to_vec1::<f32>()?, b.to_vec1::<f32>()?);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn get_rng_state() -> Result<Tensor> {
    let bytes = generator().to_bytes();
    Ok(Tensor::from_vec(bytes, RNG_STATE_LEN, &Device::Cpu)?)
}

/// Restores a state from [`get_rng_state`], PyTorch's `torch.set_rng_state`. Anything else (another
/// dtype or length) is an [`Error::InvalidInput`] and leaves the generator as it was.
pub fn set_rng_state(state: &Tensor) -> Result<()> {
    if state.dtype() != DType::U8 || state.dims() != [RNG_STATE_LEN] {
        return Err(Error::InvalidInput {
            layer: "set_rng_state",
            message: format!(
                "the state must be the U8 tensor of {RNG_STATE_LEN} bytes get_rng_state returns, \
                 got {:?} {:?}",
                state.dtype(),
                state.dims()
            ),
        });
    }
    let bytes = state.to_device(&Device::Cpu)?.to_vec1::<u8>()?;
    *generator() = Generator::from_bytes(&bytes);
    Ok(())
}

/// Values drawn uniformly from `[lo, up)` with the runtime's generator, of shape `shape`, dtype
/// `dtype` (a floating-point one) and on `device`: candle's `Tensor::rand`, made reproducible by
/// [`manual_seed`]. On the CPU the values are drawn as `f64` for `F64`, as `f32` otherwise; on a
/// CUDA or Metal device by that device's generator, reseeded from this one first.
pub fn rand(
    lo: f64,
    up: f64,
    shape: impl Into<Shape>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    draw(shape.into(), dtype, device, Draw::Uniform { lo, up })
}

/// Values drawn from the normal distribution of mean `mean` and standard deviation `std` with the
/// runtime's generator: candle's `Tensor::randn`, made reproducible by [`manual_seed`] (see
/// [`rand()`] for dtypes and devices).
pub fn randn(
    mean: f64,
    std: f64,
    shape: impl Into<Shape>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    draw(shape.into(), dtype, device, Draw::Normal { mean, std })
}

#[derive(Clone, Copy)]
enum Draw {
    Uniform { lo: f64, up: f64 },
    Normal { mean: f64, std: f64 },
}

fn draw(shape: Shape, dtype: DType, device: &Device, how: Draw) -> Result<Tensor> {
    if !dtype.is_float() {
        return Err(Error::InvalidInput {
            layer: "rand",
            message: format!("random values are drawn in a floating-point dtype, got {dtype:?}"),
        });
    }
    if !device.is_cpu() {
        // The device's own generator, reseeded from ours: the draw is a function of our state.
        let seed = generator().rng.random::<u64>();
        device.set_seed(seed)?;
        let t = match how {
            Draw::Uniform { lo, up } => Tensor::rand(lo as f32, up as f32, shape, device)?,
            Draw::Normal { mean, std } => Tensor::randn(mean as f32, std as f32, shape, device)?,
        };
        return Ok(t.to_dtype(dtype)?);
    }
    let n = shape.elem_count();
    if dtype == DType::F64 {
        let values = generator().values_f64(n, how);
        Ok(Tensor::from_vec(values, shape, device)?)
    } else {
        let values = generator().values_f32(n, how);
        Ok(Tensor::from_vec(values, shape, device)?.to_dtype(dtype)?)
    }
}

impl Generator {
    fn values_f64(&mut self, n: usize, how: Draw) -> Vec<f64> {
        let rng = &mut self.rng;
        match how {
            Draw::Uniform { lo, up } => (0..n)
                .map(|_| lo + (up - lo) * rng.random::<f64>())
                .collect(),
            Draw::Normal { mean, std } => (0..n)
                .map(|_| mean + std * rng.sample::<f64, _>(StandardNormal))
                .collect(),
        }
    }

    fn values_f32(&mut self, n: usize, how: Draw) -> Vec<f32> {
        let rng = &mut self.rng;
        match how {
            Draw::Uniform { lo, up } => {
                let (lo, width) = (lo as f32, (up - lo) as f32);
                (0..n).map(|_| lo + width * rng.random::<f32>()).collect()
            }
            Draw::Normal { mean, std } => {
                let (mean, std) = (mean as f32, std as f32);
                (0..n)
                    .map(|_| mean + std * rng.sample::<f32, _>(StandardNormal))
                    .collect()
            }
        }
    }

    fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(RNG_STATE_LEN);
        bytes.extend(self.initial_seed.to_le_bytes());
        bytes.extend(self.rng.get_seed());
        bytes.extend(self.rng.get_stream().to_le_bytes());
        bytes.extend(self.rng.get_word_pos().to_le_bytes());
        bytes
    }

    /// From [`to_bytes`](Self::to_bytes)'s `RNG_STATE_LEN` bytes.
    fn from_bytes(bytes: &[u8]) -> Self {
        let field = |range: std::ops::Range<usize>| &bytes[range];
        let initial_seed = u64::from_le_bytes(field(0..8).try_into().expect("8 bytes"));
        let key: [u8; 32] = field(8..40).try_into().expect("32 bytes");
        let stream = u64::from_le_bytes(field(40..48).try_into().expect("8 bytes"));
        let pos = u128::from_le_bytes(field(48..64).try_into().expect("16 bytes"));
        let mut rng = ChaCha8Rng::from_seed(key);
        rng.set_stream(stream);
        rng.set_word_pos(pos);
        Self { initial_seed, rng }
    }
}

#[cfg(test)]
mod tests {
    //! On generators of their own: the process's one is shared with every other test thread
    //! (the integration test `seeds` checks it end to end, alone in its process).
    use super::*;

    #[test]
    fn seeded_draws_repeat_and_seeds_differ() {
        let values = |seed: u64| {
            let mut g = Generator::seeded(seed);
            let u = g.values_f32(1000, Draw::Uniform { lo: -1., up: 1. });
            let n = g.values_f64(1000, Draw::Normal { mean: 0., std: 2. });
            (u, n)
        };
        let (a, b, c) = (values(7), values(7), values(8));
        assert_eq!(a, b);
        assert_ne!(a.0, c.0);
        assert!(a.0.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = a.1.iter().sum::<f64>() / 1000.;
        let var = a.1.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 1000.;
        assert!(
            mean.abs() < 0.2 && (var.sqrt() - 2.).abs() < 0.2,
            "{mean} {var}"
        );
    }

    #[test]
    fn a_state_round_trips() {
        let mut g = Generator::seeded(3);
        g.values_f32(17, Draw::Uniform { lo: 0., up: 1. });
        let bytes = g.to_bytes();
        assert_eq!(bytes.len(), RNG_STATE_LEN);
        let normal = Draw::Normal { mean: 0., std: 1. };
        let a = g.values_f32(33, normal);
        let mut h = Generator::from_bytes(&bytes);
        assert_eq!(h.initial_seed, 3);
        assert_eq!(a, h.values_f32(33, normal));
    }

    #[test]
    fn bad_states_and_dtypes_are_refused() -> Result<()> {
        let short = Tensor::zeros(10, DType::U8, &Device::Cpu)?;
        let err = set_rng_state(&short).unwrap_err().to_string();
        assert!(err.contains("64 bytes") && err.contains("[10]"), "{err}");
        let err = rand(0., 1., 3, DType::U32, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(err.contains("U32"), "{err}");
        Ok(())
    }
}
