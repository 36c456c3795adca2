//! [`RnnCellBase`]: one step of a recurrent layer (`nn.LSTMCell`, `nn.GRUCell`), and its
//! configuration.

use std::fmt::Debug;
use std::marker::PhantomData;

use candle_core::{DType, Device, Tensor};
use module_core::ExtraRepr;

use super::gates::{check_state, Gates, GruGates, LstmGates};
use super::weights::LayerWeights;
use crate::common::batched;
use crate::device::check_input_device;
use crate::error::{Error, Result};
use crate::{Forward, Module, Recurrent};

/// How an [`LstmCell`] or a [`GruCell`] is built: PyTorch's keyword arguments, with PyTorch's
/// defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RnnCellConfig {
    /// Whether the cell has biases `bias_ih` and `bias_hh` (default `true`).
    pub bias: bool,
    /// The parameters' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for RnnCellConfig {
    fn default() -> Self {
        Self {
            bias: true,
            dtype: DType::F32,
        }
    }
}

/// One step of a recurrent layer with the gate math `G`: PyTorch's `nn.LSTMCell` ([`LstmCell`] =
/// `RnnCellBase<LstmGates>`) and `nn.GRUCell` ([`GruCell`] = `RnnCellBase<GruGates>`). PyTorch's
/// base class is `nn.RNNCellBase`.
///
/// Parameters, with PyTorch's names, layouts and init (uniform on `±1/sqrt(hidden_size)`):
/// `weight_ih` `[G·H, input_size]`, `weight_hh` `[G·H, H]`, `bias_ih` and `bias_hh` `[G·H]`
/// (absent without `bias`), with `G` gate blocks ([`Gates::GATES`]). The math is the layer's:
/// a one-layer [`Lstm`](super::Lstm) or [`Gru`](super::Gru) with these weights computes, step by step, what the cell does.
///
/// Input `[B, input_size]` (or `[input_size]` unbatched); state tensors `[B, H]` (or `[H]`),
/// which must have exactly that shape; zeros when not given.
///
/// Typed paths into it: [`RnnCellBasePath`], from [`RnnCellBase::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
#[module(bound = "G: Gates", class_name = G::CELL_CLASS_NAME)]
pub struct RnnCellBase<G> {
    #[module(flatten)]
    weights: LayerWeights,
    hidden_size: usize,
    #[module(skip)]
    gates: PhantomData<G>,
}

/// PyTorch's `nn.LSTMCell`: one LSTM step, gates i, f, g, o. See [`RnnCellBase`] and
/// [`LstmGates`].
///
/// `call(&x)` starts from zeros, `call((&x, (&h, &c)))` from a state; both return the next
/// state `(h', c')`, as PyTorch does. As a [`Recurrent`] module, `step(&x, (h, c))` returns
/// `(h', (h', c'))`: the output and the state.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LstmCell;
/// use module_runtime::Recurrent;
///
/// let dev = Device::Cpu;
/// let cell = LstmCell::new(4, 6, &dev)?;
/// let names: Vec<String> = cell.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["weight_ih", "weight_hh", "bias_ih", "bias_hh"]);
/// assert_eq!(cell.get_parameter("weight_ih")?.shape().dims(), [24, 4]);
///
/// let xs = Tensor::randn(0f32, 1., (5, 3, 4), &dev)?; // [time, batch, feature]
/// let (mut h, mut c) = cell.initial_state(3)?;
/// for t in 0..5 {
///     (h, c) = cell.call((&xs.get(t)?, (&h, &c)))?; // PyTorch's loop
/// }
/// assert_eq!((h.dims(), c.dims()), ([3, 6].as_slice(), [3, 6].as_slice()));
///
/// // The same through `Recurrent`.
/// let mut state = cell.initial_state(3)?;
/// for t in 0..5 {
///     let (_output, next) = cell.step(&xs.get(t)?, state)?;
///     state = next;
/// }
/// assert_eq!(state.0.to_vec2::<f32>()?, h.to_vec2::<f32>()?);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type LstmCell = RnnCellBase<LstmGates>;

/// PyTorch's `nn.GRUCell`: one GRU step, gates r, z, n. See [`RnnCellBase`] and [`GruGates`].
///
/// `call(&x)` starts from zeros, `call((&x, &h))` from a state; both return `h'`, as PyTorch
/// does. As a [`Recurrent`] module, `step(&x, h)` returns `(h', h')`: the output and the state.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{GruCell, RnnCellConfig};
/// use module_runtime::Recurrent;
///
/// let dev = Device::Cpu;
/// let cell = GruCell::with_config(4, 6, RnnCellConfig { bias: false, ..Default::default() }, &dev)?;
/// assert_eq!(cell.named_parameters().len(), 2); // weight_ih, weight_hh
///
/// let x = Tensor::randn(0f32, 1., (3, 4), &dev)?;
/// let h1 = cell.call(&x)?; // from zeros
/// let (y, h) = cell.step(&x, cell.initial_state(3)?)?;
/// assert_eq!(y.to_vec2::<f32>()?, h1.to_vec2::<f32>()?);
/// assert_eq!(h.dims(), [3, 6]);
///
/// // A state of the wrong shape is an error naming both shapes.
/// let bad = Tensor::zeros((2, 6), DType::F32, &dev)?;
/// let err = cell.step(&x, bad).unwrap_err();
/// assert!(err.to_string().contains("[3, 6]"), "{err}");
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type GruCell = RnnCellBase<GruGates>;

/// PyTorch's text: `LSTMCell(10, 20)`, with `, bias=False` for a cell without biases.
impl<G> ExtraRepr for RnnCellBase<G> {
    fn extra_repr(&self) -> String {
        let sizes = format!("{}, {}", self.weights.input_size(), self.hidden_size);
        match self.weights.has_bias() {
            true => sizes,
            false => sizes + ", bias=False",
        }
    }
}

impl<G: Gates> RnnCellBase<G> {
    /// A float32 cell with biases, initialized like PyTorch.
    pub fn new(input_size: usize, hidden_size: usize, device: &Device) -> Result<Self> {
        Self::with_config(input_size, hidden_size, RnnCellConfig::default(), device)
    }

    /// A cell built as `config` says, initialized like PyTorch.
    pub fn with_config(
        input_size: usize,
        hidden_size: usize,
        config: RnnCellConfig,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            weights: LayerWeights::new(
                G::GATES,
                input_size,
                hidden_size,
                config.bias,
                config.dtype,
                device,
            )?,
            hidden_size,
            gates: PhantomData,
        })
    }

    /// The size of the input features.
    pub fn input_size(&self) -> usize {
        self.weights.input_size()
    }

    /// The size of the hidden (and cell) state.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// One step: `x` `[B, in]` or `[in]`, the state tensors `[B, H]` or `[H]` (zeros when
    /// `None`), in [`Gates::CELL_STATE_NAMES`] order. Returns the next state tensors.
    fn run(&self, x: &Tensor, state: Option<Vec<Tensor>>) -> Result<Vec<Tensor>> {
        let w = self.weights.weight_ih.tensor()?;
        check_input_device(G::CELL_WEIGHT, &w, x)?;
        for s in state.iter().flatten() {
            check_input_device(G::CELL_WEIGHT, &w, s)?;
        }
        let input_size = self.input_size();
        let unbatched = x.rank() == 1;
        if !matches!(x.rank(), 1 | 2) || x.dims().last() != Some(&input_size) {
            return Err(Error::InputShape {
                layer: G::CELL_NAME,
                expected: format!("[batch, {input_size}] or [{input_size}] unbatched"),
                got: x.shape().clone(),
            });
        }
        let (x, _) = batched(x, 1, 0)?;
        let b = x.dim(0)?;
        let state = match state {
            Some(states) => {
                let (expected, what) = if unbatched {
                    (
                        vec![self.hidden_size],
                        "[hidden_size] for an unbatched input",
                    )
                } else {
                    (vec![b, self.hidden_size], "[batch, hidden_size]")
                };
                check_state(G::CELL_STATE_NAMES, &states, &expected, what)?;
                if unbatched {
                    states
                        .iter()
                        .map(|s| s.unsqueeze(0))
                        .collect::<candle_core::Result<Vec<_>>>()?
                } else {
                    states
                }
            }
            None => {
                let zeros = Tensor::zeros((b, self.hidden_size), x.dtype(), x.device())?;
                vec![zeros; G::CELL_STATE_NAMES.len()]
            }
        };
        let gi = self.weights.project_input(&x)?;
        let gh = self.weights.project_hidden(&state[0])?;
        let next = G::step(&gi, &gh, &state)?;
        if unbatched {
            Ok(next
                .iter()
                .map(|s| s.squeeze(0))
                .collect::<candle_core::Result<Vec<_>>>()?)
        } else {
            Ok(next)
        }
    }
}

impl<G: Gates> Forward<&Tensor> for RnnCellBase<G> {
    /// The next state: `(h', c')` for an LSTM cell, `h'` for a GRU cell.
    type Output = G::State;

    /// From a zero state.
    fn forward(&self, x: &Tensor) -> Result<G::State> {
        Ok(G::from_tensors(self.run(x, None)?))
    }
}

impl Forward<(&Tensor, (&Tensor, &Tensor))> for LstmCell {
    type Output = (Tensor, Tensor);

    /// From the state `(h, c)`, each `[B, H]`: the next `(h', c')`.
    fn forward(&self, (x, (h, c)): (&Tensor, (&Tensor, &Tensor))) -> Result<(Tensor, Tensor)> {
        Ok(LstmGates::from_tensors(
            self.run(x, Some(vec![h.clone(), c.clone()]))?,
        ))
    }
}

impl Forward<(&Tensor, &Tensor)> for GruCell {
    type Output = Tensor;

    /// From the state `h` `[B, H]`: the next `h'`.
    fn forward(&self, (x, h): (&Tensor, &Tensor)) -> Result<Tensor> {
        Ok(GruGates::from_tensors(self.run(x, Some(vec![h.clone()]))?))
    }
}

impl<G: Gates> Recurrent for RnnCellBase<G> {
    /// `(h, c)` for an LSTM cell, `h` for a GRU cell, each `[batch, hidden_size]`.
    type State = G::State;

    /// Zeros, in the parameters' dtype and on their device.
    fn initial_state(&self, batch: usize) -> Result<G::State> {
        let w = self.weights.weight_ih.tensor()?;
        let zeros = Tensor::zeros((batch, self.hidden_size), w.dtype(), w.device())?;
        Ok(G::from_tensors(vec![zeros; G::CELL_STATE_NAMES.len()]))
    }

    /// `[batch, input_size]` → `h'` `[batch, hidden_size]` and the next state.
    fn step(&self, input: &Tensor, state: G::State) -> Result<(Tensor, G::State)> {
        let next = self.run(input, Some(G::to_tensors(&state)))?;
        Ok((next[0].clone(), G::from_tensors(next)))
    }
}
