//! Recurrent layers: `Lstm` and `Gru`, one type, [`Recurrent`], with the cell math ([`LstmCell`],
//! [`GruCell`]) as its parameter.

use std::fmt::Debug;
use std::marker::PhantomData;

use candle_core::{DType, Device, Tensor};

use crate::device::check_input_device;
use crate::error::Result;
use crate::module::{Child, ChildMut, Name};
use crate::nn::common::uniform_fan_in;
use crate::{Forward, Mode, Module, Param};

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

/// One layer's weights; `gates` blocks of `hidden_size` rows each.
#[derive(Clone, Debug)]
struct LayerWeights {
    weight_ih: Param,
    weight_hh: Param,
    bias_ih: Option<Param>,
    bias_hh: Option<Param>,
}

/// The weights of a stack of recurrent layers, listed under PyTorch's flat names
/// (`weight_ih_l0`, `weight_hh_l0`, `bias_ih_l0`, `bias_hh_l0`, `weight_ih_l1`, …), which a derived
/// struct cannot spell, hence the hand-written `Module` impl.
#[derive(Clone, Debug)]
struct StackedWeights {
    layers: Vec<LayerWeights>,
    names: Vec<[String; 4]>,
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
        let uniform = |dims: &[usize]| uniform_fan_in(dims, hidden_size, config.dtype, device);
        let rows = gates * hidden_size;
        let mut layers = Vec::with_capacity(config.num_layers);
        let mut names = Vec::with_capacity(config.num_layers);
        for k in 0..config.num_layers {
            let layer_input = if k == 0 { input_size } else { hidden_size };
            let bias =
                || -> Result<Option<Param>> { config.bias.then(|| uniform(&[rows])).transpose() };
            layers.push(LayerWeights {
                weight_ih: uniform(&[rows, layer_input])?,
                weight_hh: uniform(&[rows, hidden_size])?,
                bias_ih: bias()?,
                bias_hh: bias()?,
            });
            names.push(
                ["weight_ih", "weight_hh", "bias_ih", "bias_hh"].map(|n| format!("{n}_l{k}")),
            );
        }
        Ok(Self { layers, names })
    }

    /// `x W_ih^T + b_ih` for every time step at once: `[B, T, in]` → `[B, T, gates * H]`.
    fn input_projection(layer: &LayerWeights, x: &Tensor) -> Result<Tensor> {
        let (b, t, i) = x.dims3()?;
        let w = layer.weight_ih.value()?;
        let y = x.reshape((b * t, i))?.matmul(&w.t()?)?;
        let y = match &layer.bias_ih {
            Some(bias) => y.broadcast_add(&bias.value()?)?,
            None => y,
        };
        Ok(y.reshape((b, t, w.dim(0)?))?)
    }

    /// `h W_hh^T + b_hh`: `[B, H]` → `[B, gates * H]`.
    fn hidden_projection(layer: &LayerWeights, h: &Tensor) -> Result<Tensor> {
        let y = h.matmul(&layer.weight_hh.value()?.t()?)?;
        Ok(match &layer.bias_hh {
            Some(bias) => y.broadcast_add(&bias.value()?)?,
            None => y,
        })
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

/// The cell math of a [`Recurrent`] layer, the one thing that tells an LSTM from a GRU.
pub trait RnnCell: Clone + Copy + Debug + Send + Sync + 'static {
    /// The first layer's input weight, `Layer.weight_ih_l0`, named in device mismatch errors.
    const FIRST_WEIGHT: &'static str;
    /// Number of gate blocks of `hidden_size` rows in each weight.
    const GATES: usize;
    /// Number of state tensors `[B, H]` per layer (`h`, and `c` for an LSTM); the first is the
    /// layer's output.
    const STATES: usize;
    /// The final state a call returns (each tensor `[num_layers, B, H]`).
    type State;

    /// One time step: from the input projection `gi = x W_ih^T + b_ih` and the hidden projection
    /// `gh = h W_hh^T + b_hh`, both `[B, GATES * H]`, and the state, the next state.
    fn step(gi: &Tensor, gh: &Tensor, state: &[Tensor]) -> Result<Vec<Tensor>>;

    /// The final states, stacked over layers, as [`State`](Self::State).
    fn final_state(states: Vec<Tensor>) -> Self::State;
}

/// The cell math of PyTorch's `nn.LSTM`: gates i, f, g, o; state `(h, c)`.
#[derive(Clone, Copy, Debug)]
pub struct LstmCell;

impl RnnCell for LstmCell {
    const FIRST_WEIGHT: &'static str = "Lstm.weight_ih_l0";
    const GATES: usize = 4;
    const STATES: usize = 2;
    /// `(h_n, c_n)`.
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

    fn final_state(states: Vec<Tensor>) -> (Tensor, Tensor) {
        let [h_n, c_n]: [Tensor; 2] = states.try_into().expect("two states");
        (h_n, c_n)
    }
}

/// The cell math of PyTorch's `nn.GRU`: gates r, z, n, with
/// `n = tanh(W_in x + b_in + r * (W_hn h + b_hn))` and `h' = (1 - z) * n + z * h`; state `h`.
#[derive(Clone, Copy, Debug)]
pub struct GruCell;

impl RnnCell for GruCell {
    const FIRST_WEIGHT: &'static str = "Gru.weight_ih_l0";
    const GATES: usize = 3;
    const STATES: usize = 1;
    /// `h_n`.
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

    fn final_state(mut states: Vec<Tensor>) -> Tensor {
        states.remove(0)
    }
}

fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::sigmoid(x)?)
}

/// A stack of recurrent layers with the cell math `C`: PyTorch's `nn.LSTM` ([`Lstm`] =
/// `Recurrent<LstmCell>`) and `nn.GRU` ([`Gru`] = `Recurrent<GruCell>`), unidirectional, without
/// projections.
///
/// Parameters, with PyTorch's names, layouts and init (uniform on `±1/sqrt(hidden_size)`), for each
/// layer `k`: `weight_ih_lk` `[G·H, in]` (`in` = `input_size` for layer 0, `H` above),
/// `weight_hh_lk` `[G·H, H]`, `bias_ih_lk` and `bias_hh_lk` `[G·H]`, with `G` gate blocks
/// ([`RnnCell::GATES`]).
///
/// Input `[B, T, input_size]` with `batch_first` (else `[T, B, input_size]`; `[T, input_size]`
/// unbatched). Returns `(output, state)`: `output` `[B, T, H]` (the last layer's `h` at each step)
/// and the final state, each tensor `[num_layers, B, H]`.
#[derive(Module, Clone, Debug)]
pub struct Recurrent<C> {
    #[module(flatten)]
    weights: StackedWeights,
    hidden_size: usize,
    batch_first: bool,
    dropout: f64,
    training: Mode,
    #[module(skip)]
    cell: PhantomData<C>,
}

/// Long short-term memory: PyTorch's `nn.LSTM` (unidirectional, no projection). See
/// [`Recurrent`].
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
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub type Lstm = Recurrent<LstmCell>;

/// Gated recurrent unit: PyTorch's `nn.GRU` (unidirectional). See [`Recurrent`] and [`GruCell`].
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
pub type Gru = Recurrent<GruCell>;

impl<C: RnnCell> Recurrent<C> {
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
        Ok(Self {
            weights: StackedWeights::new(C::GATES, input_size, hidden_size, &config, device)?,
            hidden_size,
            batch_first: config.batch_first,
            dropout: config.dropout,
            training: Mode::new(),
            cell: PhantomData,
        })
    }

    /// The size of the hidden (and cell) states.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// The number of stacked layers.
    pub fn num_layers(&self) -> usize {
        self.weights.layers.len()
    }

    /// The loop shared by every cell: layout handling, the layer loop and inter-layer dropout.
    /// The state is [`RnnCell::STATES`] tensors `[B, H]` per layer, zeros unless `initial` gives
    /// them stacked over layers. Returns the output sequence and the final state.
    fn run(&self, x: &Tensor, initial: Option<&[&Tensor]>) -> Result<(Tensor, C::State)> {
        if let Some(layer) = self.weights.layers.first() {
            let w = layer.weight_ih.value()?;
            for t in std::iter::once(x).chain(initial.into_iter().flatten().copied()) {
                check_input_device(C::FIRST_WEIGHT, &w, t)?;
            }
        }
        let unbatched = x.rank() == 2;
        let mut seq = match (unbatched, self.batch_first) {
            (true, _) => x.unsqueeze(0)?,
            (false, true) => x.clone(),
            (false, false) => x.transpose(0, 1)?,
        };
        let (b, t, _) = seq.dims3()?;
        let num_layers = self.weights.layers.len();
        let initial = initial
            .map(|states| {
                states
                    .iter()
                    .map(|s| s.reshape((num_layers, b, self.hidden_size)))
                    .collect::<candle_core::Result<Vec<_>>>()
            })
            .transpose()?;
        // finals[j][k]: state j of layer k after the last step.
        let mut finals: Vec<Vec<Tensor>> = vec![Vec::with_capacity(num_layers); C::STATES];
        for (k, layer) in self.weights.layers.iter().enumerate() {
            let mut state = match &initial {
                Some(states) => states
                    .iter()
                    .map(|s| s.get(k))
                    .collect::<candle_core::Result<Vec<_>>>()?,
                None => {
                    let zeros = Tensor::zeros((b, self.hidden_size), seq.dtype(), seq.device())?;
                    vec![zeros; C::STATES]
                }
            };
            let projected = StackedWeights::input_projection(layer, &seq)?;
            let mut outputs = Vec::with_capacity(t);
            for i in 0..t {
                let gi = projected.narrow(1, i, 1)?.squeeze(1)?;
                let gh = StackedWeights::hidden_projection(layer, &state[0])?;
                state = C::step(&gi, &gh, &state)?;
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
        let output = match (unbatched, self.batch_first) {
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
        Ok((output, C::final_state(finals)))
    }
}

impl<C: RnnCell> Forward<&Tensor> for Recurrent<C> {
    type Output = (Tensor, C::State);

    /// From a zero state.
    fn forward(&self, x: &Tensor) -> Result<Self::Output> {
        self.run(x, None)
    }
}

impl<C: RnnCell> Forward<Tensor> for Recurrent<C> {
    type Output = (Tensor, C::State);

    fn forward(&self, x: Tensor) -> Result<Self::Output> {
        self.run(&x, None)
    }
}

impl Forward<(&Tensor, (&Tensor, &Tensor))> for Lstm {
    type Output = (Tensor, (Tensor, Tensor));

    /// From the state `(h0, c0)`, each `[num_layers, B, H]`.
    fn forward(&self, (x, (h0, c0)): (&Tensor, (&Tensor, &Tensor))) -> Result<Self::Output> {
        self.run(x, Some(&[h0, c0]))
    }
}

impl Forward<(&Tensor, &Tensor)> for Gru {
    type Output = (Tensor, Tensor);

    /// From the state `h0` `[num_layers, B, H]`.
    fn forward(&self, (x, h0): (&Tensor, &Tensor)) -> Result<Self::Output> {
        self.run(x, Some(&[h0]))
    }
}

impl<C: RnnCell> candle_core::Module for Recurrent<C> {
    /// The output sequence, from a zero state.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.run(x, None)?.0)
    }
}
