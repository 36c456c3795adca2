//! Weight normalization and spectral normalization as parametrizations: PyTorch's
//! `torch.nn.utils.parametrizations.weight_norm` and `spectral_norm` ([`WeightNorm`],
//! [`SpectralNorm`] and the functions registering them by path).

use candle_core::Tensor;

use super::{host_ref, register_parametrization, split_path};
use crate::error::Result;
use crate::{Buffer, Mode, Module, ModuleExt};
use module_core::ParametrizeError;

/// `w = g · v / ‖v‖`, the norm taken over every dimension but `dim` (over all of them without
/// one): PyTorch's `_WeightNorm`. Its originals are `g` (`original0`, the weight's shape with
/// every dimension but `dim` of size 1, or a scalar) and `v` (`original1`, the weight's shape).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(class_name = "_WeightNorm")]
pub struct WeightNorm {
    /// The dimension kept by the norm (`None`: the norm of the whole tensor).
    #[module(skip)]
    pub dim: Option<usize>,
}

impl WeightNorm {
    /// `v`'s norm over every dimension but `dim`: PyTorch's `norm_except_dim(v, 2, dim)`, of
    /// `v`'s rank with every other dimension of size 1, or a scalar without `dim`.
    fn norm_except_dim(&self, v: &Tensor) -> Result<Tensor> {
        let sq = v.sqr()?;
        let Some(dim) = self.dim else {
            return Ok(sq.sum_all()?.sqrt()?);
        };
        let mut s = sq;
        for d in 0..v.rank() {
            if d != dim {
                s = s.sum_keepdim(d)?;
            }
        }
        Ok(s.sqrt()?)
    }
}

impl super::Parametrization for WeightNorm {
    fn forward(&self, originals: &[Tensor]) -> Result<Tensor> {
        let [g, v] = originals else {
            return Err(ParametrizeError::Invalid {
                path: String::new(),
                message: format!(
                    "weight norm computes a weight from two originals (g, v), got {}: it must be \
                     the first parametrization of its tensor",
                    originals.len()
                ),
            }
            .into());
        };
        // PyTorch's `_weight_norm(v, g, dim)`: v * (g / norm_except_dim(v)).
        let scale = g.broadcast_div(&self.norm_except_dim(v)?)?;
        Ok(v.broadcast_mul(&scale)?)
    }

    fn right_inverse(&self, weight: &Tensor) -> Result<Vec<Tensor>> {
        Ok(vec![self.norm_except_dim(weight)?, weight.clone()])
    }
}

/// `w / σ(w)`, `σ` the largest singular value of the weight seen as a matrix (dimension `dim`
/// first, the others flattened), estimated by power iteration: PyTorch's `_SpectralNorm`.
///
/// Its buffers `_u` `[h]` and `_v` `[w]` (for a weight of two or more dimensions) hold the
/// estimated singular vectors: drawn from the normal distribution (the runtime's generator,
/// [`manual_seed`](module_core::manual_seed)), normalized, and refined by 15 iterations when registered;
/// then `n_power_iterations` more on every forward in training mode, none in eval. A 1-D weight is
/// divided by its norm and has no buffers.
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(class_name = "_SpectralNorm")]
pub struct SpectralNorm {
    /// The first left singular vector's estimate, `[h]`.
    #[module(rename = "_u")]
    pub u: Option<Buffer>,
    /// The first right singular vector's estimate, `[w]`.
    #[module(rename = "_v")]
    pub v: Option<Buffer>,
    /// Training mode: power iterations on each forward.
    pub mode: Mode,
    /// Iterations per forward in training mode.
    #[module(skip)]
    pub n_power_iterations: usize,
    /// The dimension of the outputs (the matrix's rows).
    #[module(skip)]
    pub dim: usize,
    /// The norms' floor.
    #[module(skip)]
    pub eps: f64,
}

/// The options of [`spectral_norm`], with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpectralNormOptions {
    /// Power iterations per forward in training mode (default 1).
    pub n_power_iterations: usize,
    /// The floor of the norms (default `1e-12`).
    pub eps: f64,
    /// The dimension of the outputs: default (`None`) 0, or 1 for a `ConvTranspose`.
    pub dim: Option<usize>,
}

impl Default for SpectralNormOptions {
    fn default() -> Self {
        Self {
            n_power_iterations: 1,
            eps: 1e-12,
            dim: None,
        }
    }
}

/// `x / max(‖x‖, eps)`: PyTorch's `F.normalize(x, dim=0, eps)` of a vector.
fn normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    let norm = x.sqr()?.sum_all()?.sqrt()?.maximum(eps)?;
    Ok(x.broadcast_div(&norm)?)
}

impl SpectralNorm {
    /// The parametrization of `weight` (its buffers drawn and refined by 15 iterations, as
    /// PyTorch's constructor does); `path` names the weight in errors.
    pub fn new(weight: &Tensor, options: SpectralNormOptions, path: &str) -> Result<Self> {
        let invalid = |message: String| ParametrizeError::Invalid {
            path: path.to_owned(),
            message,
        };
        let dim = options.dim.unwrap_or(0);
        if dim >= weight.rank().max(1) {
            return Err(invalid(format!(
                "spectral norm's dim {dim} is out of range for a weight of shape {:?}",
                weight.dims()
            ))
            .into());
        }
        if options.n_power_iterations == 0 {
            return Err(invalid("n_power_iterations must be positive, got 0".into()).into());
        }
        let mut sn = Self {
            u: None,
            v: None,
            mode: Mode::new(),
            n_power_iterations: options.n_power_iterations,
            dim,
            eps: options.eps,
        };
        if weight.rank() > 1 {
            let mat = sn.matrix(&weight.detach())?;
            let (h, w) = mat.dims2()?;
            let draw = |n| module_core::randn(0., 1., n, mat.dtype(), mat.device());
            let u = normalize(&draw(h)?, sn.eps)?;
            let v = normalize(&draw(w)?, sn.eps)?;
            sn.u = Some(Buffer::new(u));
            sn.v = Some(Buffer::new(v));
            sn.power_method(&mat, 15)?;
        }
        Ok(sn)
    }

    /// The weight as a matrix: `dim` first, the other dimensions flattened.
    fn matrix(&self, weight: &Tensor) -> Result<Tensor> {
        let w = if self.dim == 0 {
            weight.clone()
        } else {
            let mut order: Vec<usize> = vec![self.dim];
            order.extend((0..weight.rank()).filter(|&d| d != self.dim));
            weight.permute(order)?
        };
        Ok(w.flatten_from(1)?)
    }

    /// `n` power iterations on the detached matrix, written into `_u` and `_v`.
    fn power_method(&self, mat: &Tensor, n: usize) -> Result<()> {
        let (Some(u_buf), Some(v_buf)) = (&self.u, &self.v) else {
            return Ok(());
        };
        let mat = mat.detach();
        let (mut u, mut v) = (u_buf.tensor()?, v_buf.tensor()?);
        for _ in 0..n {
            u = normalize(&mat.matmul(&v.unsqueeze(1)?)?.squeeze(1)?, self.eps)?;
            v = normalize(&mat.t()?.matmul(&u.unsqueeze(1)?)?.squeeze(1)?, self.eps)?;
        }
        u_buf.set(&u)?;
        v_buf.set(&v)?;
        Ok(())
    }
}

impl super::Parametrization for SpectralNorm {
    fn forward(&self, originals: &[Tensor]) -> Result<Tensor> {
        let [weight] = originals else {
            return Err(ParametrizeError::Invalid {
                path: String::new(),
                message: format!(
                    "spectral norm computes a weight from one tensor, got {}",
                    originals.len()
                ),
            }
            .into());
        };
        let (Some(u), Some(v)) = (&self.u, &self.v) else {
            return normalize(weight, self.eps);
        };
        let mat = self.matrix(weight)?;
        if self.mode.is_training() {
            self.power_method(&mat, self.n_power_iterations)?;
        }
        let (u, v) = (u.tensor()?, v.tensor()?);
        // σ = uᵀ W v, with gradients through W only.
        let sigma = u
            .unsqueeze(0)?
            .matmul(&mat.matmul(&v.unsqueeze(1)?)?)?
            .squeeze(1)?
            .squeeze(0)?;
        Ok(weight.broadcast_div(&sigma)?)
    }
}

/// Weight normalization on the tensor at `path` (`"conv1.weight"`): PyTorch's
/// `torch.nn.utils.parametrizations.weight_norm(module, name, dim)`. The tensor becomes
/// `g · v / ‖v‖` with `g` at `<layer>.parametrizations.<name>.original0` and `v` at `original1`
/// (their initial values give the tensor its current value); `dim` is the dimension kept by the
/// norm (PyTorch's default 0; `None` for the norm of the whole tensor).
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::parametrize::{parametrized_tensor, weight_norm};
///
/// let mut fc = Linear::new(20, 40, &Device::Cpu)?;
/// let before = fc.weight.tensor()?;
/// weight_norm(&mut fc, "weight", Some(0))?;
/// assert_eq!(fc.get_parameter("parametrizations.weight.original0")?.shape().dims(), [40, 1]);
/// assert_eq!(fc.get_parameter("parametrizations.weight.original1")?.shape().dims(), [40, 20]);
/// let after = parametrized_tensor(&fc, "weight")?;
/// assert!((after - before)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn weight_norm<M: ModuleExt + ?Sized>(
    model: &mut M,
    path: &str,
    dim: Option<usize>,
) -> Result<()> {
    let (layer, name) = split_path(path);
    let rank = host_ref(model.as_dyn(), layer)?
        .tensor(name)
        .map(|p| p.shape().rank());
    if let (Some(d), Some(rank)) = (dim, rank)
        && d >= rank
    {
        return Err(ParametrizeError::Invalid {
            path: path.to_owned(),
            message: format!("weight norm's dim {d} is out of range for a {rank}-D tensor"),
        }
        .into());
    }
    register_parametrization(model, path, WeightNorm { dim })
}

/// Spectral normalization on the tensor at `path`: PyTorch's
/// `torch.nn.utils.parametrizations.spectral_norm(module, name, n_power_iterations, eps, dim)`.
/// The tensor becomes `w / σ(w)` ([`SpectralNorm`]), with the weight at
/// `<layer>.parametrizations.<name>.original` and the power iteration's vectors at
/// `<layer>.parametrizations.<name>.0._u` and `._v`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::parametrize::{parametrized_tensor, spectral_norm, SpectralNormOptions};
/// use module_runtime::nn::Conv2d;
///
/// let mut conv = Conv2d::new(3, 8, 3, &Device::Cpu)?;
/// spectral_norm(&mut conv, "weight", SpectralNormOptions::default())?;
/// let keys: Vec<String> = conv.state_dict()?.keys().map(str::to_owned).collect();
/// assert_eq!(keys, ["bias", "parametrizations.weight.original",
///                   "parametrizations.weight.0._u", "parametrizations.weight.0._v"]);
/// conv.eval(); // no power iteration in eval
/// assert_eq!(parametrized_tensor(&conv, "weight")?.dims(), [8, 3, 3, 3]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn spectral_norm<M: ModuleExt + ?Sized>(
    model: &mut M,
    path: &str,
    options: SpectralNormOptions,
) -> Result<()> {
    let (layer, _) = split_path(path);
    let host = host_ref(model.as_dyn(), layer)?;
    let options = SpectralNormOptions {
        dim: Some(options.dim.unwrap_or(usize::from(host.transposed()))),
        ..options
    };
    // The tensor's current value: PyTorch's `getattr(module, name)`, parametrized or not.
    let weight = module_core::without_grad(|| super::parametrized_tensor(model.as_dyn(), path))?;
    let sn = SpectralNorm::new(&weight, options, path)?;
    register_parametrization(model, path, sn)
}
