//! Padding layers: PyTorch's `ZeroPad1d/2d/3d`, `ConstantPad1d/2d/3d`, `ReflectionPad1d/2d/3d`,
//! `ReplicationPad1d/2d/3d` and `CircularPad1d/2d/3d`, one generic type, [`Pad`], over the number
//! of padded dimensions and the [`PadMode`], with PyTorch's names as aliases (and in summaries).
//!
//! `padding` is PyTorch's: one size for every side, or `(before, after)` per padded dimension,
//! **last dimension first** (`(left, right, top, bottom)` for a 2-D pad). The last `N` dimensions
//! are padded. Reflection, replication and circular padding read the input at computed positions
//! (`index_select`), so their gradients sum onto the elements that were copied, as PyTorch's do.
//! PyTorch's negative padding (cropping) is not supported: sizes are `usize`.

use std::fmt::Debug;

use candle_core::Tensor;
use module_core::{py_float, py_tuple, ExtraRepr};

use crate::common::input_shape_error;
use crate::error::Result;
use crate::{Forward, Module};

/// How a [`Pad`] fills the border: [`Zeros`], [`Constant`], [`Reflect`], [`Replicate`] or
/// [`Circular`] (PyTorch's `F.pad` modes).
pub trait PadMode: Clone + Debug + Send + Sync + 'static {
    /// PyTorch's class names for 1, 2 and 3 padded dimensions (`"ReflectionPad1d"`, …).
    const LAYERS: [&'static str; 3];

    /// Whether the mode fills with a value (zeros or a constant), which pads inputs of any rank of
    /// at least `N`; the others take PyTorch's `[C, *]` or `[N, C, *]`.
    const CONSTANT: bool;

    /// `x` padded along `dim` by `before` and `after`, or `None` if the size along `dim` is too
    /// small for this mode.
    fn pad(&self, x: &Tensor, dim: usize, before: usize, after: usize) -> Result<Option<Tensor>>;

    /// The rule a too-small dimension broke, for the error message.
    fn size_rule(&self) -> &'static str {
        ""
    }

    /// PyTorch's `extra_repr` of the layer, given its padding as a Python tuple: the tuple
    /// itself (`(1, 2, 3, 4)`) for most modes.
    fn extra_repr(&self, padding: &str) -> String {
        padding.to_owned()
    }
}

/// Pads with zeros (PyTorch's `ZeroPad1d/2d/3d`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Zeros;

/// Pads with `value` (PyTorch's `ConstantPad1d/2d/3d`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Constant {
    /// The fill value.
    pub value: f64,
}

/// Mirrors the input without repeating the edge: `[a b c]` padded by 2 on the left reads
/// `[c b a b c]` (PyTorch's `ReflectionPad1d/2d/3d`). Each padding must be smaller than the
/// dimension.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reflect;

/// Repeats the edge value: `[a b c]` padded by 2 on the left reads `[a a a b c]` (PyTorch's
/// `ReplicationPad1d/2d/3d`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Replicate;

/// Wraps around: `[a b c]` padded by 2 on the left reads `[b c a b c]` (PyTorch's
/// `CircularPad1d/2d/3d`). Each padding must be at most the dimension.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Circular;

/// `x` along `dim` at the positions `source(i)` for `i` in `-before..n + after`.
fn gather_along(
    x: &Tensor,
    dim: usize,
    before: usize,
    after: usize,
    source: impl Fn(isize, isize) -> isize,
) -> Result<Tensor> {
    let n = x.dim(dim)? as isize;
    let ids: Vec<u32> = (-(before as isize)..n + after as isize)
        .map(|i| source(i, n) as u32)
        .collect();
    let ids = Tensor::new(ids, x.device())?;
    Ok(x.contiguous()?.index_select(&ids, dim)?)
}

/// `x` with `before` and `after` copies of `value` along `dim`.
fn fill_along(x: &Tensor, dim: usize, before: usize, after: usize, value: f64) -> Result<Tensor> {
    let side = |count: usize| -> Result<Tensor> {
        let mut dims = x.dims().to_vec();
        dims[dim] = count;
        let zeros = Tensor::zeros(dims, x.dtype(), x.device())?;
        Ok(if value == 0.0 {
            zeros
        } else {
            zeros.affine(1.0, value)?
        })
    };
    Ok(Tensor::cat(&[&side(before)?, x, &side(after)?], dim)?)
}

impl PadMode for Zeros {
    const LAYERS: [&'static str; 3] = ["ZeroPad1d", "ZeroPad2d", "ZeroPad3d"];
    const CONSTANT: bool = true;

    fn pad(&self, x: &Tensor, dim: usize, before: usize, after: usize) -> Result<Option<Tensor>> {
        fill_along(x, dim, before, after, 0.0).map(Some)
    }
}

impl PadMode for Constant {
    const LAYERS: [&'static str; 3] = ["ConstantPad1d", "ConstantPad2d", "ConstantPad3d"];
    const CONSTANT: bool = true;

    fn pad(&self, x: &Tensor, dim: usize, before: usize, after: usize) -> Result<Option<Tensor>> {
        fill_along(x, dim, before, after, self.value).map(Some)
    }

    fn extra_repr(&self, padding: &str) -> String {
        format!("padding={padding}, value={}", py_float(self.value))
    }
}

impl PadMode for Reflect {
    const LAYERS: [&'static str; 3] = ["ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d"];
    const CONSTANT: bool = false;

    fn pad(&self, x: &Tensor, dim: usize, before: usize, after: usize) -> Result<Option<Tensor>> {
        let n = x.dim(dim)?;
        if before >= n || after >= n {
            return Ok(None);
        }
        let reflect = |i: isize, n: isize| {
            let i = i.abs();
            if i >= n {
                2 * (n - 1) - i
            } else {
                i
            }
        };
        gather_along(x, dim, before, after, reflect).map(Some)
    }

    fn size_rule(&self) -> &'static str {
        "each padding smaller than the padded dimension"
    }
}

impl PadMode for Replicate {
    const LAYERS: [&'static str; 3] = ["ReplicationPad1d", "ReplicationPad2d", "ReplicationPad3d"];
    const CONSTANT: bool = false;

    fn pad(&self, x: &Tensor, dim: usize, before: usize, after: usize) -> Result<Option<Tensor>> {
        if x.dim(dim)? == 0 {
            return Ok(None);
        }
        gather_along(x, dim, before, after, |i, n| i.clamp(0, n - 1)).map(Some)
    }

    fn size_rule(&self) -> &'static str {
        "no empty padded dimension"
    }
}

impl PadMode for Circular {
    const LAYERS: [&'static str; 3] = ["CircularPad1d", "CircularPad2d", "CircularPad3d"];
    const CONSTANT: bool = false;

    fn pad(&self, x: &Tensor, dim: usize, before: usize, after: usize) -> Result<Option<Tensor>> {
        let n = x.dim(dim)?;
        if n == 0 || before > n || after > n {
            return Ok(None);
        }
        gather_along(x, dim, before, after, isize::rem_euclid).map(Some)
    }

    fn size_rule(&self) -> &'static str {
        "each padding at most the padded dimension"
    }
}

/// PyTorch's `padding` argument of an `N`-dimensional pad: one size for every side (`2`), or
/// `(before, after)` per dimension, last dimension first: `(left, right)` for 1-D,
/// `(left, right, top, bottom)` for 2-D, `(left, right, top, bottom, front, back)` for 3-D (as a
/// tuple or an array).
pub trait Padding<const N: usize> {
    /// `(before, after)` per padded dimension, last dimension first.
    fn sides(self) -> [(usize, usize); N];
}

impl<const N: usize> Padding<N> for usize {
    fn sides(self) -> [(usize, usize); N] {
        [(self, self); N]
    }
}

impl Padding<1> for (usize, usize) {
    fn sides(self) -> [(usize, usize); 1] {
        [self]
    }
}

impl Padding<1> for [usize; 2] {
    fn sides(self) -> [(usize, usize); 1] {
        [(self[0], self[1])]
    }
}

impl Padding<2> for (usize, usize, usize, usize) {
    fn sides(self) -> [(usize, usize); 2] {
        [(self.0, self.1), (self.2, self.3)]
    }
}

impl Padding<2> for [usize; 4] {
    fn sides(self) -> [(usize, usize); 2] {
        [(self[0], self[1]), (self[2], self[3])]
    }
}

impl Padding<3> for (usize, usize, usize, usize, usize, usize) {
    fn sides(self) -> [(usize, usize); 3] {
        [(self.0, self.1), (self.2, self.3), (self.4, self.5)]
    }
}

impl Padding<3> for [usize; 6] {
    fn sides(self) -> [(usize, usize); 3] {
        [(self[0], self[1]), (self[2], self[3]), (self[4], self[5])]
    }
}

/// Pads the last `N` dimensions of its input as `M` ([`PadMode`]) says: PyTorch's padding layers,
/// under their names ([`ZeroPad2d`], [`ConstantPad1d`], [`ReflectionPad2d`],
/// [`ReplicationPad3d`], [`CircularPad1d`], …).
///
/// The input is `[C, *]` or `[N, C, *]` with `N` dimensions in `*` (for zero and constant padding,
/// any rank of at least `N`); another rank, or a dimension too small for the mode (reflection needs
/// each padding smaller than the dimension), is an [`Error::InputShape`](crate::Error::InputShape).
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{ConstantPad1d, ReflectionPad1d, ReplicationPad2d};
/// let x = Tensor::new(&[[[1f32, 2., 3.]]], &Device::Cpu)?; // [N, C, W] = [1, 1, 3]
/// let reflected = ReflectionPad1d::new((2, 1)).call(&x)?;
/// assert_eq!(reflected.to_vec3::<f32>()?, [[[3., 2., 1., 2., 3., 2.]]]);
/// let filled = ConstantPad1d::new(1, -1.0).call(&x)?;
/// assert_eq!(filled.to_vec3::<f32>()?, [[[-1., 1., 2., 3., -1.]]]);
/// // (left, right, top, bottom), as in PyTorch:
/// let image = Tensor::zeros((1, 3, 4, 5), DType::F32, &Device::Cpu)?;
/// assert_eq!(ReplicationPad2d::new((1, 2, 0, 3)).call(&image)?.dims(), [1, 3, 7, 8]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`PadPath`], from [`Pad::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
#[module(bound = "M: PadMode", class_name = M::LAYERS[N.clamp(1, 3) - 1])]
pub struct Pad<const N: usize, M> {
    /// `(before, after)` per padded dimension, last dimension first (PyTorch's `padding` in pairs).
    #[module(skip)]
    pub padding: [(usize, usize); N],
    /// How the border is filled.
    #[module(skip)]
    pub mode: M,
}

/// Zero padding of the last dimension: PyTorch's `nn.ZeroPad1d(padding)`. See [`Pad`].
pub type ZeroPad1d = Pad<1, Zeros>;
/// Zero padding of the last two dimensions: PyTorch's `nn.ZeroPad2d(padding)`. See [`Pad`].
pub type ZeroPad2d = Pad<2, Zeros>;
/// Zero padding of the last three dimensions: PyTorch's `nn.ZeroPad3d(padding)`. See [`Pad`].
pub type ZeroPad3d = Pad<3, Zeros>;
/// Constant padding of the last dimension: PyTorch's `nn.ConstantPad1d(padding, value)`.
pub type ConstantPad1d = Pad<1, Constant>;
/// Constant padding of the last two dimensions: PyTorch's `nn.ConstantPad2d(padding, value)`.
pub type ConstantPad2d = Pad<2, Constant>;
/// Constant padding of the last three dimensions: PyTorch's `nn.ConstantPad3d(padding, value)`.
pub type ConstantPad3d = Pad<3, Constant>;
/// Reflection padding of `[C, W]` or `[N, C, W]`: PyTorch's `nn.ReflectionPad1d(padding)`.
pub type ReflectionPad1d = Pad<1, Reflect>;
/// Reflection padding of `[C, H, W]` or `[N, C, H, W]`: PyTorch's `nn.ReflectionPad2d(padding)`.
pub type ReflectionPad2d = Pad<2, Reflect>;
/// Reflection padding of `[C, D, H, W]` or `[N, C, D, H, W]`: PyTorch's `nn.ReflectionPad3d`.
pub type ReflectionPad3d = Pad<3, Reflect>;
/// Replication padding of `[C, W]` or `[N, C, W]`: PyTorch's `nn.ReplicationPad1d(padding)`.
pub type ReplicationPad1d = Pad<1, Replicate>;
/// Replication padding of `[C, H, W]` or `[N, C, H, W]`: PyTorch's `nn.ReplicationPad2d`.
pub type ReplicationPad2d = Pad<2, Replicate>;
/// Replication padding of `[C, D, H, W]` or `[N, C, D, H, W]`: PyTorch's `nn.ReplicationPad3d`.
pub type ReplicationPad3d = Pad<3, Replicate>;
/// Circular padding of `[C, W]` or `[N, C, W]`: PyTorch's `nn.CircularPad1d(padding)`.
pub type CircularPad1d = Pad<1, Circular>;
/// Circular padding of `[C, H, W]` or `[N, C, H, W]`: PyTorch's `nn.CircularPad2d(padding)`.
pub type CircularPad2d = Pad<2, Circular>;
/// Circular padding of `[C, D, H, W]` or `[N, C, D, H, W]`: PyTorch's `nn.CircularPad3d`.
pub type CircularPad3d = Pad<3, Circular>;

impl<const N: usize, M: PadMode> Pad<N, M> {
    /// The layer with `padding` ([`Padding`]) and `mode`.
    pub fn with_mode(padding: impl Padding<N>, mode: M) -> Self {
        Self {
            padding: padding.sides(),
            mode,
        }
    }
}

impl<const N: usize> Pad<N, Constant> {
    /// Pads with `value`: PyTorch's `ConstantPad{N}d(padding, value)`.
    pub fn new(padding: impl Padding<N>, value: f64) -> Self {
        Self::with_mode(padding, Constant { value })
    }
}

/// `new(padding)` of a mode without a value.
macro_rules! pad_new {
    ($($mode:ident: $doc:literal),+ $(,)?) => {$(
        impl<const N: usize> Pad<N, $mode> {
            #[doc = $doc]
            pub fn new(padding: impl Padding<N>) -> Self {
                Self::with_mode(padding, $mode)
            }
        }
    )+};
}

pad_new! {
    Zeros: "Pads with zeros: PyTorch's `ZeroPad{N}d(padding)`.",
    Reflect: "Pads by reflection: PyTorch's `ReflectionPad{N}d(padding)`.",
    Replicate: "Pads by replication: PyTorch's `ReplicationPad{N}d(padding)`.",
    Circular: "Pads circularly: PyTorch's `CircularPad{N}d(padding)`.",
}

impl<const N: usize, M: PadMode> Pad<N, M> {
    fn shape_error(&self, x: &Tensor) -> crate::Error {
        let spatial = ["W", "H, W", "D, H, W"]
            .get(N.wrapping_sub(1))
            .copied()
            .unwrap_or("*");
        let expected = if M::CONSTANT {
            format!("[*, {spatial}] (at least {N} dimensions)")
        } else {
            format!(
                "[C, {spatial}] or [N, C, {spatial}], {}",
                self.mode.size_rule()
            )
        };
        let layer = M::LAYERS[N.clamp(1, 3) - 1];
        input_shape_error(layer, format!("{expected} (padding {:?})", self.padding), x)
    }
}

impl<const N: usize, M: PadMode> Forward<&Tensor> for Pad<N, M> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rank = x.rank();
        let rank_ok = if M::CONSTANT {
            rank >= N
        } else {
            rank == N + 1 || rank == N + 2
        };
        if !rank_ok {
            return Err(self.shape_error(x));
        }
        let mut y = x.clone();
        for (i, &(before, after)) in self.padding.iter().enumerate() {
            if before == 0 && after == 0 {
                continue;
            }
            match self.mode.pad(&y, rank - 1 - i, before, after)? {
                Some(padded) => y = padded,
                None => return Err(self.shape_error(x)),
            }
        }
        Ok(y)
    }
}

/// PyTorch's text: the padding as a tuple of all sides, `ZeroPad2d((2, 2, 2, 2))` also when
/// built from one number, and `ConstantPad1d(padding=(2, 2), value=3.5)`.
impl<const N: usize, M: PadMode> ExtraRepr for Pad<N, M> {
    fn extra_repr(&self) -> String {
        let sides: Vec<usize> = self.padding.iter().flat_map(|&(b, a)| [b, a]).collect();
        self.mode.extra_repr(&py_tuple(&sides))
    }
}

impl<const N: usize, M: PadMode> Forward<Tensor> for Pad<N, M> {
    type Output = Tensor;

    fn forward(&self, x: Tensor) -> Result<Tensor> {
        self.forward(&x)
    }
}

impl<const N: usize, M: PadMode> candle_core::Module for Pad<N, M> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(Forward::forward(self, x)?)
    }
}
