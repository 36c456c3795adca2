//! Recurrent layers: LSTM and GRU.

use candle_core::{DType, Device, Tensor};

use crate::device::check_input_device;
use crate::error::Result;
use crate::module::{Child, ChildMut, Name};
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
}

impl Default for RnnConfig {
    fn default() -> Self {
        Self {
            num_layers: 1,
            bias: true,
            batch_first: false,
            dropout: 0.0,
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
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let bound = 1.0 / (hidden_size.max(1) as f64).sqrt();
        let uniform = |shape: &[usize]| -> Result<Param> {
            Param::new(Tensor::rand(-bound, bound, shape, device)?.to_dtype(dtype)?)
        };
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
        let w = layer.weight_ih.tensor();
        let y = x.reshape((b * t, i))?.matmul(&w.t()?)?;
        let y = match &layer.bias_ih {
            Some(bias) => y.broadcast_add(&bias.tensor())?,
            None => y,
        };
        Ok(y.reshape((b, t, w.dim(0)?))?)
    }

    /// `h W_hh^T + b_hh`: `[B, H]` → `[B, gates * H]`.
    fn hidden_projection(layer: &LayerWeights, h: &Tensor) -> Result<Tensor> {
        let y = h.matmul(&layer.weight_hh.tensor().t()?)?;
        Ok(match &layer.bias_hh {
            Some(bias) => y.broadcast_add(&bias.tensor())?,
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

/// How a recurrent layer runs: its configuration and weights.
struct Recurrence<'a> {
    /// The first layer's input weight, `Layer.weight_ih_l0`, for device mismatch errors.
    first_weight: &'static str,
    weights: &'a StackedWeights,
    hidden_size: usize,
    batch_first: bool,
    dropout: f64,
    training: &'a Mode,
}

impl Recurrence<'_> {
    /// The loop shared by LSTM and GRU: layout handling, the layer loop and inter-layer dropout.
    /// The state is `num_states` tensors `[B, H]` per layer (`h`, and `c` for an LSTM), the first
    /// being the layer's output; `step` maps one time step's input projection `[B, gates * H]`, the
    /// layer's weights and the state to the next state. Returns the output sequence and each final
    /// state stacked over layers, `[num_layers, B, H]`.
    fn run(
        &self,
        x: &Tensor,
        num_states: usize,
        initial: Option<&[&Tensor]>,
        step: impl Fn(&Tensor, &LayerWeights, Vec<Tensor>) -> Result<Vec<Tensor>>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        if let Some(layer) = self.weights.layers.first() {
            let w = layer.weight_ih.tensor();
            for t in std::iter::once(x).chain(initial.into_iter().flatten().copied()) {
                check_input_device(self.first_weight, &w, t)?;
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
        let mut finals: Vec<Vec<Tensor>> = vec![Vec::with_capacity(num_layers); num_states];
        for (k, layer) in self.weights.layers.iter().enumerate() {
            let mut state = match &initial {
                Some(states) => states
                    .iter()
                    .map(|s| s.get(k))
                    .collect::<candle_core::Result<Vec<_>>>()?,
                None => {
                    let zeros = Tensor::zeros((b, self.hidden_size), seq.dtype(), seq.device())?;
                    vec![zeros; num_states]
                }
            };
            let projected = StackedWeights::input_projection(layer, &seq)?;
            let mut outputs = Vec::with_capacity(t);
            for i in 0..t {
                let gi = projected.narrow(1, i, 1)?.squeeze(1)?;
                state = step(&gi, layer, state)?;
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
        Ok((output, finals))
    }
}

fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::sigmoid(x)?)
}

/// Long short-term memory: PyTorch's `nn.LSTM` (unidirectional, no projection).
///
/// Parameters, with PyTorch's names, layouts and init (uniform on `±1/sqrt(hidden_size)`), for each
/// layer `k`: `weight_ih_lk` `[4H, in]` (`in` = `input_size` for layer 0, `H` above),
/// `weight_hh_lk` `[4H, H]`, `bias_ih_lk` and `bias_hh_lk` `[4H]`; the four row blocks are the
/// gates i, f, g, o.
///
/// Input `[B, T, input_size]` with `batch_first` (else `[T, B, input_size]`; `[T, input_size]`
/// unbatched). Returns `(output, (h_n, c_n))`: `output` `[B, T, H]` (the last layer's `h` at each
/// step), `h_n` and `c_n` `[num_layers, B, H]`. Call with `(&x, (&h0, &c0))` to start from a state;
/// plain `&x` starts from zeros.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Lstm, RnnConfig};
///
/// let dev = Device::Cpu;
/// let config = RnnConfig { num_layers: 2, batch_first: true, ..Default::default() };
/// let lstm = Lstm::with_config(4, 6, config, DType::F32, &dev)?;
/// assert_eq!(lstm.get_parameter("weight_hh_l1")?.shape().dims(), [24, 6]);
/// let x = Tensor::randn(0f32, 1., (2, 5, 4), &dev)?;
/// let (y, (h, c)) = lstm.call(&x)?;
/// assert_eq!(y.dims(), [2, 5, 6]);
/// assert_eq!(h.dims(), [2, 2, 6]);
/// assert_eq!(c.dims(), [2, 2, 6]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct Lstm {
    #[module(flatten)]
    weights: StackedWeights,
    hidden_size: usize,
    batch_first: bool,
    dropout: f64,
    training: Mode,
}

impl Lstm {
    /// A one-layer float32 LSTM with PyTorch's defaults (`[seq, batch, feature]` inputs).
    pub fn new(input_size: usize, hidden_size: usize, device: &Device) -> Result<Self> {
        Self::with_config(
            input_size,
            hidden_size,
            RnnConfig::default(),
            DType::F32,
            device,
        )
    }

    /// An LSTM of any floating-point dtype, initialized like PyTorch.
    pub fn with_config(
        input_size: usize,
        hidden_size: usize,
        config: RnnConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            weights: StackedWeights::new(4, input_size, hidden_size, &config, dtype, device)?,
            hidden_size,
            batch_first: config.batch_first,
            dropout: config.dropout,
            training: Mode::new(),
        })
    }

    /// The size of the hidden and cell states.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// The number of stacked layers.
    pub fn num_layers(&self) -> usize {
        self.weights.layers.len()
    }

    fn recurrence(&self) -> Recurrence<'_> {
        Recurrence {
            first_weight: "Lstm.weight_ih_l0",
            weights: &self.weights,
            hidden_size: self.hidden_size,
            batch_first: self.batch_first,
            dropout: self.dropout,
            training: &self.training,
        }
    }

    fn run(&self, x: &Tensor, initial: Option<[&Tensor; 2]>) -> Result<(Tensor, (Tensor, Tensor))> {
        let h = self.hidden_size;
        let step = |gi: &Tensor, layer: &LayerWeights, state: Vec<Tensor>| {
            let (h_prev, c_prev) = (&state[0], &state[1]);
            let gates = (gi + StackedWeights::hidden_projection(layer, h_prev)?)?;
            let i = sigmoid(&gates.narrow(1, 0, h)?)?;
            let f = sigmoid(&gates.narrow(1, h, h)?)?;
            let g = gates.narrow(1, 2 * h, h)?.tanh()?;
            let o = sigmoid(&gates.narrow(1, 3 * h, h)?)?;
            let c = ((f * c_prev)? + (i * g)?)?;
            let h = (o * c.tanh()?)?;
            Ok(vec![h, c])
        };
        let (out, finals) =
            self.recurrence()
                .run(x, 2, initial.as_ref().map(|s| s.as_slice()), step)?;
        let [h_n, c_n]: [Tensor; 2] = finals.try_into().expect("two states");
        Ok((out, (h_n, c_n)))
    }
}

impl Forward<&Tensor> for Lstm {
    type Output = (Tensor, (Tensor, Tensor));

    /// From a zero state.
    fn forward(&self, x: &Tensor) -> Result<Self::Output> {
        self.run(x, None)
    }
}

impl Forward<Tensor> for Lstm {
    type Output = (Tensor, (Tensor, Tensor));

    fn forward(&self, x: Tensor) -> Result<Self::Output> {
        self.run(&x, None)
    }
}

impl Forward<(&Tensor, (&Tensor, &Tensor))> for Lstm {
    type Output = (Tensor, (Tensor, Tensor));

    /// From the state `(h0, c0)`, each `[num_layers, B, H]`.
    fn forward(&self, (x, (h0, c0)): (&Tensor, (&Tensor, &Tensor))) -> Result<Self::Output> {
        self.run(x, Some([h0, c0]))
    }
}

impl candle_core::Module for Lstm {
    /// The output sequence, from a zero state.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.run(x, None)?.0)
    }
}

/// Gated recurrent unit: PyTorch's `nn.GRU` (unidirectional).
///
/// Parameters, with PyTorch's names, layouts and init (uniform on `±1/sqrt(hidden_size)`), for each
/// layer `k`: `weight_ih_lk` `[3H, in]`, `weight_hh_lk` `[3H, H]`, `bias_ih_lk` and `bias_hh_lk`
/// `[3H]`; the three row blocks are the gates r, z, n, with PyTorch's
/// `n = tanh(W_in x + b_in + r * (W_hn h + b_hn))` and `h' = (1 - z) * n + z * h`.
///
/// Input `[B, T, input_size]` with `batch_first` (else `[T, B, input_size]`; `[T, input_size]`
/// unbatched). Returns `(output, h_n)`: `output` `[B, T, H]`, `h_n` `[num_layers, B, H]`. Call with
/// `(&x, &h0)` to start from a state; plain `&x` starts from zeros.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Gru, RnnConfig};
///
/// let dev = Device::Cpu;
/// let gru = Gru::with_config(4, 6, RnnConfig { batch_first: true, ..Default::default() }, DType::F32, &dev)?;
/// let x = Tensor::randn(0f32, 1., (2, 5, 4), &dev)?;
/// let (y, h) = gru.call(&x)?;
/// assert_eq!((y.dims(), h.dims()), ([2, 5, 6].as_slice(), [1, 2, 6].as_slice()));
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct Gru {
    #[module(flatten)]
    weights: StackedWeights,
    hidden_size: usize,
    batch_first: bool,
    dropout: f64,
    training: Mode,
}

impl Gru {
    /// A one-layer float32 GRU with PyTorch's defaults (`[seq, batch, feature]` inputs).
    pub fn new(input_size: usize, hidden_size: usize, device: &Device) -> Result<Self> {
        Self::with_config(
            input_size,
            hidden_size,
            RnnConfig::default(),
            DType::F32,
            device,
        )
    }

    /// A GRU of any floating-point dtype, initialized like PyTorch.
    pub fn with_config(
        input_size: usize,
        hidden_size: usize,
        config: RnnConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            weights: StackedWeights::new(3, input_size, hidden_size, &config, dtype, device)?,
            hidden_size,
            batch_first: config.batch_first,
            dropout: config.dropout,
            training: Mode::new(),
        })
    }

    /// The size of the hidden state.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// The number of stacked layers.
    pub fn num_layers(&self) -> usize {
        self.weights.layers.len()
    }

    fn recurrence(&self) -> Recurrence<'_> {
        Recurrence {
            first_weight: "Gru.weight_ih_l0",
            weights: &self.weights,
            hidden_size: self.hidden_size,
            batch_first: self.batch_first,
            dropout: self.dropout,
            training: &self.training,
        }
    }

    fn run(&self, x: &Tensor, h0: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let h = self.hidden_size;
        let step = |gi: &Tensor, layer: &LayerWeights, state: Vec<Tensor>| {
            let h_prev = &state[0];
            let gh = StackedWeights::hidden_projection(layer, h_prev)?;
            let r = sigmoid(&(gi.narrow(1, 0, h)? + gh.narrow(1, 0, h)?)?)?;
            let z = sigmoid(&(gi.narrow(1, h, h)? + gh.narrow(1, h, h)?)?)?;
            let n = (gi.narrow(1, 2 * h, h)? + (r * gh.narrow(1, 2 * h, h)?)?)?.tanh()?;
            // (1 - z) * n + z * h, with one multiplication.
            let h_new = (&n + (z * (h_prev - &n)?)?)?;
            Ok(vec![h_new])
        };
        let h0 = h0.map(|h0| [h0]);
        let (out, mut finals) =
            self.recurrence()
                .run(x, 1, h0.as_ref().map(|s| s.as_slice()), step)?;
        Ok((out, finals.remove(0)))
    }
}

impl Forward<&Tensor> for Gru {
    type Output = (Tensor, Tensor);

    /// From a zero state.
    fn forward(&self, x: &Tensor) -> Result<Self::Output> {
        self.run(x, None)
    }
}

impl Forward<Tensor> for Gru {
    type Output = (Tensor, Tensor);

    fn forward(&self, x: Tensor) -> Result<Self::Output> {
        self.run(&x, None)
    }
}

impl Forward<(&Tensor, &Tensor)> for Gru {
    type Output = (Tensor, Tensor);

    /// From the state `h0` `[num_layers, B, H]`.
    fn forward(&self, (x, h0): (&Tensor, &Tensor)) -> Result<Self::Output> {
        self.run(x, Some(h0))
    }
}

impl candle_core::Module for Gru {
    /// The output sequence, from a zero state.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.run(x, None)?.0)
    }
}
