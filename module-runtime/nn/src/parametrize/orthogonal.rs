//! An orthogonal weight: PyTorch's `torch.nn.utils.parametrizations.orthogonal` ([`Orthogonal`],
//! [`orthogonal`]), with its dynamic trivialization (`use_trivialization=True`, the default) and
//! its three maps: `matrix_exp` and `householder` (PyTorch's default for a square and for a
//! non-square matrix) and `cayley`.

use candle_core::{DType, Device, Tensor};

use super::{register_parametrization, split_path};
use crate::error::Result;
use crate::{Buffer, Module, ModuleExt};
use module_core::ParametrizeError;

/// How [`Orthogonal`] maps its original to an orthogonal matrix (PyTorch's `orthogonal_map`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrthogonalMap {
    /// `exp(A)` of the skew-symmetric `A` made of the original's lower triangle.
    MatrixExp,
    /// The product of the Householder reflectors stored below the original's diagonal.
    Householder,
    /// The Cayley map `(I − A/2)⁻¹ (I + A/2)` of the same skew-symmetric `A` as `MatrixExp`'s.
    Cayley,
}

/// `Q`, an `n × k` matrix with orthonormal columns (or rows, when wider than tall), from its
/// original: PyTorch's `_Orthogonal` with the dynamic trivialization, `Q = base · map(original)`,
/// `base` (the buffer `<layer>.parametrizations.<name>.0.base`) the orthogonalized weight at
/// registration and the original starting as `-I`, so that the weight starts as the orthogonal
/// matrix nearest to the layer's (its QR factor `Q`).
///
/// Matrices only (a 2-D weight, as a `Linear`'s); PyTorch's batches of matrices are not
/// implemented.
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(class_name = "_Orthogonal")]
pub struct Orthogonal {
    /// The trivialization's base, `[n, n]` (`n` the larger side).
    pub base: Buffer,
    /// The map from the original.
    #[module(skip)]
    pub map: OrthogonalMap,
}

/// A float64 matrix, row-major, on the host: what the registration's QR works on.
struct Host64 {
    rows: usize,
    cols: usize,
    v: Vec<f64>,
}

impl Host64 {
    fn of(t: &Tensor) -> Result<Self> {
        let (rows, cols) = t.dims2()?;
        let v = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        Ok(Self { rows, cols, v })
    }

    fn col(&self, j: usize) -> Vec<f64> {
        (0..self.rows).map(|i| self.v[i * self.cols + j]).collect()
    }

    /// The `Q` of `self = Q R` with `R`'s diagonal non-negative (PyTorch's `_make_orthogonal`):
    /// modified Gram–Schmidt, which gives that `Q` directly.
    fn orthogonalized(&self) -> Self {
        let mut q: Vec<Vec<f64>> = Vec::with_capacity(self.cols);
        for j in 0..self.cols {
            let mut v = self.col(j);
            for qi in &q {
                let d: f64 = qi.iter().zip(&v).map(|(a, b)| a * b).sum();
                v.iter_mut().zip(qi).for_each(|(x, y)| *x -= d * y);
            }
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            v.iter_mut()
                .for_each(|x| *x = if norm > 0. { *x / norm } else { 0. });
            q.push(v);
        }
        let mut v = vec![0.; self.rows * self.cols];
        for (j, c) in q.iter().enumerate() {
            for (i, x) in c.iter().enumerate() {
                v[i * self.cols + j] = *x;
            }
        }
        Self { v, ..*self }
    }

    /// Whether `QᵀQ = I` within PyTorch's `_is_orthogonal` tolerance (`10 n ε`).
    fn is_orthogonal(&self, eps: f64) -> bool {
        let tol = 10. * self.rows as f64 * eps;
        (0..self.cols).all(|a| {
            (0..self.cols).all(|b| {
                let d: f64 = (0..self.rows)
                    .map(|i| self.v[i * self.cols + a] * self.v[i * self.cols + b])
                    .sum();
                (d - f64::from(u8::from(a == b))).abs() <= tol
            })
        })
    }

    fn tensor(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_vec(self.v.clone(), (self.rows, self.cols), device)?.to_dtype(dtype)?)
    }
}

/// `exp(a)` of a square matrix: scaling and squaring over a Taylor series of degree 12, with
/// gradients (candle has no `matrix_exp`).
fn matrix_exp(a: &Tensor) -> Result<Tensor> {
    let n = a.dim(0)?;
    let norm: f64 = a
        .detach()
        .abs()?
        .sum(0)?
        .max(0)?
        .to_dtype(DType::F64)?
        .to_scalar()?;
    let squarings = if norm > 0.25 {
        (norm / 0.25).log2().ceil() as i32
    } else {
        0
    };
    let a = (a / 2f64.powi(squarings))?;
    let eye = Tensor::eye(n, a.dtype(), a.device())?;
    let (mut sum, mut term) = (eye.clone(), eye);
    for k in 1..=12 {
        term = (term.matmul(&a)? / k as f64)?;
        sum = (sum + &term)?;
    }
    for _ in 0..squarings {
        sum = sum.matmul(&sum)?;
    }
    Ok(sum)
}

/// `M⁻¹ B` by Gauss–Jordan elimination in tensor ops (so gradients flow through it), without
/// pivoting: the Cayley map's `M = I − A/2`, `A` skew-symmetric, has a positive definite symmetric
/// part (`xᵀMx = |x|²`), so every pivot is nonzero and the elimination is stable. PyTorch's
/// `torch.linalg.solve(M, B)` (candle has no solver).
fn solve(m: &Tensor, b: &Tensor) -> Result<Tensor> {
    let n = m.dim(0)?;
    let eye = Tensor::eye(n, m.dtype(), m.device())?;
    let mut aug = Tensor::cat(&[m, b], 1)?;
    for i in 0..n {
        let row = aug.narrow(0, i, 1)?;
        let row = row.broadcast_div(&row.narrow(1, i, 1)?)?;
        // Row i becomes `row`; every other row r loses `aug[r, i]` times it.
        let col = (aug.narrow(1, i, 1)? - eye.narrow(1, i, 1)?)?;
        aug = (aug - col.matmul(&row)?)?;
    }
    Ok(aug.narrow(1, n, b.dim(1)?)?)
}

/// The first `k` columns of `H₀ H₁ ⋯ H_{k−1}`, `Hᵢ = I − τᵢ vᵢ vᵢᵀ`, `vᵢ` column `i` of `a` (zero
/// on and above the diagonal) plus `eᵢ`: PyTorch's `householder_product(a, tau)`.
fn householder_product(a: &Tensor, tau: &Tensor) -> Result<Tensor> {
    let (n, k) = a.dims2()?;
    let eye = Tensor::eye(n, a.dtype(), a.device())?;
    let mut q = eye.clone();
    for i in 0..k {
        let v = (a.narrow(1, i, 1)? + eye.narrow(1, i, 1)?)?;
        let qv = q.matmul(&v)?;
        let step = qv.matmul(&v.t()?)?.broadcast_mul(&tau.narrow(0, i, 1)?)?;
        q = (q - step)?;
    }
    Ok(q.narrow(1, 0, k)?)
}

/// Ones on and below diagonal `offset` of an `n × k` matrix.
fn tril_mask(n: usize, k: usize, offset: i64, dtype: DType, device: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..n)
        .flat_map(|i| (0..k).map(move |j| f32::from(u8::from(j as i64 <= i as i64 + offset))))
        .collect();
    Ok(Tensor::from_vec(v, (n, k), device)?.to_dtype(dtype)?)
}

impl super::Parametrization for Orthogonal {
    fn forward(&self, originals: &[Tensor]) -> Result<Tensor> {
        let [x] = originals else {
            return Err(ParametrizeError::Invalid {
                path: String::new(),
                message: format!(
                    "orthogonal computes a matrix from one tensor, got {}",
                    originals.len()
                ),
            }
            .into());
        };
        let (rows, cols) = x.dims2()?;
        let transposed = rows < cols;
        let x = if transposed { x.t()? } else { x.clone() };
        let (n, k) = x.dims2()?;
        let (dtype, device) = (x.dtype(), x.device().clone());
        let q = match self.map {
            OrthogonalMap::MatrixExp | OrthogonalMap::Cayley => {
                let mut low = (&x * tril_mask(n, k, 0, dtype, &device)?)?;
                if n != k {
                    low = Tensor::cat(&[&low, &Tensor::zeros((n, n - k), dtype, &device)?], 1)?;
                }
                let a = (&low - low.t()?)?;
                let q = if self.map == OrthogonalMap::Cayley {
                    let eye = Tensor::eye(n, dtype, &device)?;
                    solve(&(&eye - (&a * 0.5)?)?, &(&eye + (&a * 0.5)?)?)?
                } else {
                    matrix_exp(&a)?
                };
                q.narrow(1, 0, k)?
            }
            OrthogonalMap::Householder => {
                let a = (&x * tril_mask(n, k, -1, dtype, &device)?)?;
                let tau = (a.sqr()?.sum(0)? + 1.)?.recip()?.affine(2., 0.)?;
                let q = householder_product(&a, &tau)?;
                // PyTorch's `X.diagonal().int()`: truncated towards zero, no gradient.
                let diag =
                    (x.detach() * Tensor::eye(n, dtype, &device)?.narrow(1, 0, k)?)?.sum(0)?;
                let trunc = (diag.abs()?.floor()? * diag.sign()?)?;
                q.broadcast_mul(&trunc.unsqueeze(0)?)?
            }
        };
        let q = self.base.tensor()?.matmul(&q)?;
        Ok(if transposed { q.t()? } else { q })
    }

    fn right_inverse(&self, value: &Tensor) -> Result<Vec<Tensor>> {
        let (rows, cols) = value.dims2()?;
        let q = if rows < cols {
            value.t()?
        } else {
            value.clone()
        };
        let (n, k) = q.dims2()?;
        let (dtype, device) = (value.dtype(), value.device().clone());
        let eps = match dtype {
            DType::F64 => f64::EPSILON,
            DType::F16 => 0.0009765625,
            DType::BF16 => 0.0078125,
            _ => f64::from(f32::EPSILON),
        };
        let host = Host64::of(&q)?;
        let base = if n == k {
            if host.is_orthogonal(eps) {
                host
            } else {
                host.orthogonalized()
            }
        } else {
            // Completed to a square matrix with normal draws, then orthogonalized.
            let extra = module_core::randn(0., 1., (n, n - k), dtype, &device)?;
            Host64::of(&Tensor::cat(&[&q, &extra], 1)?)?.orthogonalized()
        };
        self.base.replace(base.tensor(dtype, &device)?);
        let neg_eye = (Tensor::eye(rows.max(cols), dtype, &device)?
            .narrow(0, 0, rows)?
            .narrow(1, 0, cols)?
            * -1.)?;
        Ok(vec![neg_eye])
    }
}

/// An orthogonal parametrization of the matrix at `path`: PyTorch's
/// `torch.nn.utils.parametrizations.orthogonal(module, name, orthogonal_map)`, with
/// `orthogonal_map` `None` for PyTorch's default (`MatrixExp` for a square matrix, `Householder`
/// otherwise). The weight starts as the orthogonal matrix nearest the layer's and stays
/// orthogonal however its original (`<layer>.parametrizations.<name>.original`) is trained.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::parametrize::{orthogonal, parametrized_tensor};
///
/// let mut fc = Linear::new(20, 40, &Device::Cpu)?;
/// orthogonal(&mut fc, "weight", None)?;
/// let q = parametrized_tensor(&fc, "weight")?;
/// let qtq = q.t()?.matmul(&q)?;
/// let eye = Tensor::eye(20, DType::F32, &Device::Cpu)?;
/// assert!((qtq - eye)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn orthogonal<M: ModuleExt + ?Sized>(
    model: &mut M,
    path: &str,
    orthogonal_map: Option<OrthogonalMap>,
) -> Result<()> {
    let weight = module_core::without_grad(|| super::parametrized_tensor(model.as_dyn(), path))?;
    if super::is_parametrized(model, path) {
        return Err(ParametrizeError::Invalid {
            path: path.to_owned(),
            message: "orthogonal must be the first parametrization of its tensor".into(),
        }
        .into());
    }
    let Ok((rows, cols)) = weight.dims2() else {
        let (_, name) = split_path(path);
        return Err(ParametrizeError::Invalid {
            path: path.to_owned(),
            message: format!(
                "orthogonal takes a matrix; `{name}` has shape {:?} (batches of matrices are not \
                 supported)",
                weight.dims()
            ),
        }
        .into());
    };
    let map = orthogonal_map.unwrap_or(if rows == cols {
        OrthogonalMap::MatrixExp
    } else {
        OrthogonalMap::Householder
    });
    let n = rows.max(cols);
    let base = Buffer::new(Tensor::zeros((n, n), weight.dtype(), weight.device())?);
    register_parametrization(model, path, Orthogonal { base, map })
}
