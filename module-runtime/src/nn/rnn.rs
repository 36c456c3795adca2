//! Recurrent layers: [`Lstm`] and [`Gru`] (PyTorch's `nn.LSTM`/`nn.GRU`, one generic type,
//! [`RnnBase`]) and the one-step cells [`LstmCell`] and [`GruCell`] (PyTorch's
//! `nn.LSTMCell`/`nn.GRUCell`, one generic type, [`RnnCellBase`]), with the gate math
//! ([`LstmGates`], [`GruGates`]) as their type parameter. All four implement
//! [`Recurrent`]: `initial_state(batch)`, a one-step call that takes and returns the state, and a
//! whole-sequence call from a state.

use std::fmt::Debug;
use std::marker::PhantomData;

use candle_core::{DType, Device, Shape, Tensor};

use crate::device::check_input_device;
use crate::error::{Error, Result};
use crate::module::{Child, ChildMut, Name};
use crate::nn::common::uniform_fan_in;
use crate::{Forward, Mode, Module, Param, Recurrent, TensorTree};

/// How an [`Lstm`] or a [`Gru`] is built: PyTorch's keyword arguments, with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RnnConfig {
    /// Number of stacked layers (default 1).
    pub num_layers: usize,
    /// Whether the layers have biases (default `true`).
    pub bias: bool,
    /// Whether inputs and outputs are `[batch, seq, feature]` (`true`) or `[seq, batch, feature]`
    /// (`false`, PyTorch's default).
    pub batch_first: bool,
    /// Dropout on the output of every layer but the last, in training mode only (default `0.0`).
    pub dropout: f64,
    /// The parameters' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for RnnConfig {
    fn default() -> Self {
        Self {
            num_layers: 1,
            bias: true,
            batch_first: false,
            dropout: 0.0,
            dtype: DType::F32,
        }
    }
}

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

/// One layer's weights, `gates` blocks of `hidden_size` rows each, under PyTorch's cell names
/// (`weight_ih`, `weight_hh`, `bias_ih`, `bias_hh`).
#[derive(Module, Clone, Debug)]
#[module(paths)]
struct LayerWeights {
    weight_ih: Param,
    weight_hh: Param,
    bias_ih: Option<Param>,
    bias_hh: Option<Param>,
}

impl LayerWeights {
    /// PyTorch's init: every weight and bias uniform on `±1/sqrt(hidden_size)`.
    fn new(
        gates: usize,
        input_size: usize,
        hidden_size: usize,
        bias: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let uniform = |dims: &[usize]| uniform_fan_in(dims, hidden_size, dtype, device);
        let rows = gates * hidden_size;
        let bias = || -> Result<Option<Param>> { bias.then(|| uniform(&[rows])).transpose() };
        Ok(Self {
            weight_ih: uniform(&[rows, input_size])?,
            weight_hh: uniform(&[rows, hidden_size])?,
            bias_ih: bias()?,
            bias_hh: bias()?,
        })
    }

    /// The input size, from `weight_ih` `[G·H, in]`.
    fn input_size(&self) -> usize {
        self.weight_ih.shape().dims().get(1).copied().unwrap_or(0)
    }

    /// `x W_ih^T + b_ih`: `[N, in]` → `[N, G·H]`.
    fn project_input(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul(&self.weight_ih.value()?.t()?)?;
        Ok(match &self.bias_ih {
            Some(bias) => y.broadcast_add(&bias.value()?)?,
            None => y,
        })
    }

    /// `x W_ih^T + b_ih` for every time step at once: `[B, T, in]` → `[B, T, G·H]`.
    fn project_sequence(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, i) = x.dims3()?;
        let y = self.project_input(&x.reshape((b * t, i))?)?;
        let rows = y.dim(1)?;
        Ok(y.reshape((b, t, rows))?)
    }

    /// `h W_hh^T + b_hh`: `[B, H]` → `[B, G·H]`.
    fn project_hidden(&self, h: &Tensor) -> Result<Tensor> {
        let y = h.matmul(&self.weight_hh.value()?.t()?)?;
        Ok(match &self.bias_hh {
            Some(bias) => y.broadcast_add(&bias.value()?)?,
            None => y,
        })
    }
}

/// The weights of a stack of recurrent layers, listed under PyTorch's flat names
/// (`weight_ih_l0`, `weight_hh_l0`, `bias_ih_l0`, `bias_hh_l0`, `weight_ih_l1`, …), which a derived
/// struct cannot spell, hence the hand-written `Module` impl.
#[derive(Clone, Debug)]
struct StackedWeights {
    layers: Vec<LayerWeights>,
    names: Vec<[String; 4]>,
}

/// A node with no typed path methods: its names are built at run time.
impl crate::typed_path::HasPath for StackedWeights {
    type Path<R: 'static, K: crate::typed_path::PathKind> = crate::typed_path::Path<R, K, Self>;
}

impl StackedWeights {
    /// PyTorch's init: every weight and bias uniform on `±1/sqrt(hidden_size)`.
    fn new(
        gates: usize,
        input_size: usize,
        hidden_size: usize,
        config: &RnnConfig,
        device: &Device,
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(config.num_layers);
        let mut names = Vec::with_capacity(config.num_layers);
        for k in 0..config.num_layers {
            let layer_input = if k == 0 { input_size } else { hidden_size };
            layers.push(LayerWeights::new(
                gates,
                layer_input,
                hidden_size,
                config.bias,
                config.dtype,
                device,
            )?);
            names.push(
                ["weight_ih", "weight_hh", "bias_ih", "bias_hh"].map(|n| format!("{n}_l{k}")),
            );
        }
        Ok(Self { layers, names })
    }
}

#[diagnostic::do_not_recommend]
impl Module for StackedWeights {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        for (layer, [w_ih, w_hh, b_ih, b_hh]) in self.layers.iter().zip(&self.names) {
            f(Name::Field(w_ih), Child::Param(&layer.weight_ih));
            f(Name::Field(w_hh), Child::Param(&layer.weight_hh));
            if let Some(b) = &layer.bias_ih {
                f(Name::Field(b_ih), Child::Param(b));
            }
            if let Some(b) = &layer.bias_hh {
                f(Name::Field(b_hh), Child::Param(b));
            }
        }
    }

    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        for (layer, [w_ih, w_hh, b_ih, b_hh]) in self.layers.iter_mut().zip(&self.names) {
            f(Name::Field(w_ih), ChildMut::Param(&mut layer.weight_ih));
            f(Name::Field(w_hh), ChildMut::Param(&mut layer.weight_hh));
            if let Some(b) = &mut layer.bias_ih {
                f(Name::Field(b_ih), ChildMut::Param(b));
            }
            if let Some(b) = &mut layer.bias_hh {
                f(Name::Field(b_hh), ChildMut::Param(b));
            }
        }
    }
}

/// The gate math of a recurrent layer or cell, the one thing that tells an LSTM from a GRU: the
/// type parameter of [`RnnBase`] and [`RnnCellBase`].
pub trait Gates: Clone + Copy + Debug + Send + Sync + 'static {
    /// The layer's name in error messages (`"Lstm"`).
    const NAME: &'static str;
    /// The cell's name in error messages (`"LstmCell"`).
    const CELL_NAME: &'static str;
    /// The first layer's input weight, `Lstm.weight_ih_l0`, named in device mismatch errors.
    const FIRST_WEIGHT: &'static str;
    /// The cell's input weight, `LstmCell.weight_ih`, named in device mismatch errors.
    const CELL_WEIGHT: &'static str;
    /// Number of gate blocks of `hidden_size` rows in each weight.
    const GATES: usize;
    /// The state tensors of the layer, as shape errors name them (`"Lstm h_0"`, `"Lstm c_0"`):
    /// one `[B, H]` tensor per layer each (`h`, and `c` for an LSTM); the first is the output.
    const STATE_NAMES: &'static [&'static str];
    /// The state tensors of the cell, as shape errors name them (`"LstmCell h"`, …).
    const CELL_STATE_NAMES: &'static [&'static str];
    /// The state as a value: `(h, c)` for an LSTM, `h` for a GRU (each `[num_layers, B, H]` for a
    /// layer, `[B, H]` for a cell).
    type State: TensorTree + Clone + Debug + Send + Sync + 'static;

    /// One time step: from the input projection `gi = x W_ih^T + b_ih` and the hidden projection
    /// `gh = h W_hh^T + b_hh`, both `[B, GATES * H]`, and the state tensors (in
    /// [`STATE_NAMES`](Self::STATE_NAMES) order), the next state tensors.
    fn step(gi: &Tensor, gh: &Tensor, state: &[Tensor]) -> Result<Vec<Tensor>>;

    /// The state tensors, in [`STATE_NAMES`](Self::STATE_NAMES) order, as [`State`](Self::State).
    fn from_tensors(states: Vec<Tensor>) -> Self::State;

    /// The state's tensors, in [`STATE_NAMES`](Self::STATE_NAMES) order.
    fn to_tensors(state: &Self::State) -> Vec<Tensor>;
}

/// The gate math of PyTorch's `nn.LSTM`/`nn.LSTMCell`: gates i, f, g, o, with
/// `c' = f * c + i * g` and `h' = o * tanh(c')`; state `(h, c)`.
#[derive(Clone, Copy, Debug)]
pub struct LstmGates;

impl Gates for LstmGates {
    const NAME: &'static str = "Lstm";
    const CELL_NAME: &'static str = "LstmCell";
    const FIRST_WEIGHT: &'static str = "Lstm.weight_ih_l0";
    const CELL_WEIGHT: &'static str = "LstmCell.weight_ih";
    const GATES: usize = 4;
    const STATE_NAMES: &'static [&'static str] = &["Lstm h_0", "Lstm c_0"];
    const CELL_STATE_NAMES: &'static [&'static str] = &["LstmCell h", "LstmCell c"];
    /// `(h, c)`.
    type State = (Tensor, Tensor);

    fn step(gi: &Tensor, gh: &Tensor, state: &[Tensor]) -> Result<Vec<Tensor>> {
        let (h_prev, c_prev) = (&state[0], &state[1]);
        let h = h_prev.dim(1)?;
        let gates = (gi + gh)?;
        let i = sigmoid(&gates.narrow(1, 0, h)?)?;
        let f = sigmoid(&gates.narrow(1, h, h)?)?;
        let g = gates.narrow(1, 2 * h, h)?.tanh()?;
        let o = sigmoid(&gates.narrow(1, 3 * h, h)?)?;
        let c = ((f * c_prev)? + (i * g)?)?;
        let h = (o * c.tanh()?)?;
        Ok(vec![h, c])
    }

    fn from_tensors(states: Vec<Tensor>) -> (Tensor, Tensor) {
        let mut states = states.into_iter();
        match (states.next(), states.next()) {
            (Some(h), Some(c)) => (h, c),
            _ => unreachable!("an LSTM state is two tensors"),
        }
    }

    fn to_tensors((h, c): &(Tensor, Tensor)) -> Vec<Tensor> {
        vec![h.clone(), c.clone()]
    }
}

/// The gate math of PyTorch's `nn.GRU`/`nn.GRUCell`: gates r, z, n, with
/// `n = tanh(W_in x + b_in + r * (W_hn h + b_hn))` and `h' = (1 - z) * n + z * h`; state `h`.
#[derive(Clone, Copy, Debug)]
pub struct GruGates;

impl Gates for GruGates {
    const NAME: &'static str = "Gru";
    const CELL_NAME: &'static str = "GruCell";
    const FIRST_WEIGHT: &'static str = "Gru.weight_ih_l0";
    const CELL_WEIGHT: &'static str = "GruCell.weight_ih";
    const GATES: usize = 3;
    const STATE_NAMES: &'static [&'static str] = &["Gru h_0"];
    const CELL_STATE_NAMES: &'static [&'static str] = &["GruCell h"];
    /// `h`.
    type State = Tensor;

    fn step(gi: &Tensor, gh: &Tensor, state: &[Tensor]) -> Result<Vec<Tensor>> {
        let h_prev = &state[0];
        let h = h_prev.dim(1)?;
        let r = sigmoid(&(gi.narrow(1, 0, h)? + gh.narrow(1, 0, h)?)?)?;
        let z = sigmoid(&(gi.narrow(1, h, h)? + gh.narrow(1, h, h)?)?)?;
        let n = (gi.narrow(1, 2 * h, h)? + (r * gh.narrow(1, 2 * h, h)?)?)?.tanh()?;
        // (1 - z) * n + z * h, with one multiplication.
        Ok(vec![(&n + (z * (h_prev - &n)?)?)?])
    }

    fn from_tensors(states: Vec<Tensor>) -> Tensor {
        match states.into_iter().next() {
            Some(h) => h,
            None => unreachable!("a GRU state is one tensor"),
        }
    }

    fn to_tensors(h: &Tensor) -> Vec<Tensor> {
        vec![h.clone()]
    }
}

fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::sigmoid(x)?)
}

/// Checks that every state tensor has the `expected` shape, naming the tensor and the shapes.
fn check_state(
    names: &[&'static str],
    states: &[Tensor],
    expected: &[usize],
    what: &str,
) -> Result<()> {
    if states.len() != names.len() {
        return Err(Error::InputShape {
            layer: names.first().copied().unwrap_or("state"),
            expected: format!("{} state tensors", names.len()),
            got: Shape::from_dims(&[states.len()]),
        });
    }
    for (name, s) in names.iter().zip(states) {
        if s.dims() != expected {
            return Err(Error::InputShape {
                layer: name,
                expected: format!("{expected:?} ({what})"),
                got: s.shape().clone(),
            });
        }
    }
    Ok(())
}

/// A stack of recurrent layers with the gate math `G`: PyTorch's `nn.LSTM` ([`Lstm`] =
/// `RnnBase<LstmGates>`) and `nn.GRU` ([`Gru`] = `RnnBase<GruGates>`), unidirectional, without
/// projections. PyTorch's base class is `nn.RNNBase`.
///
/// Parameters, with PyTorch's names, layouts and init (uniform on `±1/sqrt(hidden_size)`), for each
/// layer `k`: `weight_ih_lk` `[G·H, in]` (`in` = `input_size` for layer 0, `H` above),
/// `weight_hh_lk` `[G·H, H]`, `bias_ih_lk` and `bias_hh_lk` `[G·H]`, with `G` gate blocks
/// ([`Gates::GATES`]).
///
/// Input `[B, T, input_size]` with `batch_first` (else `[T, B, input_size]`; `[T, input_size]`
/// unbatched). Returns `(output, state)`: `output` `[B, T, H]` (the last layer's `h` at each step)
/// and the final state, each tensor `[num_layers, B, H]` (`[num_layers, H]` unbatched). A state
/// given to the call must have exactly that shape.
///
/// As a [`Recurrent`] module its state is the same value: [`step`](Recurrent::step) takes one
/// time step `[B, input_size]` and returns `[B, H]` with the next state;
/// [`scan`](Recurrent::scan) takes `[B, T, input_size]` whatever `batch_first` says.
///
/// Typed paths into it: [`RnnBasePath`], from [`RnnBase::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(paths)]
pub struct RnnBase<G> {
    #[module(flatten)]
    weights: StackedWeights,
    hidden_size: usize,
    batch_first: bool,
    dropout: f64,
    training: Mode,
    #[module(skip)]
    gates: PhantomData<G>,
}

/// Long short-term memory: PyTorch's `nn.LSTM` (unidirectional, no projection). See
/// [`RnnBase`] and [`LstmGates`].
///
/// The four row blocks of each weight are the gates i, f, g, o. Returns `(output, (h_n, c_n))`.
/// Call with `(&x, (&h0, &c0))` to start from a state; plain `&x` starts from zeros.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Lstm, RnnConfig};
///
/// let dev = Device::Cpu;
/// let config = RnnConfig { num_layers: 2, batch_first: true, ..Default::default() };
/// let lstm = Lstm::with_config(4, 6, config, &dev)?;
/// assert_eq!(lstm.get_parameter("weight_hh_l1")?.shape().dims(), [24, 6]);
/// let x = Tensor::randn(0f32, 1., (2, 5, 4), &dev)?;
/// let (y, (h, c)) = lstm.call(&x)?;
/// assert_eq!(y.dims(), [2, 5, 6]);
/// assert_eq!(h.dims(), [2, 2, 6]);
/// assert_eq!(c.dims(), [2, 2, 6]);
///
/// // One step at a time, with the state explicit (see `Recurrent`).
/// let state = lstm.initial_state(2)?;
/// let (y0, (h, c)) = lstm.step(&x.narrow(1, 0, 1)?.squeeze(1)?, state)?;
/// assert_eq!((y0.dims(), h.dims()), ([2, 6].as_slice(), [2, 2, 6].as_slice()));
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type Lstm = RnnBase<LstmGates>;

/// Gated recurrent unit: PyTorch's `nn.GRU` (unidirectional). See [`RnnBase`] and [`GruGates`].
///
/// The three row blocks of each weight are the gates r, z, n. Returns `(output, h_n)`. Call with
/// `(&x, &h0)` to start from a state; plain `&x` starts from zeros.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Gru, RnnConfig};
///
/// let dev = Device::Cpu;
/// let gru = Gru::with_config(4, 6, RnnConfig { batch_first: true, ..Default::default() }, &dev)?;
/// let x = Tensor::randn(0f32, 1., (2, 5, 4), &dev)?;
/// let (y, h) = gru.call(&x)?;
/// assert_eq!((y.dims(), h.dims()), ([2, 5, 6].as_slice(), [1, 2, 6].as_slice()));
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type Gru = RnnBase<GruGates>;

impl<G: Gates> RnnBase<G> {
    /// A one-layer float32 layer with PyTorch's defaults (`[seq, batch, feature]` inputs).
    pub fn new(input_size: usize, hidden_size: usize, device: &Device) -> Result<Self> {
        Self::with_config(input_size, hidden_size, RnnConfig::default(), device)
    }

    /// A layer built as `config` says, initialized like PyTorch.
    pub fn with_config(
        input_size: usize,
        hidden_size: usize,
        config: RnnConfig,
        device: &Device,
    ) -> Result<Self> {
        if config.num_layers == 0 {
            return Err(Error::InvalidConfig {
                layer: G::NAME,
                message: "num_layers must be at least 1".to_owned(),
            });
        }
        Ok(Self {
            weights: StackedWeights::new(G::GATES, input_size, hidden_size, &config, device)?,
            hidden_size,
            batch_first: config.batch_first,
            dropout: config.dropout,
            training: Mode::new(),
            gates: PhantomData,
        })
    }

    /// The size of the input features.
    pub fn input_size(&self) -> usize {
        self.first_layer().input_size()
    }

    /// The size of the hidden (and cell) states.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// The number of stacked layers.
    pub fn num_layers(&self) -> usize {
        self.weights.layers.len()
    }

    /// Whether `forward` takes `[batch, seq, feature]` (`true`) or `[seq, batch, feature]`.
    pub fn batch_first(&self) -> bool {
        self.batch_first
    }

    fn first_layer(&self) -> &LayerWeights {
        // `with_config` refuses zero layers.
        &self.weights.layers[0]
    }

    /// The loop shared by every gate math: layout handling, the layer loop and inter-layer
    /// dropout. `x` is `[B, T, in]` when `batch_first`, else `[T, B, in]`, or `[T, in]`. The state
    /// is [`Gates::STATE_NAMES`] tensors `[num_layers, B, H]` (`[num_layers, H]` unbatched), zeros
    /// unless `initial` gives them. Returns the output sequence and the final state tensors.
    fn run(
        &self,
        x: &Tensor,
        batch_first: bool,
        initial: Option<Vec<Tensor>>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let first = self.first_layer();
        let w = first.weight_ih.value()?;
        check_input_device(G::FIRST_WEIGHT, &w, x)?;
        for s in initial.iter().flatten() {
            check_input_device(G::FIRST_WEIGHT, &w, s)?;
        }
        let input_size = first.input_size();
        let unbatched = x.rank() == 2;
        if !matches!(x.rank(), 2 | 3) || x.dims().last() != Some(&input_size) {
            let layout = if batch_first {
                "[batch, seq, {i}]"
            } else {
                "[seq, batch, {i}]"
            };
            return Err(Error::InputShape {
                layer: G::NAME,
                expected: format!("{} or [seq, {{i}}] unbatched", layout)
                    .replace("{i}", &input_size.to_string()),
                got: x.shape().clone(),
            });
        }
        let mut seq = match (unbatched, batch_first) {
            (true, _) => x.unsqueeze(0)?,
            (false, true) => x.clone(),
            (false, false) => x.transpose(0, 1)?,
        };
        let (b, t, _) = seq.dims3()?;
        let num_layers = self.weights.layers.len();
        let initial = match initial {
            Some(states) => {
                let (expected, what) = if unbatched {
                    (
                        vec![num_layers, self.hidden_size],
                        "[num_layers, hidden_size]",
                    )
                } else {
                    (
                        vec![num_layers, b, self.hidden_size],
                        "[num_layers, batch, hidden_size]",
                    )
                };
                check_state(G::STATE_NAMES, &states, &expected, what)?;
                let states = if unbatched {
                    states
                        .iter()
                        .map(|s| s.unsqueeze(1))
                        .collect::<candle_core::Result<Vec<_>>>()?
                } else {
                    states
                };
                Some(states)
            }
            None => None,
        };
        let n_states = G::STATE_NAMES.len();
        // finals[j][k]: state j of layer k after the last step.
        let mut finals: Vec<Vec<Tensor>> = vec![Vec::with_capacity(num_layers); n_states];
        for (k, layer) in self.weights.layers.iter().enumerate() {
            let mut state = match &initial {
                Some(states) => states
                    .iter()
                    .map(|s| s.get(k))
                    .collect::<candle_core::Result<Vec<_>>>()?,
                None => {
                    let zeros = Tensor::zeros((b, self.hidden_size), seq.dtype(), seq.device())?;
                    vec![zeros; n_states]
                }
            };
            let projected = layer.project_sequence(&seq)?;
            let mut outputs = Vec::with_capacity(t);
            for i in 0..t {
                let gi = projected.narrow(1, i, 1)?.squeeze(1)?;
                let gh = layer.project_hidden(&state[0])?;
                state = G::step(&gi, &gh, &state)?;
                outputs.push(state[0].clone());
            }
            seq = Tensor::stack(&outputs, 1)?;
            if self.dropout > 0.0 && self.training.is_training() && k + 1 < num_layers {
                seq = candle_nn::ops::dropout(&seq, self.dropout as f32)?;
            }
            for (j, s) in state.into_iter().enumerate() {
                finals[j].push(s);
            }
        }
        let output = match (unbatched, batch_first) {
            (true, _) => seq.squeeze(0)?,
            (false, true) => seq,
            (false, false) => seq.transpose(0, 1)?,
        };
        let finals = finals
            .iter()
            .map(|per_layer| {
                let s = Tensor::stack(per_layer, 0)?;
                if unbatched {
                    s.squeeze(1)
                } else {
                    Ok(s)
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok((output, finals))
    }

    /// [`run`](Self::run) in the layer's own layout, with the final state as a value.
    fn run_forward(&self, x: &Tensor, initial: Option<Vec<Tensor>>) -> Result<(Tensor, G::State)> {
        let (output, finals) = self.run(x, self.batch_first, initial)?;
        Ok((output, G::from_tensors(finals)))
    }
}

impl<G: Gates> Forward<&Tensor> for RnnBase<G> {
    type Output = (Tensor, G::State);

    /// From a zero state.
    fn forward(&self, x: &Tensor) -> Result<Self::Output> {
        self.run_forward(x, None)
    }
}

impl<G: Gates> Forward<Tensor> for RnnBase<G> {
    type Output = (Tensor, G::State);

    fn forward(&self, x: Tensor) -> Result<Self::Output> {
        self.run_forward(&x, None)
    }
}

impl Forward<(&Tensor, (&Tensor, &Tensor))> for Lstm {
    type Output = (Tensor, (Tensor, Tensor));

    /// From the state `(h0, c0)`, each `[num_layers, B, H]`.
    fn forward(&self, (x, (h0, c0)): (&Tensor, (&Tensor, &Tensor))) -> Result<Self::Output> {
        self.run_forward(x, Some(vec![h0.clone(), c0.clone()]))
    }
}

impl Forward<(&Tensor, &Tensor)> for Gru {
    type Output = (Tensor, Tensor);

    /// From the state `h0` `[num_layers, B, H]`.
    fn forward(&self, (x, h0): (&Tensor, &Tensor)) -> Result<Self::Output> {
        self.run_forward(x, Some(vec![h0.clone()]))
    }
}

impl<G: Gates> candle_core::Module for RnnBase<G> {
    /// The output sequence, from a zero state.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.run_forward(x, None)?.0)
    }
}

impl<G: Gates> Recurrent for RnnBase<G> {
    /// `(h, c)` for an LSTM, `h` for a GRU, each `[num_layers, batch, hidden_size]`: what
    /// `forward` returns as `(h_n, c_n)` / `h_n`.
    type State = G::State;

    /// Zeros, in the parameters' dtype and on their device.
    fn initial_state(&self, batch: usize) -> Result<G::State> {
        let w = self.first_layer().weight_ih.value()?;
        let zeros = Tensor::zeros(
            (self.num_layers(), batch, self.hidden_size),
            w.dtype(),
            w.device(),
        )?;
        Ok(G::from_tensors(vec![zeros; G::STATE_NAMES.len()]))
    }

    /// One time step `[batch, input_size]` (or `[input_size]` with an unbatched state
    /// `[num_layers, hidden_size]`) → `[batch, hidden_size]`: the last layer's `h`.
    fn step(&self, input: &Tensor, state: G::State) -> Result<(Tensor, G::State)> {
        let rank = input.rank();
        if !matches!(rank, 1 | 2) {
            return Err(Error::InputShape {
                layer: G::NAME,
                expected: format!("[batch, {0}] or [{0}] (one time step)", self.input_size()),
                got: input.shape().clone(),
            });
        }
        // A sequence of one step: `[B, 1, in]` batch-first, or `[1, in]` unbatched.
        let (output, finals) = self.run(
            &input.unsqueeze(rank - 1)?,
            true,
            Some(G::to_tensors(&state)),
        )?;
        Ok((output.squeeze(rank - 1)?, G::from_tensors(finals)))
    }

    /// `[batch, time, input_size]` → `[batch, time, hidden_size]`, in one pass per layer.
    fn scan(&self, inputs: &Tensor, state: G::State) -> Result<(Tensor, G::State)> {
        if inputs.rank() != 3 || inputs.dim(1)? == 0 {
            return Err(Error::InputShape {
                layer: G::NAME,
                expected: format!("[batch, time >= 1, {}]", self.input_size()),
                got: inputs.shape().clone(),
            });
        }
        let (output, finals) = self.run(inputs, true, Some(G::to_tensors(&state)))?;
        Ok((output, G::from_tensors(finals)))
    }
}

/// One step of a recurrent layer with the gate math `G`: PyTorch's `nn.LSTMCell` ([`LstmCell`] =
/// `RnnCellBase<LstmGates>`) and `nn.GRUCell` ([`GruCell`] = `RnnCellBase<GruGates>`). PyTorch's
/// base class is `nn.RNNCellBase`.
///
/// Parameters, with PyTorch's names, layouts and init (uniform on `±1/sqrt(hidden_size)`):
/// `weight_ih` `[G·H, input_size]`, `weight_hh` `[G·H, H]`, `bias_ih` and `bias_hh` `[G·H]`
/// (absent without `bias`), with `G` gate blocks ([`Gates::GATES`]). The math is the layer's:
/// a one-layer [`Lstm`] or [`Gru`] with these weights computes, step by step, what the cell does.
///
/// Input `[B, input_size]` (or `[input_size]` unbatched); state tensors `[B, H]` (or `[H]`),
/// which must have exactly that shape; zeros when not given.
///
/// Typed paths into it: [`RnnCellBasePath`], from [`RnnCellBase::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(paths)]
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
        let w = self.weights.weight_ih.value()?;
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
        let x = if unbatched {
            x.unsqueeze(0)?
        } else {
            x.clone()
        };
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
        let w = self.weights.weight_ih.value()?;
        let zeros = Tensor::zeros((batch, self.hidden_size), w.dtype(), w.device())?;
        Ok(G::from_tensors(vec![zeros; G::CELL_STATE_NAMES.len()]))
    }

    /// `[batch, input_size]` → `h'` `[batch, hidden_size]` and the next state.
    fn step(&self, input: &Tensor, state: G::State) -> Result<(Tensor, G::State)> {
        let next = self.run(input, Some(G::to_tensors(&state)))?;
        Ok((next[0].clone(), G::from_tensors(next)))
    }
}
